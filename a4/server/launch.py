"""Putting the server together: the engine of a checkpoint, its loop, its metrics and the app; uvicorn runs it.

uvicorn handles SIGINT and SIGTERM: it stops accepting connections, waits for the open ones to finish, then runs the
app's lifespan shutdown. `Server` stops the engine loop first, which aborts every request in flight, so that their
responses end at once (a stream with an error event and `[DONE]`) instead of running on; a connection still open after
SHUTDOWN_GRACE_SECONDS is cancelled.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI

from a4.core import SamplingParams
from a4.engine.engine import Engine, EngineConfig
from a4.engine.stats import EngineStats
from a4.server.app import create_app
from a4.server.engine_loop import EngineLoop
from a4.server.limits import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_REQUEST_TIMEOUT, HeadersTimeoutProtocol
from a4.server.metrics import ServerMetrics

DEFAULT_MAX_QUEUED_REQUESTS = 128
SHUTDOWN_GRACE_SECONDS = 5
# The warm-up's batches, as prompt lengths: one short prompt, a varlen prefill of three, then eight side by side (a
# prefill of many sequences, chunked where max_prefill_tokens is smaller, and decode batches up to eight).
WARM_UP_BATCHES = ((8,), (5, 40, 130), (3, 17, 64, 100, 150, 200, 250, 300))


def default_model_dir() -> Path:
    """The trained tiny Qwen3.5, which has a tokenizer and a chat template (the random tiny checkpoints have none)."""
    from a4.checkpoints import tiny_checkpoint

    return tiny_checkpoint("qwen3_5", trained=True)


def build_app(
    model_dir: str | Path,
    tokenizer,
    *,
    served_model_name: str | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    enable_special_tokens_in_messages: bool = False,
    **engine_options: Any,
) -> FastAPI:
    """The app serving the checkpoint in model_dir; `engine_options`: EngineConfig's fields. The model's name in the
    API is `served_model_name`, by default the directory's name; the other options are `create_app`'s."""
    if isinstance(max_queued_requests, bool) or not isinstance(max_queued_requests, int) or max_queued_requests < 0:
        raise ValueError(f"max_queued_requests must be a non-negative integer, got {max_queued_requests!r}")
    # Checked before the engine loads (the middlewares are only built when uvicorn starts).
    if api_key == "":
        raise ValueError("the API key must not be empty (no key: leave it out)")
    if isinstance(max_request_bytes, bool) or not isinstance(max_request_bytes, int) or max_request_bytes <= 0:
        raise ValueError(f"max_request_bytes must be a positive integer, got {max_request_bytes!r}")
    if not request_timeout > 0:
        raise ValueError(f"request_timeout must be a positive number of seconds, got {request_timeout!r}")
    engine = Engine(EngineConfig(model_dir, **engine_options))
    if engine.runner.device.type == "cuda":
        warm_up(engine)
    engine_loop = EngineLoop(engine, tokenizer.backend_tokenizer, ServerMetrics(engine), max_queued_requests)
    return create_app(
        engine_loop, tokenizer, served_model_name or Path(model_dir).name, api_key=api_key,
        max_request_bytes=max_request_bytes, request_timeout=request_timeout,
        enable_special_tokens_in_messages=enable_special_tokens_in_messages,
    )  # fmt: skip


def warm_up(engine: Engine) -> None:
    """Run a few throwaway batches (WARM_UP_BATCHES) before serving, then zero the engine's counters.

    Why: on a GPU, Triton compiles a kernel the first time it meets a new specialisation of its arguments, and
    flash-linear-attention autotunes its prefill kernels then too. Without a warm-up those seconds land on the first
    requests to bring each shape: on an H200, `bench serve` saw a time to first token of 33 s at its third request
    rate. SGLang warms its server up the same way before it reports ready."""
    vocab = engine.model_config.vocab_size
    for lengths in WARM_UP_BATCHES:
        prompts = [[(31 * i + 7 * n) % vocab for i in range(n)] for n in lengths]
        reqs = [engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in prompts]
        engine.run(reqs)
    engine.stats = EngineStats()


def uvicorn_config(app: FastAPI, **options: Any) -> uvicorn.Config:
    """uvicorn's config for an app of `build_app`: its HTTP/1.1 protocol drops a request whose headers take longer
    than the app's request timeout (limits.py)."""
    protocol = HeadersTimeoutProtocol.with_headers_timeout(app.state.request_timeout)
    return uvicorn.Config(app, http=protocol, **options)


class Server(uvicorn.Server):
    """uvicorn's server, which ends the app's requests in flight as it begins to shut down."""

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.config.app.state.engine_loop.stop)
        await super().shutdown(sockets)


def run_server(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM, then return (port 0: a free port, which uvicorn's "running on" line names).

    Once shut down, uvicorn raises the signal it caught again, for the handler that was there before it: SIGTERM is
    given Python's SIGINT handler, so that both end here as a KeyboardInterrupt and the process exits normally."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        Server(uvicorn_config(app, host=host, port=port, timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)).run()
    except KeyboardInterrupt:
        pass
