"""EngineLoop: the one thread that owns the Engine and steps it; the HTTP handlers reach it through a queue.

An Engine serves one thread (`Engine.serving`), so every call into it is made here. Handlers `submit` requests and
`abort` them by putting commands in the inbox; between two steps the thread takes them all in, so a request that
arrives while others decode joins their next steps (continuous batching). After each step every request's new
tokens go back to its handler through its `RequestStream`, an asyncio queue on the server's event loop fed with
`call_soon_threadsafe`, as text: this thread detokenizes them (detokenizer.py) and applies the request's stop
strings, so that a request whose text reaches one finishes before the next step, where it is, as at an
end-of-sequence token (`Engine.finish_req`: its KV and state enter the prefix cache for its conversation's next turn;
SGLang's scheduler checks stop strings the same way). An abort (the client went away) frees the request's slot,
pages, prefix-cache locks and state at the next turn of the loop, within one step, and caches nothing.

The inbox is bounded by what it admits, not by its length: past `max_running_requests + max_queued_requests`
unfinished requests, `submit` raises Unavailable (the server answers 503) and the engine keeps serving the others;
so it does once `stop` has begun. Stopping aborts every request left, so that no handler waits for ever.
The roles are those of SGLang's scheduler process (here a thread) and its TokenizerManager's per-request state; text
is the handlers' business.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from a4.core import FinishReason, Req, SamplingParams, TokenLogprobs
from a4.course.exercises import not_written_yet, unwritten_exercise
from a4.engine.engine import Engine
from a4.server.detokenizer import IncrementalDetokenizer
from a4.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class Unavailable(Exception):
    """The loop takes no more requests now (too many unfinished, or it is stopping): the client should retry later."""


@dataclass(frozen=True)
class RequestOutput:
    """What a request gained in one step: the text its new tokens made final, and once it has finished, why (the
    engine's reason; "stop" for a stop string)."""

    text: str
    num_tokens: int  # output tokens so far (up to the one that completed a stop string)
    cached_tokens: int  # prompt tokens served by the prefix cache
    finish_reason: FinishReason | None = None
    error: str | None = None
    # Asked for in SamplingParams: the log-probabilities of the tokens this output counts anew (the first output of
    # a request: and those of its prompt, the first None).
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class RequestStream:
    """One request's outputs, from the engine thread to the handler awaiting them on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

    def put(self, output: RequestOutput) -> None:
        """Called from the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, output)
        except RuntimeError:
            pass  # the event loop is closed: the server is gone, and so is whoever awaited this request

    async def get(self) -> RequestOutput:
        """The next output (the last one has a finish_reason)."""
        return await self._outputs.get()


@dataclass
class _Running:
    req: Req
    detokenizer: IncrementalDetokenizer
    num_seen: int = 0  # output tokens already given to the detokenizer
    num_counted: int = 0  # output tokens already counted in an output (their logprobs sent)


class EngineLoop:
    def __init__(self, engine: Engine, tokenizer: Tokenizer, metrics: ServerMetrics, max_queued_requests: int) -> None:
        """`tokenizer`: the `tokenizers` backend of the model's tokenizer (a transformers fast tokenizer's
        `backend_tokenizer`), which turns the outputs into text."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.capacity = engine.memory_plan.max_running_requests + max_queued_requests
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _num_unfinished, which handlers read and the loop decrements
        self._num_unfinished = 0
        self._running: dict[RequestStream, _Running] = {}  # the loop thread's own
        self._stopping = threading.Event()
        # A daemon, so that a step that never returns cannot keep the process alive; `stop` joins it normally.
        self._thread = threading.Thread(target=self._run, name="a4-engine-loop", daemon=True)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Shutting down: its requests were aborted for that, not for a fault of theirs (the client may retry)."""
        return self._stopping.is_set()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every unfinished request (their handlers see finish_reason "abort") and end the thread."""
        with self._lock:
            self._stopping.set()
        self._inbox.put(None)  # wakes the loop if it waits for work
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine loop did not stop within %.0f s (a step still running)", timeout)

    # ------------------------------------------------------------------------------------ called by the handlers

    def submit(self, input_ids: list[int], params: SamplingParams, stop: Sequence[str] = ()) -> list[RequestStream]:
        """Queue a request (from a coroutine on the server's event loop), whose text ends before the first of the
        `stop` strings: one engine request and stream per sample (`params.n`, Engine.add_parallel_requests);
        Unavailable past the bound, or once stopping."""
        streams = [RequestStream(asyncio.get_running_loop()) for _ in range(params.n)]
        # Under the lock with `stop`: a request queued before it is aborted by the loop's last turn, none after it.
        with self._lock:
            if self._stopping.is_set():
                raise Unavailable("the server is shutting down")
            if self._num_unfinished + params.n > self.capacity:
                raise Unavailable(
                    f"the server holds {self._num_unfinished} unfinished requests, its limit "
                    f"(max_running_requests + max_queued_requests = {self.capacity}): retry later"
                )
            self._num_unfinished += params.n
            self._inbox.put(("add", streams, input_ids, params, tuple(stop)))
        return streams

    def abort(self, stream: RequestStream) -> None:
        """Stop the request of `stream` (a finished one is left alone); nothing more is put on its stream."""
        self._inbox.put(("abort", stream))

    # -------------------------------------------------------------------------------------------- the loop thread

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._take_inbox(wait=not self._running)
            if self._running and not self._stopping.is_set():
                try:
                    self.engine.step()
                except Exception as e:
                    # The engine has aborted the step's requests (their streams get the error below) and is clean
                    # for the others. An unwritten exercise (a student's handout) needs its name, not a traceback.
                    if missing := unwritten_exercise(e):
                        logger.error("an engine step raised: %s", not_written_yet(missing))
                    else:
                        logger.exception("an engine step raised")
                self._publish()
            self._update_metrics()
        self._take_inbox(wait=False)
        for running in self._running.values():
            self.engine.abort_req(running.req, "the server is shutting down")
        self._publish()

    def _take_inbox(self, wait: bool) -> None:
        """Apply every queued command; with `wait`, first wait for one (an idle engine has nothing else to do)."""
        try:
            command = self._inbox.get() if wait else self._inbox.get_nowait()
            while True:
                if command is not None:
                    self._apply(*command)
                command = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _apply(self, kind: str, stream: RequestStream | list[RequestStream], *args) -> None:
        if kind == "add":
            input_ids, params, stop = args
            if params.n == 1:
                reqs = [self.engine.add_request(input_ids, params)]
            else:
                reqs = self.engine.add_parallel_requests(input_ids, params)
            for one, req in zip(stream, reqs):
                self._running[one] = _Running(req, IncrementalDetokenizer(self.tokenizer, stop))
            if reqs[0].finished:  # refused at once (its error says why)
                self._publish()
        elif (running := self._running.pop(stream, None)) is not None:
            self.engine.abort_req(running.req, "aborted by the server (the client is gone)")
            self._finished(running.req)

    def _publish(self) -> None:
        """Put each request's new text on its stream, finishing those whose text reached a stop string; the finished
        ones leave the loop."""
        for stream, running in list(self._running.items()):
            req, detokenizer = running.req, running.detokenizer
            new_tokens = req.output_ids[running.num_seen :]
            running.num_seen = len(req.output_ids)
            # Finished "stop" by the engine: at one of its stop token ids (a stop string is found here, below). As in
            # vLLM, that token's text is not output, but the token counts.
            stop_token = int(req.finish_reason == "stop" and bool(new_tokens))
            text = detokenizer.add(new_tokens[: len(new_tokens) - stop_token])
            if detokenizer.stopped and not req.finished:
                self.engine.finish_req(req, "stop")
            elif req.finished and req.finish_reason in ("eos", "length", "stop"):
                text += detokenizer.finish()
            # A request that asks for logprobs gets each token's as it is booked, whether or not it made text yet.
            logprobs = req.output_logprobs[running.num_counted : detokenizer.num_tokens]
            if text or req.finished or logprobs:
                # A stop string found in the tokens of the step that finished the request anyway ends it too.
                finish_reason = "stop" if detokenizer.stopped else req.finish_reason
                num_tokens = detokenizer.num_tokens + (stop_token and not detokenizer.stopped)
                prompt_logprobs = None
                if running.num_counted == 0 and req.sampling_params.prompt_logprobs is not None:
                    prompt_logprobs = req.prompt_logprobs
                output = RequestOutput(text, num_tokens, req.prefix_hit_len, finish_reason, req.error,
                                       logprobs, prompt_logprobs)  # fmt: skip
                running.num_counted = detokenizer.num_tokens
                stream.put(output)
            if req.finished:
                del self._running[stream]
                self._finished(req)

    def _update_metrics(self) -> None:
        num_running = sum(running.req.admitted for running in self._running.values())
        self.metrics.engine_updated(self.engine, num_running, len(self._running) - num_running)

    def _finished(self, req: Req) -> None:
        with self._lock:
            self._num_unfinished -= 1
        self.metrics.request_finished(req)
