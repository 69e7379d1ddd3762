"""Timing for the benchmarks: the median wall time of several runs after a warm-up, the runs taking turns.

Underscored so that the `bench` dispatcher, which runs every other module of this package, does not take it for a
benchmark.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


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
