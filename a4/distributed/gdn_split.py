# GENERATED from solutions/a4/distributed/gdn_split.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/distributed/gdn_split.py instead
# and run `python -m a4.course sync`.
"""Exercise (notebook 13): which part of a Gated DeltaNet layer rank r of N keeps under tensor parallelism.

A GDN layer splits by heads, as attention does, and two facts decide which heads go together:
- value head j reads key head j // (Hv / Hk) (repeat_interleave, a4/layers/deltanet.py): a key head and the Hv / Hk
  consecutive value heads that read it, a **value-head group**, must sit on the same rank, or that rank would need a
  query and a key that another rank computed;
- the recurrent state is one [dk, dv] matrix per value head, and the conv state one row per channel of
  in_proj_qkv's output: with whole groups on a rank, its heads' states are all it ever reads or writes, so the
  layer needs no communication until out_proj.

So rank r keeps Hk / N whole groups: key heads r*Hk/N .. (r+1)*Hk/N - 1 and the value heads that read them. Their rows
of in_proj_qkv (three blocks, q | k | v), the same channels of conv1d, their rows of in_proj_z, in_proj_b, in_proj_a,
A_log and dt_bias, and the matching input columns of out_proj (row-parallel: the ranks' partial sums are added by
an all-reduce). a4/distributed/sharding.py applies this share to each loaded GDN layer; the ranks then run the
layer's own forward, unchanged, on their shares and their heads' states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4.model_config import ModelConfig


@dataclass(frozen=True)
class GDNShare:
    """One rank's share of a GDN layer, as int64 indices into the whole layer's tensors, in increasing order."""

    key_heads: torch.Tensor  # [Hk / N]
    # [Hv / N]: rows of in_proj_b, in_proj_a, A_log and dt_bias; the heads of the recurrent state [Hv, dk, dv].
    value_heads: torch.Tensor
    # [2 * Hk/N * dk + Hv/N * dv]: rows of in_proj_qkv = channels of conv1d and of the conv state, q | k | v.
    qkv_channels: torch.Tensor
    # [Hv/N * dv]: rows of in_proj_z = columns of out_proj (the gated norm's output, value head by value head).
    value_channels: torch.Tensor


def gdn_rank_share(config: ModelConfig, rank: int, world_size: int) -> GDNShare:
    """Rank `rank`'s share of every GDN layer of `config`, split over `world_size` ranks.

    With Hk = config.linear_num_key_heads, Hv = config.linear_num_value_heads, dk = config.linear_key_head_dim,
    dv = config.linear_value_head_dim (world_size divides Hk and Hv: sharding.check_divisible says so before):
    - key_heads: the contiguous range r*Hk/N .. (r+1)*Hk/N - 1;
    - value_heads: every value head that reads one of them (value head j reads key head j // (Hv / Hk));
    - qkv_channels: in_proj_qkv's output is q (Hk heads of dk channels), then k (the same), then v (Hv heads of dv):
      the channels of key head h are h*dk .. h*dk + dk - 1 in the q block and Hk*dk + h*dk .. in the k block, those of
      value head j are 2*Hk*dk + j*dv .. in the v block; the rank's channels of each block, q's first, then k's,
      then v's;
    - value_channels: value head j's channels of the value dim, j*dv .. j*dv + dv - 1, for each of its value heads.
    """
    raise NotImplementedError("Exercise tp-gdn-split: rank r's key heads, the value heads reading them, their channels (notebooks/13_tensor_parallel.ipynb)")
