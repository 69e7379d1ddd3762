"""Triton paged decode attention: one query token per request against its keys in the paged KV pool.

The torch backend gathers each request's K and V into a fresh tensor per layer per step (`k_buf[locations]`), a
copy as large as the context, then runs SDPA; on a GPU at long context that copy is most of the step. This kernel
reads every key and value where it lies, through the request's row of `req_to_token` (its KV location per
position), so any page size works (the locations say where each token is). FlashInfer would do the same, but some
of its releases reject head_dim 256 (Qwen3.5), and a kernel of our own keeps the course's dependencies light.

Flash-decoding: one query row per request gives one program per (request, KV head) at most, far too few to use a
GPU at batch 1, so the context of each request is split into `num_splits` stretches, each its own program, which
writes its partial softmax (output normalised by its own sum, and log-sum-exp) to a scratch buffer; a second kernel
merges the splits. Each split covers an equal share of that request's own length, read from `seq_lens` on the
device; the number of splits depends only on the call's shapes (batch, KV heads, the table's width), never on the
lengths, so one launch configuration serves every step of a captured CUDA graph. A KV head's query heads (GQA)
share its program: the keys are loaded once for all of them, and their scores are one small matrix product.
Scores, softmax and accumulation are float32; probabilities are rounded to the value dtype for the P @ V product,
as flash attention does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel

# The merge kernel holds all splits of one head in registers: [MAX_SPLITS, head_dim] float32.
MAX_SPLITS = 64


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, req_to_token_ptr, slots_ptr, seq_lens_ptr, part_o_ptr, part_lse_ptr,
    scale, head_dim, num_splits,
    stride_q_row, stride_q_head, stride_k_loc, stride_k_head, stride_v_loc, stride_v_head, stride_table_row,
    stride_po_row, stride_po_head, stride_po_split, stride_pl_row, stride_pl_head,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + row)
    table_row = req_to_token_ptr + tl.load(slots_ptr + row) * stride_table_row
    # This split's share of the row's positions, whole blocks of BLOCK_N; the last splits may be empty.
    share = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * share
    end = tl.minimum(start + share, seq_len)

    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + h
    in_group = h < GROUP
    in_dim = d < head_dim
    q = tl.load(
        q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
        mask=in_group[:, None] & in_dim[None, :],
        other=0.0,
    )
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores
    total = tl.zeros([BLOCK_H], tl.float32)  # running sum of exp(score - m)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        in_seq = pos < end
        loc = tl.load(table_row + pos, mask=in_seq, other=0)
        kv_mask = in_seq[:, None] & in_dim[None, :]
        k = tl.load(k_ptr + loc[:, None] * stride_k_loc + kv_head * stride_k_head + d[None, :], mask=kv_mask, other=0.0)
        # Cast: under torch.compile `scale` may arrive as a float64 constant, and m must stay float32 in the loop.
        scores = (tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale).to(tl.float32)
        scores = tl.where(in_seq[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        rescale = tl.exp(m - m_new)
        total = total * rescale + tl.sum(p, axis=1)
        v = tl.load(v_ptr + loc[:, None] * stride_v_loc + kv_head * stride_v_head + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    # An empty split leaves total = 0: it stores o = 0 and lse = -inf, which the merge weighs by exp(-inf) = 0.
    has_keys = total > 0
    o = acc / tl.where(has_keys, total, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, total, 1.0)), float("-inf"))
    tl.store(
        part_o_ptr + row * stride_po_row + heads[:, None] * stride_po_head + split * stride_po_split + d[None, :],
        o,
        mask=in_group[:, None] & in_dim[None, :],
    )
    tl.store(part_lse_ptr + row * stride_pl_row + heads * stride_pl_head + split, lse, mask=in_group)


@triton.jit
def _merge_kernel(
    part_o_ptr, part_lse_ptr, o_ptr,
    head_dim, num_splits,
    stride_po_row, stride_po_head, stride_po_split, stride_pl_row, stride_pl_head, stride_o_row, stride_o_head,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    in_splits = s < num_splits
    in_dim = d < head_dim
    lse = tl.load(part_lse_ptr + row * stride_pl_row + head * stride_pl_head + s, mask=in_splits, other=float("-inf"))
    # Split 0 always holds position 0, so the max is finite.
    weight = tl.exp(lse - tl.max(lse, axis=0))
    parts = tl.load(
        part_o_ptr + row * stride_po_row + head * stride_po_head + s[:, None] * stride_po_split + d[None, :],
        mask=in_splits[:, None] & in_dim[None, :],
        other=0.0,
    )
    o = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(o_ptr + row * stride_o_row + head * stride_o_head + d, o.to(o_ptr.dtype.element_ty), mask=in_dim)


@functools.cache
def _programs_wanted(device: torch.device) -> int:
    """Split programs to aim for: two per SM keep every SM busy while one waits on memory."""
    if device.type != "cuda":  # Triton's CPU interpreter, for development
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, head_dim: int, device: torch.device) -> int:
    """Splits per (request, KV head): enough programs for the GPU, from shapes only (so capturable)."""
    wanted = triton.cdiv(_programs_wanted(device), batch * num_kv_heads)
    return max(1, min(wanted, MAX_SPLITS, triton.cdiv(max_context, _block_n(head_dim))))


def _block_n(head_dim: int) -> int:
    # Keys per iteration: K and V tiles of [BLOCK_N, head_dim] stay ~16 KiB each in bfloat16.
    return 32 if head_dim > 128 else 64


def paged_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    slots: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Decode attention of B query tokens over the paged KV pool, without gathering K/V.

    q [B, nH, D]; k_buf, v_buf [num_locations, nKV, D] (`KVPool.get_kv(layer)`); req_to_token [R, max_context]
    int64; slots [B] int64 (rows of req_to_token); seq_lens [B] int64 on the device: row i attends to the keys of
    positions 0 .. seq_lens[i]-1 of its table row (its query is the last of them). Query head h reads KV head
    h // (nH / nKV). Returns [B, nH, D] in q's dtype. num_splits: context splits per (request, KV head); by default
    `default_num_splits` (tests pass small values to cross split boundaries at short lengths).
    """
    batch, num_heads, head_dim = q.shape
    _, num_kv_heads, kv_dim = k_buf.shape
    if kv_dim != head_dim or v_buf.shape != k_buf.shape or num_heads % num_kv_heads:
        raise ValueError(
            f"paged_decode_attention: q {tuple(q.shape)}, k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)} "
            "do not fit q [B, nH, D], k_buf = v_buf [locations, nKV, D] with nH a multiple of nKV"
        )
    if slots.shape != (batch,) or seq_lens.shape != (batch,):
        raise ValueError(
            f"paged_decode_attention: slots {tuple(slots.shape)} and seq_lens {tuple(seq_lens.shape)} "
            f"should be [{batch}]"
        )
    if q.stride(2) != 1:
        q = q.contiguous()
    if k_buf.stride(2) != 1 or v_buf.stride(2) != 1 or req_to_token.stride(1) != 1:
        raise ValueError("paged_decode_attention: k_buf, v_buf and req_to_token need a contiguous last dimension")
    max_context = req_to_token.shape[1]
    block_n = _block_n(head_dim)
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, max_context, head_dim, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"paged_decode_attention: num_splits {num_splits} outside 1..{MAX_SPLITS}")
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)

    part_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_buf, v_buf, req_to_token, slots, seq_lens, part_o, part_lse,
        scale, head_dim, num_splits,
        q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), v_buf.stride(0), v_buf.stride(1),
        req_to_token.stride(0),
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        # tl.dot needs at least 16 rows: a KV head's query heads, padded.
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=block_d, BLOCK_N=block_n,
        # float32 models get float32 products (Triton's default for them is tf32, ~1e-3 relative error).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if block_d <= 128 else 8,
        **pdl_launch(q.device, batch * num_kv_heads * num_splits),
    )
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    _merge_kernel[(batch, num_heads)](
        part_o, part_lse, o,
        head_dim, num_splits,
        part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
        o.stride(0), o.stride(1),
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d, num_warps=4,
        **pdl_launch(q.device, batch * num_heads),
    )
    return o
