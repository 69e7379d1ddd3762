"""Contracts of the public objects under misuse (issue: a reliability probe found holes between LLM, Engine and Req).

Each test asserts what the engine must do when a caller uses `LLM` / `llm.engine` / a `Req` in a way the happy path
never does, and checks tokens against transformers' greedy output. What is expected, and the errors named:

1. Threads. One `LLM` is not thread-safe. A second thread's `generate` while a first thread's call is inside a step
   is either refused at once with a RuntimeError whose message says so (matches THREAD_ERROR: "another thread",
   "thread-safe"), or waits for the first call to end (serialised) and then returns transformers' tokens. Either way
   the first call's tokens are right, no internal error leaks out, and the next single-threaded call is right.
2. Re-entrant calls. `generate`, `engine.add_request` and `engine.step` called from inside a step, by the thread
   running it (a forward hook on a decoder layer, a drafter's `propose`), raise a RuntimeError matching REENTRANT
   ("re-entrant" / "reentrant", or "inside a step"), before changing anything: a hook that catches it leaves the
   outer call to finish with transformers' tokens; a hook that lets it propagate fails the outer call with that same
   RuntimeError, as any exception inside a step (its requests aborted, the engine clean, the next call right).
3. `engine.abort_req(req)` from inside a step, for a request of the step's batch, is allowed and takes effect when
   the step is booked: the request ends with finish_reason "abort" and the caller's error, holding nothing, with a
   prefix of its greedy tokens; the batch's other requests get transformers' tokens.
4. A `Req` is submitted once, to one engine. `engine.scheduler.add_req(req)` of a request already queued, running
   or finished, or belonging to another engine, and `engine.run([req])` of a request this engine never queued (one
   of another engine, finished there or not, or a Req made by hand) raise ValueError or RuntimeError matching
   RESUBMITTED / FOREIGN, at once: nothing is queued that could never finish (a `run` waiting forever, a hang, is
   detected by a timeout, HANG_SECONDS). `engine.run` of this engine's own finished requests returns at once.
5. Drafters. The `Drafter` protocol says `propose` returns "up to" num_drafts[i] tokens for request i: fewer (even
   none) is a drafter's right, and the output is still transformers'. More than asked is refused: the step raises a
   ValueError naming the drafter's class, the request and both counts (returned, asked). Why an exception and not
   finish_reason "error": "error" is what is wrong with one request (its prompt, its logits; README "The engine"),
   while a drafter breaking the protocol is the engine's own component failing, for every request, like a failing
   layer. So it follows the convention for an exception inside a step (README, tests/test_fault_injection.py): the
   step's requests are aborted (finish_reason "abort"), `generate` / `run` re-raise it, the engine stays clean, and
   the next call is right.
"""

from __future__ import annotations

import random
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from a4 import LLM, SamplingParams
from a4.core import Req
from a4.reference import hf_greedy
from a4.speculative.drafter import OracleDrafter

MAX_NEW = 6
_rng = random.Random(29)
# Ids below 1000: the tiny checkpoints' stop tokens never appear inside a prompt. With max_prefill_tokens=16 the
# 23-token prompt is prefilled in two chunks.
PROMPTS = [[_rng.randrange(1000) for _ in range(n)] for n in (5, 23, 9, 17)]
PARAMS = SamplingParams(max_new_tokens=MAX_NEW)

THREAD_ERROR = r"another thread|thread-safe|thread safe"
REENTRANT = r"re-?entrant|inside (a|the|its|another) step"
RESUBMITTED = r"already|twice|finished|another engine"
FOREIGN = r"another engine|not (queued|submitted|added) (to|by|in) this engine|never (queued|submitted|added)"
# How long a call may take before it counts as hung. Each call here takes well under a second.
HANG_SECONDS = 5.0
# Test 1: how long the first thread, paused inside a step, waits for the second to be refused (a serialising
# engine keeps the second waiting until the first call is done: then the pause ends after this long).
PAUSE_SECONDS = 1.0


# ------------------------------------------------------------------------------------------------------- helpers


@dataclass
class Outcome:
    """What a call returned, or what it raised."""

    value: object = None
    error: BaseException | None = None


class Hung(Exception):
    """Raised by a watched engine's step once its call is declared hung, so that its thread ends."""


class Background:
    """call() in a daemon thread named `name`; `outcome()` waits for it. While it runs, the steps of `engines` raise
    Hung once the call is declared hung, so that a loop of `run` stepping an engine that has nothing to run for it
    ends instead of spinning through the rest of the session."""

    def __init__(self, call: Callable[[], object], name: str, *engines) -> None:
        self.name, self.engines, self.result = name, engines, Outcome()
        self.stop = threading.Event()
        for engine in engines:
            real = engine.step

            def step(real=real):
                if self.stop.is_set():
                    raise Hung(f"{name}: stopped by the test")
                return real()

            engine.step = step
        self.thread = threading.Thread(target=self._target, args=(call,), name=name, daemon=True)
        self.thread.start()

    def _target(self, call: Callable[[], object]) -> None:
        try:
            self.result.value = call()
        except BaseException as error:  # noqa: BLE001 - reported by the test
            self.result.error = error

    def outcome(self, seconds: float = HANG_SECONDS) -> Outcome:
        """What the call returned or raised; a call still running after `seconds` fails the test."""
        self.thread.join(seconds)
        hung = self.thread.is_alive()
        if hung:
            self.stop.set()
            self.thread.join(seconds)
        for engine in self.engines:
            vars(engine).pop("step", None)
        if hung:
            pytest.fail(f"{self.name} still running after {seconds:g} s: it waits forever (hang)", pytrace=False)
        return self.result


def within(call: Callable[[], object], what: str, *engines, seconds: float = HANG_SECONDS) -> Outcome:
    """call() in a thread, which must end within `seconds`: its result or what it raised (see Background)."""
    return Background(call, what, *engines).outcome(seconds)


def describe(error: BaseException | None) -> str:
    return "nothing" if error is None else f"{type(error).__name__}: {error}"


def assert_raised(outcome: Outcome, types: tuple[type[BaseException], ...], pattern: str, what: str) -> None:
    names = " or ".join(t.__name__ for t in types)
    assert outcome.error is not None, f"{what} must raise {names} matching {pattern!r}; it returned {outcome.value!r}"
    assert isinstance(outcome.error, types) and re.search(pattern, str(outcome.error), re.IGNORECASE), (
        f"{what} must raise {names} matching {pattern!r}; it raised {describe(outcome.error)}"
    )


def assert_returned(outcome: Outcome, what: str) -> object:
    assert outcome.error is None, f"{what} raised {describe(outcome.error)}"
    return outcome.value


def tokens(outputs) -> list[list[int]]:
    return [out.token_ids for out in outputs]


def decoder_layers(llm: LLM):
    return llm.engine.model.model.layers


def assert_idle(llm: LLM) -> None:
    """Nothing queued or running; every slot free; no page held by anyone but the allocator or the prefix cache."""
    engine = llm.engine
    assert not engine.has_unfinished_requests, "requests were left queued or running"
    tables = engine.table_manager
    assert tables.available_size == tables.max_running_requests, "a request slot was not freed"
    cache, allocator = engine.cache_manager.prefix_cache, engine.cache_manager.allocator
    assert cache.protected_size == 0, "a lock on the prefix cache was not released"
    assert allocator.num_free_pages + cache.evictable_size // allocator.page_size == allocator.num_pages, "pages leaked"


def oracle(reference: list[list[int]], correct: int) -> dict:
    return dict(continuations={tuple(p): out for p, out in zip(PROMPTS, reference)}, correct=correct, vocab_size=1024)


class HookedDrafter(OracleDrafter):
    """The oracle's drafts; `on_propose()` runs first at every propose (None: nothing)."""

    on_propose: Callable[[], None] | None = None

    def propose(self, reqs, num_drafts):
        if self.on_propose is not None:
            self.on_propose()
        return super().propose(reqs, num_drafts)


class Once:
    """Counts the calls of a hook (those of forwards of `phase` only, if given); `due()` is True at the `at`-th one
    only (counted from 1)."""

    def __init__(self, at: int, phase: str | None = None) -> None:
        self.at, self.phase, self.calls = at, phase, 0

    def due(self, phase: str | None = None) -> bool:
        if self.phase is not None and phase != self.phase:
            return False
        self.calls += 1
        return self.calls == self.at


def phase_of(args) -> str:
    """The phase of the forward a decoder layer's hook sees (its last argument is the step's ForwardBatch): "prefill"
    for an EXTEND step (a mixed one included), "decode" otherwise."""
    return "prefill" if args[-1].mode.is_extend() else "decode"


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request, tiny_qwen3, tiny_qwen3_5):
    ckpt = {"qwen3": tiny_qwen3, "qwen3_5": tiny_qwen3_5}[request.param]
    return ckpt, hf_greedy(ckpt, PROMPTS, MAX_NEW)


@pytest.fixture(scope="module")
def hybrid(tiny_qwen3_5):
    return tiny_qwen3_5, hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)


# ------------------------------------------------------------------------------------------------- 1. threads


def test_a_second_thread_is_refused_or_serialised(model):
    """Thread A's generate is paused inside its second step (a forward hook) until thread B's generate on the same
    LLM has returned or raised (or PAUSE_SECONDS, if B waits for A). B: refused (RuntimeError, THREAD_ERROR) or
    transformers' tokens; A: transformers' tokens; then one thread: transformers' tokens."""
    ckpt, reference = model
    llm = LLM(ckpt, max_prefill_tokens=16)
    a_paused, b_done = threading.Event(), threading.Event()
    pause = Once(at=2)

    def hook(module, args, output):
        if threading.current_thread().name == "thread A" and pause.due():
            a_paused.set()
            b_done.wait(PAUSE_SECONDS)

    def second_call():
        assert a_paused.wait(HANG_SECONDS), "thread A never reached its second step"
        try:
            return llm.generate(PROMPTS[2:], PARAMS)
        finally:
            b_done.set()

    handle = decoder_layers(llm)[0].register_forward_hook(hook)
    first = Background(lambda: llm.generate(PROMPTS[:2], PARAMS), "thread A", llm.engine)
    second = Background(second_call, "thread B")
    a = first.outcome(HANG_SECONDS + PAUSE_SECONDS)
    b = second.outcome(HANG_SECONDS + PAUSE_SECONDS)
    handle.remove()

    b_refused = isinstance(b.error, RuntimeError) and re.search(THREAD_ERROR, str(b.error), re.IGNORECASE)
    if not b_refused:
        assert b.error is None, (
            f"thread B's generate, while thread A's was inside a step, must be refused with a RuntimeError matching "
            f"{THREAD_ERROR!r} or wait for A; it raised {describe(b.error)}"
        )
        assert tokens(b.value) == reference[2:], "thread B's generate, serialised after A's, gave wrong tokens"
    assert a.error is None, f"thread A's generate raised {describe(a.error)} (thread B: {describe(b.error)})"
    assert tokens(a.value) == reference[:2], f"thread A's generate gave wrong tokens (thread B: {describe(b.error)})"
    assert_idle(llm)
    after = within(lambda: llm.generate(PROMPTS, PARAMS), "generate after the two threads", llm.engine)
    assert tokens(assert_returned(after, "generate after the two threads")) == reference


# ----------------------------------------------------------------------------------------- 2. re-entrant calls


def reentrant_call(llm: LLM, kind: str) -> None:
    engine = llm.engine
    if kind == "generate":
        llm.generate([PROMPTS[0]], PARAMS)
    elif kind == "add_request":
        engine.add_request(PROMPTS[0], PARAMS)
    elif kind == "step":
        engine.step()
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["generate", "add_request", "step"])
@pytest.mark.parametrize("where", ["forward-prefill", "forward-decode", "propose"])
def test_a_reentrant_call_from_inside_a_step_is_refused(model, where, kind):
    """A hook inside a step (a decoder layer's forward in a prefill or a decode step, or the drafter's propose)
    calls `kind` once and catches what it raises: a RuntimeError matching REENTRANT. The outer generate then gives
    transformers' tokens, and nothing the refused call tried is left queued."""
    ckpt, reference = model
    recorded = []

    def call_once(phase=None):
        if trigger.due(phase):
            try:
                reentrant_call(llm, kind)
            except Exception as error:  # noqa: BLE001 - checked below
                recorded.append(error)
            else:
                recorded.append(None)

    if where == "propose":
        trigger = Once(at=2)
        drafter = HookedDrafter(**oracle(reference, correct=1))
        drafter.on_propose = call_once
        llm = LLM(ckpt, drafter=drafter, speculative_tokens=2, max_prefill_tokens=16)
    else:
        trigger = Once(at=1, phase=where.removeprefix("forward-"))
        llm = LLM(ckpt, max_prefill_tokens=16)
        decoder_layers(llm)[0].register_forward_hook(lambda module, args, output: call_once(phase_of(args)))

    outer = within(lambda: llm.generate(PROMPTS, PARAMS), "the outer generate", llm.engine)
    assert recorded, f"the hook never ran (the outer generate: {describe(outer.error)})"
    what = f"{kind} from inside a step ({where})"
    assert recorded[0] is not None, f"{what} must raise a RuntimeError matching {REENTRANT!r}; it went through"
    assert isinstance(recorded[0], RuntimeError) and re.search(REENTRANT, str(recorded[0]), re.IGNORECASE), (
        f"{what} must raise a RuntimeError matching {REENTRANT!r}; it raised {describe(recorded[0])}"
    )
    outputs = assert_returned(outer, f"the outer generate (its hook caught the refused {kind})")
    assert tokens(outputs) == reference, f"the outer generate gave wrong tokens after a refused {kind}"
    assert_idle(llm)


def test_a_reentrant_error_that_escapes_the_hook_fails_only_the_outer_call(hybrid):
    """The hook lets the re-entrant RuntimeError propagate: the outer generate raises it (REENTRANT), as any
    exception inside a step; the engine is clean and the next call gives transformers' tokens."""
    ckpt, reference = hybrid
    llm = LLM(ckpt, max_prefill_tokens=16)
    trigger = Once(at=1, phase="decode")

    def hook(module, args, output):
        if trigger.due(phase_of(args)):
            llm.generate([PROMPTS[0]], PARAMS)

    handle = decoder_layers(llm)[0].register_forward_hook(hook)
    outer = within(lambda: llm.generate(PROMPTS, PARAMS), "the outer generate", llm.engine)
    handle.remove()
    assert_raised(outer, (RuntimeError,), REENTRANT, "the outer generate, whose hook called generate")
    assert_idle(llm)
    again = within(lambda: llm.generate(PROMPTS, PARAMS), "the next generate", llm.engine)
    assert tokens(assert_returned(again, "the next generate")) == reference


# ------------------------------------------------------------------------------------- 3. abort inside a step


@pytest.mark.parametrize("where", ["forward-prefill", "forward-decode", "propose"])
def test_abort_req_from_inside_a_step_takes_effect_after_it(model, where):
    """`engine.abort_req(reqs[1])` from a hook inside a step that runs reqs[1] (the second prefill chunk of its
    23-token prompt, a decode step, a drafter's propose): it ends with "abort" and the caller's error, with a prefix
    of its greedy tokens; the other requests get transformers' tokens; nothing leaks; the next call is right."""
    ckpt, reference = model
    aborted = []
    reqs: list[Req] = []

    def abort_once(phase=None):
        if trigger.due(phase):
            llm.engine.abort_req(reqs[1], "cancelled from inside a step")
            aborted.append(True)

    if where == "propose":
        trigger = Once(at=2)
        drafter = HookedDrafter(**oracle(reference, correct=1))
        drafter.on_propose = abort_once
        llm = LLM(ckpt, drafter=drafter, speculative_tokens=2, max_prefill_tokens=16)
    else:
        # The second prefill step runs the second chunk of PROMPTS[1] (16 tokens a step: 5 + 11, then 12 + ...).
        trigger = Once(at=2, phase=where.removeprefix("forward-"))
        llm = LLM(ckpt, max_prefill_tokens=16)
        decoder_layers(llm)[0].register_forward_hook(lambda module, args, output: abort_once(phase_of(args)))
    engine = llm.engine
    reqs.extend(engine.add_request(prompt, PARAMS) for prompt in PROMPTS)

    run = within(lambda: engine.run(reqs), "engine.run", engine)
    assert aborted, f"the hook never ran (engine.run: {describe(run.error)})"
    assert_returned(run, "engine.run, with a request aborted inside its step")
    req = reqs[1]
    assert (req.finished, req.finish_reason, req.error) == (True, "abort", "cancelled from inside a step"), (
        f"the request aborted inside a step ended with finish_reason {req.finish_reason!r}, error {req.error!r}"
    )
    assert req.output_ids == reference[1][: len(req.output_ids)] and len(req.output_ids) < MAX_NEW, (
        f"the aborted request's tokens {req.output_ids} are not a strict prefix of its greedy ones {reference[1]}"
    )
    assert req.slot is None, "the aborted request still holds its slot"
    others = [0, 2, 3]
    assert [reqs[i].output_ids for i in others] == [reference[i] for i in others]
    assert [reqs[i].finish_reason for i in others] == ["length"] * 3
    assert_idle(llm)
    again = within(lambda: llm.generate(PROMPTS, PARAMS), "the next generate", engine)
    assert tokens(assert_returned(again, "the next generate")) == reference


# ---------------------------------------------------------------------------------------- 4. one Req, once


def dashed(name: str) -> str:
    return name.replace(" ", "-")


@pytest.mark.parametrize("state", ["queued", "running", "finished", "of another engine"], ids=dashed)
def test_adding_a_req_again_is_refused(model, state):
    """`engine.scheduler.add_req(req)` of a request already queued, running (decoding) or finished here, or queued
    in another engine, raises ValueError or RuntimeError matching RESUBMITTED, queues nothing, and leaves the
    request as it was: the engines then finish their requests with transformers' tokens."""
    ckpt, reference = model
    llm = LLM(ckpt)
    engine = llm.engine
    owner = LLM(ckpt) if state == "of another engine" else llm
    req = owner.engine.add_request(PROMPTS[0], PARAMS)
    if state == "running":
        engine.step()  # the prompt's prefill: the request is decoding
        assert not req.finished and req.output_ids
    elif state == "finished":
        engine.run([req])
        assert req.output_ids == reference[0]
    before = (list(req.output_ids), req.finish_reason, req.computed_len)

    added = within(lambda: engine.scheduler.add_req(req), "scheduler.add_req", engine)
    assert_raised(added, (ValueError, RuntimeError), RESUBMITTED, f"scheduler.add_req of a request {state}")
    assert (req.output_ids, req.finish_reason, req.computed_len) == before, "the refused request was changed"
    if state in ("finished", "of another engine"):
        assert not engine.has_unfinished_requests, "the refused request was queued"
    run = within(lambda: owner.engine.run([req]), "its engine's run", owner.engine)
    assert_returned(run, "its engine's run")
    assert req.output_ids == reference[0] and req.finish_reason == "length"
    assert_idle(llm)
    assert_idle(owner)
    again = within(lambda: llm.generate(PROMPTS, PARAMS), "the next generate", engine)
    assert tokens(assert_returned(again, "the next generate")) == reference


SOURCES = ["queued in another engine", "finished in another engine", "made by hand"]


@pytest.mark.parametrize("source", SOURCES, ids=dashed)
def test_run_of_a_req_this_engine_never_queued_is_refused(model, source):
    """`engine.run([req])` of a request this engine never queued raises ValueError or RuntimeError matching FOREIGN
    at once, instead of stepping an engine that has nothing to run for it forever. This engine has already served a
    request of the same uid (uids are per engine), so the check cannot be by uid."""
    ckpt, reference = model
    llm, other = LLM(ckpt), LLM(ckpt)
    engine = llm.engine
    assert tokens(llm.generate(PROMPTS[:1], PARAMS)) == reference[:1]  # uid 0 used here too
    if source == "made by hand":
        req = Req(uid=0, input_ids=list(PROMPTS[1]), sampling_params=PARAMS)
    else:
        req = other.engine.add_request(PROMPTS[1], PARAMS)
        if source.startswith("finished"):
            other.engine.run([req])
            assert req.output_ids == reference[1]
    before = (list(req.output_ids), req.finish_reason, req.finished)

    run = within(lambda: engine.run([req]), f"engine.run of a request {source}", engine)
    assert_raised(run, (ValueError, RuntimeError), FOREIGN, f"engine.run of a request {source}")
    assert (req.output_ids, req.finish_reason, req.finished) == before, "the refused request was changed"
    assert_idle(llm)
    if source == "queued in another engine":
        assert_returned(within(lambda: other.engine.run([req]), "its own engine's run", other.engine), "its run")
        assert req.output_ids == reference[1]
        assert_idle(other)
    again = within(lambda: llm.generate(PROMPTS, PARAMS), "the next generate", engine)
    assert tokens(assert_returned(again, "the next generate")) == reference


def test_run_of_this_engines_finished_reqs_returns_at_once(tiny_qwen3_5):
    """What generate relies on (a bad prompt's request comes back finished from add_request): run() of this
    engine's finished requests, beside unfinished ones, is no error."""
    llm = LLM(tiny_qwen3_5)
    engine = llm.engine
    bad = engine.add_request([], PARAMS)
    done = engine.add_request(PROMPTS[0], PARAMS)
    assert bad.finished and bad.finish_reason == "error"
    assert_returned(within(lambda: engine.run([done]), "engine.run", engine), "engine.run")
    fresh = engine.add_request(PROMPTS[2], PARAMS)
    assert_returned(within(lambda: engine.run([bad, done, fresh]), "engine.run", engine), "engine.run")
    assert_returned(within(lambda: engine.run([bad, done]), "engine.run", engine), "engine.run")
    assert [done.output_ids, fresh.output_ids] == hf_greedy(tiny_qwen3_5, [PROMPTS[0], PROMPTS[2]], MAX_NEW)
    assert_idle(llm)


# --------------------------------------------------------------------------------------- 5. drafter counts


class CutDrafter(OracleDrafter):
    """The oracle's drafts, cut to `keep(i, asked)` tokens for the i-th request of the step; counts what it gave."""

    def __init__(self, keep: Callable[[int, int], int], **oracle_args) -> None:
        super().__init__(**oracle_args)
        self.keep, self.returned = keep, 0

    def propose(self, reqs, num_drafts):
        drafts = super().propose(reqs, num_drafts)
        drafts = [d[: self.keep(i, n)] for i, (d, n) in enumerate(zip(drafts, num_drafts))]
        self.returned += sum(map(len, drafts))
        return drafts


@pytest.mark.parametrize(
    ("returned", "correct"), [(0, 3), (1, 3), (2, 3), (2, 1), ("mixed", 3)], ids=["0", "1", "2", "2-one-right", "mixed"]
)
def test_a_drafter_may_return_fewer_drafts_than_asked(model, returned, correct):
    """speculative_tokens=3, the drafter returns 0, 1 or 2 drafts (all right, or one right and one wrong; "mixed":
    request i of a step gets i % 4 of the 3 it may have): transformers' tokens, and the engine's draft count is what
    the drafter returned."""
    ckpt, reference = model
    keep = (lambda i, asked: i % 4) if returned == "mixed" else (lambda i, asked, r=returned: r)
    drafter = CutDrafter(keep, **oracle(reference, correct))
    llm = LLM(ckpt, drafter=drafter, speculative_tokens=3, max_prefill_tokens=16)
    outputs = within(lambda: llm.generate(PROMPTS, PARAMS), "generate", llm.engine)
    assert tokens(assert_returned(outputs, f"generate with a drafter returning {returned} drafts of 3")) == reference
    assert llm.stats.draft_tokens == drafter.returned, "the engine counted drafts the drafter did not propose"
    assert_idle(llm)


class OverDrafter(OracleDrafter):
    """The oracle's drafts, one more than asked for request `req_index` of its `at`-th propose (counted from 1), or
    always k = 3 whatever was asked ("always k"); right otherwise."""

    def __init__(self, mode: str, **oracle_args) -> None:
        super().__init__(**oracle_args)
        self.mode, self.calls = mode, 0

    def propose(self, reqs, num_drafts):
        self.calls += 1
        if self.mode == "always k":
            return super().propose(reqs, [3] * len(reqs))
        drafts = super().propose(reqs, num_drafts)
        if self.calls == 1:
            drafts[1] = drafts[1] + [drafts[1][-1] if drafts[1] else 0]
        return drafts


@pytest.mark.parametrize("mode", ["one more", "always k"], ids=dashed)
def test_a_drafter_returning_more_drafts_than_asked_is_refused(model, mode):
    """speculative_tokens=3, one draft right in each. "one more": 4 drafts for the second request of the first
    decode step, where 3 are asked; "always k": 3 drafts where 2 are asked (the second decode step: 6 - 3 tokens
    left). The step raises ValueError naming OverDrafter and both counts; its requests end with "abort" with a
    prefix of their greedy tokens; the engine is clean; the next call, with a drafter that keeps to the protocol,
    gives transformers' tokens."""
    ckpt, reference = model
    drafter = OverDrafter(mode, **oracle(reference, correct=1))
    llm = LLM(ckpt, drafter=drafter, speculative_tokens=3)
    engine = llm.engine
    reqs = [engine.add_request(prompt, PARAMS) for prompt in PROMPTS]
    run = within(lambda: engine.run(reqs), "engine.run", engine)
    what = f"a drafter returning more drafts than asked ({mode})"
    assert_raised(run, (ValueError,), "OverDrafter", what)
    message = str(run.error)
    counts = ("4", "3") if mode == "one more" else ("3", "2")
    assert all(re.search(rf"\b{n}\b", message) for n in counts), f"{what}: the error must give the counts: {message}"
    assert all(req.finished for req in reqs), "requests of the refused step were left running"
    assert all(req.finish_reason == "abort" for req in reqs), [req.finish_reason for req in reqs]
    assert all(req.output_ids == ref[: len(req.output_ids)] for req, ref in zip(reqs, reference)), (
        "an aborted request's tokens are not a prefix of its greedy ones"
    )
    assert_idle(llm)
    drafter.mode, drafter.calls = "one more", 1  # keeps to the protocol from now on
    again = within(lambda: llm.generate(PROMPTS, PARAMS), "the next generate", engine)
    assert tokens(assert_returned(again, "the next generate")) == reference
