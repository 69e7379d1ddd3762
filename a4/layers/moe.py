# GENERATED from solutions/a4/layers/moe.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/layers/moe.py instead
# and run `python -m a4.course sync`.
"""Exercises (notebook 09): the sparse mixture-of-experts (MoE) MLP of Qwen3.5-35B-A3B.

In the MoE model the MLP of every decoder layer is a `SparseMoeBlock`, with three parts:
- a router, `gate` (a [E, H] matrix), scores the E experts for each token. The k experts with the highest softmax
  probability get the token, weighted by those probabilities renormalised to sum to one;
- E routed experts, each a SwiGLU MLP of width I = moe_intermediate_size. They are stored fused, as the checkpoint
  stores them: `experts.gate_up_proj` [E, 2I, H] (the I gate rows, then the I up rows) and `experts.down_proj`
  [E, H, I];
- one shared expert, a SwiGLU MLP of width shared_expert_intermediate_size that every token goes through. It is
  scaled by sigmoid(shared_expert_gate(x)), one scalar per token (`shared_expert_gate` is a [1, H] matrix).

    out(x) = sum over the k chosen experts e of  w_e * expert_e(x)  +  sigmoid(shared_expert_gate(x)) * shared_expert(x)

The routed experts run expert by expert. The batch's token-expert pairs are sorted by expert, and each expert that
received at least one token runs once, over all its tokens, with its own slice of the fused weights. The work, and
the weight bytes read, then grow with the experts actually used and not with E: a decode step of one token reads 8
of the 256 experts of 35B-A3B.

Inputs are flattened batches, [T, H]: the tokens of every request in one dimension, as in a4's ForwardBatch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from a4.layers.mlp import GatedMLP
from a4.model_config import ModelConfig


class Routing(NamedTuple):
    """The router's decision for T tokens, k experts each (in the order torch.topk gives: most probable first)."""

    weights: torch.Tensor  # [T, k], the dtype of the router logits
    experts: torch.Tensor  # [T, k] int64 expert ids, distinct within a row


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> Routing:
    """Choose each token's top_k experts and their weights, as transformers' Qwen3_5MoeTopKRouter does.

    router_logits: [T, E] in the model dtype (the `gate` projection of the tokens).
    1. softmax over the E experts, computed in float32 (`dtype=torch.float32`: no bfloat16 probabilities);
    2. the top_k largest probabilities per token and their expert ids (`torch.topk`);
    3. when `normalize` (config.norm_topk_prob), divide them by their sum, still in float32, so that each token's
       weights sum to one;
    4. cast the weights to router_logits' dtype.
    """
    raise NotImplementedError("Exercise moe-router: softmax in float32, top-k experts, renormalised weights (notebooks/09_moe.ipynb)")


class ExpertGroups(NamedTuple):
    """A batch's token-expert pairs grouped by expert. Pair p is token p // k and its (p % k)-th choice."""

    pairs: torch.Tensor  # [T * k] int64 pair ids sorted by expert; within one expert, in increasing order
    experts: list[int]  # the experts that received at least one pair, in increasing order
    counts: list[int]  # the number of pairs of each of those experts (sums to T * k)


def group_by_expert(expert_ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the token-expert pairs of `expert_ids` [T, k] by expert: the plan for running each active expert once.

    Flatten expert_ids to its T * k pairs (pair p = row p // k, column p % k) and sort the pair ids by expert with a
    stable sort, so that one expert's pairs stay in token order. `experts` lists the experts that occur, `counts`
    how many pairs each has: `pairs.split(counts)` then gives each active expert's pairs. Vectorised, in time
    O(T * k + E): no Python loop over the E experts or the T tokens (`torch.argsort(stable=True)`,
    `torch.bincount`).
    """
    raise NotImplementedError("Exercise moe-group: sort the token-expert pairs by expert, list the active experts (notebooks/09_moe.ipynb)")


class FusedExperts(nn.Module):
    """The E routed experts of one layer, as the checkpoint stores them (`mlp.experts.gate_up_proj`, `.down_proj`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        # Expert e's gate_proj is gate_up_proj[e, :I] and its up_proj gate_up_proj[e, I:], both [I, H] like an
        # nn.Linear weight; its down_proj is down_proj[e], [H, I].
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] (a `Routing`) -> [T, H], the weighted sum of each token's experts.

        Expert e applied to tokens x_e [n, H]: `gate, up = (x_e @ gate_up_proj[e].T).chunk(2)` (gate first), then
        `(silu(gate) * up) @ down_proj[e].T`, then each row times its pair's routing weight. All in x's dtype.

        Efficiency is part of the exercise: group the pairs with `group_by_expert`, then run each ACTIVE expert once,
        over all its tokens: one matrix product with gate_up_proj[e] and one with down_proj[e] per active expert.
        Never loop over all E experts (a decode step of a few tokens uses a few experts), and never gather a weight
        matrix per token (`gate_up_proj[expert_ids]` is a [T, k, 2I, H] copy of the weights).

        Sum into a zero tensor with `index_add_`, expert after expert in increasing expert order, as transformers
        does: then every float32 and bfloat16 rounding happens in the same order as in the reference.
        """
        raise NotImplementedError("Exercise moe-experts: run each active expert once over its tokens, with the fused weights (notebooks/09_moe.ipynb)")

    def extra_repr(self) -> str:
        experts, hidden, intermediate = self.down_proj.shape
        return f"{experts} experts, hidden {hidden}, intermediate {intermediate}"


class SparseMoeBlock(nn.Module):
    """The MLP of a Qwen3.5-MoE decoder layer (`mlp` in the checkpoint): router, routed experts, shared expert."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        hidden = config.hidden_size
        # Attribute names are the checkpoint's (`mlp.gate.weight`, `mlp.experts.gate_up_proj`, ...).
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)  # the router
        self.experts = FusedExperts(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert = GatedMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: routed experts plus the gated shared expert, as transformers' Qwen3_5MoeSparseMoeBlock.

        Router logits `gate(x)` in the model dtype, `route` them (top_k experts, renormalised when norm_topk_prob),
        run the routed experts, and add sigmoid(shared_expert_gate(x)) * shared_expert(x). All in x's dtype but the
        softmax inside `route`.
        """
        raise NotImplementedError("Exercise moe-block: route, run the routed experts, add the gated shared expert (notebooks/09_moe.ipynb)")
