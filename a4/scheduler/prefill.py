"""Prefill scheduling: which waiting requests enter the next step, and how many of their tokens.

`PrefillManager` keeps the queue of requests whose prompt is not fully prefilled; `PrefillAdder` fills one step
from it under a token budget (`max_prefill_tokens`), as in mini-sglang:

- Requests are taken in arrival order. The n samples of one prompt (n > 1) are admitted together, with their
  worst cases, and only the first is prefilled: the others fork from it (scheduler.py). The first one that cannot
  be admitted (no free slot, not enough memory) stops the step: letting later, smaller requests overtake it could
  starve it forever.
- A request whose remaining prompt exceeds the budget left gets only a chunk. It keeps its slot and its pages, is
  not sampled (its last prompt token has not been seen yet), and goes back to the front of the queue so that it
  resumes first in the next prefill step. Only the last request of a step is cut for the budget. A request is also
  cut where the prefix cache asks to pause it (`prefill_pause`: a hybrid model with page_size > 1 pauses at its
  prompt's last page boundary, the one place where it can save the prompt's state); it resumes like a chunk.

Admission policy (why decode never runs out of memory): a request is admitted only if the memory that can be made
available (free pages + evictable cache pages) covers its worst case, prompt + max_new_tokens, on top of the worst
case still outstanding for every request already admitted. Pages are then allocated step by step, evicting unlocked
cache entries when the free list runs short, and the reservation guarantees that this always succeeds: a running
request never has to be preempted. The price is admitting fewer requests when max_new_tokens is much larger than
what requests really generate; SGLang instead over-admits and retracts requests when decode runs out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a4.core import Batch, Req
from a4.scheduler.cache import CacheManager
from a4.scheduler.table import TableManager


@dataclass
class PrefillAdder:
    """Builds one prefill batch under a token budget and a memory reservation."""

    token_budget: int
    cache_manager: CacheManager
    table_manager: TableManager
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)

    def try_add(self, req: Req) -> bool:
        """Add req (or a chunk of it) to the step; False when the budget or the memory says stop."""
        if self.token_budget == 0:
            return False
        admitted = req.admitted
        if not admitted and not self._admit(req):
            return False
        extend_len = min(self.token_budget, req.extend_len)
        pause = self.cache_manager.prefill_pause(req)
        if req.computed_len < pause < req.computed_len + extend_len:
            extend_len = pause - req.computed_len
        self.token_budget -= extend_len
        self.reqs.append(req)
        self.extend_lens.append(extend_len)
        return True

    def _admit(self, req: Req) -> bool:
        """Give req a slot and its cached prefix if its worst case fits; otherwise leave everything as it was."""
        if self.table_manager.available_size < 1 + len(req.forks):
            return False
        match = self.cache_manager.match_req(req)
        # Lock before counting: the matched pages may be evictable now, and must not count as available to req.
        self.cache_manager.lock(match.handle)
        needed = self.cache_manager.pages_to_finish(req, match.handle.cached_len)
        fork_pages = [self.cache_manager.pages_to_fork(fork) for fork in req.forks]
        needed += sum(fork_pages)
        if needed + self.cache_manager.reserved_pages > self.cache_manager.available_pages:
            self.cache_manager.unlock(match.handle)
            return False
        req.slot = self.table_manager.allocate()
        req.computed_len = req.prefix_hit_len = req.kv_allocated_len = match.handle.cached_len
        req.cache_handle = match.handle
        self.table_manager.write(req.slot, 0, match.locations)
        try:
            self.cache_manager.give_state(req)
        except BaseException:
            # Not admitted after all: the request stays queued as it came, holding nothing.
            self.cache_manager.unlock(match.handle)
            self.table_manager.free(req.slot)
            req.slot, req.computed_len, req.prefix_hit_len, req.kv_allocated_len = None, 0, 0, 0
            req.cache_handle = None
            raise
        self.cache_manager.reserve(req, needed - sum(fork_pages))
        for fork, pages in zip(req.forks, fork_pages):
            # Held until the fork (Scheduler.cache_prefill): a slot, and the prefix hit's lock, as its parent's.
            fork.slot = self.table_manager.allocate()
            fork.computed_len = fork.prefix_hit_len = fork.kv_allocated_len = match.handle.cached_len
            fork.cache_handle = match.handle
            self.cache_manager.lock(match.handle)
            self.cache_manager.reserve(fork, pages)
        return True

    def batch(self) -> Batch:
        # Only a request that gets all of its remaining prompt tokens produces a token this step.
        sample = [n == req.extend_len for req, n in zip(self.reqs, self.extend_lens)]
        return Batch(reqs=self.reqs, phase="prefill", extend_lens=self.extend_lens, sample=sample)


@dataclass
class PrefillManager:
    cache_manager: CacheManager
    table_manager: TableManager
    # Waiting requests, in arrival order; a chunked request (already admitted) is always first.
    pending: list[Req] = field(default_factory=list)

    def add_req(self, req: Req) -> None:
        self.pending.append(req)

    def schedule_next_batch(self, token_budget: int) -> Batch | None:
        adder = PrefillAdder(token_budget, self.cache_manager, self.table_manager)
        for req in self.pending:
            if not adder.try_add(req):
                break
        if not adder.reqs:
            return None
        return adder.batch()

    def launched(self, batch: Batch) -> None:
        """The step `batch` (prefill or mixed) is launched: its chunked requests (not sampled) go to the front of the
        queue to resume first, its prompts that sample leave it. Its prompts are the first of the queue, in order."""
        prompts = [(req, sampled) for req, sampled, decode in zip(batch.reqs, batch.sample, batch.decode_rows)
                   if not decode]  # fmt: skip
        chunked = [req for req, sampled in prompts if not sampled]
        self.pending = chunked + self.pending[len(prompts) :]

    def remove_req(self, req: Req) -> None:
        """Take req out of the queue, if it is there."""
        if req in self.pending:
            self.pending.remove(req)

    @property
    def runnable(self) -> bool:
        return bool(self.pending)
