"""Qwen3: the all-attention model a4 serves first, written top to bottom like transformers' modeling_qwen3.py.

Differences from transformers are the engine's, not the model's: the input is a ForwardBatch (every request's new
tokens in one flat row, no padding, no batch dimension), attention reads and writes the paged KV pool, and the final
norm and lm_head run only on the rows whose next token will be sampled.

Module and parameter names equal the checkpoint keys (`model.layers.0.self_attn.q_proj.weight`, ...), so the weights
load with the identity key map.
"""

from __future__ import annotations

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.layers.attention import paged_attention
from a4.layers.mlp import GatedMLP
from a4.layers.norm import RMSNorm
from a4.layers.rope import RotaryEmbedding, apply_rope
from a4.models.config import ModelConfig


class Qwen3Attention(nn.Module):
    """GQA self-attention with a per-head RMSNorm on queries and keys (Qwen3's addition), applied before RoPE."""

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        q_size = config.num_attention_heads * config.head_dim
        kv_size = config.num_key_value_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(num_tokens, -1, self.head_dim))  # [T, nH, D]
        k = self.k_norm(self.k_proj(x).view(num_tokens, -1, self.head_dim))  # [T, nKV, D]
        v = self.v_proj(x).view(num_tokens, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # Every Qwen3 layer keeps a KV cache, so the model's layer index is the pool's.
        out = paged_attention(q, k, v, fb, pool_layer=self.layer_id, scale=self.scale)
        return self.o_proj(out.reshape(num_tokens, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, layer_id)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # Pre-norm residual blocks; the residual adds run in the model dtype, as in transformers.
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, fb)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Built on torch's default device: build the model under `with torch.device(...)` (registry.load_model does).
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.max_position_embeddings)

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """Final hidden states [S, hidden] of the rows fb.sample_indices."""
        x = self.embed_tokens(fb.input_ids)  # [T, hidden]
        cos, sin = self.rotary_emb(fb.positions, x.dtype)  # shared by all layers
        for layer in self.layers:
            x = layer(x, cos, sin, fb)
        # The norm is per token, so normalising only the sampled rows gives the same values for less work.
        return self.norm(x[fb.sample_indices])


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            # One tensor under two names: the checkpoint stores it once, as model.embed_tokens.weight.
            self.lm_head.weight = self.model.embed_tokens.weight

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
