"""Tensor parallelism (issue 21): one model split over N processes that run each step together through
torch.distributed, rank 0 the engine's own process (a4/engine/tp_driver.py), ranks 1.. its workers
(a4/engine/tp_worker.py). Here are the pieces they run, below the engine: process groups, parallel layers, what each
rank keeps of the model, and the messages between the ranks."""

from a4._overlay import overlay

overlay(__name__, __path__)
