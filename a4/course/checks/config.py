"""Checks of notebook 01: a4's ModelConfig against what transformers reads from the same config.json.

The ground truth for each field is transformers' own config object for the file (`AutoConfig`): the rotary dims
as its default RoPE initialisation computes them from the object's `rope_parameters`, and the tying of embeddings
from the top-level flag that `Qwen3_5ForConditionalGeneration` ties by.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from a4.checkpoints import preset_config
from a4.course.checks import conclude, error_problems
from a4.course.checks.common import QWEN3_5_PRESETS
from a4.models.config import ConfigError, ModelConfig, load_model_config, parse_config

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# Copied straight from transformers' text config object.
TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    *LINEAR_FIELDS,
)


def transformers_config(raw: dict[str, Any]):
    """transformers' config object for a config.json's contents (it edits the dict it is given: pass a copy)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**copy.deepcopy(raw))


def transformers_rotary_dim(text_config) -> int:
    """The dims transformers rotates, computed as its default RoPE initialisation does from its rope_parameters."""
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    return int(head_dim * text_config.rope_parameters.get("partial_rotary_factor", 1.0))


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def transformers_fields(raw: dict[str, Any], generation_eos: int | list[int] | None = None) -> dict[str, Any]:
    """Every ModelConfig field as transformers reads it from `raw` (a Qwen3.5 or Qwen3.5-MoE config.json).

    generation_eos: generation_config.json's eos_token_id, which transformers' generate stops on when given.
    """
    hf = transformers_config(raw)
    text = hf.get_text_config()
    moe = text.model_type == "qwen3_5_moe_text"
    fields = {name: getattr(text, name) for name in TEXT_FIELDS}
    fields.update(
        architecture=hf.architectures[0],
        # The MoE model has no dense MLP in any layer.
        intermediate_size=0 if moe else text.intermediate_size,
        rope_theta=text.rope_parameters["rope_theta"],
        rotary_dim=transformers_rotary_dim(text),
        # Qwen3_5(Moe)ForConditionalGeneration owns lm_head and ties by its own, top-level config.
        tie_word_embeddings=hf.tie_word_embeddings,
        eos_token_ids=_as_tuple(generation_eos if generation_eos is not None else text.eos_token_id),
        layer_types=tuple(text.layer_types),
        # transformers' Qwen3.5-MoE router always renormalises the top-k weights.
        norm_topk_prob=True,
        **{name: getattr(text, name) if moe else 0 for name in MOE_FIELDS},
    )
    missing = {f.name for f in dataclasses.fields(ModelConfig)} - set(fields)
    assert not missing, f"transformers_fields does not cover {sorted(missing)}"
    return fields


def field_problems(actual: ModelConfig, expected: dict[str, Any], label: str) -> list[str]:
    """One line per field of `actual` that differs from `expected`; layer types are compared layer by layer."""
    problems = []
    for name, want in expected.items():
        got = getattr(actual, name)
        if name == "layer_types":
            problems += layer_problems(tuple(got), want, label)
        elif got != want:
            problems.append(f"{label}: {name}: expected {want!r}, got {got!r}")
    return problems


def layer_problems(got: tuple[str, ...], want: tuple[str, ...], label: str) -> list[str]:
    problems = []
    if len(got) != len(want):
        problems.append(f"{label}: expected {len(want)} layer types, got {len(got)}")
    problems += [f"{label}: layer {i}: expected {w}, got {g}" for i, (w, g) in enumerate(zip(want, got)) if w != g]
    return problems


def check_checkpoint(model_dir: str | Path, label: str) -> None:
    """`load_model_config(model_dir)` (your parser, reached through `parse_config`) against transformers."""
    from transformers import GenerationConfig

    model_dir = Path(model_dir)
    raw = transformers_config_dict(model_dir)
    generation_eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    expected = transformers_fields(raw, generation_eos)
    conclude(
        field_problems(load_model_config(model_dir), expected, label),
        f"{label}: all {len(expected)} fields match transformers",
    )


def transformers_config_dict(model_dir: Path) -> dict[str, Any]:
    """config.json as transformers reads it from disk (its own file reader, not a4's)."""
    from transformers import PretrainedConfig

    return PretrainedConfig.get_config_dict(str(model_dir))[0]


def check_presets(presets: tuple[tuple[str, str], ...] = QWEN3_5_PRESETS) -> None:
    """Every real preset through `parse_config` (your parser) against transformers, every field."""
    problems = []
    for arch, preset in presets:
        raw = preset_config(arch, preset)
        problems += field_problems(parse_config(raw), transformers_fields(raw), preset)
    conclude(problems, f"{len(presets)} real configs: every field matches transformers")


def layer_pattern_cases() -> dict[str, dict[str, Any]]:
    """text_configs whose layer patterns differ from the real files' (from the 0.8B text_config)."""
    real = preset_config("qwen3_5", "0.8b")["text_config"]
    derived = {k: v for k, v in real.items() if k not in ("layer_types", "full_attention_interval")}
    return {
        "0.8b as written (layer_types listed)": real,
        "no layer_types, full_attention_interval 4": {**derived, "full_attention_interval": 4},
        "no layer_types, full_attention_interval 3": {**derived, "full_attention_interval": 3},
        "no layer_types, no interval (default 4), 10 layers": {**derived, "num_hidden_layers": 10},
        "no layer_types, full_attention_interval 1 (all full)": {**derived, "full_attention_interval": 1},
        "listed, full attention first": {
            **real,
            "num_hidden_layers": 6,
            "layer_types": ["full_attention"] + ["linear_attention"] * 4 + ["full_attention"],
        },
    }


def _text_config_in_transformers(text: dict[str, Any]):
    return transformers_config({"model_type": "qwen3_5", "text_config": text}).get_text_config()


def check_layer_patterns(layer_types_of: Callable[[dict[str, Any]], tuple[str, ...]]) -> None:
    """`layer_types_of(text_config)` against transformers' layer_types on listed and derived patterns."""
    problems = []
    for label, text in layer_pattern_cases().items():
        want = tuple(_text_config_in_transformers(text).layer_types)
        problems += layer_problems(tuple(layer_types_of(copy.deepcopy(text))), want, label)
    conclude(problems, f"{len(layer_pattern_cases())} layer patterns match transformers")


def rope_cases() -> dict[str, dict[str, Any]]:
    """text_configs with RoPE written in the current and the older layout."""
    real = preset_config("qwen3_5", "0.8b")["text_config"]
    older = {k: v for k, v in real.items() if k != "rope_parameters"}
    return {
        "0.8b as written (rope_parameters)": real,
        "older file: top-level rope_theta and partial_rotary_factor 0.5": {
            **older,
            "rope_theta": 1_000_000,
            "partial_rotary_factor": 0.5,
        },
        "both places (rope_parameters wins)": {**real, "partial_rotary_factor": 0.5},
        "head_dim 128, factor 0.75": {
            **real,
            "head_dim": 128,
            "rope_parameters": {**real["rope_parameters"], "partial_rotary_factor": 0.75},
        },
    }


def check_rotary_dims(rotary_dim_of: Callable[[dict[str, Any]], int]) -> None:
    """`rotary_dim_of(text_config)` against the number of dims transformers rotates."""
    problems = []
    for label, text in rope_cases().items():
        want = transformers_rotary_dim(_text_config_in_transformers(text))
        got = rotary_dim_of(copy.deepcopy(text))
        if got != want:
            problems.append(f"{label}: rotary_dim: expected {want}, got {got}")
    conclude(problems, f"{len(rope_cases())} RoPE layouts give transformers' rotary dims")


def error_cases() -> dict[str, tuple[dict[str, Any], str]]:
    """Broken config.json files, each with a word its ConfigError must contain."""
    dense = preset_config("qwen3_5", "0.8b")
    moe = preset_config("qwen3_5_moe", "35b-a3b")

    def edit(raw: dict[str, Any], **text_changes: Any) -> dict[str, Any]:
        raw = copy.deepcopy(raw)
        for key, value in text_changes.items():
            if value is None:
                del raw["text_config"][key]
            else:
                raw["text_config"][key] = value
        return raw

    no_factor = edit(dense)
    del no_factor["text_config"]["rope_parameters"]["partial_rotary_factor"]
    unknown_layer = edit(dense)
    unknown_layer["text_config"]["layer_types"][5] = "sliding_attention"
    return {
        "no text_config": ({k: v for k, v in dense.items() if k != "text_config"}, "text_config"),
        "text_config without hidden_size": (edit(dense, hidden_size=None), "hidden_size"),
        "text_config without linear_num_value_heads": (
            edit(dense, linear_num_value_heads=None),
            "linear_num_value_heads",
        ),
        "dense model without intermediate_size": (edit(dense, intermediate_size=None), "intermediate_size"),
        "no partial_rotary_factor anywhere": (no_factor, "partial_rotary_factor"),
        "unknown layer type at layer 5": (unknown_layer, "sliding_attention"),
        "23 layer_types for 24 layers": (
            edit(dense, layer_types=dense["text_config"]["layer_types"][:-1]),
            "layer_types",
        ),
        "no layer_types, full_attention_interval 0": (
            edit(dense, layer_types=None, full_attention_interval=0),
            "full_attention_interval",
        ),
        "MoE without num_experts": (edit(moe, num_experts=None), "num_experts"),
    }


def check_config_errors() -> None:
    """Each broken file through `parse_config` must raise a ConfigError that names what is wrong."""
    problems = []
    for label, (raw, mentions) in error_cases().items():
        problems += error_problems(label, lambda: parse_config(raw), ConfigError, mentions, accepted="accepted")
    conclude(problems, f"{len(error_cases())} broken configs each raise a ConfigError naming the problem")
