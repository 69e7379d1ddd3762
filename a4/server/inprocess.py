"""A server inside this Python process: uvicorn in a thread on 127.0.0.1, on a free port (for notebooks and tests).

`RunningApp(app)` serves an app built by `build_app` until `stop` is called; `InProcessServer` is that plus the
app, built from a checkpoint and the engine's options:

    with InProcessServer(tiny_checkpoint("qwen3_5", trained=True), max_running_requests=4) as server:
        server.client().completions.create(model=server.model, prompt="The fox", max_tokens=8, temperature=0)

`InProcessServer(...)` only records its options; `start()` (or the first `url`, `client()`, `engine`) builds the
engine and starts serving, so a notebook can create one in a cell that must not fail and use it where the engine's
exercises may still be missing. `stop()` is the clean shutdown of `python -m a4 serve` (requests in flight aborted,
the engine loop's thread and uvicorn's ended); the threads are daemons, so that a kernel that exits without it does
not hang.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI

from a4.server.launch import Server, build_app, default_model_dir, uvicorn_config

START_SECONDS = 60


class RunningApp:
    """An app served by uvicorn in a daemon thread of this process, from construction until `stop`."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._server = Server(uvicorn_config(app, host="127.0.0.1", port=0, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = START_SECONDS) -> None:
        """Shut down as on SIGINT and wait for uvicorn's thread (and the engine loop's, which its shutdown stops)."""
        self._server.should_exit = True
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"uvicorn did not shut down within {timeout:g} s")


def parse_metrics(text: str) -> dict[str, float]:
    """The `a4:` samples of a /metrics answer (Prometheus' text format) by name, less the counters' creation times."""
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("a4:"))
    return {name: float(value) for name, value in samples if not name.split("{")[0].endswith("_created")}


class InProcessServer:
    """`python -m a4 serve` in this process: a checkpoint with a tokenizer (default: the trained tiny Qwen3.5) and
    the engine's options (EngineConfig's fields, and max_queued_requests)."""

    def __init__(self, model_dir: str | Path | None = None, **options: Any) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.model = self.model_dir.name  # the model's name in the API
        self.options = options
        self._running: RunningApp | None = None

    def start(self) -> InProcessServer:
        """Build the engine and serve; does nothing if already serving."""
        if self._running is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            self._running = RunningApp(build_app(self.model_dir, tokenizer, **self.options))
        return self

    @property
    def running(self) -> bool:
        return self._running is not None and self._running.alive

    @property
    def url(self) -> str:
        return self.start()._running.url

    @property
    def engine(self):
        """The engine being served (its `stats`, `memory_plan`); read it, but call it only from the engine loop."""
        return self.start()._running.app.state.engine_loop.engine

    def client(self, asynchronous: bool = False):
        """An `openai` client of this server (no retries: an error reaches the caller)."""
        import openai

        kind = openai.AsyncOpenAI if asynchronous else openai.OpenAI
        return kind(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def metrics(self) -> dict[str, float]:
        """GET /metrics: the `a4:` samples by name (labelled ones with their labels), less the counters' creation
        times."""
        import httpx

        return parse_metrics(httpx.get(f"{self.url}/metrics").text)

    def stop(self) -> None:
        """Shut down (requests in flight are aborted); a server never started or already stopped is left alone."""
        if self._running is not None:
            running, self._running = self._running, None
            running.stop()

    def __enter__(self) -> InProcessServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
