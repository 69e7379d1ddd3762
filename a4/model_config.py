"""ModelConfig: the shapes the engine needs of a model, and the rules for reading them from a config.json's fields.

One frozen dataclass serves every model a4 runs. All-attention models (Qwen3) leave the Gated DeltaNet and MoE
fields at their defaults; hybrid models (Qwen3.5) fill them. The parsers (a4/models/config.py, and Qwen3.5's in
a4/models/qwen3_5_config.py, notebook 01) build it with the helpers here; `FIELD_RULES` are the types `parse_config`
checks before any parser runs.

It imports nothing of a4: the layers, the pools and the models all read it, so it sits below them, beside
a4/core.py (a4.models.config re-exports it with the parsers).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"
LAYER_TYPES = (FULL_ATTENTION, LINEAR_ATTENTION)


class ConfigError(ValueError):
    """A config.json that a4 cannot run: a missing field, an unknown layer type, an unknown architecture."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Dims of each attention head that RoPE rotates: head_dim for Qwen3, head_dim * partial_rotary_factor for Qwen3.5.
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    # One entry per layer, each "full_attention" or "linear_attention" (Gated DeltaNet).
    layer_types: tuple[str, ...]
    # Gated DeltaNet shapes; zero for all-attention models.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    # Mixture of experts; zero for dense models.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ConfigError(f"layer {i}: unknown layer type {kind!r} (expected one of {LAYER_TYPES})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ConfigError(f"rotary_dim {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the full-attention layers: the only layers that keep a KV cache."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == FULL_ATTENTION)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        """Model layer indices of the Gated DeltaNet layers: the layers that keep a conv and a recurrent state."""
        return tuple(i for i, kind in enumerate(self.layer_types) if kind == LINEAR_ATTENTION)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.linear_attention_layers)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q, k and v projections side by side."""
        return 2 * self.linear_key_dim + self.linear_value_dim


def require(cfg: dict[str, Any], key: str, where: str = "config.json") -> Any:
    """cfg[key], or a ConfigError naming the missing (or null) field and the file section it was looked for in."""
    if cfg.get(key) is None:
        raise ConfigError(f"{where}: missing required field {key!r}" + (" (it is null)" if key in cfg else ""))
    return cfg[key]


# ------------------------------------------------------------------------------------------------- field types


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_positive_int(value: Any) -> bool:
    return _is_int(value) and value > 0


def _is_non_negative_int(value: Any) -> bool:
    return _is_int(value) and value >= 0


def _is_positive_number(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value) and value > 0


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_list_of_str(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# field -> (test of its value, what the value must be). A field that is absent or null is left to the parser.
# Every config.json field named like an integer field of ModelConfig is a size or a count. full_attention_interval
# and num_experts_per_tok only need to be integers here: their ranges are the exercise's.
FIELD_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{f.name: (_is_positive_int, "a positive integer") for f in fields(ModelConfig) if f.type == "int"},
    "sliding_window": (_is_positive_int, "a positive integer"),
    "full_attention_interval": (_is_int, "an integer"),
    "num_experts_per_tok": (_is_int, "an integer"),
    "max_window_layers": (_is_non_negative_int, "a non-negative integer"),
    "rms_norm_eps": (_is_positive_number, "a positive number"),
    "rope_theta": (_is_positive_number, "a positive number"),
    "partial_rotary_factor": (lambda v: _is_positive_number(v) and v <= 1, "a number in (0, 1]"),
    "tie_word_embeddings": (_is_bool, "true or false"),
    "norm_topk_prob": (_is_bool, "true or false"),
    "use_sliding_window": (_is_bool, "true or false"),
    "eos_token_id": (
        lambda v: _is_non_negative_int(v) or (isinstance(v, list) and all(map(_is_non_negative_int, v))),
        "a token id or a list of token ids",
    ),
    "layer_types": (_is_list_of_str, "a list of layer type names"),
    "architectures": (
        lambda v: _is_list_of_str(v) and bool(v),
        'a list of model class names, e.g. ["Qwen3ForCausalLM"]',
    ),
}


def check_field_types(section: dict[str, Any], where: str) -> None:
    """A ConfigError naming the first field of `section` (and of its rope_parameters) that breaks FIELD_RULES."""
    for name, (valid, expected) in FIELD_RULES.items():
        value = section.get(name)
        if value is not None and not valid(value):
            raise ConfigError(f"{where}: {name} must be {expected}, got {value!r} ({type(value).__name__})")
    rope = section.get("rope_parameters")
    if isinstance(rope, dict):
        check_field_types(rope, f"{where} rope_parameters")


def rope_theta_of(cfg: dict[str, Any], where: str) -> float:
    """rope_theta from `rope_parameters` (transformers 5 files) or the older top-level field."""
    params = cfg.get("rope_parameters") or {}
    if "rope_theta" in params:
        return float(params["rope_theta"])
    return float(require(cfg, "rope_theta", where))


def eos_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def qwen3_layer_types(raw: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """Qwen3's layer kinds as transformers reads them; a ConfigError unless every one is full attention.

    transformers takes `layer_types` where the file lists it; otherwise, with `use_sliding_window` on, the layers from
    `max_window_layers` (default 28) on attend within a sliding window. a4's Qwen3 has no sliding window: running
    such a file with full attention would give other tokens than the model it describes.
    """
    listed = raw.get("layer_types")
    source = "layer_types"
    if listed is None:
        sliding = raw.get("use_sliding_window") and raw.get("sliding_window") is not None
        first_sliding = raw.get("max_window_layers", 28) if sliding else num_layers
        listed = [FULL_ATTENTION if i < first_sliding else "sliding_attention" for i in range(num_layers)]
        source = "use_sliding_window with max_window_layers"
    for i, kind in enumerate(listed):
        if kind != FULL_ATTENTION:
            raise ConfigError(f"config.json: layer {i} is {kind!r} ({source}); a4's Qwen3 runs full attention only")
    return tuple(listed)
