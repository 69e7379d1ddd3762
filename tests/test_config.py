"""Qwen3.5 config parsing (the reference solution of notebook 01's exercises) against transformers' own configs.

Runs under A4_SOLUTIONS=1. The expected values are what transformers reads from the same config.json
(`a4.course.checks.config.transformers_fields`: AutoConfig, its rope_parameters, the top-level tie flag); the
tests here also prove that those helpers catch wrong answers, and that transformers really ties embeddings by the
top-level flag.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re

import pytest
import torch

from a4.checkpoints import preset_config, tiny_checkpoint
from a4.course.checks import CheckFailed, common
from a4.course.checks import config as checks
from a4.models.config import ConfigError, load_model_config, parse_config
from a4.models.qwen3_5_config import qwen3_5_layer_types, qwen3_5_rotary_dim


@pytest.mark.parametrize(("arch", "preset"), common.QWEN3_5_PRESETS, ids=[p for _, p in common.QWEN3_5_PRESETS])
def test_real_presets_match_transformers(arch: str, preset: str) -> None:
    raw = preset_config(arch, preset)
    assert checks.field_problems(parse_config(raw), checks.transformers_fields(raw), preset) == []


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_tiny_checkpoints_match_transformers(arch: str) -> None:
    from transformers import GenerationConfig

    model_dir = tiny_checkpoint(arch)
    raw = checks.transformers_config_dict(model_dir)
    expected = checks.transformers_fields(raw, GenerationConfig.from_pretrained(model_dir).eos_token_id)
    assert checks.field_problems(load_model_config(model_dir), expected, arch) == []


def test_real_memory_shapes() -> None:
    """The derived shapes the memory ledger uses, against the arithmetic in qwen3_5-configs.md."""
    small = parse_config(preset_config("qwen3_5", "0.8b"))
    moe = parse_config(preset_config("qwen3_5_moe", "35b-a3b"))
    assert (small.conv_dim, moe.conv_dim) == (2 * 16 * 128 + 16 * 128, 2 * 16 * 128 + 32 * 128)
    assert (len(small.full_attention_layers), len(small.linear_attention_layers)) == (6, 18)
    assert (len(moe.full_attention_layers), len(moe.linear_attention_layers)) == (10, 30)
    assert moe.intermediate_size == 0 and moe.is_moe and not small.is_moe


@pytest.mark.parametrize("label", list(checks.layer_pattern_cases()))
def test_layer_patterns(label: str) -> None:
    text = checks.layer_pattern_cases()[label]
    expected = tuple(checks.transformers_config({"model_type": "qwen3_5", "text_config": text}).text_config.layer_types)
    assert qwen3_5_layer_types(copy.deepcopy(text)) == expected


def test_layer_patterns_by_hand() -> None:
    """Independent of transformers: interval 3 puts full attention on layers 2, 5, 8."""
    text = {k: v for k, v in preset_config("qwen3_5", "0.8b")["text_config"].items() if k != "layer_types"}
    layer_types = qwen3_5_layer_types({**text, "num_hidden_layers": 9, "full_attention_interval": 3})
    assert [i for i, kind in enumerate(layer_types) if kind == "full_attention"] == [2, 5, 8]


@pytest.mark.parametrize("label", list(checks.rope_cases()))
def test_rotary_dims(label: str) -> None:
    text = checks.rope_cases()[label]
    hf_text = checks.transformers_config({"model_type": "qwen3_5", "text_config": text}).text_config
    assert qwen3_5_rotary_dim(copy.deepcopy(text)) == checks.transformers_rotary_dim(hf_text)


def test_rotary_dim_is_what_transformers_rotates() -> None:
    """The helper's rotary dim equals the frequencies transformers' rotary embedding module really builds."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    for text in checks.rope_cases().values():
        hf_text = checks.transformers_config({"model_type": "qwen3_5", "text_config": text}).text_config
        assert checks.transformers_rotary_dim(hf_text) == 2 * Qwen3_5TextRotaryEmbedding(hf_text).inv_freq.numel()


@pytest.mark.parametrize("label", list(checks.error_cases()))
def test_config_errors(label: str) -> None:
    raw, mentions = checks.error_cases()[label]
    with pytest.raises(ConfigError, match=mentions):
        parse_config(raw)


@pytest.mark.parametrize("top_level", [True, False])
def test_transformers_ties_by_the_top_level_flag(top_level: bool) -> None:
    """Why the parser reads tie_word_embeddings from the top level: the model class transformers builds does."""
    from transformers import Qwen3_5ForConditionalGeneration

    raw = preset_config("qwen3_5", "tiny")
    raw["tie_word_embeddings"] = top_level
    raw["text_config"]["tie_word_embeddings"] = not top_level
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(checks.transformers_config(raw))
    assert bool(model.get_expanded_tied_weights_keys()) == top_level
    assert parse_config(raw).tie_word_embeddings == top_level


def test_field_problems_names_the_wrong_field_and_layer() -> None:
    raw = preset_config("qwen3_5", "0.8b")
    config = parse_config(raw)
    wrong = dataclasses.replace(
        config,
        rotary_dim=config.head_dim,
        layer_types=("full_attention",) * 4 + config.layer_types[4:],
    )
    problems = checks.field_problems(wrong, checks.transformers_fields(raw), "0.8b")
    assert "0.8b: rotary_dim: expected 64, got 256" in problems
    assert "0.8b: layer 0: expected linear_attention, got full_attention" in problems
    assert len(problems) == 4  # rotary_dim and layers 0, 1, 2 (layer 3 is full attention either way)


def test_checks_fail_on_wrong_answers() -> None:
    with pytest.raises(CheckFailed, match="layer 3: expected full_attention, got linear_attention"):
        checks.check_layer_patterns(lambda text: ("linear_attention",) * text.get("num_hidden_layers", 24))
    with pytest.raises(CheckFailed, match="rotary_dim: expected 64, got 256"):
        checks.check_rotary_dims(lambda text: text["head_dim"])


def test_config_errors_check_rejects_a_parser_that_accepts_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from a4.course.checks import config as module

    monkeypatch.setattr(module, "parse_config", lambda raw: None)
    with pytest.raises(CheckFailed, match="accepted; expected a ConfigError"):
        module.check_config_errors()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_architectures_given_as_a_string_is_named(arch: str) -> None:
    raw = preset_config(arch, "tiny")
    raw["architectures"] = raw["architectures"][0]
    with pytest.raises(ConfigError, match=rf"architectures must be a list .*got '{raw['architectures']}'"):
        parse_config(raw)


# (field, a wrong value): each would otherwise be converted without a word ("64" -> 64, 64.5 -> 64, True -> 1,
# "false" -> tied) or fail deep inside a parser with a message that names no field.
WRONG_VALUES = [
    ("hidden_size", "64"),
    ("hidden_size", 64.5),
    ("num_attention_heads", True),
    ("num_hidden_layers", 0),
    ("vocab_size", -1024),
    ("max_position_embeddings", [4096]),
    ("rms_norm_eps", "1e-6"),
    ("rms_norm_eps", float("nan")),
    ("tie_word_embeddings", "false"),
    ("eos_token_id", "1000"),
    ("eos_token_id", [1000, None]),
    ("layer_types", "full_attention"),
]


def with_field(arch: str, field: str, value) -> dict:
    """The tiny preset's config.json with `field` set where the parser reads it (Qwen3.5: text_config, but the tie
    flag at the top level)."""
    raw = preset_config(arch, "tiny")
    section = raw if arch == "qwen3" or field == "tie_word_embeddings" else raw["text_config"]
    section[field] = value
    return raw


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize(("field", "value"), WRONG_VALUES, ids=[f"{f}={v!r}" for f, v in WRONG_VALUES])
def test_a_field_of_the_wrong_type_is_named(arch: str, field: str, value) -> None:
    with pytest.raises(ConfigError, match=rf"{field} must be .*got {re.escape(repr(value))}"):
        parse_config(with_field(arch, field, value))


@pytest.mark.parametrize(("field", "value"), [("rope_theta", "1e7"), ("partial_rotary_factor", 1.5)])
def test_a_rope_parameter_of_the_wrong_type_is_named(field: str, value) -> None:
    raw = preset_config("qwen3_5", "tiny")
    raw["text_config"]["rope_parameters"][field] = value
    with pytest.raises(ConfigError, match=rf"text_config rope_parameters: {field} must be"):
        parse_config(raw)


def test_a_null_required_field_is_missing() -> None:
    raw = with_field("qwen3", "vocab_size", None)
    with pytest.raises(ConfigError, match="missing required field 'vocab_size'"):
        parse_config(raw)


def test_generation_config_eos_of_the_wrong_type_is_named(tmp_path) -> None:
    import shutil

    model_dir = shutil.copytree(tiny_checkpoint("qwen3"), tmp_path / "ckpt")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    (model_dir / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": ["1002"]}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be"):
        load_model_config(model_dir)


# Qwen3 files whose layers transformers' Qwen3Config runs as it says; a4's Qwen3 runs full attention only.
QWEN3_LAYER_CASES = {
    "layer_types listed, all full attention": dict(layer_types=["full_attention"] * 4),
    "layer_types listed, sliding window from layer 2": dict(
        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2, use_sliding_window=True
    ),
    "layer_types listed, a linear attention layer": dict(layer_types=["full_attention"] * 3 + ["linear_attention"]),
    "use_sliding_window from layer 2": dict(use_sliding_window=True, sliding_window=64, max_window_layers=2),
    "use_sliding_window, max_window_layers past the last layer": dict(
        use_sliding_window=True, sliding_window=64, max_window_layers=4
    ),
    "sliding_window set but use_sliding_window off": dict(use_sliding_window=False, sliding_window=64),
}


@pytest.mark.parametrize("label", list(QWEN3_LAYER_CASES))
def test_qwen3_layer_types_are_read_not_ignored(label: str) -> None:
    """a4 parses a Qwen3 file exactly when transformers would run every layer with full attention."""
    from transformers import Qwen3Config

    raw = preset_config("qwen3", "tiny") | QWEN3_LAYER_CASES[label]
    hf_layer_types = tuple(Qwen3Config(**copy.deepcopy(raw)).layer_types)
    if set(hf_layer_types) == {"full_attention"}:
        assert parse_config(raw).layer_types == hf_layer_types
    else:
        first = next(i for i, kind in enumerate(hf_layer_types) if kind != "full_attention")
        with pytest.raises(ConfigError, match=rf"layer {first} is '{hf_layer_types[first]}'.*full attention only"):
            parse_config(raw)


def test_qwen3_layer_types_of_the_wrong_length() -> None:
    raw = preset_config("qwen3", "tiny") | dict(layer_types=["full_attention"] * 3)
    with pytest.raises(ConfigError, match="layer_types has 3 entries but num_hidden_layers is 4"):
        parse_config(raw)
