"""a4's gated attention against transformers' Qwen3.5 modules: notebook 03's checks (a4.course.checks.gated_attention).

ZeroCenteredRMSNorm against Qwen3_5RMSNorm; partial RoPE against transformers' apply_rotary_pos_emb with the cos/sin
of Qwen3_5TextRotaryEmbedding; the GatedAttention layer against Qwen3_5Attention with random weights over a flattened
batch of requests (one prefilled in two chunks, then decode steps) and against transformers' captures of the tiny
checkpoint, with the keys and values a4 writes into its paged KV pool checked against transformers' cache (keys after
k_norm and RoPE), one pool layer per full-attention layer. Beyond the checks: other rotary fractions.
"""

from __future__ import annotations

import pytest

from a4.course.checks import gated_attention as checks
from a4.course.checks._harness import DTYPES
from a4.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm, apply_partial_rope


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
