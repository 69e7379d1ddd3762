"""The shared layers against independent references.

paged_attention against a dense causal attention written here (repeat_interleave GQA, explicit mask, softmax);
RoPE, RMSNorm and the gated MLP against transformers' Qwen3 modules.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from a4.core import ForwardMode
from a4.engine.forward_batch import build_forward_batch
from a4.course.checks._harness import assert_close, tolerance
from a4.kvcache.kv_pool import KVPool
from a4.layers.attention import paged_attention
from a4.layers.mlp import GatedMLP
from a4.layers.norm import RMSNorm
from a4.layers.rope import RotaryEmbedding, apply_rope

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16  # 3 query heads per kv head: catches h // 3 vs h % 2 mix-ups
MAX_CONTEXT = 128
SCALE = HEAD_DIM**-0.5


def dense_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int) -> torch.Tensor:
    """The textbook formula in float64. q [n, nH, D] at positions first_pos.., k and v [L, nKV, D] at 0..L-1."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    query_pos = torch.arange(first_pos, first_pos + q.shape[0])
    allowed = torch.arange(k.shape[0])[None, :] <= query_pos[:, None]
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class PagedRequests:
    """Requests with scattered pages in a KVPool, and the full K/V history of each one kept densely for the check."""

    def __init__(self, page_size: int, dtype: torch.dtype, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        num_pages = 4 * MAX_CONTEXT // page_size
        self.pool = KVPool(1, num_pages, page_size, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu")
        # Pages handed out in a random order, so that no request's locations are contiguous.
        self.free_pages = torch.randperm(num_pages, generator=self.gen).tolist()
        # Stale entries everywhere: a request must never read past its own length.
        self.req_to_token = torch.randint(0, self.pool.num_locations, (4, MAX_CONTEXT), generator=self.gen)
        self.history: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def _locations(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Locations of positions start .. stop-1 of a request: a fresh page wherever a position begins one."""
        page_size = self.pool.page_size
        for pos in range(start, stop):
            if pos % page_size == 0:
                first = self.free_pages.pop() * page_size
                self.req_to_token[slot, pos : pos + page_size] = torch.arange(first, first + page_size)
        return self.req_to_token[slot, start:stop].clone()

    def step(self, slots: list[int], extend_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed extend_lens[i] new tokens of request slots[i]; returns (paged output, dense reference output)."""
        prefix_lens = [len(self.history[s][0]) if s in self.history else 0 for s in slots]
        qs, ks, vs, locs, expected = [], [], [], [], []
        for slot, prefix_len, n in zip(slots, prefix_lens, extend_lens):
            q = self.randn(n, NUM_HEADS, HEAD_DIM)
            k = self.randn(n, NUM_KV_HEADS, HEAD_DIM)
            v = self.randn(n, NUM_KV_HEADS, HEAD_DIM)
            old_k, old_v = self.history.get(slot, (k[:0], v[:0]))
            self.history[slot] = (torch.cat([old_k, k]), torch.cat([old_v, v]))
            expected.append(dense_causal_attention(q, *self.history[slot], first_pos=prefix_len))
            qs.append(q)
            ks.append(k)
            vs.append(v)
            locs.append(self._locations(slot, prefix_len, prefix_len + n))
        decode = all(n == 1 for n in extend_lens) and min(prefix_lens) > 0
        fb = build_forward_batch(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=[0] * sum(extend_lens),
            slots=slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sample_indices=[],
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
        )
        assert torch.equal(fb.out_cache_loc, torch.cat(locs))  # the context finds the locations the test chose
        out = paged_attention(torch.cat(qs), torch.cat(ks), torch.cat(vs), fb, pool_layer=0, scale=SCALE)
        return out, torch.cat(expected)


def assert_attention_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, context: int) -> None:
    """paged_attention's output against the float64 formula: sums over head_dim (the scores) and over the context
    (the softmax, the weighted values); in bfloat16, the kernel rounds the softmax weights and the output."""
    assert out.dtype == dtype
    assert_close(out, expected, tolerance(dtype, HEAD_DIM + context, roundings=2))


DTYPES = [torch.float32, torch.bfloat16]
PAGE_SIZES = [1, 16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_prefill_without_prefix(page_size, dtype):
    reqs = PagedRequests(page_size, dtype)
    # 70 tokens: from 64 queries and keys on, torch's bfloat16 flash kernel packs its blocks for AMX (where the CPU
    # has it), another path through the kernel.
    assert_attention_close(*reqs.step([2, 0, 3], [13, 1, 70]), dtype, 70)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_chunked_prefill_attends_to_prefix_in_pool(page_size, dtype):
    reqs = PagedRequests(page_size, dtype)
    assert_attention_close(*reqs.step([1, 3], [17, 5]), dtype, 17)
    # Second chunks: their queries must see the first chunks (read back from the pool) plus themselves, causally.
    assert_attention_close(*reqs.step([1, 3], [9, 22]), dtype, 27)
    # A prefix hit that leaves one token to prefill, next to a longer chunk.
    assert_attention_close(*reqs.step([1, 3], [1, 4]), dtype, 31)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_decode_batch_of_varied_lengths(page_size, dtype):
    reqs = PagedRequests(page_size, dtype)
    reqs.step([0, 1, 2, 3], [1, 7, 16, 30])
    for step in range(3):
        assert_attention_close(*reqs.step([0, 1, 2, 3], [1, 1, 1, 1]), dtype, 31 + step)


def test_bfloat16_attention_runs_when_the_kernels_emulate_another_cpu(run_python):
    # ATEN_CPU_CAPABILITY=avx2 runs torch's AVX2 kernels, as a CPU without AVX-512 would. On a CPU with AMX, torch's
    # bfloat16 flash kernel then fails for 64 queries and keys or more ("pack_vnni2 is only supported when avx512 is
    # supported"): a4's attention must take another kernel there. Elsewhere this passes as it is.
    code = (
        "import torch\n"
        "from a4.layers.attention import sdpa\n"
        "q, k = torch.randn(1, 4, 70, 16).bfloat16(), torch.randn(1, 2, 70, 16).bfloat16()\n"
        "causal = torch.ones(70, 70, dtype=torch.bool).tril()\n"
        "assert sdpa(q, k, k, causal, scale=0.25).isfinite().all()\n"
    )
    run = run_python(code, ATEN_CPU_CAPABILITY="avx2")
    assert run.returncode == 0, run.stderr


def test_kv_pool_sizes_and_layer_views():
    pool = KVPool(3, num_pages=5, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, device="cpu")
    assert pool.num_locations == 20
    assert pool.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert pool.total_bytes == pool.bytes_per_token * 20
    k, v = torch.randn(2, 2, 8).bfloat16(), torch.randn(2, 2, 8).bfloat16()
    pool.set_kv(1, torch.tensor([7, 13]), k, v)
    k_buf, v_buf = pool.get_kv(1)
    assert k_buf.shape == (20, 2, 8)
    assert torch.equal(k_buf[[7, 13]], k) and torch.equal(v_buf[[7, 13]], v)  # copies: equal, bit for bit
    assert not pool.get_kv(0)[0].any() and not pool.get_kv(2)[1].any()  # other layers untouched
    with pytest.raises(IndexError):
        pool.get_kv(3)


def qwen3_config(**overrides) -> Qwen3Config:
    fields = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        max_position_embeddings=40960,
    )
    return Qwen3Config(**(fields | overrides))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_matches_transformers(dtype):
    config = qwen3_config()
    reference = Qwen3RotaryEmbedding(config)
    ours = RotaryEmbedding(HEAD_DIM, 1_000_000.0, config.max_position_embeddings, "cpu")
    positions = torch.tensor([0, 1, 2, 17, 1000, 32767, 40959])
    x = torch.randn(len(positions), NUM_HEADS, HEAD_DIM).to(dtype)
    ref_cos, ref_sin = reference(x, positions[None])
    cos, sin = ours(positions, dtype)
    assert cos.dtype == sin.dtype == dtype
    # Bit for bit: the same elementwise float32 formulas (no sums) on the same values run the same kernels within
    # one process, whatever the CPU, and round alike.
    assert torch.equal(cos, ref_cos[0])
    assert torch.equal(sin, ref_sin[0])
    # transformers rotates [B, H, T, D] tensors; ours are [T, H, D].
    ref_x, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], ref_cos, ref_sin)
    assert torch.equal(apply_rope(x, cos, sin), ref_x[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_matches_transformers(dtype):
    reference = Qwen3RMSNorm(32, eps=1e-6)
    ours = RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(torch.randn(32))
        ours.weight.copy_(reference.weight)
    reference.to(dtype), ours.to(dtype)
    x = (torch.randn(5, 32) * 3).to(dtype)
    # Bit for bit: the same operations on the same shapes, the mean's sum included, run the same kernels within one
    # process, whatever the CPU, and round alike.
    assert torch.equal(ours(x), reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_mlp_matches_transformers(dtype):
    reference = Qwen3MLP(qwen3_config()).to(dtype)
    ours = GatedMLP(32, 48).to(dtype)
    ours.load_state_dict(reference.state_dict())  # same parameter names as the checkpoint
    x = torch.randn(5, 32).to(dtype)
    # Bit for bit, as the RMSNorm above: the same three products on the same shapes.
    assert torch.equal(ours(x), reference(x))
