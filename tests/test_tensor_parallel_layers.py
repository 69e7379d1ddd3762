"""Each parallel layer's output on gloo ranks (a4/distributed/layers.py, sharding.py) = its unsplit module's.

Every rank loads the tiny checkpoint twice, whole and as its share, and runs both on the same inputs: the embedding
and lm_head, the dense MLP, the mixture of experts (its experts across the ranks, on two and four ranks), and the
attention layers over their KV pool, a prefill then a decode step. Outputs agree within the rounding of their sums
(`tolerance`: a row-parallel layer adds its partial sums in another order); the embedding exactly (one rank gives
each row, the others zeros); a rank's KV is the whole layer's at its KV heads (exactly). The Gated DeltaNet layers
and their states are notebook 13's check (tests/test_tensor_parallel_split.py)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from a4.checkpoints import tiny_checkpoint
from a4.core import ForwardMode
from a4.course.checks._harness import (
    assert_close,
    attention_reduction_length,
    mlp_reduction_length,
    randn,
    tolerance,
)
from a4.distributed.group import run_ranks
from a4.distributed.sharding import kv_heads_of_rank, rank_model_config, rank_range, shard_model
from a4.engine.factories import create_kv_pool
from a4.engine.forward_batch import build_forward_batch
from a4.models.registry import load_model

F32 = torch.float32
PROMPTS = [5, 7]  # tokens of each request's prefill; then one decode token each


def whole_and_share(checkpoint, group):
    config, whole, _ = load_model(checkpoint, dtype=F32, device="cpu", progress=False)
    _, share, _ = load_model(checkpoint, dtype=F32, device="cpu", progress=False,
                             shard=partial(shard_model, group=group))  # fmt: skip
    return config, whole, share


class KVPool:
    """A KV pool and a request-slot table of two requests for `config`'s shapes."""

    def __init__(self, config):
        self.kv = create_kv_pool(config, num_pages=32, page_size=1, dtype=F32, device="cpu")
        self.table = torch.arange(2 * 16).view(2, 16)

    def step(self, mode, prefix_lens, extend_lens):
        tokens = sum(extend_lens)
        return build_forward_batch(mode, input_ids=[0] * tokens, slots=[0, 1], prefix_lens=prefix_lens,
                                   extend_lens=extend_lens, sample_indices=list(range(tokens)),
                                   req_to_token=self.table, kv_pool=self.kv)  # fmt: skip


def attention_agrees(group, checkpoint) -> None:
    config, whole, share = whole_and_share(checkpoint, group)
    pools = {"whole": KVPool(config), "share": KVPool(rank_model_config(config, group.world_size))}
    steps = [(ForwardMode.EXTEND, [0, 0], PROMPTS), (ForwardMode.DECODE, PROMPTS, [1, 1])]
    for step, (mode, prefix_lens, extend_lens) in enumerate(steps):
        fbs = {name: p.step(mode, prefix_lens, extend_lens) for name, p in pools.items()}
        cos, sin = whole.model.rotary_emb(fbs["whole"].positions, F32)
        allowed = tolerance(F32, attention_reduction_length(config, max(PROMPTS) + step))
        for i in config.full_attention_layers:
            x = randn(sum(extend_lens), config.hidden_size, seed=100 * step + i)
            out = [model.model.layers[i].self_attn(x, cos, sin, fbs[name])
                   for model, name in ((whole, "whole"), (share, "share"))]  # fmt: skip
            assert_close(out[1], out[0], allowed, f"layer {i}, {mode.name}: rank {group.rank}'s output")
    # The rank's KV is the whole layer's at its KV heads.
    kv_heads = kv_heads_of_rank(config, group)
    for j in range(pools["whole"].kv.num_layers):
        for whole_kv, share_kv in zip(pools["whole"].kv.get_kv(j), pools["share"].kv.get_kv(j)):
            assert torch.equal(share_kv, whole_kv[:, kv_heads])


def embedding_lm_head_and_mlps_agree(group, checkpoint) -> None:
    config, whole, share = whole_and_share(checkpoint, group)
    ids = torch.randint(0, config.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    assert torch.equal(share.model.embed_tokens(ids), whole.model.embed_tokens(ids))
    x = randn(9, config.hidden_size, seed=1)
    assert_close(share.lm_head(x), whole.lm_head(x), tolerance(F32, config.hidden_size), "lm_head")
    allowed = tolerance(F32, mlp_reduction_length(config))
    for i in (0, len(whole.model.layers) - 1):
        assert_close(share.model.layers[i].mlp(x), whole.model.layers[i].mlp(x), allowed, f"layer {i}'s MLP")


def experts_agree(group, checkpoint) -> None:
    """Each rank holds its E/N experts' weights only, computes only the pairs routed to them (every pair on one
    rank), and the block's all-reduced output is the unsplit block's, for a prefill and for one decode token (which
    may leave a rank without a pair)."""
    config, whole, share = whole_and_share(checkpoint, group)
    experts = rank_range(config.num_experts, group)
    expert_bytes = 3 * config.moe_intermediate_size * config.hidden_size * F32.itemsize  # gate, up, down
    rank_experts = rank_model_config(config, group.world_size).num_experts
    allowed = tolerance(F32, mlp_reduction_length(config))
    pairs_on_rank = []
    for i, (layer_whole, layer_share) in enumerate(zip(whole.model.layers, share.model.layers)):
        whole_experts, share_experts = layer_whole.mlp.experts, layer_share.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(getattr(share_experts.local_experts, name), getattr(whole_experts, name)[experts])
        assert weight_bytes(share_experts) == rank_experts * expert_bytes
        assert group.world_size * weight_bytes(share_experts) == weight_bytes(whole_experts)
        hook = share_experts.local_experts.register_forward_pre_hook(
            lambda _module, args: pairs_on_rank.append(len(args[0]))
        )
        for tokens in (9, 1):
            x = randn(tokens, config.hidden_size, seed=10 * i + tokens)
            pairs_on_rank.clear()
            ours, expected = layer_share.mlp(x), layer_whole.mlp(x)
            assert_close(ours, expected, allowed, f"layer {i}'s MoE block, {tokens} tokens")
            pairs = group.all_reduce(torch.tensor(sum(pairs_on_rank)))
            assert pairs == tokens * config.num_experts_per_tok, f"layer {i}: {pairs} pairs computed over the ranks"
        hook.remove()


def weight_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def test_attention_shares_and_their_kv():
    run_ranks(attention_agrees, 2, tiny_checkpoint("qwen3_5"))


def test_embedding_lm_head_and_mlp():
    for arch in ("qwen3_5", "qwen3"):
        run_ranks(embedding_lm_head_and_mlps_agree, 2, tiny_checkpoint(arch))


@pytest.mark.parametrize("size, overrides", [(2, {}), (4, {"linear_num_key_heads": 4})])
def test_experts_across_ranks(size, overrides):
    # Four ranks: the tiny checkpoint's two key heads made four; its 8 experts already divide.
    run_ranks(experts_agree, size, tiny_checkpoint("qwen3_5_moe", **overrides))
