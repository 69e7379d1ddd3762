"""Rank 0's side of a tensor-parallel engine: it starts the workers, shards its own model, and mirrors to them every
module call and state-pool operation of the engine (a4/distributed/protocol.py), so that the engine above it is
unchanged.

`TPDriver(config)` spawns ranks 1 .. N-1 (tp_worker.py; torch.multiprocessing's spawn context, a fresh interpreter each)
and joins their process group (a4/distributed/group.py). The engine then loads its model with `shard`
(a4/distributed/sharding.py), builds its ModelRunner over `rank_config` (so its memory ledger, plan and pools are one
rank's), and hands its model, its MTP module and its state pool to `mirror` / `mirror_state_pool`. What those return
behave as what they wrap, except that each module call first broadcasts the step to the workers, and each state-pool
operation is logged for the next broadcast. `serve(runner)` sends the pools' sizes; `shutdown()` stops the workers.

Failures: a module call is a collective, so it must run to its end on every rank or on none.
- Ctrl-C is held until the call returns (as the scheduler holds it while booking), then raised: the step is aborted
  on rank 0, every rank has run the same forward, and the next request in a slot starts from a cleared or restored
  state there as everywhere.
- A worker that dies fails rank 0's next collective at once (gloo sees the closed connection), or its
  COLLECTIVE_TIMEOUT if it hangs; any exception inside a call leaves the ranks at different points of it. Either
  way the driver kills the workers and raises a RuntimeError saying which rank died and how; every later call
  raises the same error. A new LLM starts a new group.

One driver at a time: torch.distributed has one default group per process. A new TPDriver takes over from the one
before it (a notebook cell run again, or an LLM dropped without `close()` that the garbage collector has not freed
yet): that one is shut down, its workers and its group released, and its calls are refused from then on. A driver
collected without `shutdown()` releases them too.
"""

from __future__ import annotations

import itertools
import signal
import shutil
import tempfile
import threading
import weakref
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from a4.distributed.group import destroy_tp_group, init_tp_group
from a4.distributed.protocol import Call, PoolOp, RankReport, Report, Setup, StepInputs, Stop, to_host
from a4.distributed.sharding import check_divisible, rank_model_config, shard_model
from a4.engine.config import EngineConfig
from a4.engine.tp_worker import worker_main
from a4.models.config import ModelConfig, load_model_config
from a4.scheduler.scheduler import sigint_deferred

# How long `shutdown` waits for a worker to leave after Stop before killing it.
STOP_WAIT_SECONDS = 10.0
TAKEN_OVER = "a newer tensor-parallel LLM took over this process's group"

# The driver that holds this process's group, if any: the next one shuts it down first.
_holder: weakref.ref[TPDriver] | None = None


class TPDriver:
    def __init__(self, config: EngineConfig) -> None:
        world_size = config.tensor_parallel_size
        self.model_config = load_model_config(config.model_dir)
        check_divisible(self.model_config, world_size)
        self.rank_config: ModelConfig = rank_model_config(self.model_config, world_size)
        global _holder
        if _holder is not None and (previous := _holder()) is not None:
            previous.shutdown(TAKEN_OVER)
        self._store_dir = tempfile.mkdtemp(prefix="a4-tp-")
        store_path = str(Path(self._store_dir) / "rendezvous")
        spawn = mp.get_context("spawn")
        self.workers = [
            spawn.Process(
                target=worker_main,
                args=(rank, world_size, store_path, config, torch.get_num_threads()),
                name=f"a4-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, world_size)
        ]
        for worker in self.workers:
            worker.start()
        # Released at the latest when this driver is collected or the interpreter exits; the group is left only
        # once joined (a failed join may have met another's).
        self._joined = threading.Event()
        self._finalizer = weakref.finalize(self, _release, self.workers, self._store_dir, self._joined)
        self._ops: list[PoolOp] = []
        self._down: str | None = None  # why the group is down, once it is
        self._checkpoint_keys = itertools.count()
        try:
            self.group = init_tp_group(0, world_size, store_path, config.torch_device)
        except BaseException:
            self._finalizer()
            raise
        self._joined.set()
        _holder = weakref.ref(self)

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def shard(self, model: nn.Module, config: ModelConfig) -> None:
        """Rank 0's share of a loaded module (registry.load_model's and load_mtp's `shard` hook)."""
        shard_model(model, config, self.group)

    def mirror(self, module: nn.Module, name: str) -> MirroredModule:
        return MirroredModule(module, name, self)

    def mirror_state_pool(self, pool):
        return None if pool is None else MirroredStatePool(pool, self)

    def mirror_kv_copies(self, pool) -> MirroredKVCopies:
        return MirroredKVCopies(pool, self)

    def serve(self, runner, *, load_mtp: bool) -> None:
        """Size the workers' pools as rank 0's (`runner`: its ModelRunner); from here they follow every call."""
        kv_pool, table = runner.kv_pool, runner.table_manager.req_to_token
        setup = Setup(kv_pool.num_layers, kv_pool.num_pages, kv_pool.page_size, *table.shape, load_mtp=load_mtp)
        self._collective(lambda: self._send(setup))

    def call(self, module: str, method: str, fb, args: tuple, kwargs: dict, run):
        """`run()` (rank 0's own call), with the workers making the same call on their shards."""
        step = None if fb is None else StepInputs.of(fb)
        message = Call(module, method, step, to_host(args), kwargs)

        def together():
            self._send(message)
            return run()

        return self._collective(together)

    def log(self, op: PoolOp) -> None:
        self._ops.append(op)

    def new_checkpoint_key(self) -> int:
        return next(self._checkpoint_keys)

    def reports(self) -> list[RankReport]:
        """Every worker's report (after the ops so far), rank 1 first."""

        def ask():
            self._send(Report())
            answers = [None] * self.world_size
            dist.gather_object(None, answers, dst=0, group=self.group.command)
            return answers[1:]

        return self._collective(ask)

    def shutdown(self, reason: str = "the engine was closed") -> None:
        """Stop the workers (killing those that do not leave) and leave the group; later calls are refused, saying
        `reason`. Safe to call twice."""
        if self._down is None:
            try:
                self._send(Stop())
                for worker in self.workers:
                    worker.join(STOP_WAIT_SECONDS)
            except Exception:  # noqa: BLE001 - a worker already gone: nothing more to tell it
                pass
            self._down = reason
        self._finalizer()

    def _send(self, command) -> None:
        ops, self._ops = self._ops, []
        dist.broadcast_object_list([(ops, command)], src=0, group=self.group.command)

    def _collective(self, fn):
        """fn(), which every rank takes part in: refused when the group is down, Ctrl-C held until it returns, and
        any failure inside it taking the group down (module docstring)."""
        if self._down is not None:
            raise RuntimeError(f"the tensor-parallel engine is down ({self._down}): create a new LLM")
        dead = self._dead_workers()
        if dead:
            self._fail(dead)
            raise RuntimeError(f"tensor-parallel {dead}; the engine is down")
        # The held Ctrl-C is raised when the block ends, after the call: outside the `try`, a clean interrupt.
        with sigint_deferred():
            try:
                return fn()
            except BaseException as e:
                # A worker whose connection just closed may not have been reaped yet: give it a moment.
                dead = self._dead_workers(wait_seconds=1.0)
                self._fail(dead or f"rank 0 stopped inside a collective call ({type(e).__name__}: {e})")
                if dead:
                    raise RuntimeError(f"tensor-parallel {dead}; the engine is down") from e
                raise

    def _dead_workers(self, wait_seconds: float = 0.0) -> str | None:
        """Which workers have exited, and how (None: all alive)."""
        if wait_seconds:
            for worker in self.workers:
                worker.join(wait_seconds / len(self.workers))
        dead = [(rank, worker) for rank, worker in enumerate(self.workers, 1) if worker.exitcode is not None]
        if not dead:
            return None
        return ", ".join(f"worker rank {rank} (pid {w.pid}) {_how(w.exitcode)}" for rank, w in dead)

    def _fail(self, reason: str) -> None:
        self._down = reason
        self._finalizer()


def _how(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}" + (" (its traceback is on stderr)" if exitcode else "")


def _release(workers: list, store_dir: str, joined: threading.Event) -> None:
    """Kill the workers still alive and leave the group (once: a driver's weakref.finalize)."""
    for worker in workers:
        if worker.is_alive():
            worker.kill()
        worker.join()
    shutil.rmtree(store_dir, ignore_errors=True)
    if joined.is_set():
        destroy_tp_group()


class MirroredModule(nn.Module):
    """A model (or the MTP module) whose calls every rank makes together; its attributes are the module's."""

    def __init__(self, module: nn.Module, name: str, driver: TPDriver) -> None:
        super().__init__()
        self.module, self.name, self.driver = module, name, driver

    def forward(self, fb, *args, **kwargs):
        return self.driver.call(self.name, "forward", fb, args, kwargs, partial(self.module, fb, *args, **kwargs))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP module's lm_head, vocabulary-parallel: its all-gather needs every rank."""
        return self.driver.call(self.name, "logits", None, (hidden,), {}, partial(self.module.logits, hidden))

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class MirroredCheckpoint:
    """Rank 0's share of a state checkpoint saved on every rank; the workers hold theirs under `key`, and drop it
    when the prefix cache drops this object."""

    def __init__(self, local, key: int, driver: TPDriver) -> None:
        self.local, self.key = local, key
        weakref.finalize(self, driver.log, PoolOp("drop", (key,)))

    conv = property(lambda self: self.local.conv)
    recurrent = property(lambda self: self.local.recurrent)
    nbytes = property(lambda self: self.local.nbytes)


class MirroredStatePool:
    """Rank 0's StatePool, each operation that changes it logged for the workers; reads go to the pool."""

    def __init__(self, pool, driver: TPDriver) -> None:
        self.pool, self.driver = pool, driver

    def clear(self, slots) -> None:
        self.pool.clear(slots)
        self.driver.log(PoolOp("clear", (list(slots),)))

    def clear_new_requests(self, reqs) -> None:
        self.pool.clear_new_requests(reqs)
        self.driver.log(PoolOp("clear_new_requests", ([(req.slot, req.computed_len) for req in reqs],)))

    def allocate_verify_states(self, num_tokens: int) -> None:
        self.pool.allocate_verify_states(num_tokens)
        self.driver.log(PoolOp("allocate_verify_states", (num_tokens,)))

    def commit_verified(self, slots: torch.Tensor, kept_lens: torch.Tensor) -> None:
        self.pool.commit_verified(slots, kept_lens)
        self.driver.log(PoolOp("commit_verified", to_host((slots, kept_lens))))

    def copy(self, src_slot: int, dst_slots) -> None:
        self.pool.copy(src_slot, dst_slots)
        self.driver.log(PoolOp("copy", (src_slot, list(dst_slots))))

    def save(self, slot: int) -> MirroredCheckpoint:
        key = self.driver.new_checkpoint_key()
        checkpoint = MirroredCheckpoint(self.pool.save(slot), key, self.driver)
        self.driver.log(PoolOp("save", (slot, key)))
        return checkpoint

    def restore(self, checkpoint: MirroredCheckpoint, slot: int) -> None:
        self.pool.restore(checkpoint.local, slot)
        self.driver.log(PoolOp("restore", (checkpoint.key, slot)))

    def __getattr__(self, name: str):
        return getattr(self.pool, name)


class MirroredKVCopies:
    """Rank 0's KVPool as the cache manager sees it: a fork's copy of its prompt's partial last page is logged for the
    workers, whose pools hold their own heads of the same locations."""

    def __init__(self, pool, driver: TPDriver) -> None:
        self.pool, self.driver = pool, driver

    def copy_locations(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.pool.copy_locations(src, dst)
        self.driver.log(PoolOp("copy_locations", to_host((src, dst))))
