"""Notebook 12's helpers (serving; the notebook has no exercise, so no check): watch a server's load while clients
talk to it, and a small `bench serve` run against a server of this process.

The server itself is `a4.server.inprocess.InProcessServer`; the workload and its figures are `a4.bench.serve`'s.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from a4.bench.serve import Workload, run_rate
from a4.server.inprocess import InProcessServer, parse_metrics


class LoadWatcher:
    """Reads the server's /metrics every `every` seconds while the `with` block runs: `samples` is a list of
    (time.perf_counter() halfway through the request, a4:num_requests_running, a4:num_requests_waiting)."""

    def __init__(self, server: InProcessServer, every: float = 0.01) -> None:
        self.server, self.every = server, every
        self.samples: list[tuple[float, float, float]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="load-watcher", daemon=True)

    def _watch(self) -> None:
        with httpx.Client(base_url=self.server.url) as client:  # one connection for all the reads
            while not self._done.is_set():
                sent = time.perf_counter()
                metrics = parse_metrics(client.get("/metrics").text)
                self.samples.append(((sent + time.perf_counter()) / 2, metrics["a4:num_requests_running"],
                                     metrics["a4:num_requests_waiting"]))  # fmt: skip
                self._done.wait(self.every)

    def __enter__(self) -> LoadWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._done.set()
        self._thread.join()


def bench_rates(
    server: InProcessServer, rates: tuple[float, ...], seconds_per_rate: float, max_tokens: int,
    prompt_words: tuple[int, int] = (8, 32), seed: int = 0,
) -> list[dict]:  # fmt: skip
    """`python -m a4 bench serve`'s random workload against `server`, at each rate: Poisson arrivals for
    `seconds_per_rate`, prompts of random words, `max_tokens` tokens each (ignore_eos). One summary per rate, as in
    serve.json: TTFT / ITL / E2E percentiles in ms, throughputs."""
    workload = Workload(tuple(rates), seconds_per_rate, drain_seconds=30, prompt_words=prompt_words,
                        max_tokens=max_tokens, conversations=0, turns=0, system_words=0, chat_max_tokens=0, seed=seed)  # fmt: skip
    rng = random.Random(seed)

    def run_all() -> list[dict]:
        return [asyncio.run(run_rate(server.url, rate, workload, rng)) for rate in rates]

    # In a thread: a notebook's kernel already runs an event loop in this one, where asyncio.run is refused.
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run_all).result()
