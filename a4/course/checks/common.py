"""Helpers that several notebooks and their checks share, public so that each imports them from here.

- The real Qwen3.5 configs (`QWEN3_5_PRESETS`) and what follows from their config.json fields alone, never from
  a4's ModelConfig: the GDN state of a request slot (notebooks 05, 07), the GDN layer shapes (10, 13), the bytes of
  the weights the engine loads (08, 11, 13).
- The H200 figures the GPU notebooks draw (10, 11).
- The engine against transformers: the prompts every engine check serves and transformers' greedy tokens for them,
  computed once per process (the checks of notebooks 05, 09, 10, 11 and 13), and how a request's tokens differ.

A notebook's own checks stay in its module (`from a4.course.checks import <module> as checks`).
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from a4._overlay import REPO_ROOT
from a4.checkpoints import preset_config, tensor_plan
from a4.core import Output
from a4.models.config import LINEAR_ATTENTION

# The five real Qwen3.5 configs: (arch, preset) as `a4.checkpoints.preset_config` names them.
QWEN3_5_PRESETS = (
    ("qwen3_5", "0.8b"),
    ("qwen3_5", "2b"),
    ("qwen3_5", "9b"),
    ("qwen3_5", "27b"),
    ("qwen3_5_moe", "35b-a3b"),
)

# Prompt lengths of every engine check: a single token, lengths just before, at and after a boundary of the GDN
# layer's prefill chunks, and long ones that span several chunks. 64 is a multiple of every chunk size
# `chunk_gated_delta_rule` takes (16, 32, 64; a4's is its default, `gdn_chunk_size()`), so 63, 64, 65 and 130
# straddle a boundary whichever it is.
PROMPT_LENGTHS = (1, 7, 40, 63, 64, 65, 130, 300)
MAX_NEW_TOKENS = 6


# ------------------------------------------------------------------------------------------------ the real configs


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    return raw.get("text_config", raw)


def expected_state_layout(raw: dict[str, Any]) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """(GDN layers, conv state shape of one slot, recurrent state shape of one slot), from config.json's fields."""
    t = text_config(raw)
    conv_dim = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"] + (
        t["linear_num_value_heads"] * t["linear_value_head_dim"]
    )
    num_gdn = t["layer_types"].count(LINEAR_ATTENTION)
    conv = (conv_dim, t["linear_conv_kernel_dim"] - 1)
    recurrent = (t["linear_num_value_heads"], t["linear_key_head_dim"], t["linear_value_head_dim"])
    return num_gdn, conv, recurrent


def expected_bytes_per_slot(raw: dict[str, Any], dtype: torch.dtype) -> int:
    """Per GDN layer: conv_dim x (K-1) values in the model dtype + Hv x dk x dv values in float32."""
    num_gdn, conv, recurrent = expected_state_layout(raw)
    conv_values = conv[0] * conv[1]
    recurrent_values = recurrent[0] * recurrent[1] * recurrent[2]
    return num_gdn * (conv_values * dtype.itemsize + recurrent_values * 4)


def read_config(checkpoint: str | Path) -> dict[str, Any]:
    return json.loads((Path(checkpoint) / "config.json").read_text())


@dataclass(frozen=True)
class GDNShapes:
    """A Qwen3.5 model's GDN layer shapes, from its config.json's fields (not from a4's ModelConfig)."""

    key_heads: int
    value_heads: int
    dk: int
    dv: int
    kernel: int
    gdn_layers: int

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k (key heads x dk each) and v (value heads x dv)."""
        return 2 * self.key_heads * self.dk + self.value_heads * self.dv


def gdn_shapes(preset: str, arch: str = "qwen3_5") -> GDNShapes:
    text = preset_config(arch, preset)["text_config"]
    return GDNShapes(
        key_heads=text["linear_num_key_heads"],
        value_heads=text["linear_num_value_heads"],
        dk=text["linear_key_head_dim"],
        dv=text["linear_value_head_dim"],
        kernel=text["linear_conv_kernel_dim"],
        gdn_layers=text["layer_types"].count(LINEAR_ATTENTION),
    )


def weight_bytes(arch: str, preset: str, dtype: torch.dtype) -> int:
    """Bytes of the tensors the engine loads (language model and lm_head; not the vision tower, not MTP) in dtype."""
    specs = tensor_plan(arch, preset_config(arch, preset))
    values = sum(math.prod(spec.shape) for spec in specs if not spec.name.startswith(("model.visual.", "mtp.")))
    return values * torch.empty((), dtype=dtype).element_size()


# ------------------------------------------------------------------------------------------------ the H200 figures

# Where the course keeps its H200 run (written by `python -m a4 bench gpu` on the H200), and where a handout has it
# (a4.course.release copies it there); A4_GPU_REPORT overrides both.
H200_REPORTS = (REPO_ROOT / "solutions" / "report" / "h200_gpu.json", REPO_ROOT / "notebooks" / "data" / "h200_gpu.json")
GPU_REPORT_ENV = "A4_GPU_REPORT"


def gpu_report(path: Path | None = None) -> dict[str, Any] | None:
    """The H200 figures: the file `path`, else $A4_GPU_REPORT, else the course's run (H200_REPORTS); None if none
    exists (it says so)."""
    found = next((report for report in H200_REPORTS if report.is_file()), H200_REPORTS[0])
    path = Path(path or os.environ.get(GPU_REPORT_ENV) or found)
    if not path.is_file():
        print(f"No H200 figures at {path}: the cells that draw them show nothing.")
        return None
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------- the engine against transformers


def stop_tokens(checkpoint: str | Path) -> set[int]:
    """Every end-of-sequence id in config.json and generation_config.json (kept out of the prompts)."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((Path(checkpoint) / name).read_text())
        for value in (raw.get("eos_token_id"), text_config(raw).get("eos_token_id")):
            ids |= set(value) if isinstance(value, list) else {value} if value is not None else set()
    return ids


def shared_prompts(checkpoint: str | Path, seed: int = 5) -> list[list[int]]:
    """One random prompt per PROMPT_LENGTHS entry, without stop tokens."""
    rng = random.Random(seed)
    vocab = text_config(read_config(checkpoint))["vocab_size"]
    allowed = sorted(set(range(vocab)) - stop_tokens(checkpoint))
    return [[rng.choice(allowed) for _ in range(n)] for n in PROMPT_LENGTHS]


@functools.cache
def _reference(checkpoint: str, dtype: str) -> tuple[tuple[int, ...], ...]:
    from a4.reference import hf_greedy

    tokens = hf_greedy(checkpoint, shared_prompts(checkpoint), MAX_NEW_TOKENS, dtype=dtype)
    return tuple(tuple(t) for t in tokens)


def reference_tokens(checkpoint: str | Path, dtype: str = "float32") -> list[list[int]]:
    """transformers' greedy tokens for shared_prompts (MAX_NEW_TOKENS each), computed once per process."""
    return [list(t) for t in _reference(str(Path(checkpoint).resolve()), dtype)]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """Index of the first token where a and b differ (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_problems(
    label: str, outputs: Sequence[Output], prompts: Sequence[Sequence[int]], expected: Sequence[Sequence[int]]
) -> list[str]:
    """Every request whose tokens differ from transformers', with the first position where they do."""
    problems = []
    for i, (out, prompt, want) in enumerate(zip(outputs, prompts, expected, strict=True)):
        if out.error is not None:
            problems.append(f"{label}: request {i} (prompt of {len(prompt)} tokens) failed: {out.error}")
        elif out.token_ids != list(want):
            problems.append(
                f"{label}: request {i} (prompt of {len(prompt)} tokens) differs from transformers at output token "
                f"{first_difference(out.token_ids, want)}: "
                f"a4 {out.token_ids}, transformers {list(want)}"
            )
    return problems
