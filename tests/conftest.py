"""Shared test setup: one torch thread per worker, the hypothesis profile, the fixtures every test file uses (the
cached tiny checkpoints, a fresh interpreter), and failures caused by an unwritten exercise reported as such.

What the tests compare, and how closely, comes from the notebooks' checks (`a4.course.checks`,
`a4.course.checks._harness`), which the tests drive. On a student's own code (A4_SOLUTIONS unset) a test that reaches
an exercise still raising its NotImplementedError fails with one line, `exercise <id> not written yet: ...`, instead of
a traceback, and the summary lists the exercises the failing tests wait for, in notebook order.
"""

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable

import pytest
import torch
from hypothesis import settings
from transformers import AutoTokenizer

from a4._overlay import REPO_ROOT
from a4.checkpoints import tiny_checkpoint
from a4.course.exercises import exercise_named_in, not_written_yet, unwritten_exercise

# The suite runs in two pytest-xdist workers on two cores. Two OpenMP threads per worker oversubscribe the cores,
# and small ops then wait on spinning threads: tiny-model forwards measured 10-20x slower than with one thread.
# OMP_NUM_THREADS, which torch reads, chooses another count (sums split across threads add in another order).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

NOT_WRITTEN = "exercise-not-written"  # the user property that carries the exercise's message to the summary

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


@pytest.fixture(scope="session")
def chat_model_dir():
    """The trained tiny Qwen3.5, with its tokenizer and Qwen's chat template: the server's and its benchmark's."""
    return tiny_checkpoint("qwen3_5", trained=True)


@pytest.fixture(scope="module")
def tokenizer(chat_model_dir):
    """The trained tiny Qwen3.5's tokenizer, as transformers loads it."""
    return AutoTokenizer.from_pretrained(chat_model_dir, local_files_only=True)


@pytest.fixture(scope="module")
def server(chat_model_dir, tokenizer):
    """The server's tests: the app of `python -m a4 serve` on the trained tiny Qwen3.5 under uvicorn in a thread of
    this process; yields its base URL and its engine loop."""
    from server_helpers import running_server

    from a4.server.launch import build_app

    app = build_app(chat_model_dir, tokenizer, max_running_requests=4, max_prefill_tokens=64)
    with running_server(app) as base_url:
        yield base_url, app.state.engine_loop


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if not report.failed or call.excinfo is None:
        return report
    error = call.excinfo.value
    # A test may only tell it in words: a subprocess's traceback in its assertion, a command's error line.
    message = unwritten_exercise(error) or exercise_named_in(f"{error}\n{report.capstdout}\n{report.capstderr}")
    if message is not None:
        report.longrepr = not_written_yet(message)
        report.user_properties.append((NOT_WRITTEN, message))
    return report


def pytest_terminal_summary(terminalreporter) -> None:
    waiting = Counter(
        properties[NOT_WRITTEN]
        for kind in ("failed", "error")
        for report in terminalreporter.stats.get(kind, [])
        if NOT_WRITTEN in (properties := dict(getattr(report, "user_properties", [])))  # collection errors have none
    )
    if not waiting:
        return
    terminalreporter.section("exercises not written yet")
    for message, count in sorted(waiting.items(), key=lambda item: (item[0].rsplit("(", 1)[-1], item[0])):
        terminalreporter.line(f"{count:4} test(s) wait for {message}")
    terminalreporter.line("`python -m a4.course list` shows where each exercise is; the notebooks explain them.")
