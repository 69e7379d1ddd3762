"""A Triton kernel for SwiGLU's activation, silu(gate) * up, in one launch.

Why a kernel of our own: in torch it is two launches (F.silu, then the product), each a pass over the rows, in every
gated MLP of a decode step (Qwen3.5-0.8B: 24 of them; the 35B-A3B's shared experts: 40). With merged projections
(a4/layers/merged_linear.py) gate and up are two column ranges of one product, read here through their strides.

The arithmetic is torch's: silu in float32, rounded to the model dtype (F.silu's output), then the product in float32,
rounded again. `use_fused_activation(model)` (a4/layers/fused.py) gives every GatedMLP of a model this kernel as its
`act_and_mul` (the engine does it where a4's Triton kernels run, `a4.models.registry.fuse_for_device`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Columns per program: at batch 1 the 0.8B MLP's 3,584 columns are 7 programs.
BLOCK = 512


@triton.jit
def _silu_and_mul_kernel(gate_ptr, up_ptr, y_ptr, width, stride_gate, stride_up, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < width
    gate = tl.load(gate_ptr + row * stride_gate + cols, mask=in_row, other=0.0)
    up = tl.load(up_ptr + row * stride_up + cols, mask=in_row, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (silu * up.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=in_row)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., width] of one shape and dtype (strided rows are fine): [..., width]."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"silu_and_mul: gate {gate.dtype} {tuple(gate.shape)} and up {up.dtype} {tuple(up.shape)} should match"
        )
    gate_rows, up_rows = (t.reshape(-1, t.shape[-1]) for t in (gate, up))
    gate_rows, up_rows = (t if t.stride(-1) == 1 else t.contiguous() for t in (gate_rows, up_rows))
    rows, width = gate_rows.shape
    y = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(width, BLOCK))](
            gate_rows, up_rows, y, width, gate_rows.stride(0), up_rows.stride(0), y.stride(0), BLOCK=BLOCK
        )
    return y.view(gate.shape)
