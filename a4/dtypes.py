"""The dtypes a4 serves, and checks against transformers in, by name: the one table and the one resolver.

Every place that takes a dtype (`LLM(dtype=...)`, `load_model`, the transformers reference, the command line) takes a
name of this table or its torch.dtype, and rejects anything else with the same error.
"""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch.dtype of a name of DTYPES, or a torch.dtype of DTYPES as it is; a ValueError naming anything else."""
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"unknown dtype {dtype!r} (expected one of {list(DTYPES)}, as a name or a torch.dtype)")
