"""Benchmark: the gated delta rule on CPU, token by token against chunked.

Side by side on the shapes of Qwen3.5-0.8B's GDN layers (16 value heads, dk = dv = 128, float32, one sequence):
a4's recurrence (`recurrent_gated_delta_rule`, what decode runs), a4's chunked form (`chunk_gated_delta_rule`, what
prefill runs) and transformers' `torch_chunk_gated_delta_rule`, at several sequence lengths T. Each figure is the
median wall time of several runs after a warm-up run, as tokens/s. The chunked form should be several times faster
than the recurrence and keep the same tokens/s as T grows.

    python -m a4 bench gdn [--quick] [--out DIR]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from a4.bench import write_report

NUM_HEADS, HEAD_DIM = 16, 128
METHODS = ("recurrence", "a4 chunked", "transformers chunked")


def runners(length: int) -> dict[str, Callable[[], tuple]]:
    """One zero-argument call per method, all on the same inputs of `length` tokens, from a zero state."""
    # Imported here: the a4 module is an exercise (notebook 04), and transformers is only the reference.
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
    )

    from a4.course.checks.deltanet import delta_rule_inputs
    from a4.layers.deltanet import chunk_gated_delta_rule, recurrent_gated_delta_rule

    # The inputs of notebook 04's checks, at the model's shapes: q already scaled by dk^-0.5.
    q, k, v, g, beta = delta_rule_inputs((length,), NUM_HEADS, dk=HEAD_DIM, dv=HEAD_DIM)
    q_unscaled = q * HEAD_DIM**0.5  # transformers' function scales q itself
    state = torch.zeros(1, NUM_HEADS, HEAD_DIM, HEAD_DIM)
    cu_seqlens = torch.tensor([0, length])
    batched = [x[None] for x in (q, k, v, g, beta)]  # [1, T, ...]: one sequence
    return {
        "recurrence": lambda: recurrent_gated_delta_rule(*batched, state),
        "a4 chunked": lambda: chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, state),
        "transformers chunked": lambda: torch_chunk_gated_delta_rule(
            q_unscaled[None], k[None], v[None], g[None], beta[None], initial_state=state, output_final_state=True
        ),
    }


def time_runs(runs: dict[str, Callable[[], tuple]], repeats: int) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median wall time of each run, and the output o of its warm-up call.

    The runs take turns (one of each per round), so that a burst of load from other processes slows all of them
    alike instead of one method's whole series. The warm-up call is not timed: first-call allocations and library
    initialisation are not what we measure.
    """
    outputs = {name: run()[0] for name, run in runs.items()}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, outputs


def max_relative_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours - reference).abs().max() / reference.abs().max()).item()


def print_table(results: list[dict]) -> None:
    print(
        f"gated delta rule, {NUM_HEADS} heads, dk = dv = {HEAD_DIM}, float32, {torch.get_num_threads()} CPU threads: "
        "tokens/s (median of the runs)"
    )
    print(
        f"{'T':>6}"
        + "".join(f"{m:>22}" for m in METHODS)
        + f"{'a4 / recurrence':>17}{'a4 / transformers':>19}{'max rel. diff':>15}"
    )
    for row in results:
        rates = row["tokens_per_s"]
        print(
            f"{row['T']:>6}"
            + "".join(f"{rates[m]:>22,.0f}" for m in METHODS)
            + f"{row['a4_over_recurrence']:>16.2f}x{row['a4_over_transformers']:>18.2f}x"
            + f"{max(row['max_relative_difference'].values()):>15.1e}"
        )


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [row["T"] for row in results]
    for method in METHODS:
        ax.plot(lengths, [row["tokens_per_s"][method] for row in results], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(t) for t in lengths])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("sequence length T (tokens)")
    ax.set_ylabel("tokens/s")
    ax.set_title(f"gated delta rule on CPU ({NUM_HEADS} heads, dk = dv = {HEAD_DIM}, float32)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure, print the table, write gdn.json and gdn.png into out_dir (when given); returns the JSON's contents."""
    lengths, repeats = ((128, 512), 3) if quick else ((512, 2048, 8192), 5)
    results = []
    for length in lengths:
        seconds, outputs = time_runs(runners(length), repeats)
        rates = {method: length / s for method, s in seconds.items()}
        ours = outputs["a4 chunked"].reshape(length, NUM_HEADS, HEAD_DIM)
        results.append(
            {
                "T": length,
                "seconds": seconds,
                "tokens_per_s": rates,
                "a4_over_recurrence": rates["a4 chunked"] / rates["recurrence"],
                "a4_over_transformers": rates["a4 chunked"] / rates["transformers chunked"],
                # Fast is worthless if wrong: a4's chunked output against the two others, relative to their scale.
                "max_relative_difference": {
                    method: max_relative_difference(ours, outputs[method].reshape(ours.shape))
                    for method in ("recurrence", "transformers chunked")
                },
            }
        )
    print_table(results)
    report = {
        "benchmark": "gdn",
        "num_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "dtype": "float32",
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "statistic": "median wall time after one warm-up run, the methods taking turns",
        "results": results,
    }
    if out_dir is not None:
        write_report(out_dir, "gdn", report, plot, plotted=results)
    return report
