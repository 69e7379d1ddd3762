"""Tensor parallelism (issue 21): one model split over N processes that run each step together through
torch.distributed, rank 0 the engine's own process (driver.py), ranks 1.. its workers (worker.py)."""

from a4._overlay import overlay

overlay(__name__, __path__)
