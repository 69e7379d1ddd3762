"""A Triton kernel for a gate's activation times another tensor, in one launch: SwiGLU's silu(gate) * up, and gated
attention's output gate, attn * sigmoid(gate).

Why a kernel of our own: in torch each is two launches (the activation, then the product), each a pass over the rows,
in every gated MLP of a decode step (Qwen3.5-0.8B: 24 of them; the 35B-A3B's shared experts: 40) and every gated
attention layer (the 0.8B: 6). With merged projections (a4/layers/merged_linear.py) gate and up are two column ranges
of one product, and attention's gate is the second half of each query head: both are read here through their strides.

The arithmetic is torch's: the activation in float32, rounded to the model dtype (F.silu's or torch.sigmoid's
output), then the product in float32, rounded again. `use_fused_activation(model)` (a4/layers/fused.py) gives every
GatedMLP of a model the kernel as its `act_and_mul`, and the fused attention forward uses `sigmoid_and_mul` (the
engine does both where a4's Triton kernels run, `a4.models.registry.fuse_for_device`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel

# Columns per program: at batch 1 the 0.8B MLP's 3,584 columns are 7 programs.
BLOCK = 512


@triton.jit
def _act_and_mul_kernel(
    gate_ptr, up_ptr, y_ptr, width, inner,
    stride_gate_outer, stride_gate_inner, stride_up_outer, stride_up_inner,
    SIGMOID: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    wait_for_previous_kernel(PDL)
    # Row r of the [outer * inner, width] result is (r // inner, r % inner) of the inputs: a token's head, say.
    row = tl.program_id(0)
    outer, within = row // inner, row % inner
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    gate = tl.load(gate_ptr + outer * stride_gate_outer + within * stride_gate_inner + cols, mask=in_row, other=0.0)
    up = tl.load(up_ptr + outer * stride_up_outer + within * stride_up_inner + cols, mask=in_row, other=0.0)
    g = gate.to(tl.float32)
    # torch's formulas: sigmoid(g) = 1 / (1 + exp(-g)), silu(g) = g / (1 + exp(-g)).
    if SIGMOID:
        act = 1.0 / (1.0 + tl.exp(-g))
    else:
        act = g / (1.0 + tl.exp(-g))
    act = act.to(gate.dtype).to(tl.float32)
    tl.store(y_ptr + row * width + cols, (act * up.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=in_row)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., width] of one shape and dtype (strided rows are fine): [..., width]."""
    return _act_and_mul(gate, up, "silu_and_mul", sigmoid=False)


def sigmoid_and_mul(gate: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) for gate, x [..., width] of one shape and dtype (strided rows are fine): [..., width]."""
    return _act_and_mul(gate, x, "sigmoid_and_mul", sigmoid=True)


def _outer_inner_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., width] as [outer, inner, width] with unit stride along width, a view where possible: attention's gate,
    [tokens, heads, head_dim] inside a merged product's rows, reads as it is (as rows of head_dim it would be a copy)."""
    x = x.reshape(-1, 1, x.shape[-1]) if x.dim() < 3 else x.reshape(-1, *x.shape[-2:])
    return x if x.stride(-1) == 1 else x.contiguous()


def _act_and_mul(gate: torch.Tensor, up: torch.Tensor, name: str, sigmoid: bool) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"{name}: gate {gate.dtype} {tuple(gate.shape)} and {up.dtype} {tuple(up.shape)} should match")
    gate_rows, up_rows = _outer_inner_rows(gate), _outer_inner_rows(up)
    outer, inner, width = gate_rows.shape
    y = torch.empty(outer * inner, width, dtype=gate.dtype, device=gate.device)
    if y.shape[0]:
        programs = y.shape[0] * triton.cdiv(width, BLOCK)
        _act_and_mul_kernel[(y.shape[0], triton.cdiv(width, BLOCK))](
            gate_rows, up_rows, y, width, inner,
            gate_rows.stride(0), gate_rows.stride(1), up_rows.stride(0), up_rows.stride(1),
            SIGMOID=sigmoid, BLOCK=BLOCK, **pdl_launch(gate.device, programs),
        )  # fmt: skip
    return y.view(gate.shape)
