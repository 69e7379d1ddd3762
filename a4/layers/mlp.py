"""The gated MLP of every Qwen decoder layer (SwiGLU): down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation, silu(gate) * up, in the model dtype."""
    return F.silu(gate) * up


class GatedMLP(nn.Module):
    # Submodule names are the checkpoint's (`mlp.gate_proj.weight`, ...), so weights load without renaming.
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        # In torch two launches (silu, then the product); where a4's Triton kernels run, one
        # (a4/layers/fused.py: use_fused_activation).
        self.act_and_mul = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_proj(x), self.up_proj(x)))
