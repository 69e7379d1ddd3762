"""Shared test setup: one torch thread per worker, the hypothesis profile, and the cached tiny checkpoints."""

import pytest
import torch
from hypothesis import settings

from a4.checkpoints import tiny_checkpoint

# The suite runs in two pytest-xdist workers on two cores. Two OpenMP threads per worker oversubscribe the cores,
# and small ops then wait on spinning threads: tiny-model forwards measured 10-20x slower than with one thread.
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
