"""Triton kernels for Qwen3.5's two norms, one launch each: the zero-centred RMSNorm and the GDN output's gated norm.

Why kernels of our own: in torch a norm is a chain of ~10 tiny kernels (cast, square, mean, add eps, rsqrt,
multiply, cast the weight, add one, multiply, cast back), each a launch that reads and writes the whole row. A
Qwen3.5-0.8B decode step runs 61 zero-centred norms (two per layer, the attention layers' q and k norms, the final
norm) and 18 gated norms: ~750 launches, a third of a batch-1 step's kernels on an H200 (solutions/REPORT.md §5).
Here one program normalises one row: it reads the row (and the gate) once and writes the result once.

The arithmetic is the modules' own, casts included, so the results agree to float32 rounding (the sum of squares
is reduced in another order):
- `ZeroCenteredRMSNorm` (notebook 03): x * rsqrt(mean(x^2) + eps) * (1 + w), all in float32, cast at the end;
- `GatedRMSNorm` (notebook 04): x * rsqrt(mean(x^2) + eps) in float32, cast to x's dtype, times w in that dtype,
  times silu(z) in float32, cast back.

A Qwen3.5 decoder layer adds each sublayer's output to the residual stream in the norm that follows it
(`a4.layers.norm.add_and_norm`): the mixer's before its MLP's norm, the MLP's before the next layer's first norm (or
the final norm). With the kernel, the add happens in the same program (in the model dtype, as torch adds), which
writes both the sum and its norm: two launches and two reads of the row fewer per layer.

`use_fused_norms(model)` (a4/layers/fused.py) routes a model's norm modules through these kernels (the engine does it
where a4's Triton kernels run, `a4.models.registry.load_model`): each module keeps its weight and only its forward
changes, so the students' classes stay as they wrote them, and the CPU path never sees a kernel.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, z_ptr, h_ptr, sum_ptr, y_ptr,
    dim, eps,
    stride_x, stride_z, stride_h, stride_sum, stride_y,
    GATED: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=in_row, other=0.0)
    if ADD:
        # The residual add x + h, rounded to x's dtype as torch's add rounds it; the norm is the sum's.
        h = tl.load(h_ptr + row * stride_h + cols, mask=in_row, other=0.0)
        x = (x.to(tl.float32) + h.to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=in_row)
    x32 = x.to(tl.float32)
    normed = x32 * tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0)
    if GATED:
        # Cast to x's dtype, scale in that dtype, then gate in float32: GatedRMSNorm's order. The product of two
        # bfloat16 values is exact in float32, so rounding it once to x's dtype is the bfloat16 product.
        scaled = (w.to(tl.float32) * normed.to(x.dtype).to(tl.float32)).to(x.dtype).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + cols, mask=in_row, other=0.0).to(tl.float32)
        y = scaled * (z * tl.sigmoid(z))
    else:
        y = normed * (1.0 + w.to(tl.float32))
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=in_row)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., dim] as [rows, dim] with unit stride along dim (a view where possible)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None, residual: torch.Tensor | None):
    """The kernel over the rows of x: (the sum x + residual or None, the norm)."""
    rows = _rows(x)
    z = rows if gate is None else _rows(gate)
    h = rows if residual is None else _rows(residual)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    total = out if residual is None else torch.empty_like(out)
    if rows.shape[0]:
        dim = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, z, h, total, out,
            dim, eps,
            rows.stride(0), z.stride(0), h.stride(0), total.stride(0), out.stride(0),
            GATED=gate is not None, ADD=residual is not None, BLOCK=triton.next_power_of_2(dim),
            **pdl_launch(x.device, rows.shape[0]),
        )  # fmt: skip
    return (None if residual is None else total.view(x.shape)), out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor | None = None) -> torch.Tensor:
    """The zero-centred RMSNorm of x [..., dim] with weight [dim]; with `gate` (z, shaped as x), the gated norm."""
    return _launch(x, weight, eps, gate, None)[1]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, the zero-centred RMSNorm of that sum) from one launch; x and residual [..., dim] alike."""
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(
            f"add_rms_norm: residual {residual.dtype} {tuple(residual.shape)} should be x's {x.dtype} {tuple(x.shape)}"
        )
    return _launch(x, weight, eps, None, residual)
