"""Triton kernels for the Gated DeltaNet decode step and the verify pass, in place on the state pool by slot index.

Same contracts (and numbers, to float32 rounding) as the torch reference of notebook 10
(`a4.layers.gdn_decode.conv_update_by_slot_` / `gated_delta_rule_update_by_slot_`); the engine calls these on CUDA.

Why kernels of our own: in torch the decode step of a GDN layer is a chain of small ops (gather the state rows,
l2-normalise, scale, repeat the key heads, gate, the four steps of the rule, scatter back), each a kernel launch and
each a pass over the state: ~8 reads or writes of 1 MiB of float32 state per request per layer at Qwen3.5-0.8B's
shapes, and ~30 launches, when the work is one read and one write of that state. Here each op is one launch that
reads a state row once and writes it once, and does everything else in registers:
- `conv_update_by_slot_`: one program per (request, block of channels) reads the K-1 stored inputs, adds the new
  one, writes silu(conv) and the shifted window back to the same pool row;
- `gated_delta_rule_update_by_slot_`: one program per (request, value head, block of dv columns). The columns of
  S are independent in the rule (delta_j, S[:, j] and o_j only involve column j), so a [dk, BLOCK_V] tile of the
  state is the whole problem of its program: load it, decay, correct, read, store. q and k (dk values each) are
  l2-normalised by every program that needs them, which costs less than a launch of its own.
Slots are read on the device and nothing depends on host-side values, so both kernels can be captured in a CUDA
graph; padded rows of a graph batch may share one dummy slot (their writes to it race, harmlessly).

A verify pass of speculative decoding (`conv_verify_by_slot_`, `gated_delta_rule_verify_by_slot_`) is the same two
kernels walking L tokens per request: the slot's state is read once, carried in registers from token to token, and
the state after each token is stored in the pool's verify buffers, the slot's own row left as it was until the
engine commits. Each token goes through the very instructions of a decode step (one kernel, LENGTH = 1 or L), so a
verify pass computes, bit for bit, what decode steps of its tokens would: bfloat16 drafts taken from a plain run are
accepted. One launch per layer and kernel, where running the decode kernels once per token over a scratch copy of
the states took ~20 launches per layer (`python -m a4 bench gpu`'s spec part).

In-place safety: no thread of a program may overwrite a state value that another thread of it has yet to read.
The conv reads and writes its K-1 columns as separate [BLOCK_D] vectors of one layout, and one warp of 32 threads
(at most 8 elements each) covers BLOCK_D = 128 channels without repeating any, so each channel has one owning thread,
which reads a column before it writes it. The recurrence's tile passes through cross-warp reductions (a barrier) between
its load and its store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel

# Channels per conv program, and one warp: every channel has exactly one owning thread (see above). Timed on an H100
# within CUDA graphs over every GDN layer's pool (channels, warps: µs per layer at batch 1 / 32 / 128, the 0.8B's
# 6,144 channels): 256, 1: 2.6 / 5.3 / 14.3; 128, 1: 2.0 / 4.2 / 9.9; 256, 2: 2.2 / 4.4 / 10.9; 1024, 8: 3.2 / 4.5 /
# 10.7. More, smaller programs keep more of the strided state loads in flight; the 35B-A3B's 8,192 channels rank the
# same, and every variant's output and states were the same bits.
CONV_BLOCK_D = 128
CONV_WARPS = 1
# State columns per rule program, and its warps (one warp for the tiny shapes' [16, 16] tile). Timed on an H200 at
# the 0.8B shapes (one layer, states cold; columns, warps: µs at batch 1 / 32 / 128): 16, 4: 3.1 / 32.9 / 131;
# 32, 4: 3.4 / 24.2 / 87; 64, 4: 4.1 / 22.6 / 76 (3.5 TB/s of state read and written); 128, 8: 6.3 / 32.6 / 116.
# 64 columns make 32 programs for one request, too few for the SMs at batch 1, but 256-byte runs of each state row
# at every batch. Fixed, not chosen by the batch: a tile's reductions round by its layout, and a row's bits must not
# depend on how many requests share its step (a verify step and the decode steps of its tokens, above all).
RULE_BLOCK_V = 64
RULE_WARPS = 4


@triton.jit
def _window_column(
    state_row, stride_s_tap, x_ptr, stride_x_row, first_row, d, in_dim, COLUMN: tl.constexpr, KERNEL: tl.constexpr
):
    """Column COLUMN of a request's window cat(its K-1 stored inputs, its L new inputs): known at compile time."""
    if COLUMN < KERNEL - 1:
        return tl.load(state_row + COLUMN * stride_s_tap, mask=in_dim, other=0.0)
    return tl.load(x_ptr + (first_row + COLUMN - (KERNEL - 1)) * stride_x_row + d, mask=in_dim, other=0.0)


@triton.jit
def _conv_kernel(
    x_ptr, weight_ptr, state_ptr, slots_ptr, y_ptr, out_ptr,
    dim,
    stride_x_row, stride_w_dim, stride_w_tap, stride_s_slot, stride_s_dim, stride_s_tap, stride_y_row,
    stride_out_slot, stride_out_pos, stride_out_dim, stride_out_tap,
    KERNEL: tl.constexpr, LENGTH: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    request = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_dim = d < dim
    slot = tl.load(slots_ptr + request)
    state_row = state_ptr + slot * stride_s_slot + d * stride_s_dim
    out_row = out_ptr + slot * stride_out_slot + d * stride_out_dim
    first_row = request * LENGTH  # the request's tokens are rows first_row .. first_row + LENGTH - 1 of x and y
    for j in tl.static_range(LENGTH):
        # Token j's window is columns j .. j + K-1; tap K-1 of the filter meets the token itself.
        x = tl.load(x_ptr + (first_row + j) * stride_x_row + d, mask=in_dim, other=0.0)
        acc = x.to(tl.float32) * tl.load(weight_ptr + d * stride_w_dim + (KERNEL - 1) * stride_w_tap, mask=in_dim).to(
            tl.float32
        )
        for tap in tl.static_range(KERNEL - 1):
            column = _window_column(state_row, stride_s_tap, x_ptr, stride_x_row, first_row, d, in_dim, j + tap, KERNEL)
            acc += column.to(tl.float32) * tl.load(weight_ptr + d * stride_w_dim + tap * stride_w_tap, mask=in_dim).to(
                tl.float32
            )
        # The conv's output is rounded to x's dtype before silu, as F.conv1d then F.silu give it.
        conv = acc.to(x.dtype).to(tl.float32)
        y = conv / (1.0 + tl.exp(-conv))
        tl.store(y_ptr + (first_row + j) * stride_y_row + d, y.to(y_ptr.dtype.element_ty), mask=in_dim)
        # The state after token j: columns j+1 .. j+K-1. In place (decode), column c is written after column c+1,
        # the one it takes, has been read.
        for c in tl.static_range(KERNEL - 1):
            column = _window_column(
                state_row, stride_s_tap, x_ptr, stride_x_row, first_row, d, in_dim, j + 1 + c, KERNEL
            )
            out = out_row + j * stride_out_pos + c * stride_out_tap
            tl.store(out, column.to(out_ptr.dtype.element_ty), mask=in_dim)


def _conv(x, weight, conv_state, slots, out, length: int, name: str) -> torch.Tensor:
    """The conv kernel over `length` tokens per request; `out` [num_slots, length, D, K-1] gets the state after each."""
    dim = x.shape[1]
    kernel = weight.shape[-1]
    if weight.shape != (dim, 1, kernel) or conv_state.shape[1:] != (dim, kernel - 1) or kernel < 2:
        raise ValueError(
            f"{name}: x {tuple(x.shape)}, weight {tuple(weight.shape)} and conv_state "
            f"{tuple(conv_state.shape)} do not fit x [T, D], weight [D, 1, K], conv_state [slots, D, K-1]"
        )
    if slots.dim() != 1 or x.shape[0] != slots.shape[0] * length:
        raise ValueError(
            f"{name}: slots {tuple(slots.shape)} should be [{x.shape[0] // length}] for x {tuple(x.shape)}"
        )
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    _conv_kernel[(slots.shape[0], triton.cdiv(dim, CONV_BLOCK_D))](
        x, weight, conv_state, slots, y, out,
        dim,
        x.stride(0), weight.stride(0), weight.stride(2),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2), y.stride(0),
        *out.stride(),
        KERNEL=kernel, LENGTH=length, BLOCK_D=CONV_BLOCK_D, num_warps=CONV_WARPS,
        **pdl_launch(x.device, slots.shape[0] * triton.cdiv(dim, CONV_BLOCK_D)),
    )
    return y


def conv_update_by_slot_(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One decode token of the causal conv + silu for B requests, their conv states updated in place by slot.

    x [B, D] (model dtype); weight [D, 1, K]; conv_state [num_slots, D, K-1]; slots [B] int64 on x's device.
    Returns y [B, D] in x's dtype; conv_state[slots] becomes the last K-1 inputs.
    """
    # The state after the one token goes back to the slot's own row: a position axis of length 1, never stepped.
    return _conv(x, weight, conv_state, slots, conv_state.unsqueeze(1), 1, "conv_update_by_slot_")


def conv_verify_by_slot_(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor, verify_states: torch.Tensor
) -> torch.Tensor:
    """A verify pass's causal conv + silu: L tokens for each of B requests, in one launch, computing for each token
    what `conv_update_by_slot_` computes for it as a decode token (the same bits), from the slot's state.

    x [B * L, D], request after request; conv_state [num_slots, D, K-1], only read; verify_states
    [num_slots, L, D, K-1]: rows `slots` get the conv state after each token (notebook 11's `causal_conv1d_verify`
    states). Returns y [B * L, D] in x's dtype.
    """
    name = "conv_verify_by_slot_"
    length = _verify_length(verify_states, conv_state, name)
    return _conv(x, weight, conv_state, slots, verify_states, length, name)


def _verify_length(verify_states: torch.Tensor, state: torch.Tensor, name: str) -> int:
    """L, once `verify_states` is checked to be [num_slots, L, *state's row] in the state's dtype."""
    fits = verify_states.shape[0] == state.shape[0] and verify_states.shape[2:] == state.shape[1:]
    if not fits or verify_states.dtype != state.dtype:
        raise ValueError(
            f"{name}: verify_states {verify_states.dtype} {tuple(verify_states.shape)} should be {state.dtype} "
            f"[slots, L, {', '.join(map(str, state.shape[1:]))}] for the pool's {tuple(state.shape)}"
        )
    return verify_states.shape[1]


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, state_ptr, slots_ptr, o_ptr, out_ptr,
    dk, dv, scale,
    stride_q_row, stride_q_head, stride_k_row, stride_k_head, stride_v_row, stride_v_head,
    stride_a_row, stride_b_row,
    stride_s_slot, stride_s_head, stride_s_k, stride_s_v,
    stride_o_row, stride_o_head,
    stride_out_slot, stride_out_pos, stride_out_head, stride_out_k, stride_out_v,
    GROUP: tl.constexpr, LENGTH: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr,
):
    request = tl.program_id(0)
    head = tl.program_id(1)
    key_head = head // GROUP  # value head h reads key head h // (Hv / Hk)
    i = tl.arange(0, BLOCK_K)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_k = i < dk
    in_v = j < dv
    in_tile = in_k[:, None] & in_v[None, :]
    slot = tl.load(slots_ptr + request)
    tile = state_ptr + slot * stride_s_slot + head * stride_s_head + i[:, None] * stride_s_k + j[None, :] * stride_s_v
    out_tile = out_ptr + slot * stride_out_slot + head * stride_out_head + i[:, None] * stride_out_k
    out_tile += j[None, :] * stride_out_v
    # The state tile, the program's largest read, comes before the wait for the kernel before (a4/kernels/pdl.py):
    # whichever kernel that is (the conv, a projection's GEMV, a MIXED step's write-back of its prompts' states, which
    # are other slots'), it writes none of these rows, and every kernel before it has completed. q, k, v, a and b,
    # which the kernels before write, are read after the wait.
    s = tl.load(tile, mask=in_tile, other=0.0)
    wait_for_previous_kernel(PDL)
    # The request's tokens, one after the other, the tile kept in registers between them.
    for t in tl.static_range(LENGTH):
        row = request * LENGTH + t
        q = tl.load(q_ptr + row * stride_q_row + key_head * stride_q_head + i, mask=in_k, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * stride_k_row + key_head * stride_k_head + i, mask=in_k, other=0.0).to(tl.float32)
        q = (q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale).to(tl.float32)  # float32 even if scale comes as float64
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        v = tl.load(v_ptr + row * stride_v_row + head * stride_v_head + j, mask=in_v, other=0.0).to(tl.float32)

        # beta = sigmoid(b) rounded to b's dtype (the layer takes the sigmoid of the projection's output, then
        # .float()).
        b = tl.load(b_ptr + row * stride_b_row + head)
        beta = tl.sigmoid(b.to(tl.float32)).to(b.dtype).to(tl.float32)
        # g = -exp(A_log) * softplus(a + dt_bias), softplus with torch's threshold (x above 20 stays x).
        x = tl.load(a_ptr + row * stride_a_row + head).to(tl.float32) + tl.load(dt_bias_ptr + head).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))
        g = -tl.exp(tl.load(a_log_ptr + head).to(tl.float32)) * softplus

        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))  # beta (v - S^T k), for this tile's columns
        s += k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_tile + t * stride_out_pos, s, mask=in_tile)
        tl.store(o_ptr + row * stride_o_row + head * stride_o_head + j, o.to(o_ptr.dtype.element_ty), mask=in_v)


def _gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, out, length: int, out_dtype, name: str):
    """The rule kernel over `length` tokens per request; `out` [num_slots, length, Hv, dk, dv] gets S after each."""
    rows, num_k_heads, dk = k.shape
    _, num_v_heads, dv = v.shape
    if q.shape != k.shape or v.shape[0] != rows or num_v_heads % num_k_heads:
        raise ValueError(
            f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
            "fit q, k [T, Hk, dk], v [T, Hv, dv] with Hv a multiple of Hk"
        )
    if state.dtype != torch.float32 or state.shape[1:] != (num_v_heads, dk, dv):
        raise ValueError(
            f"{name}: state {state.dtype} {tuple(state.shape)} should be float32 [slots, {num_v_heads}, {dk}, {dv}]"
        )
    slots_fit = slots.dim() == 1 and rows == slots.shape[0] * length
    if a.shape != (rows, num_v_heads) or b.shape != (rows, num_v_heads) or not slots_fit:
        raise ValueError(
            f"{name}: a {tuple(a.shape)}, b {tuple(b.shape)}, slots {tuple(slots.shape)} should be [{rows}, "
            f"{num_v_heads}], [{rows}, {num_v_heads}] and [{rows} / {length} tokens per request]"
        )
    q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
    a, b = (t if t.stride(1) == 1 else t.contiguous() for t in (a, b))
    block_k = max(16, triton.next_power_of_2(dk))
    block_v = min(RULE_BLOCK_V, max(16, triton.next_power_of_2(dv)))
    num_warps = RULE_WARPS if block_k >= 64 else 1
    o = torch.empty(rows, num_v_heads, dv, dtype=out_dtype, device=v.device)
    _gated_delta_rule_kernel[(slots.shape[0], num_v_heads, triton.cdiv(dv, block_v))](
        q, k, v, a, b, A_log, dt_bias, state, slots, o, out,
        dk, dv, dk**-0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0),
        state.stride(0), state.stride(1), state.stride(2), state.stride(3),
        o.stride(0), o.stride(1),
        *out.stride(),
        GROUP=num_v_heads // num_k_heads, LENGTH=length, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
        **pdl_launch(v.device, slots.shape[0] * num_v_heads * triton.cdiv(dv, block_v)),
    )
    return o


def gated_delta_rule_update_by_slot_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One decode token of the gated delta rule for B requests, their recurrent states updated in place by slot.

    q, k [B, Hk, dk], v [B, Hv, dv] (model dtype, views of the conv output are fine); a, b [B, Hv]; A_log, dt_bias
    [Hv]; state [num_slots, Hv, dk, dv] float32; slots [B] int64. Returns o [B, Hv, dv], computed in float32 and
    stored as `out_dtype`: the model dtype saves the layer's cast to it, a launch (the same rounding). The l2-norm of
    q and k, q's dk^-0.5, the head grouping, beta and g are computed inside the kernel, as the layer does them.
    """
    # The state after the one token goes back to the slot's own row: a position axis of length 1, never stepped.
    out = state.unsqueeze(1)
    name = "gated_delta_rule_update_by_slot_"
    return _gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, out, 1, out_dtype, name)


def gated_delta_rule_verify_by_slot_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    verify_states: torch.Tensor,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """A verify pass's gated delta rule: L tokens for each of B requests, in one launch, computing for each token
    what `gated_delta_rule_update_by_slot_` computes for it as a decode token (the same bits), from the slot's state.

    q, k [B * L, Hk, dk], v [B * L, Hv, dv], a, b [B * L, Hv], request after request; state [num_slots, Hv, dk, dv],
    only read; verify_states [num_slots, L, Hv, dk, dv]: rows `slots` get S after each token (notebook 11's
    `gated_delta_rule_verify` states). Returns o [B * L, Hv, dv] as `out_dtype`.
    """
    name = "gated_delta_rule_verify_by_slot_"
    length = _verify_length(verify_states, state, name)  # float32, as _gated_delta_rule requires of state
    return _gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, slots, verify_states, length, out_dtype, name)
