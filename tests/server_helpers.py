"""What the server's tests share: a server running in this process or launched as a user does, clients of it, and
transformers' greedy text as the reference."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from a4.models.config import load_model_config
from a4.reference import hf_greedy
from a4.server.inprocess import RunningApp, parse_metrics

REPO = Path(__file__).resolve().parent.parent
WAIT_SECONDS = 60  # bound on any wait: server start, a slot freed, a process exit
MODEL = "qwen3_5-tiny"  # the name the server gives the model: its directory's


@contextmanager
def running_server(app):
    """Run the app under uvicorn in a thread of this process (as notebook 12 does); yields its base URL."""
    running = RunningApp(app)
    try:
        yield running.url
    finally:
        running.stop(WAIT_SECONDS)  # raises if uvicorn did not shut down


class LaunchedServer:
    """`python -m a4 serve` in a child process: its base URL, and its stderr so far (`log`)."""

    def __init__(self, process: subprocess.Popen, base_url: str, reader: threading.Thread, lines: queue.Queue,
                 log: list[str]) -> None:  # fmt: skip
        self.process, self.base_url = process, base_url
        self._reader, self._lines, self._log = reader, lines, log

    @property
    def log(self) -> str:
        if self.process.poll() is not None:
            self._reader.join(WAIT_SECONDS)  # the rest of what it wrote
        self._log += [self._lines.get() for _ in range(self._lines.qsize())]
        return "".join(self._log)


@contextmanager
def launched_server(model_dir: Path, *flags: str, env: dict[str, str] | None = None):
    """Start `python -m a4 serve` on a free port and wait until uvicorn serves; kill it on the way out if it is still
    running (then the test fails: the test was to stop it)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "a4", "serve", "--model-dir", str(model_dir), "--port", "0", *flags],
        cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True)
    reader.start()
    log: list[str] = []
    try:
        base_url = None
        deadline = time.monotonic() + WAIT_SECONDS
        while base_url is None and time.monotonic() < deadline and process.poll() is None:
            try:
                log.append(line := lines.get(timeout=1))
            except queue.Empty:
                continue
            if "Uvicorn running on " in line:
                base_url = line.split("Uvicorn running on ")[1].split()[0]
        assert base_url is not None, "the server did not start:\n" + "".join(log)
        yield LaunchedServer(process, base_url, reader, lines, log)
    finally:
        if process.poll() is None:
            process.kill()
            pytest.fail(f"the server was still running at the end of the test:\n{''.join(log)}")


def wait_for(condition, what: str, seconds: float = WAIT_SECONDS) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {seconds} s for {what}")
        time.sleep(0.02)


def client(base_url: str, api_key: str = "none") -> openai.OpenAI:
    # No retries: a 503 must reach the test.
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=api_key, max_retries=0)


def reference(model_dir, tokenizer, prompt_ids: list[int], max_tokens: int) -> tuple[str, str, int]:
    """transformers' greedy continuation: its text, OpenAI's finish reason, its number of tokens."""
    [ids] = hf_greedy(model_dir, [prompt_ids], max_tokens)
    stopped = ids[-1] in load_model_config(model_dir).eos_token_ids
    finish = "length" if len(ids) == max_tokens and not stopped else "stop"
    return tokenizer.decode(ids, skip_special_tokens=True), finish, len(ids)


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def metric_values(base_url: str) -> dict[str, float]:
    """GET /metrics: the `a4:` samples by name (labelled ones with their labels)."""
    return parse_metrics(httpx.get(f"{base_url}/metrics").text)


@contextmanager
def long_stream(base_url: str, headers: dict[str, str] | None = None):
    """A streamed request that would run for a long time, open until the block ends (then the client hangs up);
    yields the iterator of its lines after the first event."""
    body = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers,
                      timeout=WAIT_SECONDS) as response:  # fmt: skip
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        yield lines
