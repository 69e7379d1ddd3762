"""RMSNorm as Qwen3 uses it (normalise in float32, cast back, then scale by the learned weight), and the residual
add that comes before a norm of a decoder layer."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`weight * (x * rsqrt(mean(x²) + eps)).to(x.dtype)`, the statistics in float32.

    The cast back to the input dtype comes BEFORE the multiplication by the weight, as in transformers'
    Qwen3RMSNorm: in bfloat16 the other order rounds differently and the logits drift away from the reference.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def add_and_norm(x: torch.Tensor, h: torch.Tensor, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after a sublayer, x + h (in the model dtype, as in transformers), and `norm` of it.

    Where the norm runs a4's Triton kernel it has an `add_norm` method (a4/layers/fused.py: use_fused_norms) that
    computes both in one launch; the arithmetic is the same."""
    add_norm = getattr(norm, "add_norm", None)
    if add_norm is not None:
        return add_norm(x, h)
    x = x + h
    return x, norm(x)
