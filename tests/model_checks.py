"""Helpers shared by the model tests (test_qwen3_model.py, test_qwen3_5_model.py): a4's models, prompts, and the
float32 comparison of a4's logits with transformers'."""

from __future__ import annotations

import functools

import torch

from a4.models.registry import load_model

# float32: a4 and transformers differ only in the order of float32 roundings (and GDN's chunked vs. step form).
FP32_RELATIVE_TOLERANCE = 1e-4


@functools.cache
def a4_model(checkpoint, dtype: torch.dtype):
    return load_model(checkpoint, dtype=dtype, device="cpu", progress=False)[1]


def random_tokens(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_fp32_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    scale = reference.abs().max().item()
    err = (ours - reference).abs().max().item()
    assert err <= FP32_RELATIVE_TOLERANCE * scale, f"max abs diff {err:.3g} at logit scale {scale:.3g}"
