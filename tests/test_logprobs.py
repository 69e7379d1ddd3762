"""Log-probabilities (SamplingParams.logprobs and prompt_logprobs) against transformers' log-softmax of its float32
logits along the same sequence: through every step loop (plain, overlap scheduling, mixed steps), chunked prefill, the
static-buffer runner (cuda_graphs=True runs it eagerly on the CPU), a sampled request (the logprobs are the model's
raw distribution, not the temperature's), and the prefix cache, which a request asking for prompt logprobs skips; a
speculative engine's verify steps, however many drafts they keep; each of n samples has its own and the prompt's."""

from __future__ import annotations

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.course.checks._harness import model_reduction_length, tolerance
from a4.models.config import load_model_config
from a4.reference import hf_greedy, hf_log_softmax
from a4.speculative.drafter import OracleDrafter
from test_fault_injection import assert_clean

PROMPTS = [list(range(3, 40)), [11, 12, 13, 14, 15], [7]]
MAX_NEW = 5
TOP = 3


def assert_logprobs_are_transformers(checkpoint_dir, prompt, output) -> None:
    """output's token and prompt logprobs = transformers' log-softmax along prompt + output, within float32's
    rounding of the logits (a log-softmax moves an error of the logits by at most twice as much)."""
    sequence = prompt + output.token_ids
    expected = hf_log_softmax(checkpoint_dir, sequence)
    reduction = model_reduction_length(load_model_config(checkpoint_dir), len(sequence))
    allowed = 2 * tolerance(torch.float32, reduction) * expected.abs().max().item()
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    entries = [*output.prompt_logprobs[1:], *output.logprobs]
    assert [entry.token_id for entry in entries] == sequence[1:]
    for position, entry in enumerate(entries):
        row = expected[position]
        assert abs(entry.logprob - row[entry.token_id].item()) <= allowed, (position, entry, row[entry.token_id])
        top_ids = [token for token, _ in entry.top]
        top_values = torch.tensor([value for _, value in entry.top])
        k = len(top_ids)
        torch.testing.assert_close(top_values, row.topk(k).values, atol=allowed, rtol=0)
        # Ties aside, the same tokens: each one's reference logprob is its value.
        torch.testing.assert_close(row[top_ids], top_values, atol=allowed, rtol=0)


LOOPS = {"plain": {}, "overlap": {"overlap_schedule": True}, "overlap-mixed": {"overlap_schedule": True,
         "enable_mixed_chunk": True}, "static-runner": {"cuda_graphs": True}}  # fmt: skip


@pytest.mark.parametrize("loop", LOOPS, ids=list(LOOPS))
def test_logprobs_and_prompt_logprobs_are_transformers_log_softmax(tiny_qwen3_5, loop):
    # A 16-token budget chunks the 37-token prompt over three steps, beside the others.
    llm = LLM(tiny_qwen3_5, max_running_requests=3, max_prefill_tokens=16, **LOOPS[loop])
    params = [SamplingParams(max_new_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=TOP),
              SamplingParams(max_new_tokens=MAX_NEW, logprobs=0, prompt_logprobs=1, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=0)]  # fmt: skip
    outputs = llm.generate(PROMPTS, params)
    for prompt, output, p in zip(PROMPTS, outputs, params):
        assert_logprobs_are_transformers(tiny_qwen3_5, prompt, output)
        assert len(output.logprobs) == len(output.token_ids)
        assert {len(entry.top) for entry in output.logprobs} == {p.logprobs}
        assert {len(entry.top) for entry in output.prompt_logprobs[1:]} <= {p.prompt_logprobs}
    assert_clean(llm, tiny_qwen3_5)


def test_prompt_logprobs_skip_the_prefix_cache_and_other_requests_compute_none(tiny_qwen3_5):
    llm = LLM(tiny_qwen3_5, max_prefill_tokens=16)
    prompt = PROMPTS[0]
    [plain] = llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))
    assert plain.logprobs is None and plain.prompt_logprobs is None
    # The same prompt again: cached, but its prompt logprobs need every position's logits.
    [scored] = llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, logprobs=1, prompt_logprobs=1))
    assert scored.cached_tokens == 0 and scored.token_ids == plain.token_ids
    assert_logprobs_are_transformers(tiny_qwen3_5, prompt, scored)
    # A request without prompt logprobs still hits what both left in the cache.
    [again] = llm.generate([prompt], SamplingParams(max_new_tokens=MAX_NEW))
    assert again.cached_tokens > 0 and again.token_ids == plain.token_ids
    assert_clean(llm, tiny_qwen3_5)


@pytest.mark.parametrize("loop", ["plain", "overlap"])
def test_each_of_n_samples_has_its_logprobs_and_the_prompts(tiny_qwen3_5, loop):
    """The n samples of a prompt fork from its one prefill: each gets the prompt logprobs that prefill scored, and
    the logprob of every token it drew (its first, drawn from its parent's logits, too)."""
    llm = LLM(tiny_qwen3_5, max_prefill_tokens=16, **LOOPS[loop])
    params = SamplingParams(max_new_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=1, temperature=1.0, seed=5, n=3)
    outputs = llm.generate([PROMPTS[0]], params)
    assert len(outputs) == 3 and len({tuple(out.token_ids) for out in outputs}) > 1
    for output in outputs:
        assert len(output.logprobs) == len(output.token_ids)
        assert_logprobs_are_transformers(tiny_qwen3_5, PROMPTS[0], output)
    assert_clean(llm, tiny_qwen3_5)


@pytest.mark.parametrize(("k", "correct"), [(2, 1), (3, 3), (2, 0)], ids=["one-right", "all-right", "none-right"])
def test_a_speculative_engine_gives_the_logprobs_of_every_token_it_kept(tiny_qwen3_5, k, correct):
    """A verify step keeps each request's accepted drafts and one token more: each kept token's logprob is the
    model's, as without drafts (vLLM's speculative decoding returns the target model's); the prompt's come from the
    prefill, chunked here, and a request that asks for none gets none."""
    continuations = dict(zip(map(tuple, PROMPTS), hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)))
    drafter = OracleDrafter(continuations, correct, load_model_config(tiny_qwen3_5).vocab_size)
    llm = LLM(tiny_qwen3_5, drafter=drafter, speculative_tokens=k, max_running_requests=3, max_prefill_tokens=16)
    params = [SamplingParams(max_new_tokens=MAX_NEW, logprobs=TOP, prompt_logprobs=TOP),
              SamplingParams(max_new_tokens=MAX_NEW, logprobs=1, prompt_logprobs=0, temperature=1.0, seed=3),
              SamplingParams(max_new_tokens=MAX_NEW)]  # fmt: skip
    outputs = llm.generate(PROMPTS, params)
    assert outputs[0].token_ids == continuations[tuple(PROMPTS[0])]
    for prompt, output, p in zip(PROMPTS[:2], outputs, params):
        assert len(output.logprobs) == len(output.token_ids) == MAX_NEW
        assert_logprobs_are_transformers(tiny_qwen3_5, prompt, output)
        assert {len(entry.top) for entry in output.logprobs} == {p.logprobs}
    assert outputs[2].logprobs is None and outputs[2].prompt_logprobs is None
    assert llm.engine.stats.accepted_draft_tokens > 0 or correct == 0
    assert_clean(llm, tiny_qwen3_5)
