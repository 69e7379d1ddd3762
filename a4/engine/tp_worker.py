"""The worker process of a tensor-parallel engine (ranks 1 .. N-1): its shard of the model, its own pools, and the
loop that replays what rank 0 does (a4/distributed/protocol.py, tp_driver.py).

A worker loads the checkpoint and keeps its share (a4/distributed/sharding.py), then waits for rank 0's `Setup` to size
its pools as rank 0's: a KV pool of rank 0's pages with its own KV heads, a state pool of rank 0's slots with its own
heads' states, a request-slot table of rank 0's shape. Then, message after message, it applies rank 0's state-pool
operations and runs the module call, whose collectives pair with rank 0's; its outputs are dropped (rank 0 samples). Its
prefix-cache checkpoints are its shares of rank 0's, under the keys rank 0 gave them.

Ctrl-C is rank 0's to handle: a notebook's interrupt reaches the whole process group, and a worker that stopped in
the middle of a step would leave rank 0 waiting in a collective. Any error ends the worker (its traceback on
stderr, but for an unwritten exercise, which rank 0 names); rank 0 then finds it dead and takes the engine down.
"""

from __future__ import annotations

import signal
import sys
from functools import partial

import torch
import torch.distributed as dist

from a4.core import Req, SamplingParams
from a4.course.exercises import unwritten_exercise
from a4.distributed.group import TPGroup, destroy_tp_group, init_tp_group
from a4.distributed.protocol import Call, PoolOp, RankReport, Report, Setup, Stop, to_device
from a4.distributed.sharding import rank_model_config, shard_model
from a4.engine.config import EngineConfig
from a4.engine.factories import create_backends, create_kv_pool, create_state_pool
from a4.engine.forward_batch import rank_forward_batch
from a4.models.registry import load_model


def worker_main(rank: int, world_size: int, store_path: str, config: EngineConfig, num_threads: int) -> None:
    """The worker process's entry point (spawned by driver.py)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The same thread count as rank 0: a CPU kernel's summation order may depend on it.
    torch.set_num_threads(num_threads)
    group = init_tp_group(rank, world_size, store_path, config.torch_device)
    try:
        with torch.inference_mode():
            RankWorker(group, config).serve()
    except Exception as e:
        if unwritten_exercise(e) is None:
            raise
        # Rank 0 runs the same code and names the exercise: this rank's traceback would only bury that line.
        sys.exit(1)
    finally:
        destroy_tp_group()


def receive(group: TPGroup) -> tuple[list[PoolOp], object]:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group.command)
    return box[0]


class RankWorker:
    def __init__(self, group: TPGroup, config: EngineConfig) -> None:
        self.group, self.config = group, config
        self.model_config, model, _ = load_model(
            config.model_dir,
            dtype=config.torch_dtype,
            device=group.device,
            progress=False,
            merge_projections=config.merge_projections,
            shard=partial(shard_model, group=group),
            load_format=config.load_format,
        )
        self.rank_config = rank_model_config(self.model_config, group.world_size)
        self.modules = {"model": model}
        self.checkpoints: dict[int, object] = {}

    def setup(self, setup: Setup) -> None:
        config, device, dtype = self.config, self.group.device, self.config.torch_dtype
        if setup.load_mtp:
            from a4.models.qwen3_5_mtp import load_mtp

            self.modules["mtp"] = load_mtp(
                self.modules["model"],
                config.model_dir,
                dtype=dtype,
                device=device,
                merge_projections=config.merge_projections,
                shard=partial(shard_model, group=self.group),
                load_format=config.load_format,
            )[0]
        draft_kv_layers = setup.kv_layers - len(self.model_config.full_attention_layers)
        self.kv_pool = create_kv_pool(self.rank_config, setup.num_pages, setup.page_size, dtype, device,
                                      draft_kv_layers)  # fmt: skip
        self.state_pool = create_state_pool(self.rank_config, setup.num_slots, dtype, device)
        self.req_to_token = torch.zeros(setup.num_slots, setup.max_context_len, dtype=torch.int64, device=device)
        self.backend, self.static_backend = create_backends(self.rank_config, device, dtype)

    def serve(self) -> None:
        while True:
            ops, command = receive(self.group)
            if isinstance(command, Setup):
                # Before the ops: they were logged while rank 0 built the pools this sizes (verify states).
                self.setup(command)
            for op in ops:
                self.apply(op)
            if isinstance(command, Stop):
                return
            if isinstance(command, Call):
                self.call(command)
            elif isinstance(command, Report):
                dist.gather_object(self.report(), None, dst=0, group=self.group.command)
            elif not isinstance(command, Setup):
                raise RuntimeError(f"tensor-parallel worker {self.group.rank}: unknown command {command!r}")

    def apply(self, op: PoolOp) -> None:
        pool, args = self.state_pool, to_device(op.args, self.group.device)
        if op.method == "save":
            slot, key = args
            self.checkpoints[key] = pool.save(slot)
        elif op.method == "restore":
            key, slot = args
            pool.restore(self.checkpoints[key], slot)
        elif op.method == "drop":
            del self.checkpoints[args[0]]
        elif op.method == "copy_locations":
            self.kv_pool.copy_locations(*args)
        elif op.method == "clear_new_requests":
            # The students' rule decides which slots to clear, from what it reads of a Req: its slot and length.
            pool.clear_new_requests([Req(-1, [], SamplingParams(), slot=s, computed_len=n) for s, n in args[0]])
        else:
            getattr(pool, op.method)(*args)

    def call(self, call: Call) -> None:
        module = self.modules[call.module]
        args = to_device(call.args, self.group.device)
        if call.method == "logits":
            module.logits(*args)
            return
        step = call.step
        backend = self.backend if step.extend_lens is not None else self.static_backend
        fb = rank_forward_batch(
            step, req_to_token=self.req_to_token, kv_pool=self.kv_pool, state_pool=self.state_pool, attn_backend=backend
        )
        module(fb, *args, **call.kwargs)

    def report(self) -> RankReport:
        pool = self.state_pool
        return RankReport(
            rank=self.group.rank,
            checkpoint_keys=sorted(self.checkpoints),
            kv_bytes_per_token=self.kv_pool.bytes_per_token,
            state_bytes_per_slot=0 if pool is None else pool.total_bytes // pool.num_slots,
        )
