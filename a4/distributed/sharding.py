"""Which part of each layer a rank keeps: the sharding rules of Qwen3, Qwen3.5, Qwen3.5-MoE and the MTP module.

`shard_model(model, config, group)` runs once, after the checkpoint is loaded whole and before the projections are
merged (a4/layers/merged_linear.py), and changes the loaded modules in place (a4/distributed/layers.py); the
students' forward code runs unchanged on a rank's share. Rank r of N keeps, for each kind of layer:

- attention (Qwen3's and Qwen3.5's gated one): query heads r*nH/N .. (r+1)*nH/N - 1 of q_proj (with Qwen3.5's output
  gate, which sits beside each head's query), the KV heads those query heads read in k_proj and v_proj, and the
  matching input columns of o_proj (row-parallel). With fewer KV heads than ranks (Qwen3.5-0.8B has 2), each KV head
  is replicated on the N / nKV ranks whose query heads read it. Each rank's KV pool holds its own KV heads only.
- Gated DeltaNet: whole value-head groups (a key head and the value heads that read it), as gdn_split.py's
  `gdn_rank_share` says: their rows of in_proj_qkv (q | k | v) and the same conv1d channels, so that the rank's conv
  state holds exactly the channels its heads read; in_proj_z, in_proj_b, in_proj_a, A_log and dt_bias by value head;
  the gated norm (per value head) whole; out_proj row-parallel. Its recurrent state holds its value heads.
- the gated MLP: gate_proj and up_proj by intermediate row, down_proj row-parallel.
- the mixture of experts: expert parallelism for the routed experts, experts r*E/N .. (r+1)*E/N - 1 whole on rank
  r, each rank computing the token-expert pairs routed to its experts (a4/distributed/layers.py); the shared expert
  split within like the MLP; the router and the shared expert's gate whole. One all-reduce of the block's output
  sums the routed experts' and the shared expert's partial sums at once.
- the embedding and lm_head: vocabulary rows r*V/N .. (a tied lm_head shares the embedding's shard).
- the MTP module: its decoder layer as any decoder layer; fc whole (its input is the replicated hidden state).
Everything else (norms, RoPE, the router) is replicated.

A split that does not divide is a ValueError naming the config field (`check_divisible`), before any process starts.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from a4.distributed.gdn_split import gdn_rank_share
from a4.distributed.group import TPGroup
from a4.distributed.layers import (
    ExpertParallelExperts,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    all_reduce_output,
    column_parallel,
    input_columns,
)
from a4.model_config import ModelConfig


def check_divisible(config: ModelConfig, world_size: int) -> None:
    """A ValueError naming every config field that `world_size` ranks cannot split evenly."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    fields = ["num_attention_heads", "vocab_size"]
    if config.is_moe:
        fields += ["num_experts", "shared_expert_intermediate_size"]
    else:
        fields.append("intermediate_size")
    if config.is_hybrid:
        fields += ["linear_num_key_heads", "linear_num_value_heads"]
    problems = [
        f"{name} = {getattr(config, name)} is not a multiple of tensor_parallel_size {world_size}"
        for name in fields
        if getattr(config, name) % world_size
    ]
    kv_heads = config.num_key_value_heads
    if kv_heads % world_size and world_size % kv_heads:
        problems.append(
            f"num_key_value_heads = {kv_heads} neither divides into tensor_parallel_size {world_size} ranks nor "
            "replicates evenly over them"
        )
    if problems:
        raise ValueError(f"{config.architecture} cannot be split over {world_size} ranks: " + "; ".join(problems))


def rank_model_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes one rank holds, for its pools and memory ledger: heads and intermediate widths divided (KV heads
    at least one, replicated), the routed experts divided (each whole: moe_intermediate_size stays), the vocabulary
    whole (every rank sees whole logits and whole token ids)."""
    check_divisible(config, world_size)

    def split(value: int) -> int:
        return value // world_size

    return replace(
        config,
        num_attention_heads=split(config.num_attention_heads),
        num_key_value_heads=max(split(config.num_key_value_heads), 1),
        intermediate_size=split(config.intermediate_size),
        linear_num_key_heads=split(config.linear_num_key_heads),
        linear_num_value_heads=split(config.linear_num_value_heads),
        num_experts=split(config.num_experts),
        shared_expert_intermediate_size=split(config.shared_expert_intermediate_size),
    )


def rank_range(count: int, group: TPGroup) -> torch.Tensor:
    """This rank's contiguous share of `count` heads (or rows)."""
    share = count // group.world_size
    return torch.arange(group.rank * share, (group.rank + 1) * share)


def head_rows(heads: torch.Tensor, width: int, offset: int = 0) -> torch.Tensor:
    """The rows (or channels) of `heads`, each `width` wide, in a block that starts at `offset`."""
    return (offset + heads[:, None] * width + torch.arange(width)).flatten()


def kv_heads_of_rank(config: ModelConfig, group: TPGroup) -> torch.Tensor:
    """The KV heads this rank's query heads read: its share, or the one it replicates when there are fewer KV heads
    than ranks."""
    if config.num_key_value_heads >= group.world_size:
        return rank_range(config.num_key_value_heads, group)
    return torch.tensor([group.rank * config.num_key_value_heads // group.world_size])


def shard_attention(attn: nn.Module, config: ModelConfig, group: TPGroup) -> None:
    heads, head_dim = rank_range(config.num_attention_heads, group), config.head_dim
    kv_heads = kv_heads_of_rank(config, group)
    # A head's rows of q_proj: its query, and with Qwen3.5's output gate its gate after it (a4/layers/gated_attention).
    q_width = attn.q_proj.out_features // config.num_attention_heads
    attn.q_proj = column_parallel(attn.q_proj, head_rows(heads, q_width))
    attn.k_proj = column_parallel(attn.k_proj, head_rows(kv_heads, head_dim))
    attn.v_proj = column_parallel(attn.v_proj, head_rows(kv_heads, head_dim))
    attn.o_proj = RowParallelLinear(attn.o_proj, head_rows(heads, head_dim), group)
    if hasattr(attn, "num_heads"):  # Qwen3.5's layer views its heads by count; Qwen3's by head_dim
        attn.num_heads, attn.num_kv_heads = len(heads), len(kv_heads)


def shard_gated_deltanet(gdn: nn.Module, config: ModelConfig, group: TPGroup) -> None:
    share = gdn_rank_share(config, group.rank, group.world_size)
    channels = share.qkv_channels
    gdn.in_proj_qkv = column_parallel(gdn.in_proj_qkv, channels)
    conv = gdn.conv1d
    gdn.conv1d = nn.Conv1d(len(channels), len(channels), conv.kernel_size[0], groups=len(channels), bias=False,
                           device=conv.weight.device, dtype=conv.weight.dtype)  # fmt: skip
    gdn.conv1d.weight = nn.Parameter(conv.weight[channels].clone(), requires_grad=False)
    gdn.in_proj_z = column_parallel(gdn.in_proj_z, share.value_channels)
    gdn.in_proj_b = column_parallel(gdn.in_proj_b, share.value_heads)
    gdn.in_proj_a = column_parallel(gdn.in_proj_a, share.value_heads)
    gdn.A_log = nn.Parameter(gdn.A_log[share.value_heads].clone(), requires_grad=False)
    gdn.dt_bias = nn.Parameter(gdn.dt_bias[share.value_heads].clone(), requires_grad=False)
    gdn.out_proj = RowParallelLinear(gdn.out_proj, share.value_channels, group)
    gdn.num_k_heads, gdn.num_v_heads = len(share.key_heads), len(share.value_heads)


def shard_mlp(mlp: nn.Module, group: TPGroup, reduce: bool = True) -> None:
    """`reduce`: the all-reduce after down_proj; False inside a mixture of experts, whose block sums once."""
    rows = rank_range(mlp.gate_proj.out_features, group)
    mlp.gate_proj = column_parallel(mlp.gate_proj, rows)
    mlp.up_proj = column_parallel(mlp.up_proj, rows)
    mlp.down_proj = RowParallelLinear(mlp.down_proj, rows, group) if reduce else input_columns(mlp.down_proj, rows)


def shard_sparse_moe(block: nn.Module, config: ModelConfig, group: TPGroup) -> None:
    block.experts = ExpertParallelExperts(block.experts, rank_range(config.num_experts, group))
    shard_mlp(block.shared_expert, group, reduce=False)
    # out = sum of routed experts + sigmoid(gate(x)) * shared(x): linear in the ranks' partial sums.
    all_reduce_output(block, group)


def shard_model(model: nn.Module, config: ModelConfig, group: TPGroup) -> None:
    """Keep this rank's share of every layer of a loaded Qwen3 / Qwen3.5 / Qwen3.5-MoE model or MTP module, in place.

    Layers are recognised by their checkpoint names (as merged_linear.py does): a module with `in_proj_qkv` is a
    Gated DeltaNet, one with `o_proj` attention, one with `shared_expert` a mixture of experts, one with
    `gate_proj` a gated MLP."""
    in_moe = set()
    for module in list(model.modules()):
        if hasattr(module, "in_proj_qkv"):
            shard_gated_deltanet(module, config, group)
        elif hasattr(module, "o_proj"):
            shard_attention(module, config, group)
        elif hasattr(module, "shared_expert"):
            shard_sparse_moe(module, config, group)
            in_moe.add(module.shared_expert)
        elif hasattr(module, "gate_proj") and module not in in_moe:
            shard_mlp(module, group)
    if hasattr(model, "lm_head"):  # the main model; the MTP module uses the main model's embedding and lm_head
        embed_tokens = model.model.embed_tokens
        tied = model.lm_head.weight is embed_tokens.weight
        model.model.embed_tokens = VocabParallelEmbedding(embed_tokens, group)
        weight = model.model.embed_tokens.weight
        model.lm_head = ParallelLMHead(weight, group) if tied else ParallelLMHead.split(model.lm_head, group)
