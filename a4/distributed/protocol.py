"""What rank 0 tells the workers: the messages of the tensor-parallel protocol, and a step's ForwardBatch in a form
that crosses processes.

Rank 0 runs the scheduler, the prefix cache and the sampler; the workers only run the model on their shard. So
everything a worker needs is what rank 0 does to the model and to the state pool, and rank 0 sends it as it
happens, in order (a4/engine/tp_driver.py), one broadcast per module call:

    (pool ops since the last call, command)

- `PoolOp`: a state-pool operation the cache manager, the prefix cache or the speculative worker performed on rank 0
  (clear a new request's slot, save or restore a checkpoint, commit verify states, drop a checkpoint the prefix
  cache evicted). No rank reads a state between two module calls, so the ops wait for the next message.
- `Call`: a module call that every rank makes together (the main model's forward, the MTP module's forward and its
  lm_head), with the step's `StepInputs`: its ForwardBatch without the rank-local parts, and the rows of the table that
  the step reads (a worker rebuilds the step with a4/engine/forward_batch.py's `rank_forward_batch`). Slots and KV
  locations are rank 0's on every rank, so a worker needs no allocator of its own.
- `Setup` once the plan is made (the pools' sizes), `Report` for tests and diagnostics, `Stop`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from a4.core import ForwardBatch


# The ForwardBatch fields that stay on their own rank: its table, pools and backend, and what the backend prepared.
RANK_LOCAL_FIELDS = ("req_to_token", "kv_pool", "state_pool", "attn_backend", "attn_metadata", "gdn_metadata")


@dataclass
class StepInputs:
    """A step's ForwardBatch on the host, without what each rank has of its own, and the table rows it reads."""

    fb: ForwardBatch
    # req_to_token[slots, :max(seq_lens)]: every entry the step's layers read of the table.
    table_rows: torch.Tensor

    @classmethod
    def of(cls, fb: ForwardBatch) -> StepInputs:
        longest = int(fb.seq_lens.max())
        host = replace(fb, **{name: None for name in RANK_LOCAL_FIELDS}, **step_tensors(fb, torch.device("cpu")))
        return cls(host, fb.req_to_token[fb.slots, :longest].cpu())

    @property
    def extend_lens(self) -> list[int] | None:
        return self.fb.extend_lens


def step_tensors(fb: ForwardBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The step's own tensors (ids, positions, slots, lengths, locations) moved to `device`."""
    return {
        field.name: getattr(fb, field.name).to(device)
        for field in fields(fb)
        if field.name not in RANK_LOCAL_FIELDS and isinstance(getattr(fb, field.name), torch.Tensor)
    }


@dataclass
class PoolOp:
    """StatePool.<method>(*args) on every worker (KVPool's for copy_locations); checkpoints are named by `key`s rank 0
    gives them."""

    # clear, clear_new_requests, allocate_verify_states, commit_verified, save, restore, drop, copy (a fork's state);
    # copy_locations (a fork's partial page of KV)
    method: str
    args: tuple


@dataclass
class Call:
    """`module`'s `method` ("forward" or "logits") on every rank, with the step's inputs (None for logits)."""

    module: str  # "model" or "mtp"
    method: str
    step: StepInputs | None
    args: tuple
    kwargs: dict[str, Any]


@dataclass
class Setup:
    """The pools' sizes, rank 0's: the same slots and KV locations on every rank. The shapes of a KV head and a
    state are each rank's own (its rank_model_config)."""

    kv_layers: int
    num_pages: int
    page_size: int
    num_slots: int
    max_context_len: int
    load_mtp: bool


@dataclass
class Report:
    """Every worker answers with its `RankReport`."""


@dataclass
class Stop:
    pass


@dataclass
class RankReport:
    rank: int
    checkpoint_keys: list[int]
    kv_bytes_per_token: int
    state_bytes_per_slot: int


def to_host(value: Any) -> Any:
    """Tensors (also inside tuples) moved to the CPU, for pickling to another process (and device)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, tuple):
        return tuple(to_host(v) for v in value)
    return value


def to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(to_device(v, device) for v in value)
    return value
