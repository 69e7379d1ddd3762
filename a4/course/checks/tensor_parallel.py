"""Checks of notebook 13: a Gated DeltaNet layer split over tensor-parallel ranks (`a4/distributed/gdn_split.py`).

Ground truths:
- the split: a loop over the heads written here (`naive_split`), which gives every key head to the rank that owns
  its block of Hk / N, every value head to the rank of the key head it reads (j // (Hv / Hk)), and lists each
  head's channels block by block; for the tiny model, Qwen3.5-0.8B, Qwen3.5-35B-A3B and a made-up layer with three
  value heads per key head and dk != dv, over every world size that divides them;
- the layer: on two gloo ranks (`a4.distributed.group.run_ranks`), every GDN layer of the tiny Qwen3.5 loaded whole
  and as the rank's share (the engine's `shard_model`, which calls the student's split), fed the same tokens, a
  prefill then a decode step: the share's output, whose out_proj all-reduce sums the ranks' partial outputs, equals
  the whole layer's, and the rank's conv and recurrent states are the whole layer's at the channels and value
  heads `naive_split` gives;
- the engine: `LLM(..., tensor_parallel_size=2)` against transformers' greedy `generate` (a4.reference.hf_greedy),
  token by token, and a next turn that restores a prefix-cache checkpoint on every rank.
The layer and engine checks run the split check first (`split_first`): a wrong split is reported as such, not by
the errors and tokens it leads to.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from a4.core import ForwardMode, SamplingParams
from a4.course.checks import CheckFailed, conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks._harness import compare, gdn_reduction_length, randn, tolerance
from a4.course.checks.common import (
    MAX_NEW_TOKENS,
    GDNShapes,
    gdn_shapes,
    reference_tokens,
    shared_prompts,
    token_problems,
)
from a4.course.exercises import exercise_named_in
from a4.distributed.group import TPGroup, run_ranks
from a4.distributed.sharding import rank_model_config, shard_model
from a4.engine.factories import create_state_pool
from a4.engine.forward_batch import build_forward_batch
from a4.models.config import LINEAR_ATTENTION, ModelConfig
from a4.models.qwen3_5 import pool_layer_of
from a4.models.registry import load_model

F32 = torch.float32
# A layer no preset has: three value heads per key head, dk != dv (a split that mixes them up shows here).
UNEVEN = GDNShapes(key_heads=2, value_heads=6, dk=8, dv=12, kernel=4, gdn_layers=3)
SPLIT_CASES = {
    "tiny Qwen3.5": gdn_shapes("tiny"),
    "Qwen3.5-0.8B": gdn_shapes("0.8b"),
    "Qwen3.5-35B-A3B": gdn_shapes("35b-a3b", "qwen3_5_moe"),
    "3 value heads per key head, dk 8, dv 12": UNEVEN,
}
WORLD_SIZES = (1, 2, 4, 8)
FIELDS = ("key_heads", "value_heads", "qkv_channels", "value_channels")
LAYER_RANKS = 2
# Prompt lengths of the layer check's two requests (a prefill of both, then one decode token each).
LAYER_PROMPTS = [5, 7]
# Positions per request in the layer check's request-slot table: more than its prompts and their decode token.
TABLE_ROW = 16
ENGINE_OPTIONS = {"max_running_requests": 3, "max_prefill_tokens": 64}


# ------------------------------------------------------------------------------------------------------- the split


def split_config(shapes: GDNShapes) -> ModelConfig:
    """A ModelConfig with these GDN shapes, which are all a split reads (the other fields are placeholders)."""
    return ModelConfig(
        architecture="Qwen3_5ForCausalLM", vocab_size=1024, hidden_size=64, intermediate_size=128,
        num_hidden_layers=shapes.gdn_layers, num_attention_heads=shapes.key_heads, num_key_value_heads=1,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=1e7, rotary_dim=16, max_position_embeddings=4096,
        tie_word_embeddings=False, eos_token_ids=(), layer_types=(LINEAR_ATTENTION,) * shapes.gdn_layers,
        linear_num_key_heads=shapes.key_heads, linear_num_value_heads=shapes.value_heads,
        linear_key_head_dim=shapes.dk, linear_value_head_dim=shapes.dv, linear_conv_kernel_dim=shapes.kernel,
    )  # fmt: skip


def naive_split(shapes: GDNShapes, rank: int, world_size: int) -> dict[str, list[int]]:
    """Rank `rank`'s key heads, value heads, in_proj_qkv rows and value channels, head by head."""
    hk, hv, dk, dv = shapes.key_heads, shapes.value_heads, shapes.dk, shapes.dv
    keys_per_rank, group = hk // world_size, hv // hk
    key_heads = [h for h in range(hk) if h // keys_per_rank == rank]
    # A value head goes where the key head it reads goes.
    value_heads = [j for j in range(hv) if j // group in key_heads]
    q_block = [h * dk + i for h in key_heads for i in range(dk)]
    k_block = [hk * dk + h * dk + i for h in key_heads for i in range(dk)]
    v_block = [2 * hk * dk + j * dv + i for j in value_heads for i in range(dv)]
    value_channels = [j * dv + i for j in value_heads for i in range(dv)]
    return dict(key_heads=key_heads, value_heads=value_heads, qkv_channels=q_block + k_block + v_block,
                value_channels=value_channels)  # fmt: skip


def qkv_channel_name(channel: int, shapes: GDNShapes) -> str:
    """Which head's channel of in_proj_qkv's output `channel` is, in words."""
    key_dim = shapes.key_heads * shapes.dk
    if channel >= 2 * key_dim:
        head, i = divmod(channel - 2 * key_dim, shapes.dv)
        return f"the v block's channel {i} of value head {head}"
    block, offset = ("q", channel) if channel < key_dim else ("k", channel - key_dim)
    head, i = divmod(offset, shapes.dk)
    return f"the {block} block's channel {i} of key head {head}"


def share_problems(label: str, share: object, expected: dict[str, list[int]], shapes: GDNShapes) -> list[str]:
    """How a rank's share differs from `expected` (naive_split's), one problem per wrong field."""
    problems = []
    for name in FIELDS:
        got = getattr(share, name, None)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.int64 or got.dim() != 1:
            problems.append(f"{label}: {name} should be a 1-d int64 tensor of indices, got {got!r:.80}")
            continue
        want = expected[name]
        if got.tolist() == want:
            continue
        if len(got) != len(want):
            problems.append(f"{label}: {name} has {len(got)} entries, expected {len(want)}")
            continue
        at = next(i for i, (g, w) in enumerate(zip(got.tolist(), want)) if g != w)
        where = f" ({qkv_channel_name(want[at], shapes)})" if name == "qkv_channels" else ""
        problems.append(f"{label}: {name}[{at}] is {int(got[at])}, expected {want[at]}{where}")
    return problems


def value_heads_apart(gdn_rank_share: Callable) -> bool:
    """Whether the split puts a value head on another rank than the key head it reads (three value heads per key
    head, rank 1 of 2)."""
    share = gdn_rank_share(split_config(UNEVEN), 1, 2)
    key_heads, value_heads = getattr(share, "key_heads", None), getattr(share, "value_heads", None)
    if not (isinstance(key_heads, torch.Tensor) and isinstance(value_heads, torch.Tensor)):
        return False
    group = UNEVEN.value_heads // UNEVEN.key_heads
    return any(j // group not in key_heads.tolist() for j in value_heads.tolist())


def check_gdn_split(gdn_rank_share: Callable) -> None:
    """Every rank's share of every SPLIT_CASES layer, over every world size that divides its heads, against
    `naive_split`."""
    problems, splits = [], 0
    for case, shapes in SPLIT_CASES.items():
        config = split_config(shapes)
        for world_size in WORLD_SIZES:
            if shapes.key_heads % world_size or shapes.value_heads % world_size:
                continue
            for rank in range(world_size):
                label = f"{case}, rank {rank} of {world_size}"
                share = gdn_rank_share(config, rank, world_size)
                problems += share_problems(label, share, naive_split(shapes, rank, world_size), shapes)
                splits += 1
    likely = None
    if problems and value_heads_apart(gdn_rank_share):
        likely = ("a value head sits on another rank than the key head it reads: value head j reads key head "
                  "j // (Hv / Hk), so a rank's value heads are the consecutive groups of its own key heads")
    success = f"{splits} rank shares of {len(SPLIT_CASES)} GDN shapes equal to the head-by-head split"
    conclude(problems, success, likely)


# ------------------------------------------------------------------------------------- the layer on two gloo ranks


def on_ranks(fn: Callable, world_size: int, *args) -> list:
    """run_ranks, with a rank's unwritten exercise raised here as its own NotImplementedError and any other failure
    on a rank as a CheckFailed naming it."""
    try:
        return run_ranks(fn, world_size, *args)
    except RuntimeError as e:
        if message := exercise_named_in(str(e)):
            raise NotImplementedError(message) from None
        lines = str(e).strip().splitlines()
        raise CheckFailed(f"{lines[0]} {lines[-1]}\n" + "\n".join(lines[1:])) from None


def state_pool_step(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int], pool):
    """The ForwardBatch of two requests in slots 0 and 1 over a GDN state pool (the layer check needs no KV)."""
    tokens = sum(extend_lens)
    table = torch.arange(2 * TABLE_ROW).view(2, TABLE_ROW)
    return build_forward_batch(mode, input_ids=[0] * tokens, slots=[0, 1], prefix_lens=prefix_lens,
                               extend_lens=extend_lens, sample_indices=list(range(tokens)), req_to_token=table,
                               kv_pool=None, state_pool=pool)  # fmt: skip


def gdn_shapes_of(config: ModelConfig) -> GDNShapes:
    """The GDN shapes of a ModelConfig, as `naive_split` takes them."""
    return GDNShapes(config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
                     config.linear_value_head_dim, config.linear_conv_kernel_dim,
                     len(config.linear_attention_layers))  # fmt: skip


def gdn_layers_agree(group: TPGroup, checkpoint: str) -> list[str]:
    """On one rank: every GDN layer of the checkpoint whole and as this rank's share, a prefill then a decode step;
    what differs, in words."""
    config, whole, _ = load_model(checkpoint, dtype=F32, device="cpu", progress=False)
    _, share, _ = load_model(checkpoint, dtype=F32, device="cpu", progress=False,
                             shard=partial(shard_model, group=group))  # fmt: skip
    pools = {"whole": create_state_pool(config, 2, F32, "cpu"),
             "share": create_state_pool(rank_model_config(config, group.world_size), 2, F32, "cpu")}  # fmt: skip
    models = {"whole": whole, "share": share}
    pool_layers = pool_layer_of(config)
    where = f"rank {group.rank} of {group.world_size}"
    problems = []
    steps = [(ForwardMode.EXTEND, [0, 0], LAYER_PROMPTS), (ForwardMode.DECODE, LAYER_PROMPTS, [1, 1])]
    for step, (mode, prefix_lens, extend_lens) in enumerate(steps):
        batches = {name: state_pool_step(mode, prefix_lens, extend_lens, pool) for name, pool in pools.items()}
        allowed = tolerance(F32, gdn_reduction_length(config, max(LAYER_PROMPTS) + step))
        for layer in config.linear_attention_layers:
            x = randn(sum(extend_lens), config.hidden_size, seed=100 * step + layer)
            out = {name: model.model.layers[layer].linear_attn(x, batches[name], pool_layers[layer])
                   for name, model in models.items()}  # fmt: skip
            problems += compare(f"{where}: layer {layer}'s output, {mode.name} (summed over the ranks by out_proj)",
                                out["share"], out["whole"], allowed)  # fmt: skip
    expected = naive_split(gdn_shapes_of(config), group.rank, group.world_size)
    channels, value_heads = expected["qkv_channels"], expected["value_heads"]
    allowed = tolerance(F32, gdn_reduction_length(config, max(LAYER_PROMPTS) + 1))
    for k in range(len(config.linear_attention_layers)):
        conv = {name: pool.conv_state(k) for name, pool in pools.items()}
        recurrent = {name: pool.recurrent_state(k) for name, pool in pools.items()}
        # The conv state is a copy of the share's own in_proj_qkv rows: the same products, so the same values.
        if not torch.equal(conv["share"], conv["whole"][:, channels]):
            problems.append(f"{where}: GDN layer {k}'s conv state is not the whole layer's at the rank's channels")
        problems += compare(f"{where}: GDN layer {k}'s recurrent state at the rank's value heads",
                            recurrent["share"], recurrent["whole"][:, value_heads], allowed)  # fmt: skip
    return problems


def split_first(gdn_rank_share: Callable) -> None:
    """The split check, quietly, before a check that runs the split on ranks: an unwritten or wrong split is named
    here, before any rank starts, rather than shown by its symptoms (a layer's error, a differing token)."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its "PASSED" line is not this check's
            check_gdn_split(gdn_rank_share)
    except CheckFailed as e:
        raise CheckFailed(
            f"the split is wrong, as the check tp-gdn-split says: fix it first ({str(e).splitlines()[0]})\n{e}"
        ) from None


def check_gdn_layer_split(gdn_rank_share: Callable, checkpoint: str | Path) -> None:
    """`gdn_layers_agree` on LAYER_RANKS gloo ranks, every rank's problems together."""
    split_first(gdn_rank_share)
    problems = [p for rank_problems in on_ranks(gdn_layers_agree, LAYER_RANKS, str(checkpoint)) for p in rank_problems]
    conclude(
        problems,
        f"every GDN layer on {LAYER_RANKS} gloo ranks, a prefill and a decode step: each rank's share, summed over "
        "the ranks, gives the whole layer's output; its states are the whole layer's at its channels and value heads",
    )


# -------------------------------------------------------------------------------------------------------- the engine


@after_notebooks(*ENGINE, "05")
def check_tensor_parallel_engine(checkpoint: str | Path, world_size: int = 2) -> None:
    """The shared prompts (1 to 300 tokens) through 3 slots with chunked prefill on `world_size` ranks, then the next
    turn of the longest, which restores its checkpoint on every rank: every token equal to transformers'."""
    from a4.distributed.gdn_split import gdn_rank_share
    from a4.llm import LLM
    from a4.reference import hf_greedy

    split_first(gdn_rank_share)
    prompts = shared_prompts(checkpoint)
    params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
    with LLM(checkpoint, tensor_parallel_size=world_size, **ENGINE_OPTIONS) as llm:
        outputs = llm.generate(prompts, params)
        problems = token_problems(f"{world_size} ranks", outputs, prompts, reference_tokens(checkpoint))
        turn = prompts[-1] + outputs[-1].token_ids + prompts[1]
        (follow_up,) = llm.generate([turn], params)
    problems += token_problems("the next turn", [follow_up], [turn], hf_greedy(checkpoint, [turn], MAX_NEW_TOKENS))
    if not problems and follow_up.cached_tokens == 0:
        problems.append("the next turn of the longest prompt hit no prefix-cache checkpoint: the check needs one")
    conclude(
        problems,
        f"{len(prompts)} requests and a next turn ({follow_up.cached_tokens} tokens from the prefix cache) on "
        f"{world_size} ranks: {sum(len(o.token_ids) for o in [*outputs, follow_up])} tokens equal to transformers'",
    )
