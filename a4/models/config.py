"""Reading a checkpoint's config.json into a ModelConfig (a4/model_config.py, re-exported here).

Which parser reads a file is decided by its `architectures` entry, through `CONFIG_PARSERS`; Qwen3.5's parser is the
exercise of notebook 01 (qwen3_5_config.py, which builds on a4/model_config.py, not on this module).

Before any parser runs, `parse_config` checks the type of every field a4 reads that the file sets (`FIELD_RULES`),
so that a parser's `int(...)` never turns "64" or 64.5 into 64, nor `bool("false")` ties embeddings.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from a4.model_config import (
    FIELD_RULES,
    FULL_ATTENTION,
    LAYER_TYPES,
    LINEAR_ATTENTION,
    ConfigError,
    ModelConfig,
    check_field_types,
    eos_ids,
    qwen3_layer_types,
    require,
    rope_theta_of,
)

# What the model's config is made of, importable from here as from its own module.
__all__ = [
    "CONFIG_PARSERS", "FIELD_RULES", "FULL_ATTENTION", "LAYER_TYPES", "LINEAR_ATTENTION", "ConfigError", "ModelConfig",
    "check_field_types", "eos_ids", "load_model_config", "parse_config", "parse_qwen3_config", "read_json", "require",
    "rope_theta_of",
]  # fmt: skip


def parse_qwen3_config(raw: dict[str, Any]) -> ModelConfig:
    """Qwen3ForCausalLM: a flat config.json, every layer full attention, RoPE over the whole head."""
    where = "config.json"
    num_layers = int(require(raw, "num_hidden_layers", where))
    num_heads = int(require(raw, "num_attention_heads", where))
    hidden = int(require(raw, "hidden_size", where))
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    return ModelConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=int(require(raw, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(require(raw, "intermediate_size", where)),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(require(raw, "rms_norm_eps", where)),
        rope_theta=rope_theta_of(raw, where),
        rotary_dim=head_dim,
        max_position_embeddings=int(require(raw, "max_position_embeddings", where)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids(raw.get("eos_token_id")),
        layer_types=qwen3_layer_types(raw, num_layers),
    )


def _parse_qwen3_5(raw: dict[str, Any]) -> ModelConfig:
    # Imported here so that an unfinished exercise never breaks Qwen3.
    from a4.models.qwen3_5_config import parse_qwen3_5_config

    return parse_qwen3_5_config(raw)


def _parse_qwen3_5_moe(raw: dict[str, Any]) -> ModelConfig:
    from a4.models.qwen3_5_config import parse_qwen3_5_moe_config

    return parse_qwen3_5_moe_config(raw)


CONFIG_PARSERS: dict[str, Callable[[dict[str, Any]], ModelConfig]] = {
    "Qwen3ForCausalLM": parse_qwen3_config,
    "Qwen3_5ForConditionalGeneration": _parse_qwen3_5,
    "Qwen3_5MoeForConditionalGeneration": _parse_qwen3_5_moe,
}


def read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (is this a checkpoint directory?)") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def parse_config(raw: dict[str, Any]) -> ModelConfig:
    """Check the types of a config.json's fields, then dispatch its contents to the parser of its architecture."""
    if not raw.get("architectures"):
        raise ConfigError("config.json: missing 'architectures' (which model class is this?)")
    check_field_types(raw, "config.json")
    if isinstance(raw.get("text_config"), dict):
        check_field_types(raw["text_config"], "config.json text_config")
    # Like transformers, the first class listed decides.
    architecture = raw["architectures"][0]
    parser = CONFIG_PARSERS.get(architecture)
    if parser is None:
        known = sorted(CONFIG_PARSERS)
        raise ConfigError(f"config.json: architecture {architecture!r} is not supported (known: {known})")
    return parser(raw)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of a checkpoint directory.

    Stop tokens follow transformers' `generate`: generation_config.json's eos_token_id wins over config.json's,
    so that the engine stops exactly where the reference stops.
    """
    model_dir = Path(model_dir)
    config = parse_config(read_json(model_dir / "config.json"))
    generation_path = model_dir / "generation_config.json"
    if generation_path.exists():
        generation = read_json(generation_path)
        check_field_types(generation, "generation_config.json")
        generation_eos = eos_ids(generation.get("eos_token_id"))
        if generation_eos:
            config = replace(config, eos_token_ids=generation_eos)
    return config
