"""A Triton kernel for Qwen3.5's partial RoPE (notebook 03's `apply_partial_rope`) in one launch.

Why a kernel of our own: in torch, partial RoPE on one tensor is six launches (x * cos, the negation and the
concatenation of `rotate_half`, * sin, the sum, then the concatenation with the dims that are not rotated), each a
pass over the heads. A Qwen3.5-0.8B decode step applies it to q and k in each of its 6 attention layers: 72 launches,
~0.1 ms of a 1.33 ms step's kernels at batch 1 on an H200 (solutions/REPORT.md §5). Here one program rotates one head
of one token: it reads the head and its token's cos / sin once and writes the result once.

The arithmetic is torch's, rounding included: x * cos and rotate_half(x) * sin are each rounded to x's dtype (the
product of two values of that dtype is exact in float32), then their sum is; the other dims are copied. So the
result is torch's bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _partial_rope_kernel(
    x_ptr, cos_ptr, sin_ptr, y_ptr,
    num_heads, head_dim,
    stride_x_token, stride_x_head, stride_cs, stride_y_token, stride_y_head,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0) // num_heads
    head = tl.program_id(0) % num_heads
    x_row = x_ptr + token * stride_x_token + head * stride_x_head
    y_row = y_ptr + token * stride_y_token + head * stride_y_head
    i = tl.arange(0, BLOCK_HALF)
    in_half = i < HALF
    # Dim i turns with dim i + HALF: rotate_half gives -x2 in the first half, x1 in the second.
    x1 = tl.load(x_row + i, mask=in_half, other=0.0)
    x2 = tl.load(x_row + HALF + i, mask=in_half, other=0.0)
    cos1 = tl.load(cos_ptr + token * stride_cs + i, mask=in_half, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + token * stride_cs + HALF + i, mask=in_half, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + token * stride_cs + i, mask=in_half, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + token * stride_cs + HALF + i, mask=in_half, other=0.0).to(tl.float32)
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    dtype = x1.dtype
    y1 = (a1 * cos1).to(dtype).to(tl.float32) + (-a2 * sin1).to(dtype).to(tl.float32)
    y2 = (a2 * cos2).to(dtype).to(tl.float32) + (a1 * sin2).to(dtype).to(tl.float32)
    tl.store(y_row + i, y1.to(dtype), mask=in_half)
    tl.store(y_row + HALF + i, y2.to(dtype), mask=in_half)
    rest = 2 * HALF + tl.arange(0, BLOCK_REST)
    in_rest = rest < head_dim
    tl.store(y_row + rest, tl.load(x_row + rest, mask=in_rest, other=0.0), mask=in_rest)


def partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_partial_rope(x, cos, sin)` in one launch: x [T, H, head_dim] (any strides over T and H); cos, sin
    [T, rotary_dim] in x's dtype -> [T, H, head_dim], the first rotary_dim dims of each head rotated."""
    tokens, heads, head_dim = x.shape
    rotary_dim = cos.shape[-1]
    fits = cos.shape == sin.shape == (tokens, rotary_dim) and rotary_dim % 2 == 0 and rotary_dim <= head_dim
    if not fits or cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise ValueError(
            f"partial_rope: x {x.dtype} {tuple(x.shape)}, cos {cos.dtype} {tuple(cos.shape)} and sin {sin.dtype} "
            f"{tuple(sin.shape)} do not fit x [T, H, head_dim], cos and sin [T, even rotary_dim <= head_dim] in x's "
            "dtype"
        )
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()  # the rotary tables' rows: no copy where they are already
    y = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    if tokens and heads:
        half = rotary_dim // 2
        _partial_rope_kernel[(tokens * heads,)](
            x, cos, sin, y,
            heads, head_dim,
            x.stride(0), x.stride(1), rotary_dim, y.stride(0), y.stride(1),
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_REST=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
            enable_fp_fusion=False,  # torch rounds each product before the sum: no fused multiply-add
        )  # fmt: skip
    return y
