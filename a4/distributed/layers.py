"""The parallel layers: a rank's share of a layer, and the collective that makes its output whole again.

Megatron-LM's split of a transformer, as SGLang and vLLM use it:
- column-parallel (`column_parallel`): the rank keeps some output rows of the weight, and its output is the same
  columns of the whole output, with no communication. It stays an nn.Linear, so the students' layers call it as
  before and a4/layers/merged_linear.py can still merge a rank's projections into one GEMM;
- row-parallel (`RowParallelLinear`): the rank keeps the input columns that match the columns a column-parallel
  layer before it produced; its product is a partial sum, and an all-reduce adds the ranks' partial sums;
- vocabulary-parallel embedding (`VocabParallelEmbedding`): each rank holds a contiguous range of the vocabulary's
  rows; a token outside its range gets zeros, and the all-reduce gives every token its one row;
- the parallel lm_head (`ParallelLMHead`): each rank computes the logits of its vocabulary range, and an all-gather
  puts them side by side (a tied lm_head shares the embedding's shard).
- expert parallelism (`ExpertParallelExperts`): a mixture of experts' routed experts split across the ranks, as
  SGLang's and vLLM's EP: each rank holds E/N whole experts and computes only the token-expert pairs routed to them;
  its output, the sum over its pairs, is a partial sum of the routed experts' output.
A layer whose output is a sum of partial sums that do not pass through a linear layer of their own (a mixture of
experts' block: its routed experts' and its shared expert's) gets the all-reduce as a forward hook on its module
(`all_reduce_output`).

Every rank ends each layer with the same values, bit for bit (an all-reduce gives every rank the same sum), so the
residual stream, the norms and everything between the split layers are computed alike everywhere, unsplit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from a4.distributed.group import TPGroup


def column_parallel(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A plain nn.Linear holding `rows` (output features, in that order) of `linear`'s weight."""
    if linear.bias is not None:
        raise ValueError("column_parallel: a4's models have bias-free projections; this one has a bias")
    part = nn.Linear(linear.in_features, len(rows), bias=False, device=linear.weight.device,
                     dtype=linear.weight.dtype)  # fmt: skip
    part.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
    return part


def input_columns(linear: nn.Linear, columns: torch.Tensor) -> nn.Linear:
    """A plain nn.Linear holding `columns` (input features) of `linear`'s weight: its output is a partial sum."""
    if linear.bias is not None:
        raise ValueError("input_columns: a4's models have bias-free projections; this one has a bias")
    part = nn.Linear(len(columns), linear.out_features, bias=False, device=linear.weight.device,
                     dtype=linear.weight.dtype)  # fmt: skip
    part.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
    return part


class RowParallelLinear(nn.Linear):
    """`columns` (input features) of a bias-free linear layer; the output, summed over the ranks, is the whole
    layer's."""

    def __init__(self, linear: nn.Linear, columns: torch.Tensor, group: TPGroup) -> None:
        part = input_columns(linear, columns)
        super().__init__(part.in_features, part.out_features, bias=False, device="meta")
        self.weight = part.weight
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(F.linear(x, self.weight))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of an embedding table."""

    def __init__(self, embedding: nn.Embedding, group: TPGroup) -> None:
        super().__init__()
        num_rows = embedding.num_embeddings // group.world_size
        self.start, self.num_rows, self.group = group.rank * num_rows, num_rows, group
        weight = embedding.weight[self.start : self.start + num_rows].clone()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        elsewhere = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        # One rank contributes each token's row and the others zeros: the sum is the row itself, exactly.
        return self.group.all_reduce(out.masked_fill_(elsewhere[:, None], 0))

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.num_rows - 1}, {self.weight.shape[1]} wide"


class ParallelLMHead(nn.Module):
    """The logits of one vocabulary range per rank, gathered: every rank returns the whole [S, vocab]."""

    def __init__(self, weight: nn.Parameter, group: TPGroup) -> None:
        super().__init__()
        self.weight, self.group = weight, group

    @classmethod
    def split(cls, lm_head: nn.Linear, group: TPGroup) -> ParallelLMHead:
        num_rows = lm_head.out_features // group.world_size
        rows = lm_head.weight[group.rank * num_rows : (group.rank + 1) * num_rows].clone()
        return cls(nn.Parameter(rows, requires_grad=False), group)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather(F.linear(hidden, self.weight))


class ExpertParallelExperts(nn.Module):
    """This rank's share of a mixture of experts' routed experts: `rank_experts`, contiguous global expert ids.

    The block's own experts module (notebook 09's FusedExperts) is kept, holding only these experts' weights, and
    its forward runs unchanged on a subset of the pairs. It takes k choices per token, and how many of a token's k
    experts are this rank's varies from token to token, so it is handed each of this rank's pairs as a token of its
    own with one choice, the expert id made local by `expert_map` (SGLang's and vLLM's name: global id -> local
    id, -1 for another rank's expert); the pairs' outputs are then summed per token (in another order than the
    unsplit block's, as the all-reduce's sum over the ranks is: equal to rounding). The router is replicated, so
    every rank routes every token alike and each pair is computed on exactly one rank."""

    def __init__(self, experts: nn.Module, rank_experts: torch.Tensor) -> None:
        super().__init__()
        expert_map = torch.full((experts.num_experts,), -1, dtype=torch.int64, device=experts.down_proj.device)
        expert_map[rank_experts] = torch.arange(len(rank_experts), device=expert_map.device)
        self.register_buffer("expert_map", expert_map, persistent=False)
        experts.gate_up_proj = nn.Parameter(experts.gate_up_proj[rank_experts], requires_grad=False)
        experts.down_proj = nn.Parameter(experts.down_proj[rank_experts], requires_grad=False)
        experts.num_experts = len(rank_experts)
        self.local_experts = experts

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, k] (the whole routing) -> [T, H], the sum over this rank's pairs."""
        local_ids = self.expert_map[expert_ids]
        tokens, choices = (local_ids >= 0).nonzero(as_tuple=True)
        out = torch.zeros_like(x)
        # A decode step of a few tokens often leaves a rank without a pair (k of the E experts per token), and the
        # students' forward need not handle an empty batch.
        if len(tokens):
            pairs_out = self.local_experts(x[tokens], local_ids[tokens, choices, None], weights[tokens, choices, None])
            out.index_add_(0, tokens, pairs_out)
        return out

    def extra_repr(self) -> str:
        local = (self.expert_map >= 0).nonzero().flatten()
        return f"experts {local[0].item()}..{local[-1].item()} of {len(self.expert_map)}"


def all_reduce_output(module: nn.Module, group: TPGroup) -> None:
    """Sum `module`'s output over the ranks after its forward (its own code unchanged)."""
    module.register_forward_hook(lambda _module, _args, output: group.all_reduce(output))
