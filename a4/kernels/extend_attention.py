"""A Triton kernel for the attention of an EXTEND step (prefill, a later chunk, a prompt after a prefix-cache hit):
every request of the step in one launch, causal, grouped heads, each request's cached prefix read from the KV pool in
place and its new tokens from the step's own keys and values.

Why a kernel of our own: torch's SDPA serves a prefill one request at a time. A request without a prefix takes its flash
kernel (PyTorch's build of FlashAttention-2 for SM80), which at Qwen3.5's head_dim of 256 ran a 2,048-token prompt of
the 0.8B's attention shapes in 0.11 ms a layer on an H100 and on an H200, ~160 TFLOP/s, a sixth of their dense bfloat16
rate; a request with a prefix needs a mask, which the flash kernel does not take, so its keys were gathered from the
pool, repeated for every query head and given to the memory-efficient kernel, which takes a mask; and a step of many
prompts was a call per prompt and layer. FlashInfer rejects head_dim 256 (seed 003). As SGLang's `extend_attention_fwd`,
each program takes a block of one request's queries for one query head and streams that request's keys in blocks, with
the online softmax of FlashAttention:
- its prefix's keys (positions 0 .. prefix_len-1), found through its row of req_to_token in the pool, all visible;
- then its new tokens' keys, rows of k and v, visible up to each query's own (blocks past the diagonal are skipped).
Scores, the running maximum and sum, and the output accumulate in float32; the probabilities are rounded to the
values' dtype for their product with V, as FlashAttention does. float32 inputs multiply in full float32 ("ieee"), not
TF32, so a float32 model keeps its agreement with transformers.

Lengths come from the step's device tensors (slots, seq_lens, cu_seqlens), and the grid from the longest new part, a
host integer: a captured prefill (one request padded to its bucket, a4/engine/graph_runner.py) records a fixed grid,
and its padding rows, after the request's tokens, never reach the request's rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, num_warps, num_stages): queries per program, keys per step of its loops, by head_dim. Not yet
# timed (solutions/REPORT.md §5); chosen by compiling for an H100 (sm_90, bfloat16): registers are the limit, not
# shared memory (48 and 64 KiB here). These use all 255 registers a thread may have and spill a few dozen bytes; 4
# warps, or 64 keys at head_dim 256, spill hundreds of bytes to ~1.8 KB.
TILES = {128: (64, 64, 8, 2), 256: (64, 32, 8, 2)}  # the smallest head_dim key at least as large as the head's


@triton.jit
def _attend(q, k, v, visible, row_max, row_sum, acc, scale_log2, PRECISION: tl.constexpr):
    """One block of keys in FlashAttention's online softmax (base 2: scale_log2 = scale * log2(e))."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.math.exp2(row_max - new_max)
    p = tl.math.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return new_max, row_sum, acc


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_buf_ptr, v_buf_ptr, o_ptr,
    req_to_token_ptr, slots_ptr, seq_lens_ptr, cu_seqlens_ptr,
    scale_log2,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_kb_loc, stride_kb_head, stride_vb_loc, stride_vb_head, stride_o_row, stride_o_head, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    head = tl.program_id(1)
    # The last blocks of queries, which see the most keys, are scheduled first.
    block = tl.num_programs(2) - 1 - tl.program_id(2)
    start = tl.load(cu_seqlens_ptr + request)
    extend_len = tl.load(cu_seqlens_ptr + request + 1) - start
    if block * BLOCK_M >= extend_len:
        return
    prefix_len = tl.load(seq_lens_ptr + request) - extend_len
    kv_head = head // GROUP  # query head h reads kv head h // (nH / nKV)
    m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # the queries' indices among the request's new tokens
    in_m = m < extend_len
    d = tl.arange(0, BLOCK_D)
    in_d = d < HEAD_DIM
    q_rows = q_ptr + (start + m)[:, None] * stride_q_row + head * stride_q_head + d[None, :]
    q = tl.load(q_rows, mask=in_m[:, None] & in_d[None, :], other=0.0)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # The prefix, in the pool: every query sees all of it. (The first block of either loop has a visible key for
    # every query, key 0, so the running maximum is finite from then on.)
    table = req_to_token_ptr + tl.load(slots_ptr + request) * stride_table
    for n_start in range(0, prefix_len, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        in_n = n < prefix_len
        locs = tl.load(table + n, mask=in_n, other=0)
        tile = in_n[:, None] & in_d[None, :]
        k = tl.load(k_buf_ptr + locs[:, None] * stride_kb_loc + kv_head * stride_kb_head + d[None, :], mask=tile,
                    other=0.0)  # fmt: skip
        v = tl.load(v_buf_ptr + locs[:, None] * stride_vb_loc + kv_head * stride_vb_head + d[None, :], mask=tile,
                    other=0.0)  # fmt: skip
        row_max, row_sum, acc = _attend(q, k, v, in_n[None, :], row_max, row_sum, acc, scale_log2, PRECISION)
    # The new tokens: query m sees new tokens 0 .. m.
    for n_start in range(0, tl.minimum((block + 1) * BLOCK_M, extend_len), BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        in_n = n < extend_len
        tile = in_n[:, None] & in_d[None, :]
        k = tl.load(k_ptr + (start + n)[:, None] * stride_k_row + kv_head * stride_k_head + d[None, :], mask=tile,
                    other=0.0)  # fmt: skip
        v = tl.load(v_ptr + (start + n)[:, None] * stride_v_row + kv_head * stride_v_head + d[None, :], mask=tile,
                    other=0.0)  # fmt: skip
        visible = in_n[None, :] & (n[None, :] <= m[:, None])
        row_max, row_sum, acc = _attend(q, k, v, visible, row_max, row_sum, acc, scale_log2, PRECISION)
    o_rows = o_ptr + (start + m)[:, None] * stride_o_row + head * stride_o_head + d[None, :]
    tl.store(o_rows, (acc / row_sum[:, None]).to(o_ptr.dtype.element_ty), mask=in_m[:, None] & in_d[None, :])


def extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_extend_len: int,
    scale: float,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of an EXTEND step's T new tokens over their requests' keys: o [T, nH, D] in q's dtype.

    q [T, nH, D], k, v [T, nKV, D]: the new tokens, request after request (request i's are rows cu_seqlens[i] ..
    cu_seqlens[i+1]-1, at positions seq_lens[i] - its count onwards). k_buf, v_buf [locations, nKV, D]: the pool
    layer holding each request's earlier keys, at req_to_token[slots[i], :prefix_len]. slots, seq_lens [B] and
    cu_seqlens [B+1] int64 on the device; max_extend_len: the most new tokens of a request (a bound will do).
    Query head h reads kv head h // (nH / nKV), as transformers' `repeat_kv`. `tile`: (BLOCK_M, BLOCK_N, num_warps,
    num_stages); None: the head_dim's in TILES.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if (k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != head_dim or num_heads % num_kv_heads
            or k_buf.shape[1:] != (num_kv_heads, head_dim) or v_buf.shape != k_buf.shape):  # fmt: skip
        raise ValueError(
            f"extend_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, pool {tuple(k_buf.shape)} "
            "do not fit q [T, nH, D], k and v [T, nKV, D] with nKV dividing nH, pool buffers [locations, nKV, D]"
        )
    if k_buf.stride(-1) != 1 or v_buf.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("extend_attention: the pool buffers and req_to_token must have unit stride along their last "
                         "dimension")  # fmt: skip
    if head_dim > max(TILES):
        raise ValueError(f"extend_attention: head_dim {head_dim} is past the largest tiled, {max(TILES)}")
    block_m, block_n, num_warps, num_stages = tile or TILES[min(d for d in TILES if d >= head_dim)]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return o
    _extend_attention_kernel[(slots.shape[0], num_heads, triton.cdiv(max_extend_len, block_m))](
        q, k, v, k_buf, v_buf, o,
        req_to_token, slots, seq_lens, cu_seqlens,
        scale * 1.4426950408889634,  # log2(e): the kernel's exponentials are base 2
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1), o.stride(0), o.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return o
