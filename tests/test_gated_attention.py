"""a4's gated attention against transformers' Qwen3.5 modules.

ZeroCenteredRMSNorm against Qwen3_5RMSNorm; partial RoPE against transformers' apply_rotary_pos_emb with the cos/sin
of Qwen3_5TextRotaryEmbedding; the GatedAttention layer against Qwen3_5Attention built from a small config with
random weights, in prefill, in a second prefill chunk, in decode, and for a flattened batch of requests, with the
keys and values a4 writes into its paged KV pool checked against transformers' cache (keys after k_norm and RoPE).
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5Attention,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
    apply_rotary_pos_emb,
)

import a4.reference  # noqa: F401  (refuses to run where fla / causal-conv1d would change transformers' numerics)
from a4.core import ForwardBatch
from a4.kvcache.kv_pool import KVPool
from a4.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm, apply_partial_rope
from a4.layers.rope import RotaryEmbedding
from a4.models.config import parse_config
from layer_checks import RELATIVE_TOLERANCE, assert_close, assert_same_roundings, randn

DTYPES = [torch.float32, torch.bfloat16]
NUM_SLOTS, MAX_CONTEXT, PAGE_SIZE = 4, 256, 4
POOL_LAYER = 1  # not 0: the layer must write where it is told


def text_config(partial_rotary_factor: float) -> Qwen3_5TextConfig:
    """One full-attention layer: 6 query heads over 2 KV heads (3 per group), head_dim 32, "sdpa" as a4 uses."""
    config = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,
        layer_types=["full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
    )
    config._attn_implementation = "sdpa"
    return config


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_centred_norm_matches_transformers(dtype):
    reference = Qwen3_5RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(0.5 * randn(32, seed=0))
    ours = ZeroCenteredRMSNorm(32, eps=1e-6)
    ours.load_state_dict(reference.state_dict())
    reference.to(dtype)
    ours.to(dtype)
    x = 4 * randn(7, 3, 32, seed=1, dtype=dtype)
    out = ours(x)
    assert out.dtype == dtype
    assert_close(out, reference(x), RELATIVE_TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        assert_same_roundings(out, reference(x))
    assert torch.equal(ZeroCenteredRMSNorm(32, eps=1e-6).weight, torch.zeros(32)), "weight must start at zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial_rotary_factor", [0.25, 0.5, 1.0])
def test_partial_rope_matches_transformers(partial_rotary_factor, dtype):
    config = text_config(partial_rotary_factor)
    positions = torch.tensor([0, 1, 2, 7, 100, 3000])
    q = randn(len(positions), 6, 32, seed=0, dtype=dtype)
    k = randn(len(positions), 2, 32, seed=1, dtype=dtype)
    # Text positions: the three M-RoPE rows are equal, which makes it ordinary 1-D RoPE.
    cos, sin = Qwen3_5TextRotaryEmbedding(config)(q, positions[None])  # [1, T, rotary_dim]
    expected_q, expected_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert_close(apply_partial_rope(q, cos[0], sin[0]), expected_q[0].transpose(0, 1), RELATIVE_TOLERANCE[dtype])
    assert_close(apply_partial_rope(k, cos[0], sin[0]), expected_k[0].transpose(0, 1), RELATIVE_TOLERANCE[dtype])


class AttentionPair:
    """transformers' Qwen3_5Attention with random weights and a4's GatedAttention with the same weights; a4's requests
    live in a paged KVPool (pages handed out in random order), transformers keeps one DynamicCache per request."""

    def __init__(self, dtype: torch.dtype, partial_rotary_factor: float = 0.25) -> None:
        self.text_config = text_config(partial_rotary_factor)
        config_json = Qwen3_5Config(
            text_config=self.text_config.to_dict(), architectures=["Qwen3_5ForConditionalGeneration"]
        )
        config = parse_config(config_json.to_dict())
        torch.manual_seed(0)
        self.reference = Qwen3_5Attention(self.text_config, layer_idx=0)
        with torch.no_grad():  # the norms start at zero: randomise them so that they matter
            self.reference.q_norm.weight.copy_(0.5 * randn(config.head_dim, seed=1))
            self.reference.k_norm.weight.copy_(0.5 * randn(config.head_dim, seed=2))
        self.ours = GatedAttention(config, pool_layer=POOL_LAYER)
        self.ours.load_state_dict(self.reference.state_dict())  # same parameter names as the checkpoint
        self.reference.to(dtype)
        self.ours.to(dtype)
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.hf_rope = Qwen3_5TextRotaryEmbedding(self.text_config)
        self.a4_rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, MAX_CONTEXT)

        num_pages = NUM_SLOTS * MAX_CONTEXT // PAGE_SIZE
        gen = torch.Generator().manual_seed(3)
        self.pool = KVPool(2, num_pages, PAGE_SIZE, config.num_key_value_heads, config.head_dim, dtype, "cpu")
        # Each slot owns a random set of pages: no request's locations are contiguous.
        pages = torch.randperm(num_pages, generator=gen).view(NUM_SLOTS, -1)
        self.req_to_token = (pages[:, :, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).view(NUM_SLOTS, MAX_CONTEXT)
        self.caches: dict[int, DynamicCache] = {}
        self.lengths: dict[int, int] = {}

    def hidden(self, n: int, seed: int) -> torch.Tensor:
        return randn(n, self.hidden_size, seed=seed, dtype=self.dtype)

    def step(self, slots: list[int], hiddens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of a4 over the flattened batch, and transformers once per request; (ours, reference)."""
        extend_lens = [h.shape[0] for h in hiddens]
        prefix_lens = [self.lengths.get(slot, 0) for slot in slots]
        positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)])
        fb = ForwardBatch(
            phase="decode" if all(n == 1 for n in extend_lens) and all(prefix_lens) else "prefill",
            input_ids=torch.zeros(len(positions), dtype=torch.long),
            positions=positions,
            req_slots=torch.tensor(slots),
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            out_cache_loc=torch.cat(
                [self.req_to_token[s, p : p + n] for s, p, n in zip(slots, prefix_lens, extend_lens)]
            ),
            sample_indices=torch.tensor([], dtype=torch.long),
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
        )
        with torch.no_grad():
            cos, sin = self.a4_rope(positions, self.dtype)
            ours = self.ours(torch.cat(hiddens), cos, sin, fb)
            expected = [self._reference_step(slot, p, h) for slot, p, h in zip(slots, prefix_lens, hiddens)]
        for slot, n in zip(slots, extend_lens):
            self.lengths[slot] = self.lengths.get(slot, 0) + n
        return ours, torch.cat(expected)

    def _reference_step(self, slot: int, prefix_len: int, hidden: torch.Tensor) -> torch.Tensor:
        if prefix_len == 0:
            self.caches[slot] = DynamicCache(config=self.text_config)
        n = hidden.shape[0]
        position_ids = torch.arange(prefix_len, prefix_len + n)[None]
        cos, sin = self.hf_rope(hidden, position_ids)
        # Causal over the cached prefix and the new tokens: query i (position prefix_len + i) sees keys 0..prefix_len+i.
        mask = torch.arange(prefix_len + n)[None, :] <= position_ids[0, :, None]
        out, _ = self.reference(hidden[None], (cos, sin), mask[None, None], cache=self.caches[slot])
        return out[0]

    def assert_pool_matches_cache(self, slot: int) -> None:
        """The keys and values a4 wrote for `slot`, against transformers' cache (keys after k_norm and RoPE)."""
        layer = self.caches[slot].layers[0]
        locs = self.req_to_token[slot, : self.lengths[slot]]
        k_buf, v_buf = self.pool.get_kv(POOL_LAYER)
        tolerance = RELATIVE_TOLERANCE[self.dtype]
        assert_close(k_buf[locs], layer.keys[0].transpose(0, 1), tolerance, "keys in the pool")
        assert_close(v_buf[locs], layer.values[0].transpose(0, 1), tolerance, "values in the pool")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partial_rotary_factor", [0.25, 1.0])
def test_layer_prefill_second_chunk_and_decode_match_transformers(partial_rotary_factor, dtype):
    pair = AttentionPair(dtype, partial_rotary_factor)
    tolerance = RELATIVE_TOLERANCE[dtype]
    slot = 2
    assert_close(*pair.step([slot], [pair.hidden(40, seed=1)]), tolerance, "prefill")
    pair.assert_pool_matches_cache(slot)
    # A second prefill chunk attends to the first one, read back from the pool.
    assert_close(*pair.step([slot], [pair.hidden(13, seed=2)]), tolerance, "second prefill chunk")
    for i in range(3):
        assert_close(*pair.step([slot], [pair.hidden(1, seed=10 + i)]), tolerance, f"decode step {i}")
    pair.assert_pool_matches_cache(slot)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_varlen_batch_matches_each_request_alone(dtype):
    pair = AttentionPair(dtype)
    tolerance = RELATIVE_TOLERANCE[dtype]
    slots = [3, 0, 1]
    assert_close(*pair.step(slots, [pair.hidden(n, seed=n) for n in (30, 1, 17)]), tolerance, "batched prefill")
    for i in range(3):
        hiddens = [pair.hidden(1, seed=100 * i + j) for j in range(len(slots))]
        assert_close(*pair.step(slots, hiddens), tolerance, f"batched decode step {i}")
    for slot in slots:
        pair.assert_pool_matches_cache(slot)
