"""Qwen3.5-MoE (35B-A3B): the hybrid Qwen3.5 model with a sparse mixture-of-experts MLP in every decoder layer.

Everything but the MLP is dense Qwen3.5's (a4.models.qwen3_5): the same Gated DeltaNet and gated-attention layers, the
same state and KV pools, the same norms and RoPE. Only the `make_mlp` hook differs: each decoder layer gets a
`SparseMoeBlock` (router, routed experts stored fused, gated shared expert; notebook 09) instead of a GatedMLP.

The checkpoint's layout matches the dense one, so notebook 02's key map loads it as it is: `model.language_model.*`
is renamed by prefix, whatever a layer holds, and `mtp.*` and `model.visual.*` are skipped by prefix. That matters
for the MTP layer, which stores its experts one by one (`mtp.layers.0.mlp.experts.<e>.gate_proj.weight`, ...), not
fused like the main layers: the main model skips it unread, whatever its layout. The MTP module, loaded apart for
speculative decoding (a4/models/qwen3_5_mtp.py), gets a SparseMoeBlock from `make_mlp` too and merges those experts
into it at load.
"""

from __future__ import annotations

from a4.layers.moe import SparseMoeBlock
from a4.models.qwen3_5 import Qwen3_5ForConditionalGeneration


class Qwen3_5MoeForConditionalGeneration(Qwen3_5ForConditionalGeneration):
    """The language model of a Qwen3.5-MoE checkpoint: dense Qwen3.5 with a SparseMoeBlock as every layer's MLP."""

    make_mlp = staticmethod(SparseMoeBlock)
