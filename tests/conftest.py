"""Shared test setup: one torch thread per worker, and the cached tiny checkpoints as fixtures."""

import pytest
import torch

from a4.checkpoints import tiny_checkpoint

# The suite runs in two pytest-xdist workers on two cores. Two OpenMP threads per worker oversubscribe the cores,
# and small ops then wait on spinning threads: tiny-model forwards measured 10-20x slower than with one thread.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_qwen3():
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="session")
def tiny_qwen3_5():
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="session")
def tiny_qwen3_5_moe():
    return tiny_checkpoint("qwen3_5_moe")
