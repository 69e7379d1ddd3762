"""Qwen3.5: the hybrid model, written top to bottom like transformers' modeling_qwen3_5.py (its text model only).

Each decoder layer mixes tokens either with a Gated DeltaNet (`linear_attn`: a fixed-size conv state and recurrent
state per request) or with gated full attention (`self_attn`: a KV cache), as config.layer_types says; three of
every four layers are Gated DeltaNet in the real checkpoints. Everything else is Qwen3's shape: pre-norm residual
blocks, a gated MLP, a final norm and lm_head, except that every norm outside the GDN layers is zero-centred
(scale 1 + w) and RoPE rotates only `config.rotary_dim` dims of each head.

The engine's differences from transformers are a4's Qwen3's: a flat ForwardBatch in, logits only at
fb.sample_indices out. The checkpoint is multimodal; `checkpoint_key_map` (the exercise of notebook 02) loads its
language model and skips the vision encoder and the MTP module (a4.models.qwen3_5_mtp loads that one apart).

Where each layer keeps its memory (`pool_layer_of`):
- a full-attention layer: a layer of fb.kv_pool. The KV pool holds only the full-attention layers, so the j-th
  full-attention layer of the model is KV pool layer j.
- a GDN layer: its states in fb.state_pool, which needs only the two methods of a4.core's `GDNStates` (notebook
  05's StatePool provides them). For the k-th GDN layer of the model:
      conv_state(k)      -> [slots, conv_dim, linear_conv_kernel_dim - 1], model dtype
      recurrent_state(k) -> [slots, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim], float32
  Row fb.slots[i] belongs to request i; the layer's backend (fb.attn_backend, a4.layers.gdn_backend) reads it and
  updates it in place, with the functions of the step's mode.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.layers.deltanet import GatedDeltaNet
from a4.layers.gated_attention import GatedAttention, ZeroCenteredRMSNorm
from a4.layers.mlp import GatedMLP
from a4.layers.norm import add_and_norm
from a4.layers.rope import RotaryEmbedding
from a4.models.config import LINEAR_ATTENTION, ModelConfig


def pool_layer_of(config: ModelConfig) -> dict[int, int]:
    """Model layer -> its layer in the pool of its kind: the KV pool for full attention, the state pool for GDN.

    Both pools hold only their own kind of layer, so each numbers its layers 0, 1, 2, ... in model order: with
    layer_types [gdn, gdn, gdn, full, gdn, ...], model layer 3 is KV pool layer 0 and model layer 4 is state layer 3.
    """
    layers_of_kind = (config.full_attention_layers, config.linear_attention_layers)
    return {layer: pool_layer for layers in layers_of_kind for pool_layer, layer in enumerate(layers)}


# Builds the MLP of a decoder layer: the dense model's GatedMLP, or the MoE model's sparse MoE block.
MlpFactory = Callable[[ModelConfig], nn.Module]


def dense_mlp(config: ModelConfig) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size)


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, pool_layer: int, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        # layer_type, not config.layer_types[i]: the MTP module's full-attention layer is in no list of the config.
        self.is_linear = layer_type == LINEAR_ATTENTION
        self.pool_layer = pool_layer
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        # One of the two mixers, under the attribute name the checkpoint uses for it.
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = GatedAttention(config, pool_layer)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = make_mlp(config)

    def forward(
        self, x: torch.Tensor, h: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the residual stream [T, hidden]; h: the previous layer's MLP output, not yet added to it (None at the
        first layer). Returns the stream after this layer's mixer and this layer's MLP output.

        Each sublayer's output is added to the stream by the norm that follows it (`add_and_norm`), the next layer's
        first norm for the MLP's, as vLLM and mini-sglang carry the residual: the same sums, and where a4's kernels
        run, the add happens in the norm's launch."""
        if h is None:
            h = self.input_layernorm(x)
        else:
            x, h = add_and_norm(x, h, self.input_layernorm)
        # Both mixers find their memory in fb at their own pool layer: KV for attention, states for GDN.
        if self.is_linear:
            h = self.linear_attn(h, fb, self.pool_layer)
        else:
            h = self.self_attn(h, cos, sin, fb)
        x, h = add_and_norm(x, h, self.post_attention_layernorm)
        return x, self.mlp(h)


class Qwen3_5TextModel(nn.Module):
    def __init__(self, config: ModelConfig, make_mlp: MlpFactory = dense_mlp) -> None:
        super().__init__()
        pool_layers = pool_layer_of(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3_5DecoderLayer(config, kind, pool_layers[i], make_mlp) for i, kind in enumerate(config.layer_types)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        # Partial RoPE: the tables cover only the rotary dims; the attention layers leave the other dims alone.
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.max_position_embeddings)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Final hidden states [S, hidden] of the rows fb.sample_indices."""
        if fb.state_pool is None and any(layer.is_linear for layer in self.layers):
            raise ValueError("ForwardBatch.state_pool is None: Qwen3.5's Gated DeltaNet layers keep their states there")
        x, h = self.embed_tokens(fb.input_ids), None  # [T, hidden]
        cos, sin = self.rotary_emb(fb.positions, x.dtype)  # once per forward, shared by the attention layers
        for layer in self.layers:
            x, h = layer(x, h, cos, sin, fb)
        # The last MLP's add and the norm are per token, so doing them on the sampled rows alone gives the same
        # values for less work.
        rows = fb.sample_indices
        return add_and_norm(x[rows], h[rows], self.norm)[1]


class Qwen3_5ForConditionalGeneration(nn.Module):
    """The language model of a Qwen3.5 checkpoint (the class is named after the checkpoint's architecture)."""

    # The MLP of every decoder layer; the MoE model (a4.models.qwen3_5_moe) swaps in its sparse MoE block.
    make_mlp: MlpFactory = staticmethod(dense_mlp)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3_5TextModel(config, self.make_mlp)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # One tensor under two names: the checkpoint stores it once, as the embedding.
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_key_map(key: str) -> str | None:
        """Checkpoint key -> parameter name, or None to skip (notebook 02's exercise; see a4.models.weights)."""
        # Imported when called: importing the model must not need the exercise to be written.
        from a4.models.qwen3_5_weights import checkpoint_key_map

        return checkpoint_key_map(key)

    def forward(
        self, fb: ForwardBatch, with_hidden: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Logits [S, vocab] in float32 for the rows fb.sample_indices (S = len(fb.sample_indices)).

        lm_head runs in the model dtype and its output is cast to float32, as transformers' `generate` does
        before choosing a token. `with_hidden`: also the final hidden states [S, hidden] those logits come from (a
        speculative engine's drafter reads them), as (hidden, logits).
        """
        hidden = self.model(fb)
        logits = self.lm_head(hidden).float()
        return (hidden, logits) if with_hidden else logits
