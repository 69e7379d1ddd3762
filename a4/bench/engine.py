"""Benchmark: a4's engine against transformers' `generate`, on the same Qwen3.5-0.8B-shape checkpoint.

Three workloads, in float32 and in bfloat16, each run by both systems side by side (one a4 run, then one
transformers run, and again), greedy, end of sequence ignored so that every request makes all its tokens:
- prefill: one 512-token prompt, one new token; tokens/s = 512 / median wall time of the runs (time to first token);
- decode at batch 1: one 128-token prompt, 64 new tokens; tokens/s = 1 / median time of a decode step;
- decode at batch 8: 8 prompts of 16, 32, ..., 128 tokens, 64 new tokens each; tokens/s = 8 / median time of a
  decode step. a4 batches them its own way (no padding); transformers gets one left-padded batch.
A decode step is timed from outside: a4's `Engine.step()` (scheduling, forward, sampling), and for transformers the
time between two consecutive calls of a logits processor (forward and the rest of `generate`'s loop).

a4 runs with its defaults except that the prefix cache is off (the prefill runs repeat one prompt). Memory: a4's
peak resident memory (the RSS high-water mark) above what the process held before the model was loaded, against the
weights and the pools the memory plan allocated. It is read after a4 has run every workload once and before
transformers is loaded; each dtype runs in a fresh process, so that each peak is its own.

The floor, measured in the same process after the timings (`a4.bench._floor`): this machine's GEMM rate at the
shapes of the model's MLP (the prefill's tokens times its first projection) and its memory bandwidth (a large copy).
Each workload is reported as a fraction of its floor: prefill against the time of its weight GEMMs at that rate,
decode against the time of moving its bytes (weights and KV read, GDN states read and written) at that bandwidth.

    python -m a4 bench engine [--quick] [--out DIR]
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import sdpa_kernel

from a4.bench import write_report
from a4.bench._floor import ModelBytes, copy_bytes_per_second, gemm_flop_per_second
from a4.checkpoints import make_checkpoint
from a4.dtypes import DTYPES
from a4.layers.attention import SDPA_BACKENDS

SYSTEMS = ("a4", "transformers")
WORKLOADS = ("prefill", "decode batch 1", "decode batch 8")


@dataclass(frozen=True)
class Workload:
    prefill_len: int  # the prompt of the prefill workload
    decode_len: int  # the prompt of the batch-1 decode workload
    batch_lens: tuple[int, ...]  # the prompts of the batched decode workload
    new_tokens: int  # generated per request in both decode workloads
    repeats: int  # prefill runs per system after the warm-up
    copy_bytes: int  # of the copy that measures the memory bandwidth: well beyond the CPU's caches

    @staticmethod
    def full() -> Workload:
        return Workload(512, 128, tuple(range(16, 129, 16)), new_tokens=64, repeats=3, copy_bytes=512 << 20)

    @staticmethod
    def quick() -> Workload:
        return Workload(32, 16, tuple(range(4, 33, 4)), new_tokens=8, repeats=1, copy_bytes=16 << 20)


def resident_bytes(field: str) -> int:
    """This process's resident memory now ("VmRSS") or at its highest ("VmHWM"), from Linux's /proc/self/status.

    /proc rather than getrusage's ru_maxrss: a spawned process's ru_maxrss starts at its parent's size when it was
    forked, which can hide the peak of a small model. Elsewhere both fall back to ru_maxrss (the peak only).
    """
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # KiB on Linux, bytes on macOS
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1)) * 1024


def random_prompts(lengths: tuple[int, ...], vocab_size: int, stop_tokens: tuple[int, ...], seed: int) -> list:
    """Prompts of the given lengths, tokens drawn uniformly from the vocabulary without its stop tokens."""
    allowed = torch.ones(vocab_size, dtype=torch.bool)
    allowed[list(stop_tokens)] = False
    tokens = allowed.nonzero()[:, 0]
    gen = torch.Generator().manual_seed(seed)
    return [tokens[torch.randint(len(tokens), (length,), generator=gen)].tolist() for length in lengths]


class A4Runner:
    """a4's engine, driven step by step so that each decode step can be timed."""

    def __init__(
        self,
        model_dir: Path,
        dtype: str,
        max_prefill_tokens: int,
        device: str = "cpu",
        max_running_requests: int = 8,
        cuda_graphs: bool | None = None,
        **options: Any,
    ) -> None:
        """`options`: more of LLM's options (`bench spec`: speculative_tokens and a drafter)."""
        from a4 import LLM

        # No prefix cache: the prefill runs repeat one prompt, which must be computed every time. cuda_graphs: None
        # is the engine's default (see EngineConfig).
        self.llm = LLM(
            model_dir,
            dtype=dtype,
            device=device,
            max_running_requests=max_running_requests,
            max_prefill_tokens=max_prefill_tokens,
            enable_prefix_cache=False,
            cuda_graphs=cuda_graphs,
            **options,
        )

    def prefill(self, prompt: list[int]) -> None:
        from a4 import SamplingParams

        self.llm.generate([prompt], SamplingParams(max_new_tokens=1, ignore_eos=True))

    def decode_step_seconds(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Wall time of every decode step while the prompts generate new_tokens each (prefill steps left out).

        Each decode step must decode every request not yet finished: an engine with too few request slots or KV
        pages for the batch decodes part of it while the rest waits, and its steps would be timed as the batch's."""
        from a4 import SamplingParams

        engine, stats = self.llm.engine, self.llm.engine.stats
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        reqs = [engine.add_request(prompt, params) for prompt in prompts]
        seconds = []
        while not all(req.finished for req in reqs):
            decode_steps, decoded = stats.decode_steps, stats.decode_request_steps
            unfinished = sum(not req.finished for req in reqs)
            start = time.perf_counter()
            engine.step()
            if stats.decode_steps > decode_steps:
                seconds.append(time.perf_counter() - start)
                if stats.decode_request_steps - decoded != unfinished:
                    for req in reqs:
                        engine.abort_req(req)
                    plan = engine.memory_plan
                    raise RuntimeError(
                        f"a decode step ran {stats.decode_request_steps - decoded} of the {unfinished} unfinished "
                        f"requests of a batch of {len(prompts)}: the engine holds {plan.max_running_requests} request "
                        f"slots and {plan.num_pages:,} KV pages of {plan.page_size} tokens, too few for it "
                        "(max_running_requests, memory_budget_bytes or the device's memory)"
                    )
        return seconds

    def memory(self) -> dict[str, int]:
        """Bytes of the weights, of the pools as allocated and as planned."""
        engine = self.llm.engine
        weights = sum(p.nbytes for p in engine.model.parameters())  # a tied lm_head is one parameter, counted once
        pools = engine.kv_pool.total_bytes + engine.table_manager.req_to_token.nbytes
        if engine.state_pool is not None:
            pools += engine.state_pool.total_bytes
        return {"weights": weights, "pools_allocated": pools, "pools_planned": engine.memory_plan.used_bytes}


class TransformersRunner:
    """transformers' `generate` on the same checkpoint (its default attention, sdpa)."""

    def __init__(self, model_dir: Path, dtype: str, device: str = "cpu") -> None:
        import transformers
        from transformers import LogitsProcessor

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()  # its note on the missing fla kernels comes with every call
        architecture = json.loads((Path(model_dir) / "config.json").read_text())["architectures"][0]
        # Not a4.reference's model: that one runs "eager" attention, for exact references; users get sdpa.
        model_class = getattr(transformers, architecture)
        self.device = torch.device(device)
        self.model = model_class.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(self.device).eval()

        class Clock(LogitsProcessor):
            """Called once per generated token, just after the forward that produced its logits."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def __call__(self, input_ids, scores):
                self.times.append(time.perf_counter())
                return scores

        self.clock_class = Clock

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        """Left-pad the prompts into one batch, generate; the times at which each token's logits were ready."""
        longest = max(len(p) for p in prompts)
        pad = 0
        input_ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=self.device)
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        clock = self.clock_class()
        # On a CPU, the SDPA kernels a4's attention uses: torch's flash kernel fails in bfloat16 where
        # ATEN_CPU_CAPABILITY emulates a lesser CPU (see a4.layers.attention). A GPU keeps transformers' own choice.
        kernels = sdpa_kernel(SDPA_BACKENDS) if self.device.type == "cpu" else contextlib.nullcontext()
        with torch.no_grad(), kernels:
            self.model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # as a4's ignore_eos: every request makes all its tokens
                do_sample=False,
                temperature=None,
                top_k=None,
                top_p=None,
                pad_token_id=pad,
                logits_processor=[clock],
            )
        return clock.times

    def prefill(self, prompt: list[int]) -> None:
        self.generate([prompt], 1)

    def decode_step_seconds(self, prompts: list[list[int]], new_tokens: int) -> list[float]:
        times = self.generate(prompts, new_tokens)
        return [later - earlier for earlier, later in zip(times, times[1:])]


def measure(model_dir: str, dtype: str, workload: Workload, threads: int) -> dict:
    """Both systems on every workload in one dtype. Runs in a fresh process (see the module docstring)."""
    from a4.models.config import load_model_config

    torch.set_num_threads(threads)
    config = load_model_config(model_dir)
    lengths = (workload.prefill_len, workload.decode_len, *workload.batch_lens)
    prefill_prompt, decode_prompt, *batch = random_prompts(lengths, config.vocab_size, config.eos_token_ids, seed=0)

    baseline = resident_bytes("VmRSS")
    a4 = A4Runner(model_dir, dtype, max_prefill_tokens=max(workload.prefill_len, sum(workload.batch_lens)))
    # Warm-up: every workload once (first-call costs), which is also everything a4 will allocate.
    a4.prefill(prefill_prompt)
    a4.decode_step_seconds([decode_prompt], 2)
    a4.decode_step_seconds(batch, 2)
    memory = {**a4.memory(), "peak_rss_above_baseline": resident_bytes("VmHWM") - baseline}
    memory["peak_over_weights_and_planned_pools"] = memory["peak_rss_above_baseline"] / (
        memory["weights"] + memory["pools_planned"]
    )

    hf = TransformersRunner(model_dir, dtype)
    hf.prefill(prefill_prompt)
    hf.decode_step_seconds([decode_prompt], 2)

    runners = {"a4": a4, "transformers": hf}
    prefill_seconds: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    for _ in range(workload.repeats):
        for name, runner in runners.items():
            start = time.perf_counter()
            runner.prefill(prefill_prompt)
            prefill_seconds[name].append(time.perf_counter() - start)
    decode_seconds: dict[str, dict[str, list[float]]] = {name: {} for name in SYSTEMS}
    for label, prompts in (("decode batch 1", [decode_prompt]), ("decode batch 8", batch)):
        for name, runner in runners.items():
            decode_seconds[name][label] = runner.decode_step_seconds(prompts, workload.new_tokens)

    tokens_per_s = {
        name: {
            "prefill": workload.prefill_len / statistics.median(prefill_seconds[name]),
            "decode batch 1": 1 / statistics.median(decode_seconds[name]["decode batch 1"]),
            "decode batch 8": len(batch) / statistics.median(decode_seconds[name]["decode batch 8"]),
        }
        for name in SYSTEMS
    }
    floor = machine_floor(a4.llm.engine.model, config, dtype, workload)
    return {
        "tokens_per_s": tokens_per_s,
        "a4_over_transformers": {w: tokens_per_s["a4"][w] / tokens_per_s["transformers"][w] for w in WORKLOADS},
        "floor": floor,
        "fraction_of_floor": {name: fraction_of_floor(tokens_per_s[name], floor, workload) for name in SYSTEMS},
        "prefill_seconds": prefill_seconds,
        "decode_step_seconds": decode_seconds,
        "memory": memory,
    }


def machine_floor(model: torch.nn.Module, config, dtype: str, workload: Workload) -> dict:
    """This machine's GEMM rate at the shapes of the model's MLP (the prompt's tokens times its first projection) and
    its memory bandwidth, with the bytes and FLOP the model's steps need (`ModelBytes`)."""
    from a4.models.registry import resolve_dtype

    torch_dtype, cpu = resolve_dtype(dtype), torch.device("cpu")
    m, k, n = workload.prefill_len, config.hidden_size, config.intermediate_size
    return {
        "gemm_shape": [m, k, n],
        "gemm_flop_per_s": gemm_flop_per_second(m, k, n, torch_dtype, cpu, repeats=5),
        "copy_bytes_per_s": copy_bytes_per_second(workload.copy_bytes, cpu, repeats=5),
        **asdict(ModelBytes.of(model, config, torch_dtype)),
    }


def fraction_of_floor(tokens_per_s: dict[str, float], floor: dict, workload: Workload) -> dict[str, float]:
    """Each workload's floor time over its measured time (see `a4.bench._floor`), from one system's tokens/s.

    Prefill: its weight GEMMs at the GEMM rate. Decode: its bytes (context: the mean over the timed steps) at the
    copy bandwidth.
    """
    model = ModelBytes.from_dict(floor)
    prefill_seconds = workload.prefill_len / tokens_per_s["prefill"]
    fractions = {"prefill": model.prefill_flop(workload.prefill_len) / floor["gemm_flop_per_s"] / prefill_seconds}
    for label, lens in (("decode batch 1", (workload.decode_len,)), ("decode batch 8", workload.batch_lens)):
        step_seconds = len(lens) / tokens_per_s[label]
        context = statistics.mean(lens) + workload.new_tokens / 2
        fractions[label] = model.decode_bytes(len(lens), context) / floor["copy_bytes_per_s"] / step_seconds
    return fractions


def print_table(report: dict) -> None:
    print(
        f"a4 vs transformers, {report['shapes']} (random weights), {report['threads']} CPU threads: tokens/s "
        "(prefill: median of the runs; decode: median step)"
    )
    print(f"{'dtype':>9} {'workload':>15} {'a4':>10} {'transformers':>13} {'a4 / transformers':>18}")
    for dtype, result in report["results"].items():
        for workload in WORKLOADS:
            rates = [result["tokens_per_s"][name][workload] for name in SYSTEMS]
            ratio = result["a4_over_transformers"][workload]
            print(f"{dtype:>9} {workload:>15} {rates[0]:>10.1f} {rates[1]:>13.1f} {ratio:>17.2f}x")
    print(
        "\nfraction of this machine's floor (prefill: weight GEMMs at the GEMM rate measured here; decode: bytes read "
        "at the copy bandwidth measured here)"
    )
    print(f"{'dtype':>9} {'workload':>15} {'a4':>10} {'transformers':>13}   floor measured")
    for dtype, result in report["results"].items():
        floor = result["floor"]
        gemm = " x ".join(map(str, floor["gemm_shape"]))
        peaks = {
            "prefill": f"{floor['gemm_flop_per_s'] / 1e9:,.0f} GFLOP/s (GEMM {gemm})",
            "decode": f"{floor['copy_bytes_per_s'] / 1e9:,.1f} GB/s (copy)",
        }
        for workload in WORKLOADS:
            fractions = [result["fraction_of_floor"][name][workload] for name in SYSTEMS]
            peak = peaks[workload.split()[0]]
            print(f"{dtype:>9} {workload:>15} {fractions[0]:>10.0%} {fractions[1]:>13.0%}   {peak}")
    for dtype, result in report["results"].items():
        m = result["memory"]
        print(
            f"a4 memory, {dtype}: peak RSS {gib(m['peak_rss_above_baseline'])} above the process before loading; "
            f"weights {gib(m['weights'])} + pools planned {gib(m['pools_planned'])} (allocated "
            f"{gib(m['pools_allocated'])}): peak / (weights + planned pools) = "
            f"{m['peak_over_weights_and_planned_pools']:.2f}"
        )


def gib(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"


def draw(report: dict, axes) -> None:
    """Throughput bars (a4 beside transformers) and a4's memory against weights + pools, on two matplotlib axes."""
    rates_ax, memory_ax = axes
    labels = [f"{workload}\n{dtype}" for dtype in report["results"] for workload in WORKLOADS]
    width = 0.4
    for offset, name in ((-width / 2, "a4"), (width / 2, "transformers")):
        rates = [r["tokens_per_s"][name][w] for r in report["results"].values() for w in WORKLOADS]
        bars = rates_ax.bar([i + offset for i in range(len(labels))], rates, width, label=name)
        if name == "a4":
            ratios = [r["a4_over_transformers"][w] for r in report["results"].values() for w in WORKLOADS]
            rates_ax.bar_label(bars, [f"{x:.2f}x" for x in ratios], fontsize=7)
    rates_ax.set_xticks(range(len(labels)), labels, fontsize=7)
    rates_ax.set_ylabel("tokens/s")
    rates_ax.set_title("throughput (labels: a4 / transformers)", loc="left", fontsize=10)
    rates_ax.legend(fontsize=8)

    dtypes = list(report["results"])
    memory = [report["results"][d]["memory"] for d in dtypes]
    weights = [m["weights"] / 2**30 for m in memory]
    pools = [m["pools_planned"] / 2**30 for m in memory]
    memory_ax.bar(dtypes, weights, label="weights")
    memory_ax.bar(dtypes, pools, bottom=weights, label="pools (planned)")
    memory_ax.scatter(dtypes, [m["peak_rss_above_baseline"] / 2**30 for m in memory], color="black", zorder=3,
                      label="peak RSS (above baseline)")  # fmt: skip
    memory_ax.set_ylabel("GiB")
    memory_ax.set_title("a4's memory", loc="left", fontsize=10)
    memory_ax.legend(fontsize=8, loc="lower center")


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), gridspec_kw={"width_ratios": [3, 1]})
    draw(report, axes)
    fig.suptitle(f"a4 vs transformers on CPU, {report['shapes']}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure, print the table, write engine.json and engine.png into out_dir (when given); returns the JSON."""
    workload = Workload.quick() if quick else Workload.full()
    preset = "tiny" if quick else "0.8b"
    model_dir = make_checkpoint(None, "qwen3_5", preset=preset)
    threads = torch.get_num_threads()
    results = {}
    for dtype in DTYPES:
        # A fresh process per dtype: one dtype's memory high-water mark must not include the other's.
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            results[dtype] = pool.submit(measure, str(model_dir), dtype, workload, threads).result()
    report = {
        "benchmark": "engine",
        "shapes": f"Qwen3.5-{preset}",
        "threads": threads,
        "workload": asdict(workload),
        "statistic": "prefill: median wall time of the runs after a warm-up run; decode: median step of one run",
        "results": results,
    }
    print_table(report)
    if out_dir is not None:
        write_report(out_dir, "engine", report, plot)
    return report
