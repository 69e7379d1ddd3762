"""Assertions shared by the layer tests (test_deltanet.py, test_gated_attention.py): a4's output against a reference."""

from __future__ import annotations

import torch

# Max error relative to the reference's largest magnitude: float32 differs only in the order of roundings; bfloat16
# allows a couple of ulps (one ulp is 0.4%).
RELATIVE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def assert_close(ours: torch.Tensor, reference: torch.Tensor, tolerance: float, what: str = "output") -> None:
    assert ours.shape == reference.shape, f"{what}: shape {tuple(ours.shape)} != {tuple(reference.shape)}"
    scale = reference.double().abs().max().item()
    err = (ours.double() - reference.double()).abs().max().item()
    assert err <= tolerance * scale, f"{what}: max error {err:.3g} > {tolerance:g} x max |reference| {scale:.3g}"


def assert_same_roundings(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """For bfloat16 outputs of the same formula: float32 arithmetic in a slightly different order flips a rounding
    about once in 10^4 values; a different order of casts (say, rounding to bfloat16 before a multiplication that
    transformers does in float32) changes a large share of them."""
    differ = (ours != reference).float().mean().item()
    assert differ <= 0.01, f"{differ:.1%} of the bfloat16 values differ from transformers' (expected <= 1%)"


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
