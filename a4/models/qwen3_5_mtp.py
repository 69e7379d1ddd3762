"""Qwen3.5's multi-token-prediction (MTP) module: one more decoder layer that guesses the token after the next.

Given, at position i, the main model's final hidden state h_i (the one lm_head turns into the logits of token i+1)
and the token t_{i+1} that follows, the MTP module predicts token i+2:

    x      = fc(cat(pre_fc_norm_embedding(embed(t_{i+1})), pre_fc_norm_hidden(h_i)))      fc: [2H] -> [H]
    x      = one full-attention decoder layer (gated attention over its own KV, at position i; the main model's MLP
             kind: dense for Qwen3.5, a mixture of experts for Qwen3.5-MoE)
    logits = lm_head(norm(x))

The embedding and lm_head are the main model's (shared, not stored under `mtp.*`); every norm is zero-centred, as
in the rest of Qwen3.5. The layout is the checkpoint's (/work/shared/reference/qwen3_5-configs.md). Which hidden
state and which position: vLLM's Qwen3.5 MTP (vllm/model_executor/models/qwen3_5_mtp.py) applies the two pre-fc
norms and the concatenation in this order, and its speculative proposer (vllm/v1/spec_decode/eagle.py) feeds it the
target model's output hidden states, i.e. AFTER the main model's final norm (`Qwen3_5Model.forward` returns
`norm(hidden + residual)`), with the token ids shifted one left and the positions of the hidden states unchanged.
transformers has no MTP module, so tests/test_mtp.py checks this one against a naive implementation of that layout
(with transformers' own Qwen3_5MoeSparseMoeBlock as the MoE layer's MLP).

The MTP layer is one more attention layer for the KV pool: it reads and writes its KV at pool layer `pool_layer`,
by default the one after the main model's full-attention layers. Chained drafts feed the module's own normed output
back in as the next h.

`load_mtp` loads the `mtp.*` tensors of a checkpoint (those notebook 02's key map skips for the main model) with
a4's safetensors loader: every `mtp.*` key must fill a parameter, every parameter must be filled, and every other key
is skipped unread. With `load_format="dummy"` the same keys of the tensor plan are drawn at random instead.

Qwen3.5-MoE's MTP layer stores its routed experts one by one (`mtp.layers.0.mlp.experts.<e>.gate_proj.weight`,
`.up_proj`, `.down_proj`), where the main layers store them fused. a4 merges them at load into the SparseMoeBlock's
fused tensors (`gate_up_proj` [E, 2I, H], gate rows first; `down_proj` [E, H, I]), as vLLM and SGLang merge
per-expert checkpoints: the layer then runs as the main model's do, through the same kernels, sharding and memory
accounting. While loading, each expert's three tensors are views into its slices of the fused ones
(`experts_as_stored`), so the loader's checks name any missing or misshapen expert key, and no second copy of the
experts is ever held.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.layers.gated_attention import ZeroCenteredRMSNorm
from a4.layers.moe import FusedExperts, SparseMoeBlock
from a4.layers.norm import add_and_norm
from a4.layers.rope import RotaryEmbedding
from a4.models.config import FULL_ATTENTION, ModelConfig
from a4.models.qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5ForConditionalGeneration
from a4.models.registry import Shard, default_dtype, fuse_for_device
from a4.models.weights import LoadReport, weight_loader

MTP_PREFIX = "mtp."


class Qwen3_5MTP(nn.Module):
    """The `mtp.*` weights (parameter names are the checkpoint's without `mtp.`, the experts of a MoE layer fused) and
    the main model's embedding and lm_head, which it uses but does not own: they are not among its parameters, so
    loading asks only for `mtp.*`. Its decoder layer's MLP is the main model's kind (`main.make_mlp`)."""

    def __init__(self, config: ModelConfig, main: Qwen3_5ForConditionalGeneration, pool_layer: int | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.pool_layer = len(config.full_attention_layers) if pool_layer is None else pool_layer
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, FULL_ATTENTION, self.pool_layer, main.make_mlp)])
        self.norm = ZeroCenteredRMSNorm(hidden, eps)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.max_position_embeddings)
        # A tuple, not attributes: nn.Module would register them, and they would count as this module's weights.
        self.shared = (main.model.embed_tokens, main.lm_head)

    def forward(self, fb: ForwardBatch, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normed output [S, hidden] of the rows fb.sample_indices: feed it to `logits`, or back in for a next draft.

        Row r of the batch: fb.input_ids[r] is the token that follows the position whose main-model final hidden
        state is hidden_states[r] ([T, hidden], after the main model's norm), and fb.positions[r] is that position.
        """
        embed_tokens, _ = self.shared
        embedded = self.pre_fc_norm_embedding(embed_tokens(fb.input_ids))
        x, h = self.fc(torch.cat((embedded, self.pre_fc_norm_hidden(hidden_states)), dim=-1)), None
        cos, sin = self.rotary_emb(fb.positions, x.dtype)
        for layer in self.layers:
            x, h = layer(x, h, cos, sin, fb)  # h: the layer's MLP output, added to the stream by the next norm
        rows = fb.sample_indices
        return add_and_norm(x[rows], h[rows], self.norm)[1]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The main model's lm_head over `forward`'s output, cast to float32 as the main model's logits are."""
        _, lm_head = self.shared
        return lm_head(hidden).float()


def mtp_key_map(key: str) -> str | None:
    """`mtp.<rest>` -> `<rest>`, the module's parameter name; any other key (the main model, vision) -> skipped."""
    return key.removeprefix(MTP_PREFIX) if key.startswith(MTP_PREFIX) else None


def _weight_view(weight: torch.Tensor) -> nn.Module:
    """A module whose parameter `weight` is `weight` itself, a view: filling it fills the tensor it views."""
    module = nn.Module()
    module.weight = nn.Parameter(weight, requires_grad=False)
    return module


def experts_one_by_one(experts: FusedExperts) -> nn.ModuleList:
    """The experts of `experts` under the names a checkpoint stores them by one by one, `<e>.gate_proj.weight`,
    `<e>.up_proj.weight`, `<e>.down_proj.weight` ([I, H], [I, H], [H, I]), each a view into the fused tensors."""
    intermediate = experts.down_proj.shape[-1]
    gate_up, down = experts.gate_up_proj.detach(), experts.down_proj.detach()
    return nn.ModuleList(
        nn.ModuleDict({
            "gate_proj": _weight_view(gate_up[e, :intermediate]),
            "up_proj": _weight_view(gate_up[e, intermediate:]),
            "down_proj": _weight_view(down[e]),
        })
        for e in range(experts.num_experts)
    )  # fmt: skip


@contextmanager
def experts_as_stored(module: nn.Module) -> Iterator[None]:
    """Inside: every SparseMoeBlock of `module` holds its experts one by one (`experts_one_by_one`), named as the
    MTP layer's checkpoint keys; after: its FusedExperts again, holding whatever was loaded into the views."""
    blocks = [m for m in module.modules() if isinstance(m, SparseMoeBlock)]
    fused = [block.experts for block in blocks]
    for block in blocks:
        block.experts = experts_one_by_one(block.experts)
    try:
        yield
    finally:
        for block, experts in zip(blocks, fused):
            block.experts = experts


def load_mtp(
    main: Qwen3_5ForConditionalGeneration,
    model_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: bool = False,
    merge_projections: bool | None = None,
    shard: Shard | None = None,
    load_format: str = "safetensors",
) -> tuple[Qwen3_5MTP, LoadReport]:
    """The MTP module of the checkpoint in model_dir, on `device` in `dtype`, sharing `main`'s embedding and lm_head.

    Raises WeightLoadError, before reading any tensor, naming every `mtp.*` key that fills no parameter or has the
    wrong shape and every parameter no key fills (a checkpoint without an MTP module: all of them; a MoE layer's
    experts are named as they are stored, one by one). The module comes back in eval mode, without gradients.
    `shard`: as for `load_model` (a tensor-parallel rank's share; `main` is then that rank's share too).
    `load_format`: as for `load_model` ("dummy": the plan's `mtp.*` tensors drawn).
    """
    fill = weight_loader(load_format)
    with torch.device(device), default_dtype(dtype):
        mtp = Qwen3_5MTP(main.config, main)
    with experts_as_stored(mtp):
        report = fill(mtp, model_dir, key_map=mtp_key_map, device=device, dtype=dtype, progress=progress)
    mtp.eval().requires_grad_(False)
    if shard is not None:
        shard(mtp, main.config)
    fuse_for_device(mtp, torch.device(device), merge_projections)
    return mtp, report
