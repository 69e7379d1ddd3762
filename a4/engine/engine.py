"""Engine: requests in, tokens out, one transactional step at a time.

`Engine(config)` loads the checkpoint and builds the model runner (model_runner.py: the model, the memory plan, the
request slots, the KV pool and the state pool, the backends), the scheduler and the worker that turns a batch into
tokens (worker.py, or speculative_worker.py with `speculative_tokens=k`). One step, one way:

    Scheduler.schedule_next_batch --> Batch --> worker.launch --> ModelRunner.forward --> ForwardBatch --> model
        --> layers --> backends --> KV pool / state pool;  logits --> Sampler (on the device) --> LaunchedStep
    Scheduler.cache_prefill (what the prompts wrote, to the prefix cache)
    LaunchedStep.result --> Scheduler.process_batch_output (tokens booked, finishes)

With overlap scheduling (`EngineConfig.overlap_schedule`, on for CUDA) a step books the step launched before it, not
its own, so the host schedules step n + 1 and books step n - 1 while the device runs step n (mini-sglang's
`overlap_loop`, SGLang's `event_loop_overlap`): its decode tokens come from the device, and a finish is seen one step
late (scheduler.py).

`add_request` validates a request first: a bad one finishes at once with finish_reason "error" and never reaches the
model. A step that raises (an interrupted cell, a failing layer) aborts the requests it was running and leaves the
engine clean for the next call; a request whose logits cannot be sampled finishes alone with an error. An engine
serves one caller at a time: a call from another thread while it works, or from inside its own step (a forward
hook, a drafter), is refused with a RuntimeError; an abort from inside a step takes effect when the step is booked.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace

import torch

from a4.core import Batch, Req, SamplingParams
from a4.engine.tp_driver import TPDriver
from a4.engine.config import EngineConfig
from a4.engine.factories import create_prefix_cache
from a4.engine.grammar import grammar_error
from a4.engine.memory_plan import MemoryLedger, MemoryPlan
from a4.engine.model_runner import ModelRunner
from a4.engine.sampling import Sampler
from a4.engine.speculative_worker import SpeculativeWorker
from a4.engine.stats import EngineStats
from a4.engine.validation import check_sampling_params, prompt_error, sampling_error
from a4.engine.worker import LaunchedStep, ModelWorker
from a4.kvcache.radix_cache import NoPrefixCache
from a4.models.registry import load_model
from a4.scheduler.cache import CacheManager
from a4.scheduler.scheduler import Scheduler
from a4.speculative.drafter import Drafter, MTPDrafter, load_mtp_module

__all__ = ["Engine", "EngineConfig", "EngineStats", "check_sampling_params"]


class Engine:
    def __init__(self, config: EngineConfig, *, progress: bool = False, drafter: Drafter | None = None) -> None:
        """`drafter`: what proposes the drafts of speculative decoding (config.speculative_tokens > 0); None: the
        checkpoint's MTP module (Qwen3.5)."""
        self.config = config
        # Tensor parallelism: the other ranks start first and load their shares while this process loads its own.
        self.tp = TPDriver(config) if config.tensor_parallel_size > 1 else None
        try:
            self._build(config, progress, drafter)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig, progress: bool, drafter: Drafter | None) -> None:
        tp = self.tp
        shard = None if tp is None else tp.shard
        self.model_config, model, self.load_report = load_model(
            config.model_dir,
            dtype=config.torch_dtype,
            device=config.torch_device,
            progress=progress,
            merge_projections=config.merge_projections,
            shard=shard,
            load_format=config.load_format,
        )
        mtp = None
        if config.speculative_tokens and drafter is None:
            mtp = load_mtp_module(config, self.model_config, model, shard)
        if drafter is not None and not config.speculative_tokens:
            raise ValueError("a drafter was given but speculative_tokens is 0: set speculative_tokens=k to use it")
        draft_kv_layers = len(mtp.layers) if mtp is not None else getattr(drafter, "kv_layers", 0)
        # Each rank plans and pools its own share; rank 0 serves the whole model's vocabulary and requests.
        runner_config = self.model_config if tp is None else tp.rank_config
        self.runner = ModelRunner(config, runner_config, model, draft_kv_layers, tp)
        if tp is not None:
            tp.serve(self.runner, load_mtp=mtp is not None)
            mtp = mtp if mtp is None else tp.mirror(mtp, "mtp")
        runner = self.runner
        # A verify step writes its k drafts' positions even when it keeps none of them: they are reserved too.
        lookahead = runner.tokens_per_decode - 1
        prefix_cache = create_prefix_cache(config, self.model_config, runner.state_pool)
        # A fork's copy of a partial page is made on every rank (the other pools' operations are mirrored in the runner).
        kv_copies = runner.kv_pool if tp is None else tp.mirror_kv_copies(runner.kv_pool)
        self.cache_manager = CacheManager(
            runner.allocator, prefix_cache, runner.table_manager, runner.state_pool, lookahead, kv_copies
        )
        self.scheduler = Scheduler(
            runner.table_manager,
            self.cache_manager,
            max_prefill_tokens=config.max_prefill_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            decode_tokens_per_step=runner.tokens_per_decode,
            enable_mixed_chunk=config.enable_mixed_chunk,
            captured_prefill=runner.graph_runner.takes_prefill if runner.graph_runner is not None else None,
        )
        self.sampler = Sampler(runner.device, self.model_config.vocab_size, self.model_config.eos_token_ids)
        if config.speculative_tokens:
            drafter = drafter or MTPDrafter(mtp, runner)
            keep = self.scheduler.keep_tokens
            self.worker = SpeculativeWorker(runner, self.sampler, drafter, config.speculative_tokens, keep)
        else:
            self.worker = ModelWorker(runner, self.sampler)
        # The longest request a prompt may start: every position a decode step may write must fit the context.
        self.max_context_len = runner.max_context_len - lookahead
        self.stats = EngineStats()
        self._next_uid = 0
        self._owner: threading.Thread | None = None  # the thread inside a call, while one runs
        self._in_step = False
        self._deferred_aborts: list[tuple[Req, str | None]] = []
        # Overlap scheduling: the step launched by the last call, booked by the next one.
        self._in_flight: LaunchedStep | None = None

    def close(self) -> None:
        """Stop a tensor-parallel engine's worker processes (nothing to do for one process); safe to call twice."""
        if self.tp is not None:
            self.tp.shutdown()

    # The runner's parts, where notebooks and tests look at them.
    model = property(lambda self: self.runner.model)
    kv_pool = property(lambda self: self.runner.kv_pool)
    state_pool = property(lambda self: self.runner.state_pool)
    table_manager = property(lambda self: self.runner.table_manager)
    graph_runner = property(lambda self: self.runner.graph_runner)
    drafter = property(lambda self: getattr(self.worker, "drafter", None))

    @property
    def ledger(self) -> MemoryLedger:
        return self.runner.ledger

    @property
    def memory_plan(self) -> MemoryPlan:
        return self.runner.memory_plan

    @contextmanager
    def serving(self) -> Iterator[None]:
        """Hold the engine for one caller: refuse another thread while a call runs, and any call from inside a step
        (its state is half-updated there). Calls nest within one thread outside a step (generate -> run -> step)."""
        me = threading.current_thread()
        if self._owner is not None and self._owner is not me:
            raise RuntimeError(
                f"this engine is serving another thread ({self._owner.name!r}): an Engine (and an LLM) is not "
                "thread-safe and serves one thread at a time; use one per thread, or serialise the calls"
            )
        if self._in_step:
            raise RuntimeError(
                "re-entrant call into the engine from inside its own step (a forward hook, a drafter): the step's "
                "requests are half-updated there; call it after the step returns"
            )
        outermost = self._owner is None
        self._owner = me
        try:
            yield
        finally:
            if outermost:
                self._owner = None

    def add_request(self, input_ids: list[int], sampling_params: SamplingParams) -> Req:
        """Queue a request; a request that can never run comes back already finished, with its error.

        `sampling_params` of another type is a TypeError (a caller's mistake, not a request's): nothing is queued.
        """
        check_sampling_params(sampling_params)
        if sampling_params.n != 1:
            raise ValueError(f"n = {sampling_params.n} samples are n requests: use add_parallel_requests")
        with self.serving():
            req = self._new_request(input_ids, sampling_params)
            if not req.finished:
                self.sampler.add_req(req)
                self.scheduler.add_req(req)
            return req

    def add_parallel_requests(self, input_ids: list[int], sampling_params: SamplingParams) -> list[Req]:
        """Queue the `sampling_params.n` samples of one prompt (vLLM's parallel sampling), one request each. The
        prompt is prefilled once, by the first; the others fork from it when its last prefill step is launched:
        they draw their first tokens from its logits, share its KV pages, and get a copy of its Gated DeltaNet state
        each (`CacheManager.fork`). With a seed, sample j draws with seed + j, as in vLLM. Aborting the first
        before it has forked aborts them all.

        On a speculative engine each sample prefills the prompt itself, as vLLM's parallel sampling does with every
        sample (its frontend fans a request out into n): a fork would need the drafter's state for its own first
        token, which differs from its parent's (the MTP module reads the token after each position)."""
        check_sampling_params(sampling_params)
        with self.serving():
            seed = sampling_params.seed
            reqs = [self._new_request(input_ids, sampling_params if seed is None else
                                      replace(sampling_params, seed=(seed + j) % 2**63))
                    for j in range(sampling_params.n)]  # fmt: skip
            if not reqs[0].finished:  # the same prompt and parameters: all are refused, or none
                for req in reqs:
                    self.sampler.add_req(req)
                if self.config.speculative_tokens:
                    for req in reqs:
                        self.scheduler.add_req(req)
                else:
                    self.scheduler.add_req(reqs[0], reqs[1:])
            return reqs

    def _new_request(self, input_ids: list[int], sampling_params: SamplingParams) -> Req:
        """A request of this engine, finished at once with its error if it can never run."""
        req = Req(uid=self._next_uid, input_ids=list(input_ids), sampling_params=sampling_params)
        self._next_uid += 1
        error = (
            self._prompt_error(req.input_ids)
            or self.sampling_error(sampling_params)
            or grammar_error(sampling_params, self.model_config)
        )
        if error is not None:
            req.finished, req.finish_reason, req.error = True, "error", error
            return req
        # Output stops at the context limit, like SGLang's clipping of max_tokens, so the reservation at
        # admission (prompt + max_new_tokens) can always be met by an otherwise idle engine.
        room = self.max_context_len - len(input_ids)
        if sampling_params.max_new_tokens > room:
            req.sampling_params = replace(sampling_params, max_new_tokens=room)
        return req

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether prompts can reuse cached prefixes (False when switched off, or for a hybrid model that refuses)."""
        return not isinstance(self.cache_manager.prefix_cache, NoPrefixCache)

    @property
    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: a request to run, or (overlap scheduling) a launched step to book."""
        return self.scheduler.has_unfinished_reqs or self._in_flight is not None

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that finished in it.

        Schedules and launches a batch, then books a launched one: this one, or under overlap scheduling the one the
        last call launched (a call with nothing new to launch books it too, so that stepping until no request is
        unfinished drains the engine). An exception escaping the step (KeyboardInterrupt included: a student
        interrupting a cell) aborts the requests of every batch not yet booked before it propagates: their states
        and KV may be half-advanced, so they can neither resume nor be cached (`Scheduler.abort_req`). The engine is
        then as if they had never been submitted.
        """
        with self.serving():
            in_flight, self._in_flight = self._in_flight, None
            start, self._in_step = time.perf_counter(), True
            batch = launched = None
            try:
                batch = self.scheduler.schedule_next_batch()
                if batch is None and in_flight is None and self.scheduler.has_unfinished_reqs:
                    # Admission reserves for the worst case and max_context_len fits the pool, so an idle engine can
                    # always admit the first waiting request: getting here means the bookkeeping is broken.
                    raise RuntimeError("the scheduler has unfinished requests but can run none of them")
                if batch is not None:
                    launched = self.worker.launch(batch)
                    self.scheduler.cache_prefill(batch)
                    self._count_launched(batch)
                keep = launched if self.config.overlap else None
                booked = [step for step in (in_flight, launched) if step is not None and step is not keep]
                finished = [req for step in booked for req in self._book(step)]
            except BaseException as e:
                for req in [*(in_flight.batch.booked_reqs if in_flight else []), *(batch.booked_reqs if batch else [])]:
                    error = f"the step running this request raised {type(e).__name__}: {e}"
                    self.scheduler.abort_req(req, "abort", error)
                    self.sampler.remove_req(req)
                raise
            finally:
                self._in_step = False
                aborts, self._deferred_aborts = self._deferred_aborts, []
            self._in_flight = keep
            self._record(batch if batch is not None else in_flight.batch if in_flight else None,
                         time.perf_counter() - start)  # fmt: skip
            for req, error in aborts:
                if not req.finished:
                    self.abort_req(req, error)
                    finished.append(req)
            return finished

    def _prompt_error(self, input_ids: list[int]) -> str | None:
        return prompt_error(input_ids, self.model_config, self.max_context_len, self.memory_plan.num_tokens)

    def sampling_error(self, params: SamplingParams) -> str | None:
        return sampling_error(params, self.model_config, self.memory_plan.max_running_requests)

    def _book(self, step: LaunchedStep) -> list[Req]:
        """Book a launched step with the scheduler: its tokens, its finishes."""
        next_tokens, errors = step.result()
        # A step that computed logprobs books them with the tokens the booking keeps: each output's length before.
        output_lens = [len(req.output_ids) for req in step.batch.booked_reqs] if step.has_logprobs else None
        finished = self.scheduler.process_batch_output(step.batch, next_tokens, errors)
        if output_lens is not None:
            step.book_logprobs(output_lens)
        self.worker.booked(step)
        for req in finished:
            self.sampler.remove_req(req)
            self.stats.cached_tokens += req.prefix_hit_len
        self._count_booked(step, next_tokens)
        return finished

    def abort_req(self, req: Req, error: str | None = None) -> None:
        """Stop an unfinished request wherever it is (finish_reason "abort"); its slot, pages and lock are freed and
        nothing it computed is cached. A finished request is left as it is. From inside a step (a hook), the abort
        waits for the step to be booked."""
        if self._in_step:
            self._deferred_aborts.append((req, error))
            return
        with self.serving():
            if not req.finished:
                self.scheduler.abort_req(req, "abort", error)
                self.sampler.remove_req(req)

    def finish_req(self, req: Req, reason: str = "stop") -> None:
        """Finish a decoding request now, as at an end-of-sequence token (its KV and state enter the prefix cache, so
        the next turn of its conversation reuses them): a stop condition its caller found between two steps."""
        with self.serving():
            self.scheduler.finish_req(req, reason)
            self.sampler.remove_req(req)
            self.stats.cached_tokens += req.prefix_hit_len

    def _record(self, batch: Batch | None, seconds: float) -> None:
        """Count a step call's wall time, as the kind of step it launched (or booked, launching none)."""
        if batch is not None:
            stats = self.stats
            if batch.phase in ("decode", "verify"):
                stats.decode_seconds += seconds
            else:
                stats.prefill_seconds += seconds

    def _count_launched(self, batch: Batch) -> None:
        """Count a step as it is launched (what ran): a mixed step counts as a prefill step, and apart."""
        stats = self.stats
        if batch.phase in ("decode", "verify"):
            stats.decode_steps += 1
            stats.decode_request_steps += len(batch.reqs)
        else:
            stats.prefill_steps += 1
            stats.prefill_tokens += sum(n for n, decode in zip(batch.extend_lens, batch.decode_rows) if not decode)
            stats.mixed_steps += batch.phase == "mixed"

    def _count_booked(self, step: LaunchedStep, next_tokens: list) -> None:
        """Count the tokens a booked step's decoding requests gained: more than one each with drafts."""
        stats, batch = self.stats, step.batch
        gained = sum(len(t) if isinstance(t, list) else 1 for t, d in zip(next_tokens, batch.decode_rows) if d)
        if batch.phase in ("decode", "verify"):
            stats.decode_tokens += gained
        else:
            stats.mixed_decode_tokens += gained
        stats.draft_tokens += step.draft_tokens
        stats.accepted_draft_tokens += step.accepted_draft_tokens

    def run(self, reqs: list[Req]) -> None:
        """Step until every one of reqs has finished (each must come from this engine's `add_request`)."""
        with self.serving():
            for req in reqs:
                if req.owner is not self.scheduler and not (req.finished and req.owner is None):
                    raise ValueError(f"request {req.uid} was not submitted to this engine (another engine's, or made "
                                     "by hand): use this engine's add_request")
            while not all(req.finished for req in reqs):
                self.step()
            # Under overlap scheduling the last step launched may be left to book (its tokens dropped): an idle
            # engine holds no step.
            while self._in_flight is not None and not self.scheduler.has_unfinished_reqs:
                self.step()
