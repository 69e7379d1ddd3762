"""Which code runs a Gated DeltaNet layer in a step: the layer's own forward (notebook 04), or its graph-safe decode.

A GDN layer reaches its memory as an attention layer does: through the step's context, at its own layer of the pool
(`fb.state_pool.conv_state(pool_layer)` as `fb.kv_pool.get_kv(pool_layer)`), rows chosen by `fb.slots`.

- Eager steps (prefill, and decode outside the static runner) call `GatedDeltaNet.forward`: notebook 04's code,
  which builds per-step facts from the host lists of the context.
- A graph-safe step (`fb.graph_safe`: a decode step of a4/engine/graph_runner.py, maybe being captured in a CUDA
  graph) may read only tensors, and must update the states in place by slot: the layer's weights with the
  by-slot primitives, a4's Triton kernels on CUDA (a4/kernels/gdn_decode.py) and notebook 10's torch functions
  elsewhere (a4/layers/gdn_decode.py). Each state row is read once and written once per step.
"""

from __future__ import annotations

import importlib.util

import torch

from a4.core import ForwardBatch
from a4.layers.deltanet import GatedDeltaNet


def gdn_forward(layer: GatedDeltaNet, hidden: torch.Tensor, fb: ForwardBatch, pool_layer: int) -> torch.Tensor:
    """hidden [T, hidden_size] -> [T, hidden_size]; the layer's states are state-pool layer `pool_layer`."""
    conv_state, recurrent_state = fb.state_pool.conv_state(pool_layer), fb.state_pool.recurrent_state(pool_layer)
    if fb.graph_safe:
        return gdn_decode_by_slot(layer, hidden, fb.slots, conv_state, recurrent_state)
    return layer(hidden, fb, conv_state, recurrent_state)


def _by_slot_ops(device: torch.device):
    """The module holding conv_update_by_slot_ and gated_delta_rule_update_by_slot_ for this device."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is not None:
        from a4.kernels import gdn_decode
    else:
        from a4.layers import gdn_decode
    return gdn_decode


def gdn_decode_by_slot(
    layer: GatedDeltaNet,
    hidden: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
) -> torch.Tensor:
    """One token per row: hidden [B, hidden_size], row i updating slot slots[i] of both states in place.

    The arithmetic of `GatedDeltaNet.forward`'s decode (see its docstring), without host lists: the projections,
    then the conv and the delta rule as by-slot primitives, then the gated norm and out_proj.
    """
    ops = _by_slot_ops(hidden.device)
    batch = hidden.shape[0]
    key_dim = layer.num_k_heads * layer.head_k_dim
    x = ops.conv_update_by_slot_(layer.in_proj_qkv(hidden), layer.conv1d.weight, conv_state, slots)
    q, k, v = x.split([key_dim, key_dim, layer.num_v_heads * layer.head_v_dim], dim=-1)
    o = ops.gated_delta_rule_update_by_slot_(
        q.reshape(batch, layer.num_k_heads, layer.head_k_dim),
        k.reshape(batch, layer.num_k_heads, layer.head_k_dim),
        v.reshape(batch, layer.num_v_heads, layer.head_v_dim),
        layer.in_proj_a(hidden),
        layer.in_proj_b(hidden),
        layer.A_log,
        layer.dt_bias,
        recurrent_state,
        slots,
    )
    z = layer.in_proj_z(hidden).reshape(batch, layer.num_v_heads, layer.head_v_dim)
    o = layer.norm(o.to(hidden.dtype), z)
    return layer.out_proj(o.reshape(batch, -1))
