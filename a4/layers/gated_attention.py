# GENERATED from solutions/a4/layers/gated_attention.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/layers/gated_attention.py instead
# and run `python -m a4.course sync`.
"""Exercises (notebook 03): Qwen3.5's gated full attention, the one layer in four that keeps a KV cache.

Three things differ from Qwen3's attention:
- every RMSNorm is zero-centred: it scales by (1 + w), with w initialised to zeros;
- RoPE rotates only the first `rotary_dim` dims of each head (a quarter of them in the real checkpoints);
- `q_proj` makes twice the query width: per head, the query and then an output gate; the attention output is
  multiplied by sigmoid(gate) before `o_proj`.

The attention itself is a4's `paged_attention` (the KV pool, GQA and causality are its business).
"""

from __future__ import annotations

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.layers.attention import paged_attention
from a4.layers.rope import apply_rope
from a4.model_config import ModelConfig


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3.5's RMSNorm: `(x * rsqrt(mean(x^2) + eps)) * (1 + w)`, all in float32, cast back at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        # Zero-centred: weight 0 is the identity scale.
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> same shape and dtype, normalised over the last dim.

        As transformers' Qwen3_5RMSNorm: the statistics, the normalisation AND the scaling by (1 + w.float()) happen
        in float32, and only the result is cast to x's dtype (Qwen3's RMSNorm casts before scaling instead).
        """
        raise NotImplementedError("Exercise zero-centred-norm: RMSNorm with scale (1 + w), all in float32 (notebooks/03_gated_attention.ipynb)")

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial RoPE: x [T, H, head_dim]; cos, sin [T, rotary_dim] -> [T, H, head_dim] in x's dtype.

    The first rotary_dim = cos.shape[-1] dims of each head are rotated by `a4.layers.rope.apply_rope` (dim i paired
    with dim i + rotary_dim/2); the remaining head_dim - rotary_dim dims pass through unchanged.
    """
    raise NotImplementedError("Exercise partial-rope: rotate the first rotary_dim dims of each head, keep the rest (notebooks/03_gated_attention.ipynb)")


class GatedAttention(nn.Module):
    """Qwen3.5's full-attention layer (`self_attn` in the checkpoint); its KV live in layer `pool_layer` of the pool."""

    def __init__(self, config: ModelConfig, pool_layer: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.pool_layer = pool_layer
        hidden, head_dim = config.hidden_size, config.head_dim
        # Parameter names are the checkpoint's, so weights load without renaming.
        self.q_proj = nn.Linear(hidden, 2 * self.num_heads * head_dim, bias=False)  # per head: query, then gate
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * head_dim, hidden, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """hidden [T, hidden_size] -> [T, hidden_size], as transformers' Qwen3_5Attention, over the flattened batch.

        cos, sin [T, rotary_dim]: each token's angles. Steps: q_proj viewed as [T, nH, 2 * head_dim] and split per
        head into query (first half) and gate (second half); q_norm / k_norm over head_dim; partial RoPE on q and k;
        `paged_attention` at pool layer `pool_layer` with scale head_dim^-0.5 (it also writes k and v into the pool);
        output * sigmoid(gate); o_proj. All in the model dtype.
        """
        raise NotImplementedError("Exercise gated-attention: gated attention over the paged KV pool (notebooks/03_gated_attention.ipynb)")
