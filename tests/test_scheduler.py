"""Request slots, page allocation and the scheduler, driven by a fake model (no weights needed).

The fake model stands for the KV pool: at each location it writes the whole token prefix that the real KV there
would encode (a token's KV depends on every token before it). Before every step the test checks, for every request
in the batch, that each of its stored positions maps to a location holding exactly its own prefix: a page freed too
early, shared wrongly or overwritten shows up at once. Its next token is a hash of the prefix, so a request's output
does not depend on batching or caching, and the expected outputs are computed here without the scheduler.
"""

from __future__ import annotations

import random

import pytest
import torch

from a4.core import Batch, Req, SamplingParams
from a4.kvcache.allocator import OutOfPagesError, PageAllocator
from a4.kvcache.radix_cache import NoPrefixCache, RadixCache
from a4.scheduler.cache import CacheManager
from a4.scheduler.scheduler import Scheduler
from a4.scheduler.table import TableManager

VOCAB = 50
EOS = 0


def next_token(prefix: list[int]) -> int:
    return hash(tuple(prefix)) % VOCAB


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def expected_output(prompt: list[int], params: SamplingParams) -> list[int]:
    ids, out = list(prompt), []
    while len(out) < params.max_new_tokens:
        token = next_token(ids)
        out.append(token)
        ids.append(token)
        if token == EOS and not params.ignore_eos:
            break
    return out


class FakeModelRun:
    def __init__(self, *, num_pages: int, page_size: int, slots: int, budget: int, prefix_cache: bool = True,
                 mixed: bool = False):  # fmt: skip
        self.allocator = PageAllocator(num_pages, page_size)
        self.table = TableManager(slots, max_context_len=num_pages * page_size, device="cpu")
        cache = RadixCache(page_size) if prefix_cache else NoPrefixCache(page_size)
        self.cache_manager = CacheManager(self.allocator, cache, self.table)
        self.scheduler = Scheduler(self.table, self.cache_manager, max_prefill_tokens=budget, eos_token_ids=[EOS],
                                   enable_mixed_chunk=mixed)  # fmt: skip
        self.pool: dict[int, tuple[int, ...]] = {}
        self.batches: list[Batch] = []
        self.uid = 0

    def add(self, prompt: list[int], params: SamplingParams) -> Req:
        req = Req(uid=self.uid, input_ids=list(prompt), sampling_params=params)
        self.uid += 1
        self.scheduler.add_req(req)
        return req

    def step(self) -> list[Req]:
        batch = self.scheduler.schedule_next_batch()
        assert batch is not None, "stalled with unfinished requests"
        self.batches.append(batch)
        tokens = []
        for req, prefix_len, extend_len, sampled in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.sample):
            row = self.table.req_to_token[req.slot]
            for pos in range(prefix_len):
                assert self.pool[int(row[pos])] == tuple(req.all_ids[: pos + 1]), f"req {req.uid} pos {pos}"
            for pos in range(prefix_len, prefix_len + extend_len):
                self.pool[int(row[pos])] = tuple(req.all_ids[: pos + 1])
            tokens.append(next_token(req.all_ids[: prefix_len + extend_len]) if sampled else None)
        self.scheduler.cache_prefill(batch)
        return self.scheduler.process_batch_output(batch, tokens)

    def run(self, reqs: list[Req]) -> None:
        while not all(r.finished for r in reqs):
            self.step()

    def assert_no_leak(self) -> None:
        """Idle: every page is either free or held by the (unlocked) prefix cache."""
        prefix_cache = self.cache_manager.prefix_cache
        assert prefix_cache.protected_size == 0
        cached_pages = prefix_cache.evictable_size // self.allocator.page_size
        assert self.allocator.num_free_pages + cached_pages == self.allocator.num_pages
        assert self.table.available_size == self.table.max_running_requests


# --------------------------------------------------------------------------------------------- table and allocator


def test_table_manager_hands_out_frees_and_reuses_rows():
    table = TableManager(3, max_context_len=8, device="cpu")
    assert table.req_to_token.shape == (3, 8) and table.req_to_token.dtype == torch.int64
    rows = [table.allocate() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and table.available_size == 0
    with pytest.raises(RuntimeError, match="no free request slot"):
        table.allocate()
    table.free(rows[1])
    assert table.allocate() == rows[1]
    with pytest.raises(RuntimeError, match="not in use"):
        table.free(7)
    table.write(rows[0], 2, torch.tensor([5, 6, 7]))
    assert table.read(rows[0], 2, 5).tolist() == [5, 6, 7]


def test_page_allocator_counts_pages_and_their_locations():
    alloc = PageAllocator(num_pages=4, page_size=3)
    pages = alloc.allocate(3)
    assert len(set(pages.tolist())) == 3 and alloc.num_free_pages == 1
    locations = alloc.pages_to_locations(pages)
    assert locations.tolist() == [loc for p in pages.tolist() for loc in range(3 * p, 3 * p + 3)]
    with pytest.raises(OutOfPagesError):
        alloc.allocate(2)
    alloc.free_locations(locations[1:5])  # touches the first two pages only
    assert alloc.num_free_pages == 3
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(pages[:1])


# ------------------------------------------------------------------------------------------------------ scheduling


def chunk_plan(prompt_lens: list[int], budget: int) -> list[list[tuple[int, int]]]:
    """Independent model of chunked prefill (no cache, ample memory): per step, (request, tokens) in FCFS order."""
    remaining = list(prompt_lens)
    steps = []
    first = 0
    while first < len(remaining):
        left, step = budget, []
        for i in range(first, len(remaining)):
            if left == 0:
                break
            take = min(left, remaining[i])
            step.append((i, take))
            remaining[i] -= take
            left -= take
        first = next((i for i, r in enumerate(remaining) if r), len(remaining))
        steps.append(step)
    return steps


@pytest.mark.parametrize(
    "prompt_lens, budget",
    [([150], 64), ([10, 100, 5], 32), ([1, 1, 1], 1), ([63, 64, 65], 64), ([7, 7, 7, 7], 7), ([200, 3], 65)],
)
def test_prefill_chunks_follow_the_token_budget(prompt_lens, budget):
    run = FakeModelRun(num_pages=1024, page_size=1, slots=8, budget=budget, prefix_cache=False)
    rng = random.Random(0)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    reqs = [run.add(random_tokens(rng, n), params) for n in prompt_lens]
    prefill_steps = []
    while any(not r.finished for r in reqs):
        run.step()
        batch = run.batches[-1]
        if batch.phase == "prefill":
            prefill_steps.append(batch)
    expected = chunk_plan(prompt_lens, budget)
    assert [[(r.uid, n) for r, n in zip(b.reqs, b.extend_lens)] for b in prefill_steps] == expected
    # Sampled exactly when the request's prompt is complete.
    fed = [0] * len(prompt_lens)
    for batch, step in zip(prefill_steps, expected):
        for i, n in step:
            fed[i] += n
        assert batch.sample == [fed[i] == prompt_lens[i] for i, _ in step]
    assert [r.output_ids for r in reqs] == [expected_output(r.input_ids, params) for r in reqs]


def test_mixed_steps_carry_every_running_request_under_one_budget():
    """enable_mixed_chunk: a step with prompt tokens also feeds every running request its next token, all under the
    one token budget; outputs are the fake model's own, and nothing leaks."""
    run = FakeModelRun(num_pages=512, page_size=1, slots=4, budget=16, mixed=True)
    rng = random.Random(1)
    params = SamplingParams(max_new_tokens=6)
    reqs = [run.add(random_tokens(rng, rng.randrange(1, 40)), params) for _ in range(10)]
    running = []
    while not all(r.finished for r in reqs):
        running = [r for r in reqs if r.output_ids and not r.finished]
        run.step()
        batch = run.batches[-1]
        if batch.phase == "mixed":
            prompts = [r for r, decode in zip(batch.reqs, batch.decode_rows) if not decode]
            assert batch.reqs == prompts + running, "a mixed step runs its prompts, then every running request"
            assert batch.extend_lens[len(prompts) :] == [1] * len(running) and all(batch.sample[len(prompts) :])
        assert sum(batch.extend_lens) <= 16 or batch.phase == "decode"
    assert any(batch.phase == "mixed" for batch in run.batches)
    assert [r.output_ids for r in reqs] == [expected_output(r.input_ids, r.sampling_params) for r in reqs]
    run.assert_no_leak()


def test_steps_are_never_mixed_and_decode_runs_every_running_request():
    run = FakeModelRun(num_pages=512, page_size=1, slots=4, budget=16)
    rng = random.Random(1)
    params = SamplingParams(max_new_tokens=6)
    reqs = [run.add(random_tokens(rng, rng.randrange(1, 40)), params) for _ in range(10)]
    run.run(reqs)
    for batch in run.batches:
        assert batch.phase in ("prefill", "decode")
        if batch.phase == "decode":
            assert batch.extend_lens == [1] * len(batch.reqs) and all(batch.sample)
    assert max(len(b.reqs) for b in run.batches) <= 4
    assert [r.output_ids for r in reqs] == [expected_output(r.input_ids, r.sampling_params) for r in reqs]
    run.assert_no_leak()


def test_stops_at_eos_unless_ignored_and_at_max_new_tokens():
    # Find a prompt whose continuation hits EOS within 40 tokens.
    rng = random.Random(3)
    while True:
        prompt = random_tokens(rng, 5)
        free_run = expected_output(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        if EOS in free_run[:-1]:
            break
    run = FakeModelRun(num_pages=256, page_size=1, slots=4, budget=64)
    stop = run.add(prompt, SamplingParams(max_new_tokens=40))
    ignore = run.add(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
    short = run.add(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
    run.run([stop, ignore, short])
    assert stop.output_ids == free_run[: free_run.index(EOS) + 1] and stop.finish_reason == "eos"
    assert ignore.output_ids == free_run and ignore.finish_reason == "length"
    assert short.output_ids == free_run[:2] and short.finish_reason == "length"


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_shares_pages_and_reports_hits(page_size):
    run = FakeModelRun(num_pages=512 // page_size, page_size=page_size, slots=4, budget=32)
    rng = random.Random(4)
    system = random_tokens(rng, 21)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    first = run.add(system + [7, 8], params)
    run.run([first])
    followers = [run.add(system + random_tokens(rng, n), params) for n in (1, 5, 9)]
    run.run(followers)
    stored = first.all_ids[: len(first.all_ids) - 1]
    for req in followers:
        common = 0
        while common < len(stored) and common < len(req.input_ids) - 1 and stored[common] == req.input_ids[common]:
            common += 1
        assert req.prefix_hit_len == common - common % page_size
        assert req.output_ids == expected_output(req.input_ids, params)
    run.assert_no_leak()


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_short_memory_makes_requests_wait_and_evicts_the_cache(page_size, monkeypatch):
    # 48 tokens of KV; each request may need up to 12 + 6 - 1 = 17 tokens: a few at a time fit, not all 12.
    num_pages = 48 // page_size
    run = FakeModelRun(num_pages=num_pages, page_size=page_size, slots=6, budget=16)
    rng = random.Random(5)
    shared = random_tokens(rng, 6)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    reqs = [run.add((shared if i % 2 else []) + random_tokens(rng, rng.randrange(1, 7)), params) for i in range(12)]
    cache = run.cache_manager.prefix_cache
    evicted = []
    evict = cache.evict
    monkeypatch.setattr(cache, "evict", lambda n: evicted.append(n) or evict(n))
    running_max = 0
    while not all(r.finished for r in reqs):
        run.step()
        running_max = max(running_max, len(run.scheduler.decode_manager.running))
    assert 1 < running_max < len(reqs)
    assert sum(evicted) > 0, "the cache never had to give memory back"
    assert [r.output_ids for r in reqs] == [expected_output(r.input_ids, r.sampling_params) for r in reqs]
    run.assert_no_leak()


def test_random_traffic_keeps_every_row_consistent():
    rng = random.Random(6)
    run = FakeModelRun(num_pages=40, page_size=2, slots=3, budget=9)
    prefixes = [random_tokens(rng, rng.randrange(1, 12)) for _ in range(3)]
    reqs = []
    for _ in range(30):
        prompt = rng.choice(prefixes) + random_tokens(rng, rng.randrange(1, 10))
        reqs.append(run.add(prompt, SamplingParams(max_new_tokens=rng.randrange(1, 10))))
        if rng.random() < 0.5:
            run.step()
    run.run(reqs)
    assert [r.output_ids for r in reqs] == [expected_output(r.input_ids, r.sampling_params) for r in reqs]
    assert any(r.prefix_hit_len > 0 for r in reqs)
    run.assert_no_leak()
