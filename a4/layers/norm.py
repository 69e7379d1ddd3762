"""RMSNorm as Qwen3 uses it: normalise in float32, cast back, then scale by the learned weight."""

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
