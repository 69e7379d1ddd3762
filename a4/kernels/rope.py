"""A Triton kernel for what a gated attention layer does to its query and key heads before attention, in one launch:
q_norm and k_norm (notebook 03's `ZeroCenteredRMSNorm`), partial RoPE (`apply_partial_rope`), and the write of the
new keys and values into the KV pool (`KVPool.set_kv`).

Why a kernel of our own: in torch, partial RoPE on one tensor is six launches (x * cos, the negation and the
concatenation of `rotate_half`, * sin, the sum, then the concatenation with the dims that are not rotated), each a
pass over the heads; with a4's norm kernel, each of q and k is then a norm launch and a RoPE launch, and the pool
write two `index_copy_` more. A Qwen3.5-0.8B decode step has 6 attention layers: 36 launches, here 6. One program
takes one head of one token: a query or key head is read once, normalised, rotated and written (a key head to the pool
too); a value head is copied into the pool.

The arithmetic is the modules' own, roundings included:
- the norm as a4's norm kernel does it (a4/kernels/rmsnorm.py): x * rsqrt(mean(x^2) + eps) * (1 + w) in float32,
  rounded to x's dtype (the sum of squares in another order than torch's: float32 rounding apart);
- RoPE as torch does it on that result: x * cos and rotate_half(x) * sin each rounded to x's dtype (the product of
  two values of that dtype is exact in float32), then their sum; the other dims are copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def _norm_rope_piece(x_row, w_ptr, offsets, mask, rstd, cos, sin, partner, partner_sign, ROTATE: tl.constexpr):
    """Dims `offsets` of one head normalised and, with ROTATE, turned with their partner dims (rotate_half)."""
    x = tl.load(x_row + offsets, mask=mask, other=0.0)
    dtype = x.dtype
    y = (x.to(tl.float32) * rstd * (1.0 + tl.load(w_ptr + offsets, mask=mask, other=0.0).to(tl.float32))).to(dtype)
    if ROTATE:
        p = tl.load(x_row + partner, mask=mask, other=0.0).to(tl.float32)
        partner_normed = (p * rstd * (1.0 + tl.load(w_ptr + partner, mask=mask, other=0.0).to(tl.float32))).to(dtype)
        turned = (y.to(tl.float32) * cos).to(dtype).to(tl.float32)
        y = (turned + (partner_sign * partner_normed.to(tl.float32) * sin).to(dtype).to(tl.float32)).to(dtype)
    return y


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, v_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, q_out_ptr, k_out_ptr,
    k_buf_ptr, v_buf_ptr, loc_ptr,
    num_heads, num_kv_heads, head_dim, eps,
    stride_q_token, stride_q_head, stride_k_token, stride_k_head, stride_v_token, stride_v_head,
    stride_cs, stride_buf_loc, stride_buf_head,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_KV: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    # Programs per token: its query heads, its key heads, then (writing the pool) its value heads.
    heads = num_heads + num_kv_heads
    if WRITE_KV:
        heads += num_kv_heads
    # In int64: a token's offset into a merged projection's rows passes 2**31 beyond ~230k tokens at the 35B-A3B's width.
    token = (tl.program_id(0) // heads).to(tl.int64)
    head = tl.program_id(0) % heads
    d = tl.arange(0, BLOCK_D)
    in_head = d < head_dim
    loc = 0
    if WRITE_KV:
        loc = tl.load(loc_ptr + token)
    if head >= num_heads + num_kv_heads:
        h = head - num_heads - num_kv_heads
        v = tl.load(v_ptr + token * stride_v_token + h * stride_v_head + d, mask=in_head, other=0.0)
        dst = v_buf_ptr + loc * stride_buf_loc + h * stride_buf_head + d
        tl.store(dst, v.to(v_buf_ptr.dtype.element_ty), mask=in_head)
    else:
        is_key = head >= num_heads
        if is_key:
            h = head - num_heads
            x_row = k_ptr + token * stride_k_token + h * stride_k_head
            w_ptr = k_weight_ptr
            y_row = k_out_ptr + (token * num_kv_heads + h) * head_dim
        else:
            h = head
            x_row = q_ptr + token * stride_q_token + h * stride_q_head
            w_ptr = q_weight_ptr
            y_row = q_out_ptr + (token * num_heads + h) * head_dim
        x = tl.load(x_row + d, mask=in_head, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / head_dim + eps)
        # Dim i turns with dim i + HALF: rotate_half gives -x2 in the first half, x1 in the second.
        i = tl.arange(0, BLOCK_HALF)
        in_half = i < HALF
        cos1 = tl.load(cos_ptr + token * stride_cs + i, mask=in_half, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + token * stride_cs + HALF + i, mask=in_half, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + token * stride_cs + i, mask=in_half, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + token * stride_cs + HALF + i, mask=in_half, other=0.0).to(tl.float32)
        y1 = _norm_rope_piece(x_row, w_ptr, i, in_half, rstd, cos1, sin1, HALF + i, -1.0, ROTATE=True)
        y2 = _norm_rope_piece(x_row, w_ptr, HALF + i, in_half, rstd, cos2, sin2, i, 1.0, ROTATE=True)
        rest = 2 * HALF + d
        in_rest = rest < head_dim
        y_rest = _norm_rope_piece(x_row, w_ptr, rest, in_rest, rstd, 0.0, 0.0, rest, 0.0, ROTATE=False)
        tl.store(y_row + i, y1, mask=in_half)
        tl.store(y_row + HALF + i, y2, mask=in_half)
        tl.store(y_row + rest, y_rest, mask=in_rest)
        if WRITE_KV and is_key:
            dst = k_buf_ptr + loc * stride_buf_loc + h * stride_buf_head
            out_dtype = k_buf_ptr.dtype.element_ty
            tl.store(dst + i, y1.to(out_dtype), mask=in_half)
            tl.store(dst + HALF + i, y2.to(out_dtype), mask=in_half)
            tl.store(dst + rest, y_rest.to(out_dtype), mask=in_rest)


def qk_norm_rope(
    query: torch.Tensor,
    key: torch.Tensor,
    q_norm_weight: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`apply_partial_rope(q_norm(query))` and `apply_partial_rope(k_norm(key))` in one launch.

    query [T, nH, D], key [T, nKV, D] (any strides over T and heads: views of a merged projection are fine); the two
    norms' weights [D] and eps; cos, sin [T, rotary_dim] in query's dtype. `kv_write` = (value [T, nKV, D], k_buf,
    v_buf [locations, nKV, D], loc [T]): also write each token's rotated key and its value into the pool buffers at
    its location, as `KVPool.set_kv` does. Returns (q [T, nH, D], k [T, nKV, D]), contiguous.
    """
    tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    rotary_dim = cos.shape[-1]
    fits = (
        key.shape == (tokens, num_kv_heads, head_dim)
        and key.dtype == query.dtype
        and q_norm_weight.shape == k_norm_weight.shape == (head_dim,)
        and cos.shape == sin.shape == (tokens, rotary_dim)
        and cos.dtype == sin.dtype == query.dtype
        and rotary_dim % 2 == 0
        and rotary_dim <= head_dim
    )
    if not fits:
        raise ValueError(
            f"qk_norm_rope: query {query.dtype} {tuple(query.shape)}, key {key.dtype} {tuple(key.shape)}, norm weights "
            f"{tuple(q_norm_weight.shape)} and {tuple(k_norm_weight.shape)}, cos {cos.dtype} {tuple(cos.shape)}, sin "
            f"{sin.dtype} {tuple(sin.shape)} do not fit query [T, nH, D], key [T, nKV, D] alike, weights [D], cos "
            "and sin [T, even rotary_dim <= D] in query's dtype"
        )
    query, key = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key))
    cos, sin = cos.contiguous(), sin.contiguous()  # the rotary tables' rows: no copy where they are already
    q = torch.empty(tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    k = torch.empty(tokens, num_kv_heads, head_dim, dtype=query.dtype, device=query.device)
    if kv_write is None:
        value, k_buf, v_buf, loc = key, k, k, torch.empty(0, dtype=torch.int64, device=query.device)
    else:
        value, k_buf, v_buf, loc = kv_write
        buffers_fit = k_buf.shape == v_buf.shape and k_buf.shape[1:] == (num_kv_heads, head_dim)
        if value.shape != key.shape or not buffers_fit or loc.shape != (tokens,) or k_buf.stride() != v_buf.stride():
            raise ValueError(
                f"qk_norm_rope: value {tuple(value.shape)}, k_buf {tuple(k_buf.shape)}, v_buf {tuple(v_buf.shape)} "
                f"and loc {tuple(loc.shape)} do not fit value [T, nKV, D] as key, buffers [locations, nKV, D] alike "
                "and loc [T]"
            )
        if value.stride(-1) != 1:
            value = value.contiguous()
    if tokens:
        half = rotary_dim // 2
        programs_per_token = num_heads + num_kv_heads * (1 if kv_write is None else 2)
        _qk_norm_rope_kernel[(tokens * programs_per_token,)](
            query, key, value, q_norm_weight, k_norm_weight, cos, sin, q, k, k_buf, v_buf, loc,
            num_heads, num_kv_heads, head_dim, eps,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            rotary_dim, k_buf.stride(0), k_buf.stride(1),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(max(half, 1)), BLOCK_D=triton.next_power_of_2(head_dim),
            WRITE_KV=kv_write is not None,
            enable_fp_fusion=False,  # torch rounds each product before the sum: no fused multiply-add
            **pdl_launch(query.device, tokens * programs_per_token),
        )  # fmt: skip
    return q, k
