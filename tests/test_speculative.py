"""Speculative decoding in the engine (a4/speculative, notebook 11): greedy speculative output = transformers' greedy
output, token by token, whatever the drafts.

An oracle drafter forces every acceptance pattern: its drafts are right for the first j tokens and wrong after, for
every j in 0..k, so every rollback length is exercised, on Qwen3 (KV only) and Qwen3.5 (KV and GDN states), with a
batch of several lengths, chunked prefill before decode, slot reuse, prefix-cache hits (both hybrid policies) and a
request finishing inside its draft. The real drafter, Qwen3.5's MTP module (dense and MoE), must give the same
tokens. A commit one position off must be caught: it is, against transformers.
"""

from __future__ import annotations

import random

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.checkpoints import tiny_checkpoint
from a4.engine.memory_plan import MemoryLedger
from a4.kvcache.state_pool import StatePool
from a4.reference import hf_greedy
from a4.speculative.drafter import OracleDrafter

MAX_NEW = 10
_rng = random.Random(13)
# Ids below 1000: the tiny checkpoints' stop tokens never appear inside a prompt.
PROMPTS = [[_rng.randrange(1000) for _ in range(n)] for n in (1, 5, 23, 40, 9, 17)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request, tiny_qwen3, tiny_qwen3_5):
    ckpt = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[request.param]
    return ckpt, hf_greedy(ckpt, PROMPTS, MAX_NEW)


def oracle(reference: list[list[int]], correct: int, prompts: list[list[int]] = PROMPTS) -> OracleDrafter:
    return OracleDrafter({tuple(p): out for p, out in zip(prompts, reference)}, correct=correct, vocab_size=1024)


@pytest.mark.parametrize(("k", "correct"), [(k, j) for k in (1, 3) for j in range(k + 1)])
def test_every_acceptance_length_gives_transformers_tokens(model, k, correct):
    ckpt, reference = model
    # 4 slots for 6 prompts (slots reused); prompts of 23 and 40 tokens prefill in chunks of 16.
    llm = LLM(ckpt, drafter=oracle(reference, correct), speculative_tokens=k, max_running_requests=4,
              max_prefill_tokens=16)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == reference
    stats = llm.stats
    assert stats.draft_tokens > 0
    # The oracle's first `correct` drafts are right and the next one wrong: exactly min(correct, k) accepted per
    # full-length draft (drafts are shorter only in a request's last steps).
    assert stats.acceptance_rate == pytest.approx(correct / k, abs=0.25)
    if correct == k:
        assert stats.acceptance_rate == 1.0
    if correct == 0:
        assert stats.acceptance_rate == 0.0 and stats.tokens_per_decode_step == 1.0
    else:
        assert stats.tokens_per_decode_step > 1.0


@pytest.mark.parametrize("correct", [0, 1, 2, 3])
def test_a_single_request_gives_transformers_tokens(model, correct):
    ckpt, reference = model
    llm = LLM(ckpt, drafter=oracle(reference, correct), speculative_tokens=3)
    assert [out.token_ids for out in llm.generate(PROMPTS[3:4], SamplingParams(max_new_tokens=MAX_NEW))] == reference[3:4]


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_hits_give_transformers_tokens(model, page_size):
    ckpt, reference = model
    llm = LLM(ckpt, drafter=oracle(reference, 1), speculative_tokens=2, max_running_requests=3, max_prefill_tokens=16,
              page_size=page_size)
    llm.generate(PROMPTS[2:4], SamplingParams(max_new_tokens=MAX_NEW))
    outputs = llm.generate(PROMPTS[1:4], SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == reference[1:4]
    assert all(out.cached_tokens > 0 for out in outputs[1:])


def test_hybrid_prefix_policies_give_transformers_tokens(tiny_qwen3_5):
    # A multi-turn chat: the next turn (prompt + answer + a new token) hits the checkpoint the first turn left where
    # it finished, a state that a verify step committed.
    reference = hf_greedy(tiny_qwen3_5, PROMPTS[2:4], MAX_NEW)
    follow_ups = [p + out + [7] for p, out in zip(PROMPTS[2:4], reference)]
    follow_ref = hf_greedy(tiny_qwen3_5, follow_ups, MAX_NEW)
    drafts = oracle(reference + follow_ref, 2, PROMPTS[2:4] + follow_ups)
    for policy in ("checkpoint", "refuse"):
        llm = LLM(tiny_qwen3_5, drafter=drafts, speculative_tokens=3, hybrid_prefix_policy=policy,
                  max_prefill_tokens=16)
        assert [o.token_ids for o in llm.generate(PROMPTS[2:4], SamplingParams(max_new_tokens=MAX_NEW))] == reference
        outputs = llm.generate(follow_ups, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outputs] == follow_ref
        hits = [o.cached_tokens for o in outputs]
        if policy == "checkpoint":
            assert hits == [len(p) + MAX_NEW - 1 for p in PROMPTS[2:4]]
        else:
            assert hits == [0, 0]


@pytest.mark.parametrize("correct", [0, 2, 3])
def test_a_stop_token_inside_a_draft_ends_the_request_there(model, correct):
    ckpt, reference = model
    # The stop token is the 4th output token: with drafts of 3 it can come inside an accepted draft, as the
    # model's own token, or not be reached by a rejected one. Nothing after it is kept.
    stop = reference[3][3]
    expected = [out[: out.index(stop) + 1] if stop in out else out for out in reference]
    llm = LLM(ckpt, drafter=oracle(reference, correct), speculative_tokens=3)
    llm.engine.scheduler.eos_token_ids = frozenset({stop})
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] == expected
    assert [out.finish_reason for out in outputs] == ["eos" if stop in out else "length" for out in reference]


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5])
def test_max_new_tokens_inside_a_draft(model, max_new_tokens):
    ckpt, reference = model
    llm = LLM(ckpt, drafter=oracle(reference, 3), speculative_tokens=3)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens))
    assert [out.token_ids for out in outputs] == [out[:max_new_tokens] for out in reference]
    # Drafts never run past what a request may still generate: its KV stays within its reservation.
    assert llm.engine.cache_manager.allocator.num_free_pages + llm.engine.cache_manager.prefix_cache.evictable_size \
        == llm.memory_plan.num_pages


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_the_mtp_drafter_gives_transformers_tokens(arch, k):
    """The checkpoint's own MTP module drafts (Qwen3.5-MoE's: its MoE layer, experts merged at load), for a batch of
    several lengths and for one request alone. Random weights draft nonsense: the acceptance is reported, not held
    to a target."""
    checkpoint = tiny_checkpoint(arch)
    reference = hf_greedy(checkpoint, PROMPTS, MAX_NEW)
    llm = LLM(checkpoint, speculative_tokens=k, max_running_requests=4, max_prefill_tokens=16)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    stats = llm.stats
    measured = f"{stats.draft_tokens} drafts, acceptance {stats.acceptance_rate:.2f}"
    assert [out.token_ids for out in outputs] == reference, measured
    assert stats.draft_tokens > 0, measured
    alone = LLM(checkpoint, speculative_tokens=k)
    assert alone.generate(PROMPTS[3:4], SamplingParams(max_new_tokens=MAX_NEW))[0].token_ids == reference[3], (
        f"one request: {alone.stats.draft_tokens} drafts, acceptance {alone.stats.acceptance_rate:.2f}"
    )


@pytest.mark.parametrize("off_by", [-1, 1])
def test_a_commit_one_position_off_is_caught(tiny_qwen3_5, monkeypatch, off_by):
    # The GDN state committed one token too short or too far: plausible tokens, and wrong ones. transformers says so.
    import a4.speculative.verify as verify  # the state pool's commit calls notebook 11's function by this name

    reference = hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)
    commit = verify.commit_verified_states_

    def off_by_one(conv, recurrent, conv_states, recurrent_states, slots, kept_lens):
        shifted = (kept_lens + off_by).clamp(1, conv_states.shape[1])
        commit(conv, recurrent, conv_states, recurrent_states, slots, shifted)

    monkeypatch.setattr(verify, "commit_verified_states_", off_by_one)
    llm = LLM(tiny_qwen3_5, drafter=oracle(reference, 1), speculative_tokens=2)
    outputs = llm.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW))
    assert [out.token_ids for out in outputs] != reference


def test_the_ledger_counts_the_mtp_kv_and_the_verify_states(tiny_qwen3_5):
    plain = LLM(tiny_qwen3_5).ledger
    k = 3
    llm = LLM(tiny_qwen3_5, speculative_tokens=k)
    config = llm.engine.model_config
    ledger = llm.ledger
    # From the config alone: one more attention layer's K and V per token; k + 1 states per slot while verifying.
    one_layer_kv = 2 * config.num_key_value_heads * config.head_dim * 4
    assert ledger.kv_bytes_per_token == plain.kv_bytes_per_token + one_layer_kv
    state = StatePool.bytes_per_slot(config, torch.float32)
    assert ledger.verify_bytes_per_slot == (k + 1) * state
    assert ledger.bytes_per_slot == plain.bytes_per_slot + (k + 1) * state
    assert llm.engine.kv_pool.num_layers == len(config.full_attention_layers) + 1
    assert "verify states" in llm.memory_plan.describe()
    assert isinstance(ledger, MemoryLedger)


def test_speculative_settings_are_checked(tiny_qwen3, tiny_qwen3_5):
    with pytest.raises(ValueError, match="speculative_tokens must be a non-negative integer"):
        LLM(tiny_qwen3_5, speculative_tokens=-1)
    with pytest.raises(ValueError, match="no MTP module"):
        LLM(tiny_qwen3, speculative_tokens=2)
    with pytest.raises(ValueError, match="speculative_tokens is 0"):
        LLM(tiny_qwen3_5, drafter=oracle([], 0))
    with pytest.raises(ValueError, match="state_fraction cannot be combined with speculative_tokens"):
        LLM(tiny_qwen3_5, speculative_tokens=1, state_fraction=0.5)

