"""The engine serving tiny Qwen3.5, token by token against transformers' greedy generation (a4.reference.hf_greedy).

The policies of notebook 05's checks (one request, one batch of 1 to 300-token prompts, chunked prefill cut off the
GDN chunk boundaries, slot reuse, slots poisoned with garbage) come from a4.course.checks.state_pool, and share one
set of reference generations per process (a4.course.checks.common); they run the engine with hybrid_prefix_policy="refuse" (the prefix
cache with saved states is notebook 07's, tested in its own files). Beyond them: the state a finished request leaves
in its slot equals transformers' cache, the "refuse" policy never reuses a cached prefix, the memory plan counts the
state, and a bfloat16 agreement floor.
"""

from __future__ import annotations

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.checkpoints import tiny_checkpoint
from a4.course.checks import common
from a4.course.checks import state_pool as checks
from a4.course.checks._harness import assert_close, model_reduction_length, tolerance
from a4.reference import hf_prefill_capture

# bfloat16: a floor, not a target (pytest -s prints the measured agreement).
BF16_MIN_AGREEING_FRACTION = 0.5


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def prompts(ckpt):
    return common.shared_prompts(ckpt)


@pytest.fixture(scope="module")
def reference(ckpt):
    return common.reference_tokens(ckpt)


def test_decode_single(ckpt, reference):
    checks.check_decode_single(ckpt)


def test_decode_varlen_in_one_batch(ckpt, reference):
    checks.check_decode_varlen(ckpt)


@pytest.mark.parametrize("budget", checks.CHUNK_BUDGETS)
def test_decode_chunked(ckpt, reference, budget):
    checks.check_decode_chunked(ckpt, budgets=[budget])


def test_decode_slot_reuse(ckpt, reference):
    checks.check_decode_slot_reuse(ckpt)


def test_state_poisoned(ckpt, reference):
    checks.check_state_poisoned(ckpt)


def test_finished_request_leaves_transformers_state_in_its_slot(ckpt, prompts):
    # The slot holds the state after every token fed: the prompt and all outputs but the last (never fed back).
    llm = LLM(ckpt, max_prefill_tokens=50)  # the 130-token prompt in three chunks
    engine = llm.engine
    req = engine.add_request(prompts[common.PROMPT_LENGTHS.index(130)], SamplingParams(max_new_tokens=4))
    slot = None
    while not req.finished:
        engine.step()
        slot = req.slot if req.admitted else slot
    fed = req.input_ids + req.output_ids[:-1]
    capture = hf_prefill_capture(ckpt, fed)
    gdn_captures = [layer for layer in capture.layers if layer.kind == "linear_attention"]
    pool = engine.state_pool
    assert len(gdn_captures) == pool.num_layers
    # The two differ in the order of float32 roundings (and GDN's chunked form), over every layer below the state.
    allowed = tolerance(torch.float32, model_reduction_length(engine.model_config, len(fed)))
    for k, layer in enumerate(gdn_captures):
        # transformers keeps the last `kernel` conv inputs; the pool keeps the last kernel - 1.
        assert_close(pool.conv_state(k)[slot], layer.conv_state[:, 1:], allowed, f"GDN layer {k}: conv state")
        assert_close(pool.recurrent_state(k)[slot], layer.recurrent_state, allowed, f"GDN layer {k}: recurrent state")


def test_refuse_policy_never_reuses_a_cached_prefix(ckpt, prompts, reference):
    # The same prompts twice: an all-attention model would serve all but one token of each from the radix cache.
    llm = LLM(ckpt, enable_prefix_cache=True, hybrid_prefix_policy="refuse")
    assert not llm.engine.prefix_cache_enabled
    picked = [common.PROMPT_LENGTHS.index(n) for n in (65, 130)]
    for _ in range(2):
        outputs = llm.generate([prompts[i] for i in picked], SamplingParams(max_new_tokens=common.MAX_NEW_TOKENS))
        assert [out.token_ids for out in outputs] == [reference[i] for i in picked]
        assert [out.cached_tokens for out in outputs] == [0, 0]
    assert llm.stats.cached_tokens == 0
    assert llm.stats.prefill_tokens == 2 * sum(len(prompts[i]) for i in picked)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_memory_plan_counts_the_state_of_every_slot(ckpt, dtype):
    llm = LLM(ckpt, dtype=dtype, max_running_requests=3)
    torch_dtype = getattr(torch, dtype)
    expected = common.expected_bytes_per_slot(common.read_config(ckpt), torch_dtype)
    assert llm.ledger.state_bytes_per_slot == expected
    pool = llm.engine.state_pool
    assert pool.num_slots == llm.memory_plan.max_running_requests == 3
    assert pool.total_bytes == 3 * expected
    assert pool.conv_state(0).dtype == torch_dtype and pool.recurrent_state(0).dtype == torch.float32


def test_all_attention_model_has_no_state_pool():
    llm = LLM(tiny_checkpoint("qwen3"))
    assert llm.engine.state_pool is None and llm.ledger.state_bytes_per_slot == 0


def test_bfloat16_agreement(ckpt):
    agreeing, total, identical, requests = checks.bfloat16_agreement(ckpt)
    print(f"\nbfloat16: {agreeing} of {total} tokens agree before the first difference; "
          f"{identical} of {requests} requests identical")
    assert agreeing >= BF16_MIN_AGREEING_FRACTION * total
