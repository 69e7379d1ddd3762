"""Timing for the benchmarks: the median time of several runs after a warm-up, the runs taking turns.

Underscored so that the `bench` dispatcher, which runs every other module of this package, does not take it for a
benchmark.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median wall time of each zero-argument run over `repeats` timed calls, after one untimed call of each.

    The untimed call takes first-call costs (allocations, library initialisation) out of the figures. The runs take
    turns, one call of each per round, so that a burst of load from other processes on a shared machine slows all of
    them alike instead of one run's whole series. On an accelerator, a run must wait for its own work to finish.
    """
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def device_seconds(run: Callable[[], object], device: torch.device, repeats: int, inner: int = 1) -> float:
    """Median seconds of one call of `run`, whose work is on `device`, over `repeats` timings of `inner` calls each.

    On CUDA the calls are launched back to back between two events and waited for once: the GPU's time, without a
    host round trip per call (with inner > 1, the launch of the first call too is hidden behind the GPU's work). On
    the CPU, wall time. One untimed call first, as in `median_seconds`.
    """
    if device.type != "cuda":
        return median_seconds({"run": lambda: [run() for _ in range(inner)]}, repeats)["run"] / inner
    run()
    torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)  # elapsed_time is in milliseconds
    return statistics.median(times)
