"""a4's gated attention against transformers' Qwen3.5 modules: notebook 03's checks (a4.course.checks.gated_attention).

ZeroCenteredRMSNorm against Qwen3_5RMSNorm; partial RoPE against transformers' apply_rotary_pos_emb with the cos/sin
of Qwen3_5TextRotaryEmbedding; the GatedAttention layer against Qwen3_5Attention with random weights over a flattened
batch of requests (one prefilled in two chunks, then decode steps) and against transformers' captures of the tiny
checkpoint, with the keys and values a4 writes into its paged KV pool checked against transformers' cache (keys after
k_norm and RoPE), one pool layer per full-attention layer. Beyond the checks: other rotary fractions.
"""

from __future__ import annotations

import pytest
import torch

from a4.course.checks import CheckFailed
from a4.course.checks import gated_attention as checks
from a4.dtypes import DTYPES
from a4.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm, apply_partial_rope
from a4.layers.rope import apply_rope, rotate_half


def test_zero_centred_norm_matches_transformers():
    checks.check_zero_centred_norm(ZeroCenteredRMSNorm)


def test_partial_rope_matches_transformers():
    checks.check_partial_rope(apply_partial_rope)


def test_prefill_matches_transformers():
    checks.check_prefill(GatedAttention)


def test_decode_matches_transformers():
    checks.check_decode(GatedAttention)


def test_kv_pool_holds_transformers_keys_and_values():
    checks.check_kv_pool_keys(GatedAttention)


def test_one_pool_layer_per_full_attention_layer():
    checks.check_kv_pool_layers(GatedAttention)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("partial_rotary_factor", [0.25, 1.0])
def test_batched_layer_with_other_rotary_fractions(partial_rotary_factor, dtype):
    problems = checks.run_batched_pair(GatedAttention, dtype, partial_rotary_factor)
    assert problems == {"prefill": [], "decode": [], "kv": []}


# ------------------------------------------------------------- what the checks say about the usual mistakes
# Mutant student implementations: each check must name the mistake in its first line, not only a number.


class NormWithoutOne(ZeroCenteredRMSNorm):
    """Qwen3's RMSNorm, x̂ · w, where the zero-centred one scales by 1 + w."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rope_changing_pass_through(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), -x[..., rotary_dim:]], dim=-1)


def rope_pairing_across_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    rotated = x[..., :rotary_dim] * cos[:, None] + rotate_half(x)[..., :rotary_dim] * sin[:, None]
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


class AttentionWithoutOneInKNorm(GatedAttention):
    def __init__(self, config, pool_layer: int) -> None:
        super().__init__(config, pool_layer)
        self.k_norm.__class__ = NormWithoutOne


class AttentionAllInPoolLayerZero(GatedAttention):
    def __init__(self, config, pool_layer: int) -> None:
        super().__init__(config, pool_layer=0)


def first_line(check, *args) -> str:
    with pytest.raises(CheckFailed) as failure:
        check(*args)
    return str(failure.value).splitlines()[0]


def test_norm_check_names_the_missing_one_plus_w():
    assert "missing the 1 + w of the zero-centred norm?" in first_line(checks.check_zero_centred_norm, NormWithoutOne)


def test_rope_check_names_changed_pass_through_dims():
    line = first_line(checks.check_partial_rope, rope_changing_pass_through)
    assert line.startswith("likely cause: the pass-through dims changed")


def test_rope_check_names_pairs_taken_across_the_whole_head():
    line = first_line(checks.check_partial_rope, rope_pairing_across_head)
    assert line.startswith("likely cause: the rotated dims pair dim i with dim i + 24 (half the head)")


def test_kv_pool_layers_blames_the_keys_not_the_mapping_when_k_norm_is_wrong():
    line = first_line(checks.check_kv_pool_layers, AttentionWithoutOneInKNorm)
    assert "the keys are wrong before they reach the pool (k_norm or RoPE?)" in line
    assert "should hold the keys of model layer" not in line


def test_kv_pool_layers_blames_the_mapping_when_the_keys_are_right():
    line = first_line(checks.check_kv_pool_layers, AttentionAllInPoolLayerZero)
    assert "should hold the keys of model layer" in line
