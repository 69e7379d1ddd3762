"""The layers' GPU forwards: which modules a4's Triton kernels (a4/kernels) replace, and how.

Where the kernels run (CUDA with Triton, `a4.models.registry.fuse_for_device`), each `use_*` gives the matching
modules of a loaded model the kernel's forward; each module keeps its weights and only its forward changes, so the
students' classes stay as they wrote them, and the CPU path never sees a kernel:
- `use_fused_norms`: ZeroCenteredRMSNorm and GatedRMSNorm (a4/kernels/rmsnorm.py), the first also gets `add_norm`;
- `use_fused_activation`: every GatedMLP's `act_and_mul` (a4/kernels/activation.py);
- `use_fused_attention`: GatedAttention's forward, with q/k norm + partial RoPE + KV write in one launch
  (a4/kernels/rope.py) and the output gate in one (a4/kernels/activation.py);
- `use_gemv`: bias-free linear layers and merged projections, the small-batch GEMV (a4/kernels/gemv.py);
- `use_fused_experts`: FusedExperts and the SparseMoeBlocks' routers (a4/kernels/moe.py).

Here, not in a4/kernels, so that the kernels import no layer: the layers sit above the kernels. Imports Triton:
import it only where CUDA is in use.
"""

from __future__ import annotations

from types import MethodType

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.kernels import gemv
from a4.kernels.activation import sigmoid_and_mul, silu_and_mul
from a4.kernels.moe import fused_experts, fused_route
from a4.kernels.rmsnorm import add_rms_norm, rms_norm
from a4.kernels.rope import qk_norm_rope
from a4.layers.deltanet import GatedRMSNorm
from a4.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm
from a4.layers.merged_linear import MergedLinear
from a4.layers.mlp import GatedMLP
from a4.layers.moe import FusedExperts, SparseMoeBlock


def _zero_centred_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps)


def _zero_centred_add_norm(self: nn.Module, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return add_rms_norm(x, h, self.weight, self.eps)


def _gated_forward(self: nn.Module, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps, gate=z)


def use_fused_norms(model: nn.Module) -> int:
    """Give every ZeroCenteredRMSNorm and GatedRMSNorm of `model` the kernel's forward; returns how many.

    A ZeroCenteredRMSNorm also gets `add_norm(x, h)`, the residual add and the norm in one launch, which
    `a4.layers.norm.add_and_norm` takes where a module has it."""
    fused = 0
    for module in model.modules():
        if isinstance(module, (ZeroCenteredRMSNorm, GatedRMSNorm)):
            forward = _gated_forward if isinstance(module, GatedRMSNorm) else _zero_centred_forward
            module.forward = MethodType(forward, module)
            if not isinstance(module, GatedRMSNorm):
                module.add_norm = MethodType(_zero_centred_add_norm, module)
            fused += 1
    return fused


def use_fused_activation(model: nn.Module) -> int:
    """Give every GatedMLP of `model` the kernel as its `act_and_mul`; returns how many."""
    fused = 0
    for module in model.modules():
        if isinstance(module, GatedMLP):
            module.act_and_mul = silu_and_mul
            fused += 1
    return fused


def _gated_attention_forward(
    self: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
) -> torch.Tensor:
    # GatedAttention.forward (notebook 03) in fewer launches. Its q_norm, k_norm, partial RoPE of q and k and
    # `paged_attention`'s KV write are one launch here, the output gate one: a launch per norm, per RoPE, per
    # index_copy_ of the write, for the sigmoid and for the product would be most of the layer's decode kernels.
    num_tokens = hidden.shape[0]
    query, gate = self.q_proj(hidden).view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
    k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
    v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
    kv_write = (v, *fb.kv_pool.get_kv(self.pool_layer), fb.out_cache_loc)
    q, k = qk_norm_rope(query, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin, kv_write)
    attn = fb.attn_backend.forward(q, k, v, fb, self.pool_layer, self.head_dim**-0.5)
    return self.o_proj(sigmoid_and_mul(gate, attn).reshape(num_tokens, -1))


def use_fused_attention(model: nn.Module) -> int:
    """Give every GatedAttention of `model` the fused forward above; returns how many."""
    fused = 0
    for module in model.modules():
        if isinstance(module, GatedAttention):
            if module.q_norm.eps != module.k_norm.eps:
                raise ValueError(f"use_fused_attention: q_norm's eps {module.q_norm.eps} is not k_norm's "
                                 f"{module.k_norm.eps}; the fused kernel takes one")  # fmt: skip
            module.forward = MethodType(_gated_attention_forward, module)
            fused += 1
    return fused


# `gemv.linear` is looked up on its module when called, not bound here: a probe swaps the rule
# (solutions/report/verify_probe.py).
def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return gemv.linear(x, self.weight)


def use_gemv(model: nn.Module) -> int:
    """Route `model`'s bias-free nn.Linear layers and merged projections through `gemv.linear`; returns how many."""
    routed = 0
    for module in model.modules():
        if type(module) is nn.Linear and module.bias is None:
            module.forward = MethodType(_linear_forward, module)
            routed += 1
        elif isinstance(module, MergedLinear):
            module.matmul = gemv.linear
            routed += 1
    return routed


def _sparse_moe_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    # SparseMoeBlock.forward (notebook 09) with the router in one launch; its experts module is routed below.
    weights, experts = fused_route(self.gate(x), self.top_k, self.norm_topk_prob)
    return self.experts(x, experts, weights) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def _fused_experts_forward(self: nn.Module, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
    return fused_experts(x, self.gate_up_proj, self.down_proj, expert_ids, weights)


def use_fused_experts(model: nn.Module) -> int:
    """Route `model`'s `FusedExperts` modules through `fused_experts`, and its `SparseMoeBlock`s' routers through
    `fused_route`; returns how many modules changed."""
    routed = 0
    for module in model.modules():
        if isinstance(module, FusedExperts):
            module.forward = MethodType(_fused_experts_forward, module)
            routed += 1
        elif type(module) is SparseMoeBlock:
            module.forward = MethodType(_sparse_moe_forward, module)
            routed += 1
    return routed
