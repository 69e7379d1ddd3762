# GENERATED from solutions/a4/models/qwen3_5_config.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/models/qwen3_5_config.py instead
# and run `python -m a4.course sync`.
"""Exercise (notebook 01): read a Qwen3.5 config.json into a ModelConfig.

Qwen3.5 checkpoints are multimodal: config.json holds the language model's fields in a nested `text_config`, the
vision encoder's in `vision_config` (a4 ignores it) and a few fields at the top level. Three things are new compared
with Qwen3: `layer_types` says which layers are Gated DeltaNet ("linear_attention") and which are full attention,
RoPE rotates only part of each head, and the Gated DeltaNet layers have shapes of their own. The dense models and
the mixture-of-experts model (35B-A3B) share all of that; the MoE parser adds the expert fields.

`a4.models.config.parse_config` calls `parse_qwen3_5_config` or `parse_qwen3_5_moe_config` by the file's
`architectures` entry. Use the helpers of `a4.models.config`: `require` (a field or a ConfigError naming it),
`rope_theta_of` and `eos_ids`.
"""

from __future__ import annotations

from typing import Any

from a4.model_config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    ConfigError,
    ModelConfig,
    eos_ids,
    require,
    rope_theta_of,
)

# Where a ConfigError says a missing field was looked for.
TEXT_SECTION = "config.json text_config"


def text_config_of(raw: dict[str, Any]) -> dict[str, Any]:
    """The language model's section of a multimodal config.json."""
    text = require(raw, "text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"config.json: text_config must be an object, got {type(text).__name__}")
    return text


def qwen3_5_layer_types(text: dict[str, Any]) -> tuple[str, ...]:
    """The kind of every layer, "full_attention" or "linear_attention" (Gated DeltaNet), as transformers reads it.

    `text` is the text_config section. When it lists `layer_types`, that list is the answer. Files without the list
    give `full_attention_interval` instead (4 when that is absent too): layer i is full attention exactly when
    (i + 1) % interval == 0, so interval 4 gives linear, linear, linear, full, linear, ... A missing
    `num_hidden_layers` or an interval below 1 is a ConfigError. (ModelConfig itself rejects unknown layer types and
    a list whose length is not num_hidden_layers.)
    """
    raise NotImplementedError("Exercise config-layer-types: layer_types, listed or derived from the interval (notebooks/01_config.ipynb)")


def qwen3_5_rotary_dim(text: dict[str, Any]) -> int:
    """How many of each attention head's `head_dim` dims RoPE rotates: int(head_dim * partial_rotary_factor).

    transformers 5 files keep the factor in `text_config.rope_parameters`; older files put `partial_rotary_factor`
    at the top level of text_config. When both are present, rope_parameters wins (as in transformers). The real
    files say 0.25: 64 of 256 dims. A missing head_dim or factor is a ConfigError: RoPE is not a thing to guess.
    """
    raise NotImplementedError("Exercise config-partial-rope: the rotary dims of partial RoPE (notebooks/01_config.ipynb)")


def qwen3_5_text_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields that dense Qwen3.5 and Qwen3.5-MoE share: all but `architecture` and the MLP sizes.

    `raw` is the whole config.json. From its text_config (`text_config_of`): vocab_size, hidden_size,
    num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, rms_norm_eps, max_position_embeddings and
    the Gated DeltaNet shapes linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
    linear_value_head_dim, linear_conv_kernel_dim: all required (a missing one is a ConfigError naming it: `require`).
    Then rope_theta (`rope_theta_of`), rotary_dim and layer_types (the two functions above, already called: their
    exercises come first) and eos_token_ids (text_config's `eos_token_id` through `eos_ids`; absent is ()).

    One field comes from the top level: `tie_word_embeddings` (absent means False). lm_head belongs to
    Qwen3_5ForConditionalGeneration, and transformers decides the tying from that class's config, the top level;
    a text_config.tie_word_embeddings is not what it reads.
    """
    text = text_config_of(raw)
    layer_types, rotary_dim = qwen3_5_layer_types(text), qwen3_5_rotary_dim(text)
    raise NotImplementedError("Exercise config-text-fields: the fields shared by dense and MoE (notebooks/01_config.ipynb)")


def qwen3_5_moe_fields(text: dict[str, Any]) -> dict[str, Any]:
    """The mixture-of-experts fields of a Qwen3.5-MoE text_config.

    num_experts, num_experts_per_tok, moe_intermediate_size (each routed expert's MLP width) and
    shared_expert_intermediate_size (the always-on shared expert's width) are required; num_experts_per_tok must not
    exceed num_experts. norm_topk_prob is read where present and is True when absent: transformers' Qwen3.5-MoE
    router always renormalises the top-k weights to sum to one.
    """
    raise NotImplementedError("Exercise config-moe: the expert fields of the MoE text_config (notebooks/01_config.ipynb)")


def parse_qwen3_5_config(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3_5ForConditionalGeneration: the shared fields plus the width of the dense MLP."""
    fields = qwen3_5_text_fields(raw)
    return ModelConfig(
        architecture="Qwen3_5ForConditionalGeneration",
        intermediate_size=int(require(text_config_of(raw), "intermediate_size", TEXT_SECTION)),
        **fields,
    )


def parse_qwen3_5_moe_config(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3_5MoeForConditionalGeneration: the shared fields plus the expert fields.

    intermediate_size is 0: no layer of the MoE model has a dense MLP (each has routed experts plus one shared expert
    of width shared_expert_intermediate_size), and a dense width would only inflate a weight-size estimate.
    """
    fields = qwen3_5_text_fields(raw)
    return ModelConfig(
        architecture="Qwen3_5MoeForConditionalGeneration",
        intermediate_size=0,
        **fields,
        **qwen3_5_moe_fields(text_config_of(raw)),
    )
