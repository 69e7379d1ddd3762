"""Exercises (notebook 10): the Gated DeltaNet decode step in a form a CUDA graph can capture.

On a GPU a decode step of a small model is mostly waiting: each of its kernels (574 per step of Qwen3.5-0.8B on an
H200, notebook 10) takes about 3 microseconds of GPU time, and Python takes longer than that to launch it (about 49
microseconds of wall time per kernel in the uncaptured step). A CUDA graph removes the wait: the
engine records the step's kernels once (capture) and launches the whole recording with one call (replay). Replay
runs exactly the recorded kernels, on exactly the recorded memory, so the step must be written for it:

- static shapes: one recording per batch size (padded up to a bucket: 1, 2, 4, 8, ...), every tensor at a fixed
  address; new inputs are copied into the recorded buffers before each replay;
- state by index: a request's state is not gathered into a new tensor and handed to the layer; the layer reads and
  writes its rows of the state pool in place, at the slot indices it finds in a device tensor (`slots`). A padded
  row of the batch points at a dummy slot that no request owns (several rows may share it): what it computes and
  writes there is garbage, and harmless;
- no host sync: nothing in the step may wait for the GPU to hand a value back to Python (`.item()`, `.tolist()`,
  `if tensor:`, a Python loop over the requests, an output whose shape depends on values). Python does not run
  during replay, so whatever it would have decided from those values is frozen at capture time.

These two functions are the GDN layer's decode step in that form. They compute the same numbers as notebook 04's
`causal_conv1d_decode` and `recurrent_gated_delta_rule` inside `GatedDeltaNet.forward`, but by slot: `index_select`
reads the batch's rows of the pool, `index_copy_` writes them back, and every request is a row of the same batched
tensor operations. On the CPU the static-buffer decode runner uses them as they are; on a GPU a4's Triton kernels
(a4/kernels) do the same work in one kernel per function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def conv_update_by_slot_(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One decode token of the causal conv + silu for B requests, their conv states updated in the pool.

    x: [B, D] in the model dtype, each request's new in_proj_qkv output. weight: [D, 1, K] (`conv1d.weight`).
    conv_state: [num_slots, D, K-1], one GDN layer's conv states in the pool (model dtype). slots: [B] int64, the
    pool row of each request (a dummy slot, possibly shared, for padded rows).

    Returns y [B, D] in x's dtype: for each request, silu(sum_j weight[:, 0, j] * window[:, j]) over its K inputs,
    window = its K-1 stored inputs followed by x. Rows `slots` of conv_state become the last K-1 inputs of each
    window, written in place (conv_state stays the same tensor); no other row changes. No Python loop over the
    requests, no host sync.
    """
    # BEGIN SOLUTION gdn-conv-by-slot 10_gpu: gather the slots' conv states, conv + silu, write the new states back
    window = torch.cat([conv_state.index_select(0, slots), x[:, :, None]], dim=2)  # [B, D, K]
    y = F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0])
    conv_state.index_copy_(0, slots, window[:, :, 1:])
    return y
    # END SOLUTION


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
) -> torch.Tensor:
    """One decode token of the gated delta rule for B requests, their recurrent states updated in the pool.

    q, k: [B, Hk, dk] and v: [B, Hv, dv], the conv output split into heads (model dtype). a, b: [B, Hv], the
    in_proj_a and in_proj_b outputs (model dtype). A_log, dt_bias: [Hv], the layer's parameters.
    state: [num_slots, Hv, dk, dv] float32, one GDN layer's recurrent states in the pool. slots: [B] int64, as for
    `conv_update_by_slot_`.

    Returns o [B, Hv, dv] in float32. As GatedDeltaNet.forward prepares them (notebook 04), in float32: q and k
    l2-normalised (x * rsqrt(sum(x^2) + 1e-6)), q scaled by dk^-0.5, value head h reading key head h // (Hv / Hk);
    beta = sigmoid(b) (in b's dtype, then float32), g = -exp(A_log) * softplus(a + dt_bias). Then, with S the
    request's [Hv, dk, dv] state:
        S <- S * exp(g);  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T q
    Rows `slots` of state become the new S, written in place (state stays the same tensor); no other row changes.
    No Python loop over the requests, no host sync.
    """
    # BEGIN SOLUTION gdn-rule-by-slot 10_gpu: prepare q, k, v, g, beta, then one recurrence step on the slots' states
    batch, heads, dv = v.shape
    dk = k.shape[2]

    def prepare_qk(x: torch.Tensor) -> torch.Tensor:
        """[B, Hk, dk] -> [B * Hv, 1, dk] in float32, l2-normalised; value head h reads key head h // (Hv / Hk)."""
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        return x.repeat_interleave(heads // x.shape[1], dim=1).reshape(batch * heads, 1, dk)

    q = prepare_qk(q) * dk**-0.5
    k = prepare_qk(k)
    v = v.float().reshape(batch * heads, 1, dv)
    beta = b.sigmoid().float().reshape(batch * heads, 1, 1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)

    # Requests and heads are independent: one batch of B * Hv small matrix products, as in notebook 04.
    s = state.index_select(0, slots).reshape(batch * heads, dk, dv)  # a copy of the batch's states
    s.mul_(g.exp().reshape(batch * heads, 1, 1))
    delta = (v - torch.bmm(k, s)) * beta  # v - S^T k, as a row: [B * Hv, 1, dv]
    s.baddbmm_(k.transpose(1, 2), delta)  # S += k delta^T, in place
    o = torch.bmm(q, s)  # S^T q
    state.index_copy_(0, slots, s.reshape(batch, heads, dk, dv))
    return o.reshape(batch, heads, dv)
    # END SOLUTION
