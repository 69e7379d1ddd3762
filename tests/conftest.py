"""Shared test setup: one torch thread per worker, and the fixtures every test file uses: the cached tiny checkpoints
and a fresh interpreter; and the hypothesis profile. What the tests compare, and how closely, comes from the notebooks' checks
(`a4.course.checks`, `a4.course.checks._harness`), which the tests drive."""

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from hypothesis import settings

from a4._overlay import REPO_ROOT
from a4.checkpoints import tiny_checkpoint

# The suite runs in two pytest-xdist workers on two cores. Two OpenMP threads per worker oversubscribe the cores,
# and small ops then wait on spinning threads: tiny-model forwards measured 10-20x slower than with one thread.
# OMP_NUM_THREADS, which torch reads, chooses another count (sums split across threads add in another order).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

# Property tests (tests/test_properties_*.py) must be reproducible and fast in CI: the same examples on every run
# and machine (derandomize, no example database), a bounded number of them, and no per-example deadline (two
# workers on two shared cores make timings meaningless).
settings.register_profile("a4", derandomize=True, database=None, max_examples=100, deadline=None, print_blob=True)
settings.load_profile("a4")


@pytest.fixture(scope="session")
def tiny_qwen3():
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_5():
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe():
    return tiny_checkpoint("qwen3_5_moe")


@pytest.fixture
def run_python() -> Callable[..., subprocess.CompletedProcess]:
    """run_python(code, **env): run code in a fresh interpreter from the repository root, with this environment
    (A4_SOLUTIONS included) and `env` on top: for what only a new process shows, such as which modules an import
    pulls in, or what torch does under another ATEN_CPU_CAPABILITY."""

    def run(code: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code], cwd=REPO_ROOT, env=os.environ | env, capture_output=True, text=True
        )

    return run
