"""Bad input is a clear error naming what is wrong, raised where it is written (not steps later in the engine)."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from a4 import LLM, SamplingParams
from a4.engine.engine import EngineConfig
from a4.reference import hf_greedy


@pytest.mark.parametrize(
    "field, value, error",
    [
        ("max_new_tokens", 0, ValueError),
        ("max_new_tokens", -3, ValueError),
        ("max_new_tokens", 2.5, TypeError),
        ("max_new_tokens", True, TypeError),
        ("max_new_tokens", None, TypeError),
        ("max_new_tokens", "8", TypeError),
        ("temperature", -0.1, ValueError),
        ("temperature", math.nan, ValueError),
        ("temperature", math.inf, ValueError),
        ("temperature", None, TypeError),
        ("temperature", False, TypeError),
        ("top_k", 2.5, TypeError),
        ("top_k", -1, ValueError),
        ("top_k", True, TypeError),
        ("top_p", 0.0, ValueError),
        ("top_p", 1.5, ValueError),
        ("top_p", math.nan, ValueError),
        ("top_p", "0.9", TypeError),
        ("seed", -1, ValueError),
        ("seed", 2**63, ValueError),
        ("seed", 1.0, TypeError),
        ("seed", True, TypeError),
        ("ignore_eos", 1, TypeError),
    ],
)
def test_sampling_params_reject_bad_fields_naming_them(field, value, error):
    with pytest.raises(error, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_sampling_params_accept_the_edges():
    SamplingParams(max_new_tokens=1, temperature=0, top_k=0, top_p=1, seed=0)
    SamplingParams(temperature=1e-45, top_p=1e-9, seed=2**63 - 1)


def test_a_prompt_of_bools_or_floats_is_an_error_naming_the_position(tiny_qwen3):
    llm = LLM(tiny_qwen3)
    outputs = llm.generate([[1, True, 3], [1, 2, 3.0], [4, 5, 6]], SamplingParams(max_new_tokens=3))
    assert outputs[0].finish_reason == "error" and "True at position 1" in outputs[0].error
    assert outputs[1].finish_reason == "error" and "3.0 at position 2" in outputs[1].error
    assert outputs[2].token_ids == hf_greedy(tiny_qwen3, [[4, 5, 6]], 3)[0]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_running_requests=True), "max_running_requests"),
        (dict(max_prefill_tokens=64.0), "max_prefill_tokens"),
        (dict(page_size=True), "page_size"),
        (dict(memory_budget_bytes=True), "memory_budget_bytes"),
        (dict(max_state_checkpoints=False), "max_state_checkpoints"),
        (dict(enable_prefix_cache="yes"), "enable_prefix_cache"),
    ],
)
def test_llm_arguments_are_ints_not_bools(tiny_qwen3_5, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_qwen3_5, **kwargs)


ENGINE_CONFIG_OPTIONS = [field for field in dataclasses.fields(EngineConfig) if field.name != "model_dir"]


@pytest.mark.parametrize(
    "option, hint", [("max_prefil_tokens", " (did you mean 'max_prefill_tokens'?)"), ("cuda", ""), ("model", "")]
)
def test_an_unknown_llm_option_is_a_type_error_naming_it_and_the_valid_ones(tiny_qwen3, option, hint):
    with pytest.raises(TypeError, match=f"unknown option '{option}'") as error:
        LLM(tiny_qwen3, max_running_requests=2, **{option: 1})
    valid = ", ".join(field.name for field in ENGINE_CONFIG_OPTIONS)
    expected = f"LLM() got an unknown option '{option}'{hint}; the options are EngineConfig's fields: {valid}"
    assert str(error.value) == expected


def test_llm_options_are_engine_config_fields_with_their_defaults(tiny_qwen3):
    """help(LLM) and editors show each option with its default; each reaches the engine's config."""
    parameters = list(inspect.signature(LLM).parameters.values())
    assert [(p.name, p.kind) for p in parameters] == [("model_dir", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        (field.name, inspect.Parameter.KEYWORD_ONLY) for field in ENGINE_CONFIG_OPTIONS
    ] + [("drafter", inspect.Parameter.KEYWORD_ONLY)]
    assert [p.default for p in parameters[1:]] == [field.default for field in ENGINE_CONFIG_OPTIONS] + [None]
    options = dict(dtype="bfloat16", max_running_requests=3, max_prefill_tokens=32, page_size=2,
                   enable_prefix_cache=False, memory_budget_bytes=2**24)
    assert LLM(tiny_qwen3, **options).engine.config == EngineConfig(tiny_qwen3, **options)


def test_page_size_larger_than_the_context_names_page_size(tiny_qwen3):
    # The tiny model takes 4096 positions: a page of 8192 could never be filled by one request.
    with pytest.raises(ValueError, match=r"page_size 8192 is larger than the longest context .* 4096 tokens"):
        LLM(tiny_qwen3, max_running_requests=1, page_size=8192, memory_budget_bytes=2**25)
