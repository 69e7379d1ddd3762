"""Rotary position embeddings (RoPE), laid out as transformers lays them out.

The frequencies of a head's rotary dims are `inv_freq = 1 / theta^(2i / rotary_dim)`; dim i is rotated together with
dim i + rotary_dim/2 (`rotate_half`), not with its neighbour. cos and sin are computed in float32 and only then cast
to the model dtype, as transformers does: in bfloat16 the angle of a large position would otherwise lose its digits.
"""

from __future__ import annotations

import torch


class RotaryEmbedding:
    """cos/sin tables for positions 0 .. max_positions-1, computed once in float32 on `device`.

    A table lookup per step instead of recomputing cos/sin, as SGLang's `cos_sin_cache`; a position beyond the table
    is an error. The tables are plain tensors, not module buffers, so casting a model to bfloat16 leaves them float32.
    `device=None` means torch's current default device (what `with torch.device(...)` sets while a model is built).
    """

    def __init__(
        self, rotary_dim: int, theta: float, max_positions: int, device: torch.device | str | None = None
    ) -> None:
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        self.max_positions = max_positions
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))
        freqs = torch.arange(max_positions, dtype=torch.float32, device=device)[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)  # [max_positions, rotary_dim]
        self._cos = angles.cos()
        self._sin = angles.sin()

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, each [T, rotary_dim] in `dtype`."""
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dim: pairs dim i with dim i + d/2."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every dim of x [T, H, rd] by the angles of its token; cos and sin are [T, rd].

    All rd dims are rotated. A model with partial RoPE splits the head itself and passes only the rotary part.
    """
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    return x * cos + rotate_half(x) * sin
