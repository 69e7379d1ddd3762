"""Property test (hypothesis) of the pools, the prefix caches and the scheduler together, under a fake model.

Random chat-like workloads (a new prompt, or an earlier request's prompt + output + a new message), in rounds like
`generate` calls, run with random page sizes, slots, pool sizes, prefill budgets and the three prefix caches a model
can get: RadixCache (all-attention), HybridRadixCache ("checkpoint") and NoPrefixCache ("refuse"). The fake model
writes at each KV location the token prefix its KV would encode, and into a request's state slot a code for exactly
the tokens fed so far (the engine's rule: a request that starts from nothing starts from a cleared slot).

Before every forward: every stored position of a request holds its own prefix, and its state is the state after
exactly its cached tokens (so a hybrid hit landed on a checkpoint of exactly that length). After every step: a page
is free, in the tree or owned by one running request, never two of these, and the counts add up to the pool; the
slots too. After every round: the outputs are what the model computes without batching or caching, and all memory
is back (free, or held unlocked by the cache).
"""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from a4.checkpoints import preset_config
from a4.core import Req, SamplingParams
from a4.kvcache.allocator import PageAllocator
from a4.kvcache.hybrid_radix_cache import HybridRadixCache
from a4.kvcache.radix_cache import NoPrefixCache, RadixCache
from a4.kvcache.state_pool import StatePool
from a4.models.config import parse_config
from a4.scheduler.cache import CacheManager, pages_for
from a4.scheduler.scheduler import Scheduler
from a4.scheduler.table import TableManager

VOCAB, EOS = 5, 0
TINY_QWEN3_5 = parse_config(preset_config("qwen3_5", "tiny"))


def next_token(prefix: list[int]) -> int:
    return hash(tuple(prefix)) % VOCAB


def expected_output(prompt: list[int], max_new_tokens: int) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < max_new_tokens:
        out.append(next_token(ids))
        ids.append(out[-1])
        if out[-1] == EOS:
            break
    return out


class FakeEngine:
    """The scheduler, its caches and pools, and a model that only records what it would compute."""

    def __init__(self, kind: str, *, page_size: int, slots: int, num_pages: int, max_prefill_tokens: int,
                 max_checkpoints: int) -> None:
        self.kind, self.page_size, self.num_pages = kind, page_size, num_pages
        self.allocator = PageAllocator(num_pages, page_size)
        self.table = TableManager(slots, num_pages * page_size, "cpu")
        self.states = None if kind == "radix" else StatePool(TINY_QWEN3_5, slots, torch.float32, "cpu")
        if kind == "radix":
            self.cache = RadixCache(page_size)
        elif kind == "checkpoint":
            self.cache = HybridRadixCache(page_size, self.states, max_checkpoints)
        else:
            self.cache = NoPrefixCache(page_size)
        self.scheduler = Scheduler(
            self.table, CacheManager(self.allocator, self.cache, self.table),
            max_prefill_tokens=max_prefill_tokens, eos_token_ids=[EOS],
        )
        self.kv: dict[int, tuple[int, ...]] = {}  # location -> the token prefix its KV encodes
        self.codes: dict[tuple[int, ...], int] = {(): 0}  # a cleared state is the state after no tokens
        self.reqs: list[Req] = []

    def code(self, ids: list[int]) -> int:
        return self.codes.setdefault(tuple(ids), len(self.codes))

    def state(self, slot: int) -> int:
        return int(self.states.conv_state(0)[slot].flatten()[0])

    def generate(self, prompts: list[list[int]], max_new_tokens: int, interrupt_at: int | None = None) -> list[Req]:
        """Run the prompts to the end, or, with interrupt_at, until the model raises in that step of the call; then
        abort the call's requests as Engine.step and LLM.generate do."""
        reqs = [Req(len(self.reqs) + i, list(p), SamplingParams(max_new_tokens=max_new_tokens))
                for i, p in enumerate(prompts)]
        self.reqs += reqs
        for req in reqs:
            self.scheduler.add_req(req)
        steps = 0
        try:
            while not all(req.finished for req in reqs):
                self.step(interrupt=steps == interrupt_at)
                steps += 1
        except KeyboardInterrupt:
            for req in reqs:
                self.scheduler.abort_req(req)
        return reqs

    def step(self, interrupt: bool = False) -> None:
        batch = self.scheduler.schedule_next_batch()
        assert batch is not None, "stalled with unfinished requests"
        tokens = []
        for req, prefix_len, extend_len, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample):
            slot, start, end = req.slot, prefix_len, prefix_len + extend_len
            row = self.table.read(slot, 0, end).tolist()
            for pos in range(start):
                assert self.kv[row[pos]] == tuple(req.all_ids[: pos + 1]), f"req {req.uid}: KV of position {pos}"
            for pos in range(start, end):
                self.kv[row[pos]] = tuple(req.all_ids[: pos + 1])
            if self.states is not None:
                if start == 0:
                    self.states.clear([slot])
                assert self.state(slot) == self.code(req.all_ids[:start]), (
                    f"req {req.uid} resumes at {start} tokens from the state after other tokens"
                )
                self.states.conv_state(0)[slot] = self.code(req.all_ids[:end])
            tokens.append(next_token(req.all_ids[:end]) if sampled else None)
        if interrupt:
            # The forward has written KV and advanced states, but the step is never booked.
            for req in batch.reqs:
                self.scheduler.abort_req(req)
            raise KeyboardInterrupt
        self.scheduler.cache_prefill(batch)
        self.scheduler.process_batch_output(batch, tokens)
        self.check_memory()

    def check_memory(self) -> None:
        p = self.page_size
        tree = []
        stack = list(self.cache.root.children.values()) if isinstance(self.cache, RadixCache) else []
        while stack:
            node = stack.pop()
            tree += [loc // p for loc in node.value.tolist()[::p]]
            stack.extend(node.children.values())
        running = [req for req in self.reqs if req.admitted]
        owned = []
        for req in running:
            # [0, handle) is the tree's (locked); the rest of the pages allocated so far are the request's own.
            held = req.cache_handle.cached_len if req.cache_handle is not None else 0
            owned += [loc // p for loc in self.table.read(req.slot, held, pages_for(req.computed_len, p) * p)][::p]
        assert len(set(tree)) == len(tree) and len(set(owned)) == len(owned) and not set(tree) & set(owned), (
            "a page owned twice"
        )
        assert self.allocator.num_free_pages + len(owned) + len(tree) == self.num_pages
        assert self.cache.evictable_size + self.cache.protected_size == p * len(tree)
        assert self.table.available_size + len(running) == self.table.max_running_requests
        # The admission policy's promise, recomputed: each admitted request's worst case less the pages it holds.
        max_stored = [len(req.input_ids) + req.sampling_params.max_new_tokens - 1 for req in running]
        promised = [pages_for(n, p) - pages_for(req.kv_allocated_len, p) for n, req in zip(max_stored, running)]
        assert self.scheduler.cache_manager.reserved_pages == sum(promised), "pages promised at admission miscounted"


@st.composite
def workloads(draw) -> list[list[list[int]]]:
    """Rounds of prompts: each a new prompt, or an earlier request's prompt + output + a new message."""
    # Two continuations for one new prompt: continuations are what hit the cache.
    parent = st.none() | st.integers(0, 20) | st.integers(0, 20)
    turn = st.tuples(parent, st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=8))
    return draw(st.lists(st.lists(turn, min_size=1, max_size=3), min_size=2, max_size=4))


@settings(max_examples=60)
@given(
    kind=st.sampled_from(["radix", "checkpoint", "refuse"]),
    page_size=st.sampled_from([1, 2, 4]),
    slots=st.integers(1, 3),
    max_prefill_tokens=st.integers(1, 16),
    max_new_tokens=st.integers(1, 4),
    extra_pages=st.integers(0, 6),
    max_checkpoints=st.sampled_from([2, 4, 0, 1]),
    rounds=workloads(),
    interrupts=st.lists(st.none() | st.integers(0, 6), min_size=4, max_size=4),
)
def test_pages_slots_and_states_stay_consistent(
    kind, page_size, slots, max_prefill_tokens, max_new_tokens, extra_pages, max_checkpoints, rounds, interrupts
):
    """Rounds of requests, some interrupted at a step (then aborted): every later round is still served right."""
    # The prompts, built with the outputs the model computes on its own (what the engine must reproduce).
    history: list[list[int]] = []  # each request's prompt + output
    prompts = []
    for round_ in rounds:
        prompts.append([(history[parent % len(history)] if parent is not None and history else []) + tokens
                        for parent, tokens in round_])
        history += [prompt + expected_output(prompt, max_new_tokens) for prompt in prompts[-1]]
    # A pool for the longest request and a few pages more: requests wait for memory and evict the cache.
    longest = max(len(prompt) for round_ in prompts for prompt in round_) + max_new_tokens
    engine = FakeEngine(kind, page_size=page_size, slots=slots, num_pages=pages_for(longest, page_size) + extra_pages,
                        max_prefill_tokens=max_prefill_tokens, max_checkpoints=max_checkpoints)
    for round_, interrupt_at in zip(prompts, interrupts):
        reqs = engine.generate(round_, max_new_tokens, interrupt_at)
        for prompt, req in zip(round_, reqs):
            if req.finish_reason == "abort":
                event("a request aborted by an interrupted step")
                assert req.slot is None and req.cache_handle is None
                continue
            assert req.output_ids == expected_output(prompt, max_new_tokens), f"req {req.uid}"
            if req.prefix_hit_len:
                event(f"{kind}: a prefix hit")
        if kind == "refuse":
            assert all(req.prefix_hit_len == 0 for req in reqs)
        assert engine.cache.protected_size == 0
        assert engine.allocator.num_free_pages + engine.cache.evictable_size // page_size == engine.num_pages
        assert engine.table.available_size == slots


@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=12), st.data())
def test_a_requests_ids_between_two_positions_are_its_prompt_and_output_sliced(prompt, output, data):
    req = Req(uid=0, input_ids=prompt, sampling_params=SamplingParams())
    req.output_ids = output
    start = data.draw(st.integers(0, len(prompt) + len(output) + 2))
    stop = data.draw(st.integers(start, len(prompt) + len(output) + 4))
    assert req.ids_between(start, stop) == (prompt + output)[start:stop]
