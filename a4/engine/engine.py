"""Engine: the model and its memory, driven one step at a time.

`Engine(config)` loads the checkpoint, plans memory (memory_plan.py), creates the pools and the scheduler. Each
`step()` asks the scheduler for a batch, turns it into the step's context, a ForwardBatch (flat tensors of the step's
new tokens, where their KV goes, each request's slot), runs the model, samples and hands the tokens back to the
scheduler. Decode steps on a GPU go through the DecodeGraphRunner (graph_runner.py): static buffers replayed as CUDA
graphs. What is built for which model (pools, prefix cache, attention backend) is chosen in factories.py. `add_request` validates a
request first: a bad one finishes at once with finish_reason "error" and never reaches the model. A step that raises
(an interrupted cell, a failing layer) aborts the requests it was running and leaves the engine clean for the next
call; a request whose logits cannot be sampled finishes alone with an error.

Hybrid models (config.is_hybrid, Qwen3.5) also keep a StatePool (notebook 05): the Gated DeltaNet states of every
request slot, indexed like `req_to_token` by the slot (`ForwardBatch.slots`). Its per-slot bytes go into the
memory plan, the pool is created by `create_state_pool`, cleared for each request that starts from nothing, and
handed to the model in the ForwardBatch. KV alone cannot resume a request at a cached position: its GDN layers need
the state after exactly that position. So a hybrid model's prefix cache follows `hybrid_prefix_policy`
(`create_prefix_cache`):
"checkpoint" keeps copies of states on the radix tree and hits only where one is kept (notebook 07), their bytes set
aside in the memory plan (`_checkpoint_bytes`); "refuse" never reuses a prefix.

Speculative decoding (`speculative_tokens=k`, notebook 11, `_run_speculative_batch`): a decode step asks the drafter
(a4/speculative/drafter.py: Qwen3.5's MTP module, or one given to the Engine) for up to k tokens per request, feeds
each request its last token and its drafts in one forward, and keeps the drafts that greedy verification accepts
plus the model's own next token. KV of rejected positions is simply overwritten later; GDN states cannot be cut, so
the verify pass keeps the state after every position (`VerifyStates`) and the engine commits the one after the last
token kept, before the scheduler books the step (and the prefix cache may checkpoint it). The draft's KV layer and
the verify states are in the memory plan.
"""

from __future__ import annotations

import itertools
import operator
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from a4.core import Batch, ForwardBatch, Req, SamplingParams, VerifyStates
from a4.dtypes import resolve_dtype
from a4.engine.factories import (
    check_mtp_drafts,
    create_attention_backend,
    create_kv_pool,
    create_prefix_cache,
    create_state_pool,
    keeps_state_checkpoints,
    state_bytes_per_slot,
)
from a4.engine.graph_runner import DecodeGraphRunner
from a4.engine.memory_plan import MemoryLedger, MemoryPlan, MemoryPlanError, default_budget_bytes, plan_memory
from a4.engine.sampling import Sampler
from a4.kvcache.allocator import PageAllocator
from a4.kvcache.radix_cache import NoPrefixCache
from a4.models.registry import load_model, usable_device
from a4.scheduler.cache import CacheManager
from a4.scheduler.scheduler import Scheduler
from a4.scheduler.table import TableManager
from a4.speculative.drafter import Drafter, MTPDrafter
from a4.speculative.verify import commit_verified_states_, greedy_accept

# How the prefix cache serves a hybrid model: "checkpoint" (hits only where a copy of the state was saved, notebook
# 07) or "refuse" (no hits at all: always correct, never faster).
HYBRID_PREFIX_POLICIES = ("checkpoint", "refuse")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, checked on construction (a bad value is a ValueError naming it)."""

    model_dir: str | Path
    dtype: str | torch.dtype = "float32"
    device: str | torch.device = "cpu"
    max_running_requests: int = 8
    max_prefill_tokens: int = 512
    page_size: int = 1
    enable_prefix_cache: bool = True
    memory_budget_bytes: int | None = None
    # Hybrid models: the largest share of the budget (of what the state checkpoints leave) that request slots, with
    # their states, may take, the rest going to KV pages (`plan_hybrid_memory`, notebook 06); None:
    # `max_running_requests` slots first (`plan_memory`).
    state_fraction: float | None = None
    # Hybrid models: how the prefix cache reuses prefixes (HYBRID_PREFIX_POLICIES), and under "checkpoint" how many
    # state checkpoints it keeps at most (least recently used evicted first; their bytes come out of the budget).
    hybrid_prefix_policy: str = "checkpoint"
    max_state_checkpoints: int = 16
    # Decode steps as CUDA graphs (graph_runner.py). None: on where CUDA is. False on CUDA: the same static-buffer
    # runner, not captured. True on the CPU: that runner too (nothing to capture), the GPU's decode path run eagerly.
    cuda_graphs: bool | None = None
    # Speculative decoding (a4/speculative, notebook 11): drafts per decode step, verified in one forward; 0: off.
    # Qwen3.5 drafts with its checkpoint's MTP module unless the Engine is given another drafter. Greedy only.
    speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {str(self.model_dir)!r} is not a directory")
        resolve_dtype(self.dtype)
        usable_device(self.device)
        for name in ("max_running_requests", "max_prefill_tokens", "page_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.memory_budget_bytes is not None and (
            not _is_int(self.memory_budget_bytes) or self.memory_budget_bytes <= 0
        ):
            raise ValueError(
                f"memory_budget_bytes must be a positive integer or None, got {self.memory_budget_bytes!r}"
            )
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(f"enable_prefix_cache must be True or False, got {self.enable_prefix_cache!r}")
        if self.state_fraction is not None and (
            isinstance(self.state_fraction, bool)
            or not isinstance(self.state_fraction, (int, float))
            or not 0 < self.state_fraction < 1
        ):
            raise ValueError(f"state_fraction must be a number in (0, 1) or None, got {self.state_fraction!r}")
        if self.hybrid_prefix_policy not in HYBRID_PREFIX_POLICIES:
            raise ValueError(
                f"unknown hybrid_prefix_policy {self.hybrid_prefix_policy!r} (expected one of {HYBRID_PREFIX_POLICIES})"
            )
        checkpoints = self.max_state_checkpoints
        if not _is_int(checkpoints) or checkpoints < 0:
            raise ValueError(f"max_state_checkpoints must be a non-negative integer, got {checkpoints!r}")
        if not _is_int(self.speculative_tokens) or self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be a non-negative integer, got {self.speculative_tokens!r}")
        if not (self.cuda_graphs is None or isinstance(self.cuda_graphs, bool)):
            raise ValueError(f"cuda_graphs must be True, False or None, got {self.cuda_graphs!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@contextmanager
def _sigint_deferred() -> Iterator[None]:
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


def _is_int(value: object) -> bool:
    # bool is an int in Python, but `page_size=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)


def check_sampling_params(params: object) -> None:
    if not isinstance(params, SamplingParams):
        raise TypeError(
            f"expected a4.SamplingParams, got {type(params).__name__} {params!r}: "
            "write SamplingParams(max_new_tokens=..., ...)"
        )


@dataclass
class EngineStats:
    """Counters since the engine was built; tokens are prompt tokens (prefill) or generated tokens (decode)."""

    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model
    cached_tokens: int = 0  # prompt tokens served by the prefix cache instead (counted when a request finishes)
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    # Speculative decoding: decode steps counted per request, drafts verified, drafts accepted.
    decode_request_steps: int = 0
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Of the drafted tokens, the share greedy verification accepted."""
        return self.accepted_draft_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_decode_step(self) -> float:
        """Tokens a request gains per decode step: 1 without speculation, up to k + 1 with it."""
        return self.decode_tokens / self.decode_request_steps if self.decode_request_steps else 0.0

    @property
    def steps(self) -> int:
        return self.prefill_steps + self.decode_steps

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Engine:
    def __init__(self, config: EngineConfig, *, progress: bool = False, drafter: Drafter | None = None) -> None:
        """`drafter`: what proposes the drafts of speculative decoding (config.speculative_tokens > 0); None: the
        checkpoint's MTP module (Qwen3.5)."""
        self.config = config
        self.device = config.torch_device
        self.model_config, self.model, self.load_report = load_model(
            config.model_dir, dtype=config.torch_dtype, device=self.device, progress=progress
        )
        speculative = config.speculative_tokens > 0
        if drafter is not None and not speculative:
            raise ValueError("a drafter was given but speculative_tokens is 0: set speculative_tokens=k to use it")
        mtp = None
        if speculative and drafter is None:
            check_mtp_drafts(self.model_config)
            # Imported here, as the other Qwen3.5-only pieces (factories.py): serving Qwen3 must not depend on them.
            from a4.models.qwen3_5_mtp import load_mtp

            mtp, _ = load_mtp(self.model, config.model_dir, dtype=config.torch_dtype, device=self.device)
        # A drafter's attention layers (the MTP module's one) keep their KV beside the main model's, in the same pool.
        self.draft_kv_layers = 0
        if mtp is not None:
            self.draft_kv_layers = len(mtp.layers)
        elif drafter is not None:
            self.draft_kv_layers = drafter.kv_layers
        self.ledger, self.memory_plan = self._plan_memory()
        # The longest request (prompt + output) the engine can hold: what the model accepts, and what fits in the
        # pool on its own. Whole pages, because pages are recorded in the table whole.
        page_size = config.page_size
        context = min(self.model_config.max_position_embeddings, self.memory_plan.num_tokens)
        self.max_context_len = context - context % page_size
        if self.max_context_len == 0:
            raise ValueError(
                f"page_size {page_size} is larger than the longest context this engine can hold, {context} tokens "
                f"(max_position_embeddings {self.model_config.max_position_embeddings}, KV pool "
                f"{self.memory_plan.num_tokens} tokens): lower page_size or raise memory_budget_bytes"
            )
        # Decode over static buffers (graph_runner.py): always on CUDA, captured unless cuda_graphs=False; on the CPU
        # only when asked for with cuda_graphs=True (there is nothing to capture: CI runs the GPU's path that way).
        # Speculative decode steps feed a varying number of drafts per request and run eagerly.
        on_cuda = self.device.type == "cuda"
        capture = on_cuda and config.cuda_graphs is not False
        static_decode = (on_cuda or config.cuda_graphs is True) and not speculative
        # Padded rows of a static batch need a slot and a KV page that no request owns: one of each beyond the plan
        # (SGLang keeps a padding slot likewise).
        padding = int(static_decode)
        plan, dtype = self.memory_plan, config.torch_dtype
        self.kv_pool = create_kv_pool(
            self.model_config, plan.num_pages + padding, page_size, dtype, self.device, self.draft_kv_layers
        )
        num_slots = plan.max_running_requests + padding
        self.state_pool = create_state_pool(self.model_config, num_slots, dtype, self.device)
        self.attn_backend = create_attention_backend(self.device)
        self.table_manager = TableManager(num_slots, self.max_context_len, self.device)
        allocator = PageAllocator(plan.num_pages + padding, page_size)
        self.graph_runner = None
        if static_decode:
            padding_slot = self.table_manager.allocate()
            padding_page = allocator.allocate(1)
            self.table_manager.write(padding_slot, 0, padding_page * page_size)
            self.graph_runner = DecodeGraphRunner(
                self.model,
                max_batch=plan.max_running_requests,
                max_seq_len=self.max_context_len,
                req_to_token=self.table_manager.req_to_token,
                kv_pool=self.kv_pool,
                state_pool=self.state_pool,
                attn_backend=self.attn_backend,
                padding_slot=padding_slot,
                capture=capture,
            )
        prefix_cache = create_prefix_cache(config, self.model_config, self.state_pool)
        self.cache_manager = CacheManager(allocator, prefix_cache, self.table_manager)
        self.scheduler = Scheduler(
            self.table_manager,
            self.cache_manager,
            max_prefill_tokens=config.max_prefill_tokens,
            eos_token_ids=self.model_config.eos_token_ids,
            num_draft_tokens=config.speculative_tokens,
        )
        if mtp is not None:
            drafter = MTPDrafter(
                mtp,
                num_slots=num_slots,
                req_to_token=self.table_manager.req_to_token,
                kv_pool=self.kv_pool,
                attn_backend=self.attn_backend,
            )
        self.drafter = drafter
        self.sampler = Sampler(self.device)
        self.stats = EngineStats()
        self._next_uid = 0

    def _plan_memory(self) -> tuple[MemoryLedger, MemoryPlan]:
        """The model's ledger, and the split of the budget between state checkpoints, request slots and KV pages.

        The prefix cache's state checkpoints, if it keeps any, are set aside first (`_checkpoint_bytes`; the default
        budget adds them to what full contexts need); the rest goes to slots first (`plan_memory`), or, for a hybrid
        model given a `state_fraction`, to slots capped at that share of it (`plan_hybrid_memory`, notebook 06). A
        hybrid slot also holds its Gated DeltaNet states (`StatePool.bytes_per_slot`, notebook 05), so serving Qwen3.5
        with the defaults needs notebooks 01-05 only.
        """
        config, model_config, dtype = self.config, self.model_config, self.config.torch_dtype
        state_bytes = state_bytes_per_slot(model_config, dtype)
        if not state_bytes and config.state_fraction is not None:
            raise ValueError(
                f"state_fraction {config.state_fraction} applies to hybrid models only: "
                f"{model_config.architecture} keeps no state per request"
            )
        if config.speculative_tokens and config.state_fraction is not None:
            raise ValueError(
                "state_fraction cannot be combined with speculative_tokens: notebook 06's plan_hybrid_memory does not "
                "count the verify states and the draft's KV; leave state_fraction=None (slots first)"
            )
        ledger = MemoryLedger.from_config(
            model_config,
            dtype,
            state_bytes_per_slot=state_bytes,
            draft_kv_layers=self.draft_kv_layers,
            # A verify pass keeps the state after each of its k + 1 positions (notebook 11).
            verify_bytes_per_slot=(config.speculative_tokens + 1) * state_bytes if config.speculative_tokens else 0,
        )
        checkpoint_bytes = self._checkpoint_bytes(ledger)
        budget = config.memory_budget_bytes or default_budget_bytes(
            ledger,
            max_running_requests=config.max_running_requests,
            max_context_len=model_config.max_position_embeddings,
            device=self.device,
            checkpoint_bytes=checkpoint_bytes,
        )
        # What must remain beside the checkpoints: one request slot and one KV page, the smallest plan.
        if checkpoint_bytes and budget - checkpoint_bytes < ledger.bytes_per_request(config.page_size):
            raise MemoryPlanError(
                f"max_state_checkpoints={config.max_state_checkpoints} state checkpoints take {checkpoint_bytes:,} B "
                f"of the {budget:,} B memory budget, leaving less than one request slot and one KV page "
                f"({ledger.bytes_per_request(config.page_size):,} B): lower max_state_checkpoints, raise "
                f"memory_budget_bytes, or set hybrid_prefix_policy='refuse'"
            )
        split = dict(
            budget_bytes=budget - checkpoint_bytes,
            page_size=config.page_size,
            dtype=dtype,
            max_running_requests=config.max_running_requests,
        )
        if config.state_fraction is None:
            memory_plan = plan_memory(model_config, ledger=ledger, **split)
        else:
            # Imported only when a state share is asked for: it is an exercise (notebook 06), and slots first does
            # not need it.
            from a4.engine.hybrid_memory import plan_hybrid_memory

            memory_plan = plan_hybrid_memory(model_config, state_fraction=config.state_fraction, **split)
        return ledger, replace(memory_plan, budget_bytes=budget, checkpoint_bytes=checkpoint_bytes)

    def _checkpoint_bytes(self, ledger: MemoryLedger) -> int:
        """Bytes set aside for the prefix cache's state checkpoints (each one slot's state), before slots and pages."""
        if not keeps_state_checkpoints(self.config, self.model_config):
            return 0
        return self.config.max_state_checkpoints * ledger.state_bytes_per_slot

    def add_request(self, input_ids: list[int], sampling_params: SamplingParams) -> Req:
        """Queue a request; a request that can never run comes back already finished, with its error.

        `sampling_params` of another type is a TypeError (a caller's mistake, not a request's): nothing is queued.
        """
        check_sampling_params(sampling_params)
        req = Req(uid=self._next_uid, input_ids=list(input_ids), sampling_params=sampling_params)
        self._next_uid += 1
        error = self._validate(req.input_ids)
        if error is None and self.drafter is not None and sampling_params.temperature > 0:
            error = (
                f"temperature {sampling_params.temperature} with speculative decoding: this engine verifies drafts "
                "greedily (temperature 0) only; build it with speculative_tokens=0 to sample"
            )
        if error is not None:
            req.finished, req.finish_reason, req.error = True, "error", error
            return req
        # Output stops at the context limit, like SGLang's clipping of max_tokens, so the reservation at
        # admission (prompt + max_new_tokens) can always be met by an otherwise idle engine.
        room = self.max_context_len - len(input_ids)
        if sampling_params.max_new_tokens > room:
            req.sampling_params = replace(sampling_params, max_new_tokens=room)
        self.sampler.add_req(req)
        self.scheduler.add_req(req)
        return req

    def _validate(self, input_ids: list[int]) -> str | None:
        """Why this prompt cannot run, or None. (SamplingParams check themselves on construction.)"""
        if len(input_ids) == 0:
            return "empty prompt: at least one token is needed"
        vocab_size = self.model_config.vocab_size
        for position, token in enumerate(input_ids):
            try:
                # bool is an int in Python (True == 1): a prompt of bools is a mistake, not token 1.
                token = operator.index(token) if not isinstance(token, bool) else None
            except TypeError:
                token = None
            if token is None:
                return f"token {input_ids[position]!r} at position {position} is not an integer token id"
            if not 0 <= token < vocab_size:
                return f"token id {token} at position {position} is outside the vocabulary [0, {vocab_size})"
        if len(input_ids) >= self.max_context_len:
            return (
                f"prompt of {len(input_ids)} tokens is too long: the context holds {self.max_context_len} tokens "
                f"(max_position_embeddings {self.model_config.max_position_embeddings}, KV pool "
                f"{self.memory_plan.num_tokens} tokens) and at least one must be left to generate"
            )
        return None

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether prompts can reuse cached prefixes (False when switched off, or for a hybrid model that refuses)."""
        return not isinstance(self.cache_manager.prefix_cache, NoPrefixCache)

    @property
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_reqs

    @torch.inference_mode()
    def step(self) -> list[Req]:
        """Run one scheduler step; returns the requests that finished in it.

        An exception escaping the step (KeyboardInterrupt included: a student interrupting a cell) aborts the
        requests of its batch before it propagates: their states and KV may be half-advanced, so they can neither
        resume nor be cached (`Scheduler.abort_req`). The engine is then as if they had never been submitted.
        """
        batch = self.scheduler.schedule_next_batch()
        if batch is None:
            if self.scheduler.has_unfinished_reqs:
                # Admission reserves for the worst case and max_context_len fits the pool, so an idle engine can
                # always admit the first waiting request: getting here means the bookkeeping is broken.
                raise RuntimeError("the scheduler has unfinished requests but can run none of them")
            return []
        try:
            return self._run_batch(batch)
        except BaseException as e:
            for req in batch.reqs:
                self.abort_req(req, f"the step running this request raised {type(e).__name__}: {e}")
            raise

    def _run_batch(self, batch: Batch) -> list[Req]:
        start = time.perf_counter()
        if self.state_pool is not None:
            self.state_pool.clear_new_requests(batch.reqs)
        if self.drafter is not None:
            return self._run_speculative_batch(batch, start)
        if batch.phase == "decode" and self.graph_runner is not None:
            logits = self.graph_runner.forward(
                input_ids=[req.all_ids[req.computed_len] for req in batch.reqs],
                slots=[req.slot for req in batch.reqs],
                positions=[req.computed_len for req in batch.reqs],
            )
        else:
            logits = self.model(self._forward_batch(batch))
        next_tokens, errors = self._sample(batch, logits)
        self._record(batch, time.perf_counter() - start, len(batch.reqs))
        return self._book(batch, next_tokens, errors)

    def _sample(self, batch: Batch, logits: torch.Tensor) -> tuple[list[int | None], list[str | None]]:
        """Each request's next token (None where the step does not sample it) and error, from the logits [S, vocab]
        of the sampled requests' last rows."""
        sampled_reqs = [req for req, sampled in zip(batch.reqs, batch.sample) if sampled]
        samples = iter(self.sampler.sample(logits, sampled_reqs))
        next_tokens, errors = zip(*(next(samples) if sampled else (None, None) for sampled in batch.sample))
        return list(next_tokens), list(errors)

    def _book(self, batch: Batch, next_tokens: Sequence, errors: Sequence[str | None]) -> list[Req]:
        with _sigint_deferred():
            finished = self.scheduler.process_batch_output(batch, next_tokens, errors)
        for req in finished:
            self.sampler.remove_req(req)
            self.stats.cached_tokens += req.prefix_hit_len
        return finished

    def _run_speculative_batch(self, batch: Batch, start: float) -> list[Req]:
        """A step of a speculative engine (notebook 11). Prefill as usual; a decode step feeds every request its last
        token and its drafts, keeps the drafts greedy verification accepts plus the model's own next token, and
        commits the Gated DeltaNet states after the last token kept. Then the drafter catches up with what was
        committed (`Drafter.observe`), which needs the final hidden state of every row, not only of the sampled ones.
        """
        reqs, extend_lens = batch.reqs, batch.extend_lens
        verify = batch.phase == "decode"
        drafts, input_ids = None, None
        if verify:
            drafts = self.drafter.propose(reqs, [n - 1 for n in extend_lens])
            input_ids = [t for req, d in zip(reqs, drafts) for t in (req.all_ids[req.computed_len], *d)]
        fb = self._forward_batch(batch, input_ids, every_row=True)
        if verify:
            fb.verify = VerifyStates.for_lengths(extend_lens, self.device)
        hidden = self.model.model(fb)  # [T, hidden], final hidden states of every row
        ends = list(itertools.accumulate(extend_lens))
        if verify:
            next_tokens, errors = self._accept(batch, fb, drafts, hidden)
            committed = [len(tokens) for tokens in next_tokens]
        else:
            last_rows = [end - 1 for end, sampled in zip(ends, batch.sample) if sampled]
            next_tokens, errors = self._sample(batch, self.model.lm_head(hidden[last_rows]).float())
            committed = list(extend_lens)
        finished = self._book(batch, next_tokens, errors)
        going_on = [i for i, req in enumerate(reqs) if not req.finished]
        if going_on:
            # A request's committed positions are the first rows of its block.
            starts = [end - n for end, n in zip(ends, extend_lens)]
            rows = [row for i in going_on for row in range(starts[i], starts[i] + committed[i])]
            self.drafter.observe([reqs[i] for i in going_on], [committed[i] for i in going_on], hidden[rows])
        tokens = sum(committed) if verify else len(reqs)
        self._record(batch, time.perf_counter() - start, tokens)
        return finished

    def _accept(
        self, batch: Batch, fb: ForwardBatch, drafts: list[list[int]], hidden: torch.Tensor
    ) -> tuple[list[list[int]], list[str | None]]:
        """Greedy verification: each request keeps the drafts that agree with the model's own tokens, then the
        model's token after them, cut at a token that finishes it; its GDN states are set to those after the last
        token kept (`commit_verified_states_`)."""
        reqs, extend_lens = batch.reqs, batch.extend_lens
        row_reqs = [req for req, n in zip(reqs, extend_lens) for _ in range(n)]
        samples = self.sampler.sample(self.model.lm_head(hidden).float(), row_reqs)
        width = max(extend_lens)
        targets, errors, start = [], [], 0
        for n in extend_lens:
            mine = samples[start : start + n]
            start += n
            errors.append(next((s.error for s in mine if s.error is not None), None))
            targets.append([s.token if s.token is not None else -1 for s in mine] + [-1] * (width - n))
        draft_ids = [d + [-1] * (width - 1 - len(d)) for d in drafts]
        as_tensor = partial(torch.tensor, dtype=torch.int64, device=self.device)
        accepted = greedy_accept(as_tensor(draft_ids), as_tensor(targets)).tolist()
        next_tokens = [
            self.scheduler.keep_tokens(req, d[:a] + [t[a]]) for req, d, t, a in zip(reqs, drafts, targets, accepted)
        ]
        self.stats.draft_tokens += sum(len(d) for d in drafts)
        self.stats.accepted_draft_tokens += sum(accepted)
        if self.state_pool is not None:
            kept_lens = as_tensor([len(tokens) for tokens in next_tokens])  # at least the model's own token
            for layer in fb.verify.conv:
                commit_verified_states_(
                    self.state_pool.conv_state(layer),
                    self.state_pool.recurrent_state(layer),
                    fb.verify.conv[layer],
                    fb.verify.recurrent[layer],
                    fb.slots,
                    kept_lens,
                )
        return next_tokens, errors

    def abort_req(self, req: Req, error: str | None = None) -> None:
        """Stop an unfinished request wherever it is (finish_reason "abort"); its slot, pages and lock are freed and
        nothing it computed is cached. A finished request is left as it is."""
        if not req.finished:
            self.scheduler.abort_req(req, "abort", error)
            self.sampler.remove_req(req)

    def _forward_batch(
        self, batch: Batch, input_ids: list[int] | None = None, every_row: bool = False
    ) -> ForwardBatch:
        """The step's context: its new tokens in one flat row, where their KV goes, and each request's slot.

        The tokens are the requests' next ones unless `input_ids` gives them (a verify step: last tokens and drafts).
        The rows whose output the model returns are the last of each sampled request (their logits predict its next
        token), or with `every_row` all of them (a speculative engine's drafter reads every row's hidden state)."""
        if input_ids is None:
            input_ids = [
                t for req, n in zip(batch.reqs, batch.extend_lens) for t in req.all_ids[req.computed_len :][:n]
            ]
        if every_row:
            sample_indices = list(range(len(input_ids)))
        else:
            ends = itertools.accumulate(batch.extend_lens)
            sample_indices = [end - 1 for end, sampled in zip(ends, batch.sample) if sampled]
        return ForwardBatch.build(
            input_ids=input_ids,
            slots=[req.slot for req in batch.reqs],
            prefix_lens=[req.computed_len for req in batch.reqs],
            extend_lens=list(batch.extend_lens),
            sample_indices=sample_indices,
            req_to_token=self.table_manager.req_to_token,
            kv_pool=self.kv_pool,
            state_pool=self.state_pool,
            attn_backend=self.attn_backend,
        )

    def _record(self, batch: Batch, seconds: float, decode_tokens: int) -> None:
        """Count the step; `decode_tokens`: what a decode step's requests gained (more than one each with drafts)."""
        stats = self.stats
        if batch.phase == "prefill":
            stats.prefill_steps += 1
            stats.prefill_tokens += sum(batch.extend_lens)
            stats.prefill_seconds += seconds
        else:
            stats.decode_steps += 1
            stats.decode_request_steps += len(batch.reqs)
            stats.decode_tokens += decode_tokens
            stats.decode_seconds += seconds

    def run(self, reqs: list[Req]) -> None:
        """Step until every one of reqs has finished."""
        while not all(req.finished for req in reqs):
            self.step()
