"""vLLM's sampling parameters beyond temperature / top_k / top_p: presence, frequency and repetition penalties,
logit_bias, min_tokens, stop_token_ids and min_p, and n samples of one prompt.

The reference is transformers' logits for the same prefix, processed by a plain loop over the vocabulary as vLLM's
definitions say, then greedy, one token at a time (`naive_greedy`). Requests that ask share batches with requests
that do not, which must stay transformers' plain greedy output; with overlap scheduling on and off (the penalties
count the tokens of the step still in flight on the device).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.reference import cached_hf_model, hf_greedy
from test_fault_injection import assert_clean

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], list(range(3, 30)), [11, 12, 13, 14, 15]]
MAX_NEW = 8
OVERLAP = [False, True]


def naive_greedy(model_dir, prompt: list[int], params: SamplingParams, eos_token_ids=()) -> list[int]:
    """Greedy output under params' logits processors, from transformers' logits of each prefix, by plain loops."""
    model = cached_hf_model(model_dir)
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    output: list[int] = []
    while len(output) < params.max_new_tokens:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
        for token, bias in (params.logit_bias or {}).items():
            logits[token] += bias
        if len(output) < params.min_tokens:
            for token in stops:
                logits[token] = float("-inf")
        for token in set(prompt + output):
            value, penalty = logits[token], params.repetition_penalty
            logits[token] = value / penalty if value > 0 else value * penalty
        for token in set(output):
            logits[token] -= params.presence_penalty + params.frequency_penalty * output.count(token)
        output.append(max(range(len(logits)), key=logits.__getitem__))
        if output[-1] in stops:
            break
    return output


def build(checkpoint_dir, overlap: bool, **options) -> LLM:
    options = {"max_running_requests": 4, "max_prefill_tokens": 32, **options}
    return LLM(checkpoint_dir, overlap_schedule=overlap, **options)


# The trained tiny Qwen3.5's tokens for "Once upon a time, a fox", "What is 7 plus 5?" and "The cat says meow. The
# dog": its text repeats itself, which the penalties change.
CHAT_PROMPTS = [[363, 364, 257, 352, 11, 257, 716], [293, 267, 220, 22, 309, 220, 20, 30], [613, 707, 470, 1102, 13, 313, 725]]


@pytest.mark.parametrize("overlap", OVERLAP, ids=lambda overlap: f"overlap{int(overlap)}")
@pytest.mark.parametrize("penalties", [
    {"presence_penalty": -2.0}, {"frequency_penalty": -2.0}, {"repetition_penalty": 1.8},
    {"repetition_penalty": 0.5, "presence_penalty": -0.5, "frequency_penalty": 0.7},
], ids=lambda penalties: "-".join(penalties))  # fmt: skip
def test_penalties_equal_the_naive_reference(chat_model_dir, overlap, penalties):
    """Penalized requests beside a plain one in every batch: each equals its reference, and the penalties change
    what the plain greedy output would have been (so the test sees them)."""
    llm = build(chat_model_dir, overlap)
    max_new = 12
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True, **penalties)
    plain = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    outputs = [out.token_ids for out in llm.generate(CHAT_PROMPTS, [params, params, plain])]
    assert outputs[2] == naive_greedy(chat_model_dir, CHAT_PROMPTS[2], plain)
    assert outputs[:2] == [naive_greedy(chat_model_dir, prompt, params) for prompt in CHAT_PROMPTS[:2]]
    assert outputs[:2] != [out.token_ids for out in llm.generate(CHAT_PROMPTS[:2], plain)]
    assert_clean(llm, chat_model_dir)


def test_a_speculative_engine_serves_processed_requests_without_drafts(chat_model_dir, monkeypatch):
    """As in vLLM, a request whose sampler keeps state along its tokens (penalties) or changes its logits
    (logit_bias) is served without drafts on a speculative engine, one token a step, beside requests drafted by the
    checkpoint's MTP module: each equals its reference, and the MTP module runs for the drafted request alone."""
    llm = LLM(chat_model_dir, speculative_tokens=2, max_running_requests=4, max_prefill_tokens=32)
    drafter, observed = llm.engine.worker.drafter, set()
    observe = drafter.observe

    def observe_and_record(reqs, committed, hidden):
        observed.update(tuple(req.input_ids) for req in reqs)
        observe(reqs, committed, hidden)

    monkeypatch.setattr(drafter, "observe", observe_and_record)
    max_new = 12
    penalized = SamplingParams(max_new_tokens=max_new, ignore_eos=True, repetition_penalty=0.5,
                               presence_penalty=-0.5, frequency_penalty=0.7)  # fmt: skip
    plain = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    first = naive_greedy(chat_model_dir, CHAT_PROMPTS[1], plain)[0]
    biased = SamplingParams(max_new_tokens=max_new, ignore_eos=True, logit_bias={first: -100.0, 13: 2.0})
    outputs = [out.token_ids for out in llm.generate(CHAT_PROMPTS, [penalized, biased, plain])]
    assert outputs == [naive_greedy(chat_model_dir, prompt, params)
                       for prompt, params in zip(CHAT_PROMPTS, [penalized, biased, plain])]  # fmt: skip
    assert first not in outputs[1]
    stats = llm.engine.stats
    assert 0 < stats.accepted_draft_tokens <= stats.draft_tokens <= 2 * (max_new - 1)  # the plain request's alone
    assert observed == {tuple(CHAT_PROMPTS[2])}
    assert_clean(llm, chat_model_dir)


def test_n_samples_on_a_speculative_engine(chat_model_dir):
    """On a speculative engine the n samples of a prompt are n requests, each prefilling it (vLLM's fan-out): greedy
    ones are transformers' output each, seeded ones equal the single requests with seed + j, MTP drafts are accepted
    along the way, and the engine ends idle."""
    llm = LLM(chat_model_dir, speculative_tokens=2, max_running_requests=4, max_prefill_tokens=32)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, n=3)
    expected = naive_greedy(chat_model_dir, CHAT_PROMPTS[0], replace(greedy, n=1))
    assert [out.token_ids for out in llm.generate([CHAT_PROMPTS[0]], greedy)] == [expected] * 3
    assert llm.engine.stats.prefill_tokens == 3 * len(CHAT_PROMPTS[0])
    assert llm.engine.stats.accepted_draft_tokens > 0
    sampled = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, temperature=1.5, seed=5, n=3)
    samples = [out.token_ids for out in llm.generate([CHAT_PROMPTS[0]], sampled)]
    singles = [out.token_ids for out in llm.generate([CHAT_PROMPTS[0]] * 3, [replace(sampled, seed=5 + j, n=1) for j in range(3)])]
    assert samples == singles and len({tuple(tokens) for tokens in samples}) > 1
    assert_clean(llm, chat_model_dir)


@pytest.mark.parametrize("overlap", OVERLAP, ids=lambda overlap: f"overlap{int(overlap)}")
def test_logit_bias_forces_and_forbids_tokens(tiny_qwen3_5, overlap):
    llm = build(tiny_qwen3_5, overlap)
    greedy = hf_greedy(tiny_qwen3_5, [PROMPTS[2]], MAX_NEW)[0]
    forced = SamplingParams(max_new_tokens=4, logit_bias={42: 100.0})
    forbidden = SamplingParams(max_new_tokens=MAX_NEW, logit_bias={greedy[0]: -100.0, 7: 3.5})
    outputs = llm.generate([PROMPTS[2], PROMPTS[2], PROMPTS[1]], [forced, forbidden, SamplingParams(max_new_tokens=4)])
    assert outputs[0].token_ids == [42] * 4
    assert outputs[1].token_ids == naive_greedy(tiny_qwen3_5, PROMPTS[2], forbidden)
    assert greedy[0] not in outputs[1].token_ids
    assert outputs[2].token_ids == hf_greedy(tiny_qwen3_5, [PROMPTS[1]], 4)[0]
    assert_clean(llm, tiny_qwen3_5)


@pytest.fixture
def eos_at_third_token(tiny_qwen3_5, tmp_path):
    """A copy of the tiny Qwen3.5 whose end-of-sequence token is PROMPTS[2]'s third greedy token."""
    eos = hf_greedy(tiny_qwen3_5, [PROMPTS[2]], MAX_NEW)[0][2]
    checkpoint_dir = tmp_path / "eos"
    shutil.copytree(tiny_qwen3_5, checkpoint_dir)
    generation_config = checkpoint_dir / "generation_config.json"
    generation_config.write_text(json.dumps(json.loads(generation_config.read_text()) | {"eos_token_id": eos}))
    return checkpoint_dir, eos


@pytest.mark.parametrize("overlap", OVERLAP, ids=lambda overlap: f"overlap{int(overlap)}")
def test_min_tokens_delays_the_end_of_sequence(eos_at_third_token, overlap):
    checkpoint_dir, eos = eos_at_third_token
    llm = build(checkpoint_dir, overlap)
    params = SamplingParams(max_new_tokens=MAX_NEW, min_tokens=5)
    outputs = llm.generate([PROMPTS[2], PROMPTS[2]], [params, SamplingParams(max_new_tokens=MAX_NEW)])
    assert outputs[1].token_ids[-1] == eos and len(outputs[1].token_ids) == 3  # what min_tokens delays
    assert outputs[0].token_ids == naive_greedy(checkpoint_dir, PROMPTS[2], params, [eos])
    assert len(outputs[0].token_ids) >= 5 and eos not in outputs[0].token_ids[:5]
    assert_clean(llm, checkpoint_dir)


@pytest.mark.parametrize("overlap", OVERLAP, ids=lambda overlap: f"overlap{int(overlap)}")
def test_stop_token_ids_finish_with_stop(tiny_qwen3_5, overlap):
    """A stop token id ends its request as an end-of-sequence token does (even with ignore_eos), finish_reason
    "stop", its state cached as the state before it (checked against transformers by assert_clean): under overlap
    the step after it ran on the padding slot. With min_tokens it is masked until then."""
    greedy = hf_greedy(tiny_qwen3_5, [PROMPTS[2]], MAX_NEW)[0]
    stop = greedy[2]
    llm = build(tiny_qwen3_5, overlap, max_state_checkpoints=64)
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop,), ignore_eos=True)
    late = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop,), min_tokens=4)
    outputs = llm.generate([PROMPTS[2], PROMPTS[1], PROMPTS[2]], [params, SamplingParams(max_new_tokens=MAX_NEW), late])
    assert outputs[0].token_ids == greedy[:3] and outputs[0].finish_reason == "stop"
    assert outputs[1].token_ids == hf_greedy(tiny_qwen3_5, [PROMPTS[1]], MAX_NEW)[0]
    assert outputs[2].token_ids == naive_greedy(tiny_qwen3_5, PROMPTS[2], late)
    cache = llm.engine.cache_manager.prefix_cache
    assert PROMPTS[2] + greedy[:2] in [tokens for tokens, _ in cache.checkpoints()]
    assert_clean(llm, tiny_qwen3_5)


def test_min_p_one_keeps_only_the_most_likely_token(tiny_qwen3_5):
    """min_p = 1 leaves only the tokens as likely as the most likely one: sampling at any temperature is greedy."""
    llm = build(tiny_qwen3_5, False)
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=2.0, min_p=1.0, seed=3, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params)
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "in [-2, 2]"), ("repetition_penalty", 0.0, "> 0"), ("min_p", 1.5, "in [0, 1]"),
    ("min_tokens", 20, "in [0, 16]"), ("logit_bias", {3: 101.0}, "in [-100, 100]"), ("n", 0, ">= 1"),
    ("stop_token_ids", [3], "tuple"),
])  # fmt: skip
def test_bad_values_name_their_field(field, value, message):
    with pytest.raises((ValueError, TypeError), match=rf"SamplingParams\.{field}.*{message}".replace("[", r"\[")):
        SamplingParams(**{field: value})


def test_token_ids_outside_the_vocabulary_fail_the_request_alone(tiny_qwen3_5):
    llm = build(tiny_qwen3_5, False)
    vocab_size = llm.engine.model_config.vocab_size
    outputs = llm.generate([PROMPTS[0]] * 3, [SamplingParams(stop_token_ids=(vocab_size,)),
                                              SamplingParams(logit_bias={vocab_size + 5: 1.0}), SamplingParams()])  # fmt: skip
    assert outputs[0].finish_reason == outputs[1].finish_reason == "error"
    assert "stop_token_ids" in outputs[0].error and "logit_bias" in outputs[1].error
    assert outputs[2].token_ids == hf_greedy(tiny_qwen3_5, [PROMPTS[0]], 16)[0]


@pytest.mark.parametrize("overlap", OVERLAP, ids=lambda overlap: f"overlap{int(overlap)}")
@pytest.mark.parametrize("page_size, prefix_cache", [(1, True), (4, True), (4, False)])
def test_n_samples_prefill_once_and_share_the_prompt(tiny_qwen3_5, overlap, page_size, prefix_cache):
    """n = 3 samples of a chunked prompt beside a plain request: greedy ones are transformers' output each, the
    prompt is prefilled once, seeded ones are the single requests with seed + j (independent draws); the engine ends
    idle (every page shared or copied by a fork given back, every state checkpoint right)."""
    llm = build(tiny_qwen3_5, overlap, max_running_requests=5, max_prefill_tokens=16, page_size=page_size,
                enable_prefix_cache=prefix_cache)  # fmt: skip
    engine = llm.engine
    expected = hf_greedy(tiny_qwen3_5, PROMPTS[1:], MAX_NEW)
    samples = engine.add_parallel_requests(PROMPTS[1], SamplingParams(max_new_tokens=MAX_NEW, n=3))
    plain = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=MAX_NEW))
    engine.run([*samples, plain])
    assert [req.output_ids for req in [*samples, plain]] == [expected[0]] * 3 + [expected[1]]
    assert engine.stats.prefill_tokens == len(PROMPTS[1]) + len(PROMPTS[2])
    assert_clean(llm, tiny_qwen3_5)
    sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=11, n=3)
    reqs = engine.add_parallel_requests(PROMPTS[2], sampled)
    engine.run(reqs)
    forks = [req.output_ids for req in reqs]
    singles = [out.token_ids for out in llm.generate([PROMPTS[2]] * 3, [replace(sampled, seed=11 + j, n=1) for j in range(3)])]
    assert forks == singles and len({tuple(tokens) for tokens in forks}) > 1
    assert_clean(llm, tiny_qwen3_5)
    # LLM.generate: a prompt's n samples one after the other, among the other prompts' outputs.
    outputs = llm.generate([PROMPTS[1], PROMPTS[2]], [SamplingParams(max_new_tokens=MAX_NEW, n=2), sampled])
    assert [out.token_ids for out in outputs] == [expected[0]] * 2 + singles
    assert_clean(llm, tiny_qwen3_5)
