"""Scheduler: continuous batching. Every step it picks a batch and launches it; after the forward it books the results.

Policy (mini-sglang's): prefill first. If any waiting request can make progress, the step carries prefill (new
requests and chunks of long prompts, under the `max_prefill_tokens` budget); otherwise it is a decode step over all
running requests. With `enable_mixed_chunk` a prefill step also carries every running request's next token (a
"mixed" step, SGLang's mixed chunk), the prompts getting what the budget leaves, so that a long prompt no longer stops
every decode (except a prefill the model runner runs as a captured graph, which is cheaper alone); without it a
step is never mixed. Requests join as soon as a slot and memory allow and leave as soon as
they finish, so the batch changes from step to step (continuous batching). Admission and chunking rules are in
prefill.py, the memory states in cache.py.

A step's life, in the order the engine calls:
- `schedule_next_batch`: the batch, its KV locations allocated, and its requests advanced as launched: their fed
  lengths (`computed_len`), the prefill queue, prompts that sample joining the running requests;
- `cache_prefill`: once its forward is launched, what its prompts wrote goes to the prefix cache, and the other
  samples of a prompt that ends (n > 1) fork from it: they share its KV pages and copy its state
  (`CacheManager.fork`), having sampled their first tokens from its logits in the same step (`Batch.forks`);
- `process_batch_output`: its sampled tokens booked, finishes found (EOS unless `ignore_eos`, a stop token id,
  `max_new_tokens`), a
  finished request's KV handed to the prefix cache and its slot freed.
With overlap scheduling (engine.py) the next step is scheduled before this one is booked: its tokens are still on the
device (`Req.tokens_in_flight`), a request that will finish by length is not scheduled again, and a request whose
EOS is booked one step late had its extra token dropped here.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
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
        enable_mixed_chunk: bool = False,
        captured_prefill: Callable[[list[int], list[int]], bool] | None = None,
    ) -> None:
        """`captured_prefill(prefix_lens, extend_lens)`: whether the model runner runs such a prefill step as a
        captured graph (a4/engine/graph_runner.py's `takes_prefill`); a mixed step always runs eagerly, so such a
        prefill is not mixed: alone it costs the decodes about one captured step, mixed it would cost them an eager
        one."""
        if max_prefill_tokens <= 0:
            raise ValueError(f"max_prefill_tokens must be positive, got {max_prefill_tokens}")
        self.table_manager = table_manager
        self.cache_manager = cache_manager
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.enable_mixed_chunk = enable_mixed_chunk
        self.captured_prefill = captured_prefill
        self.prefill_manager = PrefillManager(cache_manager, table_manager)
        self.decode_manager = DecodeManager(decode_tokens_per_step)

    def add_req(self, req: Req, forks: Sequence[Req] = ()) -> None:
        """Queue a validated request (see Engine.add_request) for prefill; a request already seen is refused.
        `forks`: the other samples of its prompt (n > 1), which fork from it when its prefill is launched."""
        for one in (req, *forks):
            if one.owner is not None or one.finished or one.admitted or one.computed_len or one.output_ids:
                where = "to another engine" if one.owner not in (None, self) else "already"
                state = "finished" if one.finished else f"submitted {where}"
                raise ValueError(f"request {one.uid} is {state}: a Req is submitted once; add a new request instead")
        for one in (req, *forks):
            one.owner = self
        req.forks = list(forks)
        self.prefill_manager.add_req(req)

    @property
    def has_unfinished_reqs(self) -> bool:
        return self.prefill_manager.runnable or self.decode_manager.runnable

    def schedule_next_batch(self) -> Batch | None:
        """The next step's batch, with KV locations allocated for all the tokens it writes; None if nothing can run.

        Its requests are advanced as launched (the engine runs every batch it is given): if the step raises before it
        is booked, the engine aborts them (`abort_req`), which gives back everything they hold wherever they are.
        """
        decoding = self.decode_manager.decodable()
        budget = self.max_prefill_tokens - len(decoding)
        mixed = self.enable_mixed_chunk and decoding and budget > 0
        batch = None
        if self.prefill_manager.runnable:
            batch = self.prefill_manager.schedule_next_batch(budget if mixed else self.max_prefill_tokens)
        if batch is None:
            batch = self.decode_manager.batch(decoding)
        elif mixed and not self._runs_captured(batch):
            batch = Batch(
                reqs=batch.reqs + decoding,
                phase="mixed",
                extend_lens=batch.extend_lens + [1] * len(decoding),
                sample=batch.sample + [True] * len(decoding),
            )
        if batch is None:
            return None
        batch.prefix_lens = [req.computed_len for req in batch.reqs]
        rows = enumerate(zip(batch.reqs, batch.sample, batch.decode_rows))
        batch.forks = [(row, fork) for row, (req, sampled, decode) in rows
                       if sampled and not decode for fork in req.forks if not fork.finished]  # fmt: skip
        self.cache_manager.allocate(batch.reqs, batch.extend_lens)
        self._launch(batch)
        return batch

    def _runs_captured(self, batch: Batch) -> bool:
        prefix_lens = [req.computed_len for req in batch.reqs]
        return self.captured_prefill is not None and self.captured_prefill(prefix_lens, batch.extend_lens)

    def _launch(self, batch: Batch) -> None:
        """Advance the batch's requests as if its forward had run: the next batch may be scheduled before this one
        is booked. A verify step's positions are committed at booking, by the tokens kept."""
        for req, extend_len, sampled in zip(batch.reqs, batch.extend_lens, batch.sample):
            if batch.phase != "verify":
                req.computed_len += extend_len
            req.tokens_in_flight += sampled
        self.prefill_manager.launched(batch)
        for req, sampled, decode in zip(batch.reqs, batch.sample, batch.decode_rows):
            if sampled and not decode:
                self.decode_manager.add_req(req)
                req.forks = []
        for row, fork in batch.forks:
            fork.computed_len = len(fork.input_ids)
            fork.tokens_in_flight += 1
            self.decode_manager.add_req(fork)

    def cache_prefill(self, batch: Batch) -> None:
        """The batch's forward is launched: share what its prompts wrote at once, KV and (hybrid) the state after
        them, so that a later request with the same prefix (even one arriving while this prompt is still being
        chunked) skips it. Issued before the next step's forward, which may advance the same slots."""
        with sigint_deferred():
            for req, prefix_len, extend_len, decode in zip(
                batch.reqs, batch.prefix_lens, batch.extend_lens, batch.decode_rows
            ):
                if not decode and not req.finished:
                    self.cache_manager.cache_req(req, prefix_len + extend_len)
            for row in sorted({row for row, _ in batch.forks}):
                self.cache_manager.fork(batch.reqs[row], [fork for r, fork in batch.forks if r == row])

    def process_batch_output(
        self,
        batch: Batch,
        next_tokens: Sequence[int | Sequence[int] | None],
        errors: Sequence[str | None] | None = None,
    ) -> list[Req]:
        """Book a finished forward: sampled tokens (None where not sampled), finishes.

        A decode step that feeds several tokens per request (speculative decoding) gives each request a list of
        tokens, those its forward confirmed; each token kept commits one more fed position, and the list is cut
        after a token that finishes the request (`keep_tokens`). A request with an error (its logits could not be
        sampled) finishes alone with finish_reason "error", and nothing of this step's forward for it enters the
        prefix cache. A request that finished before this step was booked (aborted, or its EOS booked a step late
        under overlap scheduling) drops its token. Returns the requests that finished.
        """
        with sigint_deferred():
            return self._book(batch, next_tokens, errors or [None] * len(batch.booked_reqs))

    def _book(self, batch: Batch, next_tokens: Sequence, errors: Sequence[str | None]) -> list[Req]:
        finished = []
        for req, sampled, tokens, error in zip(batch.booked_reqs, batch.booked_sample, next_tokens, errors):
            if not sampled:
                continue  # a chunk: what it wrote was shared at launch (`cache_prefill`)
            req.tokens_in_flight -= 1
            if req.finished:
                continue
            if error is not None:
                self.abort_req(req, "error", error)
                finished.append(req)
                continue
            tokens = self.keep_tokens(req, [tokens] if isinstance(tokens, int) else tokens)
            if batch.phase == "verify":
                req.computed_len += len(tokens)
            for token in tokens:
                req.output_ids.append(token)
                req.finish_reason = self._finish_reason(req, token)
            if req.finish_reason is not None:
                # Everything but its last sampled token, whose KV was never written (or, under overlap, was written
                # by the step after, which this hands back unshared): the prefix of a multi-turn chat's next turn.
                self.cache_manager.cache_req(req, len(req.input_ids) + len(req.output_ids) - 1)
                self._release(req)
                finished.append(req)
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
        # Samples that have not forked from it yet cannot run without it.
        for fork in req.forks:
            self.abort_req(fork, reason, error)
        req.forks = []
        self.prefill_manager.remove_req(req)
        self.decode_manager.remove_req(req)
        req.finish_reason, req.error = reason, error
        self._release(req)

    def finish_req(self, req: Req, reason: str) -> None:
        """Finish a decoding request where it is, as an end-of-sequence token would: what it computed enters the prefix
        cache with its state, unlike `abort_req`. For a stop condition found by the caller between two steps (the
        server's stop strings). That is everything but its last sampled token, or under overlap scheduling, where the
        step in flight has fed that token too (its state is then past it), everything; the step's token is dropped."""
        if req not in self.decode_manager.running:
            raise ValueError(f"request {req.uid} is not decoding: only a request with output tokens can be finished")
        with sigint_deferred():
            req.finish_reason = reason
            self.cache_manager.cache_req(req, req.computed_len)
            self._release(req)

    def _finish_reason(self, req: Req, token: int, num_output: int | None = None) -> str | None:
        """Why req finishes at `token`, its `num_output`-th output token (default: the tokens it has now)."""
        if token in self.eos_token_ids and not req.sampling_params.ignore_eos:
            return "eos"
        if token in req.sampling_params.stop_token_ids:
            return "stop"
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
