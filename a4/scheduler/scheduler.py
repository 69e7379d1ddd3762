"""Scheduler: continuous batching. Every step it picks a batch, and after the forward it books the results.

Policy (mini-sglang's): prefill first. If any waiting request can make progress, the step is a prefill step (new
requests and chunks of long prompts, under the `max_prefill_tokens` budget); otherwise it is a decode step over all
running requests. A step is never mixed. Requests join as soon as a slot and memory allow and leave as soon as they
finish, so the batch changes from step to step (continuous batching). Admission and chunking rules are in
prefill.py, the memory states in cache.py.

A request finishes at an end-of-sequence token (unless `ignore_eos`) or after `max_new_tokens`; its slot is freed and
its KV goes to the prefix cache.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from a4.core import Batch, Req
from a4.scheduler.cache import CacheManager
from a4.scheduler.decode import DecodeManager
from a4.scheduler.prefill import PrefillManager
from a4.scheduler.table import TableManager


@contextmanager
def sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C (Kernel -> Interrupt) until the block is done, then raise it.

    Booking a step moves pages between a request and the radix tree in several statements; an interrupt between two
    of them would leave the two disagreeing on who owns a page. The forward, where nearly all the time goes, stays
    interruptible. Signal handlers can only be set from the main thread; elsewhere nothing is deferred.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        signal.raise_signal(signal.SIGINT)


class Scheduler:
    def __init__(
        self,
        table_manager: TableManager,
        cache_manager: CacheManager,
        *,
        max_prefill_tokens: int,
        eos_token_ids: Sequence[int],
        decode_tokens_per_step: int = 1,
    ) -> None:
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.table_manager = table_manager
        self.cache_manager = cache_manager
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prefill_manager = PrefillManager(cache_manager, table_manager)
        self.decode_manager = DecodeManager(cache_manager, decode_tokens_per_step)

    def add_req(self, req: Req) -> None:
        """Queue a validated request (see Engine.add_request) for prefill; a request already seen is refused."""
        if req.owner is not None or req.finished or req.admitted or req.computed_len or req.output_ids:
            where = "to another engine" if req.owner not in (None, self) else "already"
            state = "finished" if req.finished else f"submitted {where}"
            raise ValueError(f"request {req.uid} is {state}: a Req is submitted once; add a new request instead")
        req.owner = self
        self.prefill_manager.add_req(req)

    @property
    def has_unfinished_reqs(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    def schedule_next_batch(self) -> Batch | None:
        """The next step's batch, with KV locations allocated for all the tokens it writes; None if nothing can run.

        Nothing is booked until `process_batch_output`: if the step raises before that, its requests are still where
        they were (queued, or decoding) and `abort_req` can take them out.
        """
        reserved_pages = self.decode_manager.reserved_pages + self.prefill_manager.reserved_pages
        batch = (
            self.prefill_manager.schedule_next_batch(self.max_prefill_tokens, reserved_pages)
            or self.decode_manager.schedule_next_batch()
        )
        if batch is not None:
            self.cache_manager.allocate(batch.reqs, batch.extend_lens)
        return batch

    def process_batch_output(
        self,
        batch: Batch,
        next_tokens: Sequence[int | Sequence[int] | None],
        errors: Sequence[str | None] | None = None,
    ) -> list[Req]:
        """Book a finished forward: tokens now in the pool, sampled tokens (None where not sampled), finishes.

        A decode step that feeds several tokens per request (speculative decoding) gives each request a list of
        tokens, those its forward confirmed; each token kept commits one more fed position, and the list is cut
        after a token that finishes the request (`keep_tokens`). A request with an error (its logits could not be sampled) finishes
        alone with finish_reason "error", and nothing of this step's forward for it enters the prefix cache. Returns
        the requests that finished.
        """
        with sigint_deferred():
            return self._book(batch, next_tokens, errors or [None] * len(batch.reqs))

    def _book(self, batch: Batch, next_tokens: Sequence, errors: Sequence[str | None]) -> list[Req]:
        if batch.phase == "prefill":
            self.prefill_manager.book(batch)
        finished = []
        for req, extend_len, tokens, error in zip(batch.reqs, batch.extend_lens, next_tokens, errors):
            if error is not None:
                self.abort_req(req, "error", error)
                finished.append(req)
                continue
            tokens = self.keep_tokens(req, [] if tokens is None else [tokens] if isinstance(tokens, int) else tokens)
            # A decode step's positions are committed one per token kept (the rest were rejected drafts).
            req.computed_len += extend_len if batch.phase == "prefill" else len(tokens)
            for token in tokens:
                req.output_ids.append(token)
                req.finish_reason = self._finish_reason(req, token)
            # Share what this step wrote at once: a later request with the same prefix (even one arriving while this
            # prompt is still being chunked) skips it. A finished request leaves everything but its last sampled
            # token, whose KV was never written: the prefix of a multi-turn chat's next turn.
            if batch.phase == "prefill" or req.finish_reason is not None:
                self.cache_manager.cache_req(req)
            if req.finish_reason is not None:
                self._release(req)
                finished.append(req)
            elif batch.phase == "prefill" and tokens:
                self.decode_manager.add_req(req)
        return finished

    def keep_tokens(self, req: Req, tokens: Sequence[int]) -> list[int]:
        """The tokens req keeps of those offered in order: all of them, or up to the first that finishes it."""
        kept = []
        for token in tokens:
            kept.append(token)
            if self._finish_reason(req, token, len(req.output_ids) + len(kept)) is not None:
                break
        return kept

    def abort_req(self, req: Req, reason: str = "abort", error: str | None = None) -> None:
        """Take an unfinished request out wherever it is, with everything it holds, and caching nothing of it.

        Safe at any point of a step: a request admitted in a step that raised before being booked holds a slot, a
        lock on its cached prefix and pages for the step's tokens, and its state in the slot is ahead of its
        computed_len. All of it is given back, so the slot and the pages are clean for the next request.
        """
        if req.finished:
            return
        self.prefill_manager.remove_req(req)
        self.decode_manager.remove_req(req)
        req.finish_reason, req.error = reason, error
        self._release(req)

    def finish_req(self, req: Req, reason: str) -> None:
        """Finish a decoding request where it is, as an end-of-sequence token would: what it computed (everything but
        its last sampled token) enters the prefix cache with its state, unlike `abort_req`. For a stop condition found
        by the caller between two steps (the server's stop strings)."""
        if req not in self.decode_manager.running:
            raise ValueError(f"request {req.uid} is not decoding: only a request with output tokens can be finished")
        with sigint_deferred():
            req.finish_reason = reason
            self.cache_manager.cache_req(req)
            self._release(req)

    def _finish_reason(self, req: Req, token: int, num_output: int | None = None) -> str | None:
        """Why req finishes at `token`, its `num_output`-th output token (default: the tokens it has now)."""
        if token in self.eos_token_ids and not req.sampling_params.ignore_eos:
            return "eos"
        if (len(req.output_ids) if num_output is None else num_output) >= req.sampling_params.max_new_tokens:
            return "length"
        return None

    def _release(self, req: Req) -> None:
        req.finished = True
        self.decode_manager.remove_req(req)
        if req.admitted:
            self.cache_manager.release_req(req)
            self.table_manager.free(req.slot)
            req.slot = None
