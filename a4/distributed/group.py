"""The process group of a tensor-parallel engine: set up, torn down, and the two collectives the layers need.

Two groups over the same N ranks, as vLLM keeps a CPU group beside its device group:
- the compute group (gloo on the CPU, NCCL on GPUs) carries the layers' all-reduces and all-gathers. Its timeout is
  short (`COLLECTIVE_TIMEOUT`): every rank runs the same step at once, so a collective that waits longer means a
  rank has died or hangs, and the engine says so instead of hanging with it;
- the command group (always gloo) carries rank 0's messages to the workers (a4/engine/tp_driver.py). A worker waits
  there for the next step however long the engine stays idle, so its timeout is long (`IDLE_TIMEOUT`). A rank that
  dies closes its sockets, and gloo reports that at once on the ranks still waiting.

The ranks meet through a file (torch's FileStore): no port to choose, so nothing to collide with another engine.
torch.distributed has one default group per process, so a process runs one tensor-parallel engine at a time (a new
one takes over from the one before: driver.py).
`run_ranks` runs a function on N spawned CPU ranks, for checks of the parallel layers.
"""

from __future__ import annotations

import datetime
import tempfile
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
IDLE_TIMEOUT = datetime.timedelta(days=7)


@dataclass
class TPGroup:
    """This process's place in the group, and the groups' handles."""

    rank: int
    world_size: int
    device: torch.device
    compute: dist.ProcessGroup
    command: dist.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, in place (every rank gets the same values, bit for bit)."""
        dist.all_reduce(x, group=self.compute)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x side by side along the last dim, rank 0's first."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.compute)
        return torch.cat(parts, dim=-1)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or GPU r."""
    return torch.device("cuda", rank) if device.type == "cuda" else device


def init_tp_group(rank: int, world_size: int, store_path: str, device: torch.device) -> TPGroup:
    """Join the group (blocks until all world_size ranks have joined, or COLLECTIVE_TIMEOUT)."""
    if dist.is_initialized():
        raise RuntimeError(
            "this process already has a torch.distributed process group that a4 did not start: leave it first "
            "(torch.distributed.destroy_process_group()); a process runs one tensor-parallel engine at a time"
        )
    device = rank_device(device, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=f"file://{store_path}",
        rank=rank,
        world_size=world_size,
        timeout=COLLECTIVE_TIMEOUT,
    )
    command = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return TPGroup(rank, world_size, device, dist.group.WORLD, command)


def destroy_tp_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> list:
    """fn(group, *args) on `world_size` spawned CPU ranks of one gloo group; each rank's return value, rank 0's first.

    For checks of the parallel layers (tests, notebook 13): `fn` must be importable by name (defined in a module,
    not in a notebook). An exception on any rank is a RuntimeError here with that rank's traceback."""
    spawn = mp.get_context("spawn")
    results = spawn.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="a4-ranks-") as store_dir:
        ranks = [
            spawn.Process(target=_run_rank, args=(fn, rank, world_size, f"{store_dir}/rendezvous", results, args))
            for rank in range(world_size)
        ]
        for process in ranks:
            process.start()
        answers = dict(results.get() for _ in ranks)
        for process in ranks:
            process.join()
    failed = {rank: answer for rank, answer in answers.items() if isinstance(answer, _RankError)}
    if failed:
        rank, error = min(failed.items())
        raise RuntimeError(f"rank {rank} of {world_size} failed:\n{error.traceback}")
    return [answers[rank] for rank in range(world_size)]


@dataclass
class _RankError:
    traceback: str


def _run_rank(fn, rank: int, world_size: int, store_path: str, results, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        group = init_tp_group(rank, world_size, store_path, torch.device("cpu"))
        try:
            results.put((rank, fn(group, *args)))
        finally:
            destroy_tp_group()
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, _RankError(traceback.format_exc())))
