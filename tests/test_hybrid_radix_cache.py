"""The prefix cache of a hybrid model (notebook 07): Qwen3.5 with hybrid_prefix_policy "refuse" and "checkpoint".

Tokens are compared with transformers' greedy generation of each prompt alone; hit lengths with
`CheckpointRecord` (a4.course.checks.radix), a model of where the checkpoint policy stores states written from the
requests alone. The notebook's checks run here too, at page_size 1 and 16, then what they do not cover: the checks
catch the bugs users hit with hybrid prefix caches, the memory plan sets the checkpoints' bytes aside, KV pressure,
an all-attention model keeps the ordinary radix cache, and bad settings are refused.
"""

from __future__ import annotations

import random

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.checkpoints import tiny_checkpoint
from a4.course.checks import CheckFailed
from a4.course.checks import radix as checks
from a4.course.checks.common import expected_bytes_per_slot, read_config
from a4.engine.memory_plan import MemoryPlanError
from a4.kvcache.radix_cache import CacheHandle, MatchResult, RadixCache



def test_refuse_never_hits_and_matches_transformers(tiny_qwen3_5):
    checks.check_refuse(tiny_qwen3_5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_multi_turn_chat_hits_the_end_of_the_last_turn(tiny_qwen3_5, page_size):
    checks.check_checkpoint(tiny_qwen3_5, page_size=page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_hits_exactly_at_stored_checkpoints(tiny_qwen3_5, page_size):
    checks.check_hit_positions(tiny_qwen3_5, page_size=page_size)


def test_a_hit_copies_the_checkpoint_and_leaves_it_unchanged(tiny_qwen3_5):
    checks.check_immutable(tiny_qwen3_5)


def test_checkpoints_are_evicted_least_recently_used_first(tiny_qwen3_5):
    checks.check_eviction(tiny_qwen3_5)


def test_page_size_16_pauses_the_prefill_at_the_prompts_last_page_boundary(tiny_qwen3_5):
    # 40 tokens in pages of 16: the state after 40 tokens cannot be kept (its last page is partial), the one after
    # 32 can, if the prefill stops there; after 4 generated tokens the request has fed 43 tokens: not aligned either.
    llm = LLM(tiny_qwen3_5, page_size=16)
    prompt = checks.random_prompt(random.Random(8), checks.allowed_tokens(tiny_qwen3_5), 40)
    out = llm.generate([prompt], SamplingParams(max_new_tokens=4))[0]
    assert out.token_ids == checks.reference_tokens(tiny_qwen3_5, [prompt], 4)[0]
    assert llm.stats.prefill_steps == 2 and llm.stats.prefill_tokens == 40
    assert [tokens for tokens, _ in llm.engine.cache_manager.prefix_cache.checkpoints()] == [prompt[:32]]


def test_checkpoint_is_the_default_policy(tiny_qwen3_5):
    from a4.kvcache.hybrid_radix_cache import HybridRadixCache

    llm = LLM(tiny_qwen3_5)
    assert isinstance(llm.engine.cache_manager.prefix_cache, HybridRadixCache)
    assert llm.engine.prefix_cache_enabled
    assert not LLM(tiny_qwen3_5, hybrid_prefix_policy="refuse").engine.prefix_cache_enabled


# ------------------------------------------------------------------------------------ the checks catch known bugs


def _deepest_checkpoint_above(cache, node):
    while not node.is_root and node not in cache._checkpoints:
        node = node.parent
    return node


def hits_kv_without_state(base):
    """Bug 4: a hit as long as the KV match, resumed from the deepest checkpoint above it (a shorter state)."""

    class Cache(base):
        def match_prefix(self, token_ids):
            return RadixCache.match_prefix(self, token_ids)

        def restore_state(self, handle, slot):
            node = _deepest_checkpoint_above(self, handle.node)
            if not node.is_root:
                self.state_pool.restore(self._checkpoints[node], slot)

    return Cache


def never_hits(base):
    """Bug 5: a hybrid model that never reuses a prefix, though states were saved."""

    class Cache(base):
        def match_prefix(self, token_ids):
            return MatchResult(CacheHandle(0, self.root), torch.empty(0, dtype=torch.int64))

    return Cache


def saves_off_the_page_boundary(base):
    """Bug 3: a state saved on the node where the page-aligned KV ends, though it is the state after more tokens."""

    class Cache(base):
        def save_state(self, token_ids, slot):
            node, _ = self.match_node(token_ids)
            if not node.is_root and node not in self._checkpoints:
                self._checkpoints[node] = self.state_pool.save(slot)
                self._evict_checkpoints()

    return Cache


@pytest.mark.parametrize(
    "make_bug, check",
    [
        (hits_kv_without_state, lambda tiny_qwen3_5: checks.check_hit_positions(tiny_qwen3_5)),
        (never_hits, lambda tiny_qwen3_5: checks.check_checkpoint(tiny_qwen3_5)),
        (saves_off_the_page_boundary, lambda tiny_qwen3_5: checks.check_hit_positions(tiny_qwen3_5, page_size=16)),
    ],
    ids=["bug4-hit-without-state", "bug5-never-hits", "bug3-state-of-another-length"],
)
def test_the_checks_catch_the_bugs_users_hit(tiny_qwen3_5, monkeypatch, make_bug, check):
    import a4.kvcache.hybrid_radix_cache as module

    monkeypatch.setattr(module, "HybridRadixCache", make_bug(module.HybridRadixCache))
    with pytest.raises(CheckFailed, match="cached_tokens is"):
        check(tiny_qwen3_5)


# ----------------------------------------------------------------------------------------------------- memory


def float32_figures(tiny_qwen3_5) -> tuple[int, int, int]:
    """(state bytes, slot bytes, KV bytes per token) of the checkpoint in float32, from config.json."""
    raw = read_config(tiny_qwen3_5)
    text = raw["text_config"]
    state = expected_bytes_per_slot(raw, torch.float32)
    slot = state + text["max_position_embeddings"] * 8  # + its req_to_token row of int64 locations
    kv_per_token = text["layer_types"].count("full_attention") * 2 * text["num_key_value_heads"] * text["head_dim"] * 4
    return state, slot, kv_per_token


def test_memory_plan_sets_the_checkpoints_aside(tiny_qwen3_5):
    state, slot, kv_per_token = float32_figures(tiny_qwen3_5)
    # Three slots beside the KV of a full-length request (the plan's condition for a second slot) and 500 tokens.
    context = read_config(tiny_qwen3_5)["text_config"]["max_position_embeddings"]
    budget = 40 * state + 3 * slot + (context + 500) * kv_per_token
    llm = LLM(tiny_qwen3_5, memory_budget_bytes=budget, max_running_requests=3, max_state_checkpoints=10)
    plan = llm.memory_plan
    assert plan.budget_bytes == budget and plan.checkpoint_bytes == 10 * state
    assert plan.max_running_requests == 3
    assert plan.num_pages == (budget - 10 * state - 3 * slot) // kv_per_token
    assert plan.used_bytes <= budget and "state checkpoints 10" in plan.describe()
    # What the cache really holds stays within what the plan set aside.
    checks.play_chat(llm, checks.chat_workload(tiny_qwen3_5, conversations=3, turns=5))
    stored = llm.engine.cache_manager.prefix_cache.checkpoints()
    assert len(stored) == 10 and sum(saved.nbytes for _, saved in stored) <= plan.checkpoint_bytes
    for policy in [dict(hybrid_prefix_policy="refuse"), dict(enable_prefix_cache=False)]:
        assert LLM(tiny_qwen3_5, memory_budget_bytes=budget, **policy).memory_plan.checkpoint_bytes == 0


def test_a_budget_too_small_for_the_checkpoints_names_them(tiny_qwen3_5):
    state, _, _ = float32_figures(tiny_qwen3_5)
    with pytest.raises(MemoryPlanError, match="max_state_checkpoints=16"):
        LLM(tiny_qwen3_5, memory_budget_bytes=16 * state)


def test_hits_under_kv_pressure_land_on_stored_checkpoints():
    """A KV pool of 256 tokens for four conversations that end with ~350 distinct tokens: KV and its checkpoints
    are evicted. The model accepts 256 tokens, so that four slots fit beside one full-length request's KV."""
    ckpt = tiny_checkpoint("qwen3_5", max_position_embeddings=256)
    workload = checks.chat_workload(ckpt, conversations=4, turns=4, staggered=False)
    state, slot, kv_per_token = float32_figures(ckpt)
    budget = 16 * state + 4 * slot + 256 * kv_per_token
    llm = LLM(ckpt, memory_budget_bytes=budget, max_running_requests=4)
    assert llm.memory_plan.max_running_requests == 4
    played = checks.play_chat(llm, workload)
    reference = checks.reference_tokens(ckpt, [turn.prompt for turn in played])
    # The tokens a tree that evicted nothing would hold: the distinct prefixes of the conversations' last requests.
    last_turns = {turn.conversation: turn for turn in played}.values()
    fed = [turn.prompt + turn.output[:-1] for turn in last_turns]
    assert len({tuple(seq[:n]) for seq in fed for n in range(1, len(seq) + 1)}) > llm.memory_plan.num_tokens
    record = checks.CheckpointRecord()
    problems = []
    for round_ in range(workload.num_rounds):
        in_round = [i for i, turn in enumerate(played) if turn.round == round_]
        for i in in_round:
            turn, want = played[i], reference[i]
            allowed = {len(seq) for seq in record.stored if tuple(turn.prompt[: len(seq)]) == seq} | {0}
            if turn.cached_tokens not in allowed or turn.output != want:
                problems.append(f"conversation {turn.conversation}, turn {turn.turn}: hit {turn.cached_tokens} "
                                f"(stored: {sorted(allowed)}), tokens {turn.output} (transformers {want})")
        for i in in_round:
            record.store(played[i].prompt, reference[i], played[i].cached_tokens)
    assert not problems
    assert any(turn.cached_tokens for turn in played)
    cache = llm.engine.cache_manager.prefix_cache
    # Every checkpoint left sits on KV still in the tree.
    for tokens, _ in cache.checkpoints():
        assert RadixCache.match_prefix(cache, tokens).handle.cached_len == len(tokens)


# --------------------------------------------------------------------------------- all-attention models, settings


def test_all_attention_model_keeps_the_ordinary_radix_cache(tiny_qwen3):
    """Qwen3 hits wherever the KV matches, checkpoint or not: KV is all it needs."""
    from a4.reference import hf_greedy

    rng = random.Random(7)
    base = [rng.randrange(1000) for _ in range(50)]
    branch = base[:37] + [rng.randrange(1000) for _ in range(5)]
    llm = LLM(tiny_qwen3, hybrid_prefix_policy="checkpoint")
    assert type(llm.engine.cache_manager.prefix_cache) is RadixCache
    assert llm.memory_plan.checkpoint_bytes == 0
    params = SamplingParams(max_new_tokens=4)
    outputs = [llm.generate([prompt], params)[0] for prompt in (base, branch)]
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3, [base, branch], 4)
    assert [out.cached_tokens for out in outputs] == [0, 37]


def test_serving_qwen3_never_imports_the_hybrid_radix_cache(run_python):
    code = (
        "import sys\n"
        "from a4 import LLM\n"
        "from a4.checkpoints import tiny_checkpoint\n"
        "LLM(tiny_checkpoint('qwen3')).generate([[1, 2, 3]])\n"
        "assert 'a4.kvcache.hybrid_radix_cache' not in sys.modules\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    "setting, message",
    [
        (dict(hybrid_prefix_policy="sometimes"), "unknown hybrid_prefix_policy 'sometimes'"),
        (dict(hybrid_prefix_policy=None), "unknown hybrid_prefix_policy None"),
        (dict(max_state_checkpoints=-1), "max_state_checkpoints must be a non-negative integer, got -1"),
        (dict(max_state_checkpoints=2.5), "max_state_checkpoints must be a non-negative integer, got 2.5"),
        (dict(max_state_checkpoints=True), "max_state_checkpoints must be a non-negative integer, got True"),
    ],
)
def test_bad_settings_are_refused_by_name(tiny_qwen3_5, tiny_qwen3, setting, message):
    for model in (tiny_qwen3_5, tiny_qwen3):
        with pytest.raises(ValueError, match=message):
            LLM(model, **setting)


def test_no_checkpoints_means_no_hits(tiny_qwen3_5):
    llm = LLM(tiny_qwen3_5, max_state_checkpoints=0)
    assert llm.memory_plan.checkpoint_bytes == 0
    workload = checks.chat_workload(tiny_qwen3_5, conversations=1, turns=3)
    assert [turn.cached_tokens for turn in checks.play_chat(llm, workload)] == [0, 0, 0]
