"""Which code runs a Gated DeltaNet layer in a step: the layer's own forward (notebook 04), or its graph-safe decode.

A GDN layer reaches its memory as an attention layer does: through the step's context, at its own layer of the pool
(`fb.state_pool.conv_state(pool_layer)` as `fb.kv_pool.get_kv(pool_layer)`), rows chosen by `fb.slots`.

- Eager steps (prefill, and decode outside the static runner) call `GatedDeltaNet.forward`: notebook 04's code,
  which builds per-step facts from the host lists of the context.
- A graph-safe step (`fb.graph_safe`: a decode step of a4/engine/graph_runner.py, maybe being captured in a CUDA
  graph) may read only tensors, and must update the states in place by slot: the layer's weights with the
  by-slot primitives, a4's Triton kernels on CUDA (a4/kernels/gdn_decode.py) and notebook 10's torch functions
  elsewhere (a4/layers/gdn_decode.py). Each state row is read once and written once per step.
- The verify pass of speculative decoding (`fb.verify`, notebook 11) feeds each request up to k + 1 tokens and must
  keep the state after every one of them: the graph-safe decode step, run once per position over scratch copies of
  the requests' states, each copied aside after its position. The pool is not touched; the engine commits.
- A bfloat16 prefill on CUDA with flash-linear-attention installed (the `gpu` extra) runs its varlen kernels over
  the whole batch by slot: notebook 04's chunked rule loops over chunks in Python, thousands of launches for a long prompt.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch

from a4.core import ForwardBatch
from a4.kernels import triton_kernels_run_on
from a4.kernels.fla_prefill import fla_available
from a4.layers.deltanet import GatedDeltaNet

if TYPE_CHECKING:
    from a4.models.qwen3_5 import GDNStates


def gdn_forward(layer: GatedDeltaNet, hidden: torch.Tensor, fb: ForwardBatch, pool_layer: int) -> torch.Tensor:
    """hidden [T, hidden_size] -> [T, hidden_size]; the layer's states are state-pool layer `pool_layer`."""
    states: GDNStates = fb.state_pool
    conv_state, recurrent_state = states.conv_state(pool_layer), states.recurrent_state(pool_layer)
    if fb.verify is not None:
        return gdn_verify(layer, hidden, fb, pool_layer, conv_state, recurrent_state)
    if fb.graph_safe:
        return gdn_by_slot(layer, hidden, fb, conv_state, recurrent_state)
    # fla's kernels compute float32 products in TF32: a float32 model keeps notebook 04's exact arithmetic.
    if fb.phase == "prefill" and hidden.is_cuda and hidden.dtype != torch.float32 and fla_available():
        return gdn_by_slot(layer, hidden, fb, conv_state, recurrent_state)
    return layer(hidden, fb, conv_state, recurrent_state)


def gdn_by_slot(
    layer: GatedDeltaNet,
    hidden: torch.Tensor,
    fb: ForwardBatch,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """The arithmetic of `GatedDeltaNet.forward` (see its docstring) from the layer's weights, with the conv and the
    delta rule as by-slot primitives that read each request's pool rows and write its final states back in place.

    Decode (one token per row, graph-safe: no host lists): `conv_update_by_slot_` and
    `gated_delta_rule_update_by_slot_`, Triton's on CUDA, notebook 10's torch functions elsewhere. Prefill on CUDA:
    flash-linear-attention's varlen conv and chunked rule over the flattened batch (a4/kernels/fla_prefill.py).
    """
    mixed_qkv = layer.in_proj_qkv(hidden)
    if fb.phase == "decode":
        ops = _decode_ops(hidden.device)
        conv, rule, varlen = ops.conv_update_by_slot_, ops.gated_delta_rule_update_by_slot_, ()
    else:
        from a4.kernels import fla_prefill as ops

        # A request that starts here starts from zero states, whatever its slot still holds.
        fresh = torch.tensor([p == 0 for p in fb.prefix_lens], device=hidden.device)
        conv, rule = ops.causal_conv1d_prefill_by_slot_, ops.chunk_gated_delta_rule_by_slot_
        varlen = (fb.cu_seqlens, fresh)
    x = conv(mixed_qkv, layer.conv1d.weight, conv_state, fb.slots, *varlen)
    o = rule(*_split_heads(layer, x), layer.in_proj_a(hidden), layer.in_proj_b(hidden), layer.A_log, layer.dt_bias,
             recurrent_state, fb.slots, *varlen)
    return _output(layer, hidden, o)


def gdn_verify(
    layer: GatedDeltaNet,
    hidden: torch.Tensor,
    fb: ForwardBatch,
    pool_layer: int,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """The verify pass (speculative decoding): request i's tokens one position at a time, from its slot's states, the
    states after every position kept in `fb.verify` ([B, L, ...] per pool layer); the pool's rows are not written.

    Position j of every request is one graph-safe decode step over scratch rows 0..B-1 that start as copies of the
    requests' slots. A request with fewer than L tokens runs its padded positions on a zero input: their states are
    garbage, and the engine never commits past a request's own tokens.
    """
    verify, ops = fb.verify, _decode_ops(hidden.device)
    batch = fb.batch_size
    rows = torch.arange(batch, device=hidden.device)
    scratch_conv, scratch_recurrent = conv_state.index_select(0, fb.slots), recurrent_state.index_select(0, fb.slots)
    conv_after = scratch_conv.new_empty(batch, verify.num_tokens, *scratch_conv.shape[1:])
    recurrent_after = scratch_recurrent.new_empty(batch, verify.num_tokens, *scratch_recurrent.shape[1:])

    def padded(x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [T + 1, ...]: the zero row that padded positions read (VerifyStates.grid_rows)."""
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    mixed_qkv = padded(layer.in_proj_qkv(hidden))
    a, b = padded(layer.in_proj_a(hidden)), padded(layer.in_proj_b(hidden))
    o = hidden.new_empty(hidden.shape[0] + 1, layer.num_v_heads, layer.head_v_dim, dtype=torch.float32)
    for j in range(verify.num_tokens):
        token_rows = verify.grid_rows[:, j]
        x = ops.conv_update_by_slot_(mixed_qkv[token_rows], layer.conv1d.weight, scratch_conv, rows)
        o_j = ops.gated_delta_rule_update_by_slot_(
            *_split_heads(layer, x), a[token_rows], b[token_rows], layer.A_log, layer.dt_bias, scratch_recurrent, rows
        )
        conv_after[:, j], recurrent_after[:, j] = scratch_conv, scratch_recurrent
        o.index_copy_(0, token_rows, o_j)  # padded positions all land on the last row, which is dropped
    verify.conv[pool_layer], verify.recurrent[pool_layer] = conv_after, recurrent_after
    return _output(layer, hidden, o[:-1])


def _decode_ops(device: torch.device) -> ModuleType:
    """The graph-safe by-slot primitives: a4's Triton kernels on CUDA, notebook 10's torch functions elsewhere."""
    if triton_kernels_run_on(device):
        from a4.kernels import gdn_decode as ops
    else:
        from a4.layers import gdn_decode as ops
    return ops


def _split_heads(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The conv output [T, conv_dim] -> q, k [T, Hk, dk] and v [T, Hv, dv]."""
    key_dim = layer.num_k_heads * layer.head_k_dim
    q, k, v = x.split([key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    return (
        q.reshape(-1, layer.num_k_heads, layer.head_k_dim),
        k.reshape(-1, layer.num_k_heads, layer.head_k_dim),
        v.reshape(-1, layer.num_v_heads, layer.head_v_dim),
    )


def _output(layer: GatedDeltaNet, hidden: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """The delta rule's output [T, Hv, dv] (float32) -> gated norm with z -> out_proj: [T, hidden_size]."""
    z = layer.in_proj_z(hidden).reshape(hidden.shape[0], layer.num_v_heads, layer.head_v_dim)
    o = layer.norm(o.to(hidden.dtype), z)
    return layer.out_proj(o.reshape(hidden.shape[0], -1))
