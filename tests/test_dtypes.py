"""One dtype table, one resolver: every entry point that takes a dtype accepts the same ones and rejects the rest with
the same error, before anything is loaded."""

from __future__ import annotations

import re

import pytest
import torch

from a4 import LLM
from a4.dtypes import DTYPES, resolve_dtype
from a4.engine.engine import EngineConfig
from a4.models.registry import load_model
from a4.reference import cached_hf_model, hf_greedy, load_hf_model

UNKNOWN = ["float64", "fp32", "torch.float32", torch.float16, torch.int64, None]


ENTRY_POINTS = {
    "LLM": lambda model_dir, dtype: LLM(model_dir, dtype=dtype),
    "load_model": lambda model_dir, dtype: load_model(model_dir, dtype=dtype, device="cpu", progress=False),
    "load_hf_model": lambda model_dir, dtype: load_hf_model(model_dir, dtype),
    "cached_hf_model": lambda model_dir, dtype: cached_hf_model(model_dir, dtype),
    "hf_greedy": lambda model_dir, dtype: hf_greedy(model_dir, [[1, 2]], 1, dtype=dtype),
}


@pytest.mark.parametrize("name", ["float32", "bfloat16"])
def test_names_and_torch_dtypes_resolve(name):
    assert resolve_dtype(name) is getattr(torch, name)
    assert resolve_dtype(getattr(torch, name)) is getattr(torch, name)
    assert list(DTYPES) == ["float32", "bfloat16"]


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
@pytest.mark.parametrize("dtype", UNKNOWN, ids=str)
def test_every_entry_point_rejects_an_unknown_dtype_with_the_same_error(tiny_qwen3, entry_point, dtype):
    message = f"unknown dtype {dtype!r} (expected one of ['float32', 'bfloat16'], as a name or a torch.dtype)"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        ENTRY_POINTS[entry_point](tiny_qwen3, dtype)


def test_engine_config_resolves_its_dtype(tiny_qwen3):
    assert EngineConfig(tiny_qwen3, dtype="bfloat16").torch_dtype is torch.bfloat16
    assert EngineConfig(tiny_qwen3, dtype=torch.float32).torch_dtype is torch.float32
