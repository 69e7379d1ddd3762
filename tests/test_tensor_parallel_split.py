"""The Gated DeltaNet split of tensor parallelism (notebook 13, a4/distributed/gdn_split.py): its checks
(a4.course.checks.tensor_parallel) pass on a4's `gdn_rank_share`, on the split alone, on two gloo ranks and in the
engine; and the split check rejects the usual mistakes, each planted in an otherwise right split: value heads dealt
out round-robin, value heads numbered like the key heads, the v block's channels counted from 0.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from a4.checkpoints import tiny_checkpoint
from a4.course.checks import CheckFailed
from a4.course.checks import tensor_parallel as checks
from a4.distributed.gdn_split import GDNShare, gdn_rank_share


def test_split_matches_the_head_by_head_split():
    checks.check_gdn_split(gdn_rank_share)


def test_the_ranks_shares_sum_to_every_gdn_layer_on_two_ranks():
    checks.check_gdn_layer_split(gdn_rank_share, tiny_checkpoint("qwen3_5"))


def test_tensor_parallel_engine_matches_transformers():
    checks.check_tensor_parallel_engine(tiny_checkpoint("qwen3_5"))


# ----------------------------------------------------------------------------------------------- planted mistakes


def right_share(config, rank, world_size) -> GDNShare:
    """The head-by-head split of the checks, as the tensors a split returns."""
    split = checks.naive_split(checks.gdn_shapes_of(config), rank, world_size)
    return GDNShare(**{name: torch.tensor(indices) for name, indices in split.items()})


def round_robin_value_heads(config, rank, world_size):
    """Value heads r, r + N, r + 2N, ...: on another rank than the key head they read."""
    return replace(right_share(config, rank, world_size),
                   value_heads=torch.arange(rank, config.linear_num_value_heads, world_size))  # fmt: skip


def value_heads_like_key_heads(config, rank, world_size):
    """The key heads' numbers as value heads: right only where Hv = Hk."""
    share = right_share(config, rank, world_size)
    return replace(share, value_heads=share.key_heads)


def v_block_from_zero(config, rank, world_size):
    """The v block's channels without the q and k blocks before them."""
    share = right_share(config, rank, world_size)
    qk = 2 * len(share.key_heads) * config.linear_key_head_dim
    channels = share.qkv_channels.clone()
    channels[qk:] -= 2 * config.linear_key_dim
    return replace(share, qkv_channels=channels)


@pytest.mark.parametrize(
    "split, says",
    [
        (round_robin_value_heads, "likely cause: a value head sits on another rank than the key head it reads"),
        (value_heads_like_key_heads, "likely cause: a value head sits on another rank than the key head it reads"),
        (v_block_from_zero, "the v block's channel 0 of value head 0"),
    ],
)
def test_split_check_names_the_mistake(split, says):
    with pytest.raises(CheckFailed, match=says):
        checks.check_gdn_split(split)


def test_the_planted_mistakes_start_from_a_right_split():
    checks.check_gdn_split(right_share)


def test_the_layer_and_engine_checks_name_a_wrong_split_not_its_symptoms(monkeypatch):
    """Before any rank starts: the split check's failure, not a layer's error or a differing token."""
    says = r"^the split is wrong, as the check tp-gdn-split says: fix it first \(likely cause: a value head"
    with pytest.raises(CheckFailed, match=says):
        checks.check_gdn_layer_split(round_robin_value_heads, tiny_checkpoint("qwen3_5"))
    # The engine runs the split of a4/distributed/gdn_split.py.
    monkeypatch.setattr("a4.distributed.gdn_split.gdn_rank_share", round_robin_value_heads)
    with pytest.raises(CheckFailed, match=says):
        checks.check_tensor_parallel_engine(tiny_checkpoint("qwen3_5"))
