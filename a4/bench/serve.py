"""Benchmark: the server under load, measured from outside as SGLang's `bench_serving` and vLLM's
`benchmark_serving` measure one.

It starts `python -m a4 serve` in its own process (or measures a running server, `--base-url`) and streams requests
to it over HTTP with httpx, in two workloads:
- random: at each request rate, requests arriving as a Poisson process (exponential gaps, seeded) for a fixed time;
  prompts of random words (their token counts vary), `ignore_eos`, so that every request generates `max_tokens`;
- multi-turn chat: conversations that share a system prompt, each turn sent once the answer to the previous one has
  come, its history included. A hybrid model reuses a prefix only where the prefix cache kept a state, at the end
  of an earlier request: the hit rate shows it.
For each: time to first token (TTFT), inter-token latency (ITL: the gaps between streamed chunks that carry text)
and end-to-end latency, at p50 / p90 / p99 (ms); requests/s and tokens/s over the run; the prefix-cache hit rate
(`usage.prompt_tokens_details.cached_tokens` over `usage.prompt_tokens`). Bounded in time: arrivals stop after
`seconds_per_rate`, and requests still running `drain_seconds` later are cancelled and counted as unfinished.

Then the random workload again on a second server started with mixed steps the other way round
(`--enable-mixed-chunk` / `--no-enable-mixed-chunk`, `EngineConfig.enable_mixed_chunk`): with them a prompt's prefill
no longer stops every running decode, and ITL's tail shows it. The table gives both, and per rate the ratios of ITL
p99 and output throughput with mixed steps to without (not with `--base-url`, whose server is someone else's).

    python -m a4 bench serve [--quick] [--out DIR] [--model-dir DIR] [--device cuda] [--base-url URL]

Writes serve.json and serve.png (latency and throughput against the request rate).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from a4._overlay import REPO_ROOT
from a4.bench import write_report
from a4.course.exercises import exercise_named_in

PERCENTILES = (50, 90, 99)
SERVER_START_SECONDS = 600  # a real checkpoint on a GPU loads and captures its graphs first
WORDS = (
    "the quick brown fox jumps over lazy dog state cache prefix token model layer attention delta rule request "
    "slot page batch decode prefill stream server client engine memory kernel gate norm chunk step time"
).split()


@dataclass(frozen=True)
class Workload:
    rates: tuple[float, ...]  # requests per second
    seconds_per_rate: float  # arrivals are drawn over this long
    drain_seconds: float  # then requests still running get this long to finish
    prompt_words: tuple[int, int]  # a random prompt has this many words (inclusive range)
    max_tokens: int
    conversations: int  # multi-turn chat: how many, run side by side
    turns: int
    system_words: int
    chat_max_tokens: int
    seed: int = 0

    @staticmethod
    def full() -> Workload:
        return Workload((1, 2, 4, 8, 16), 20, 60, (32, 256), 32, 4, 4, 128, 32)

    @staticmethod
    def quick() -> Workload:
        return Workload((2, 8), 2, 30, (8, 32), 8, 2, 2, 16, 8)


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""


async def stream_request(client: httpx.AsyncClient, path: str, payload: dict) -> RequestResult:
    """One streamed request, timed at every event that carries text."""
    start = time.perf_counter()
    text_times, text, usage = [], [], None
    async with client.stream("POST", path, json={**payload, "stream": True,
                                                  "stream_options": {"include_usage": True}}) as response:  # fmt: skip
        if response.status_code != 200:
            await response.aread()
            return RequestResult(False, f"HTTP {response.status_code}: {response.text[:200]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if "error" in event:
                return RequestResult(False, event["error"]["message"])
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                piece = choice["text"] if "text" in choice else choice["delta"].get("content")
                if piece:
                    text_times.append(time.perf_counter())
                    text.append(piece)
    if usage is None:
        return RequestResult(False, "the stream ended without usage")
    return RequestResult(
        ok=True,
        ttft=text_times[0] - start if text_times else None,
        itl=[later - earlier for earlier, later in zip(text_times, text_times[1:])],
        latency=time.perf_counter() - start,
        prompt_tokens=usage["prompt_tokens"],
        completion_tokens=usage["completion_tokens"],
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        text="".join(text),
    )


def random_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


async def run_rate(base_url: str, rate: float, workload: Workload, rng: random.Random) -> dict:
    """Poisson arrivals at `rate` for workload.seconds_per_rate; returns the rate's summary."""
    arrivals, t = [], rng.expovariate(rate)
    while t < workload.seconds_per_rate:
        arrivals.append(t)
        t += rng.expovariate(rate)
    payloads = [
        {"prompt": random_prompt(rng, rng.randint(*workload.prompt_words)), "max_tokens": workload.max_tokens,
         "temperature": 0, "ignore_eos": True}
        for _ in arrivals
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        # disable=None: no bar where stderr is no terminal (a log file, a notebook).
        progress = tqdm(total=len(arrivals), desc=f"rate {rate:g}/s", unit="req", leave=False, disable=None)

        async def send(at: float, payload: dict) -> RequestResult:
            await asyncio.sleep(at - (time.perf_counter() - start))
            result = await stream_request(client, "/v1/completions", payload)
            progress.update()
            return result

        start = time.perf_counter()
        tasks = [asyncio.create_task(send(at, payload)) for at, payload in zip(arrivals, payloads)]
        done, pending = await asyncio.wait(tasks, timeout=workload.seconds_per_rate + workload.drain_seconds)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        progress.close()
        duration = time.perf_counter() - start
    results = [task.result() for task in tasks if task in done]
    return {"rate": rate, "sent": len(arrivals), "unfinished": len(pending), **summarize(results, duration)}


async def run_multi_turn(base_url: str, workload: Workload, rng: random.Random) -> dict:
    """Conversations side by side, each turn after the previous answer; hit rate per turn."""
    system = random_prompt(rng, workload.system_words)
    users = [[random_prompt(rng, 12) for _ in range(workload.turns)] for _ in range(workload.conversations)]
    by_turn: list[list[RequestResult]] = [[] for _ in range(workload.turns)]
    progress = tqdm(total=workload.conversations * workload.turns, desc="multi-turn chat", unit="req", leave=False,
                    disable=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None) as client:

        async def conversation(questions: list[str]) -> None:
            messages = [{"role": "system", "content": system}]
            for turn, question in enumerate(questions):
                messages.append({"role": "user", "content": question})
                payload = {"messages": messages, "max_tokens": workload.chat_max_tokens, "temperature": 0,
                           "ignore_eos": True}  # fmt: skip
                result = await stream_request(client, "/v1/chat/completions", payload)
                by_turn[turn].append(result)
                progress.update()
                if not result.ok:
                    return
                messages.append({"role": "assistant", "content": result.text})

        start = time.perf_counter()
        await asyncio.wait_for(
            asyncio.gather(*(conversation(questions) for questions in users)),
            timeout=workload.turns * (workload.seconds_per_rate + workload.drain_seconds),
        )
        duration = time.perf_counter() - start
    progress.close()
    return {
        "conversations": workload.conversations,
        "turns": workload.turns,
        **summarize([result for turn in by_turn for result in turn], duration),
        "cache_hit_rate_by_turn": [hit_rate(turn) for turn in by_turn],
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [result for result in results if result.ok]
    prompt_tokens = sum(result.prompt_tokens for result in ok)
    output_tokens = sum(result.completion_tokens for result in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({result.error for result in results if not result.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "cache_hit_rate": hit_rate(ok),
        "ttft_ms": percentiles([result.ttft for result in ok if result.ttft is not None]),
        "itl_ms": percentiles([gap for result in ok for gap in result.itl]),
        "e2e_ms": percentiles([result.latency for result in ok]),
    }


def hit_rate(results: list[RequestResult]) -> float:
    prompt_tokens = sum(result.prompt_tokens for result in results if result.ok)
    return sum(result.cached_tokens for result in results if result.ok) / prompt_tokens if prompt_tokens else 0.0


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 in ms, interpolated between the values (as numpy's percentile); None without values."""
    if len(seconds) < 2:
        return {f"p{p}": seconds[0] * 1e3 if seconds else None for p in PERCENTILES}
    cuts = statistics.quantiles(seconds, n=100, method="inclusive")
    return {f"p{p}": cuts[p - 1] * 1e3 for p in PERCENTILES}


# -------------------------------------------------------------------------------------------------------- server


@contextmanager
def started_server(model_dir: Path | None, device: str | None, options: tuple[str, ...] = ()):
    """`python -m a4 serve` on a free port with these engine options, until the block ends (then SIGINT, as a user
    stops it); yields its URL."""
    command = [sys.executable, "-m", "a4", "serve", "--port", "0", *options]
    if model_dir is not None:
        command += ["--model-dir", str(model_dir)]
    if device is not None:
        command += ["--device", device] + (["--dtype", "bfloat16"] if device.startswith("cuda") else [])
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    log: list[str] = []
    started = threading.Event()

    def read_log() -> None:
        for line in process.stderr:
            log.append(line)
            if "Uvicorn running on " in line:
                started.set()

    threading.Thread(target=read_log, daemon=True).start()
    try:
        deadline = time.monotonic() + SERVER_START_SECONDS
        while not started.wait(0.2):
            if process.poll() is not None or time.monotonic() > deadline:
                # The server runs the student's Qwen3.5: an unwritten exercise is said as the other benches say it.
                if (missing := exercise_named_in("".join(log))) is not None:
                    raise NotImplementedError(missing)
                raise RuntimeError("the server did not start:\n" + "".join(log[-20:]))
        yield next(line for line in log if "Uvicorn running on " in line).split("Uvicorn running on ")[1].split()[0]
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def engine_default(option: str) -> object:
    """EngineConfig's default for one option (what a server started without its flag runs)."""
    from dataclasses import fields

    from a4.engine.config import EngineConfig

    return next(f.default for f in fields(EngineConfig) if f.name == option)


# -------------------------------------------------------------------------------------------------------- report


def print_table(report: dict) -> None:
    print(f"\nserving {report['model']} ({report['device']}); random workload, {report['workload']['max_tokens']} "
          "tokens per request, ignore_eos")  # fmt: skip
    print(f"{'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} {'TTFT p50/p90/p99 ms':>22} "
          f"{'ITL p50/p90/p99 ms':>20} {'E2E p50/p90/p99 ms':>22}")  # fmt: skip
    for row in report["rates"]:
        cells = [" / ".join("-" if v is None else f"{v:.0f}" for v in row[key].values())
                 for key in ("ttft_ms", "itl_ms", "e2e_ms")]  # fmt: skip
        print(f"{row['rate']:>6g} {row['completed']:>5} {row['request_throughput']:>6.2f} "
              f"{row['output_token_throughput']:>9.1f} {cells[0]:>22} {cells[1]:>20} {cells[2]:>22}")  # fmt: skip
    if "mixed_chunk" in report:
        print("mixed steps (enable_mixed_chunk), the random workload on two servers: ITL p99 ms and output tok/s")
        off, on = report["mixed_chunk"]["off"], report["mixed_chunk"]["on"]
        for without, mixed in zip(off, on):
            itl = [row["itl_ms"]["p99"] for row in (without, mixed)]
            tokens = [row["output_token_throughput"] for row in (without, mixed)]
            ratio = "-" if None in itl else f"{itl[1] / itl[0]:.2f}x"
            print(f"{without['rate']:>6g}  ITL p99 {_ms(itl[0])} without, {_ms(itl[1])} with ({ratio}); output "
                  f"{tokens[0]:.1f} / {tokens[1]:.1f} tok/s ({tokens[1] / max(tokens[0], 1e-9):.2f}x)")  # fmt: skip
    chat = report["multi_turn"]
    by_turn = ", ".join(f"{rate:.0%}" for rate in chat["cache_hit_rate_by_turn"])
    print(f"multi-turn chat: {chat['conversations']} conversations x {chat['turns']} turns, prefix-cache hit rate "
          f"{chat['cache_hit_rate']:.0%} (by turn: {by_turn}), TTFT p50 {chat['ttft_ms']['p50']:.0f} ms")  # fmt: skip


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    rows = report["rates"]
    rates = [row["rate"] for row in rows]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    for ax, key, title in zip(axes, ("ttft_ms", "itl_ms", "e2e_ms"), ("time to first token", "inter-token latency",
                                                                        "end-to-end latency")):  # fmt: skip
        for p in PERCENTILES:
            values = [row[key][f"p{p}"] for row in rows]
            ax.plot(rates, [float("nan") if v is None else v for v in values], marker="o", label=f"p{p}")
        ax.set(xscale="log", yscale="log", xlabel="request rate (req/s)", ylabel="ms", title=title)
        ax.legend(fontsize=8)
    ax = axes[3]
    ax.plot(rates, [row["output_token_throughput"] for row in rows], marker="o", label="output tokens/s")
    ax.plot(rates, [row["total_token_throughput"] for row in rows], marker="o", label="prompt + output tokens/s")
    ax.set(xscale="log", xlabel="request rate (req/s)", ylabel="tokens/s", title="throughput")
    ax.legend(fontsize=8)
    fig.suptitle(f"a4 serve: {report['model']} on {report['device']} (Poisson arrivals, "
                 f"{report['workload']['max_tokens']} output tokens per request)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    quick: bool = False, out_dir: Path | None = None, model_dir: Path | None = None, device: str | None = None,
    base_url: str | None = None,
) -> dict:  # fmt: skip
    """Measure, print the table, write serve.json and serve.png into out_dir (when given); returns the JSON."""
    if base_url is not None and (model_dir is not None or device is not None):
        raise ValueError("--base-url measures a running server: --model-dir and --device are the server's options")
    workload = Workload.quick() if quick else Workload.full()
    rng = random.Random(workload.seed)
    with started_server(model_dir, device) if base_url is None else nullcontext(base_url.rstrip("/")) as url:
        [model] = httpx.get(f"{url}/v1/models").json()["data"]
        # One request first, so that the first rate does not pay for warming up (allocations, a GPU's kernels).
        httpx.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=None)
        rows = [asyncio.run(run_rate(url, rate, workload, rng)) for rate in workload.rates]
        multi_turn = asyncio.run(run_multi_turn(url, workload, rng))
        default_mixed = engine_default("enable_mixed_chunk")
    mixed_chunk = None
    if base_url is None:
        flag = "--no-enable-mixed-chunk" if default_mixed else "--enable-mixed-chunk"
        with started_server(model_dir, device, (flag,)) as url:
            httpx.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=None)
            # The same arrivals and prompts as the first server's rates.
            rng = random.Random(workload.seed)
            other = [asyncio.run(run_rate(url, rate, workload, rng)) for rate in workload.rates]
        mixed_chunk = {"on": rows, "off": other} if default_mixed else {"on": other, "off": rows}
    report = {
        "benchmark": "serve",
        "model": model["id"],
        "device": device or ("cpu" if base_url is None else f"server at {base_url}"),
        "workload": asdict(workload),
        "rates": rows,
        "multi_turn": multi_turn,
        **({"mixed_chunk": mixed_chunk} if mixed_chunk is not None else {}),
    }
    print_table(report)
    if out_dir is not None:
        write_report(out_dir, "serve", report, plot)
    return report
