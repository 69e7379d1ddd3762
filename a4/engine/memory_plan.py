"""The memory plan: how many KV pages and request slots fit in a byte budget.

Two kinds of memory grow with the work the engine takes on:
- per token: the K and V of every layer that keeps a KV cache (`MemoryLedger.kv_bytes_per_token`);
- per request slot, fixed whatever the request's length: its row of the `req_to_token` table and, for a hybrid model,
  its Gated DeltaNet states (`state_bytes_per_slot`, 0 for all-attention models).

`plan_memory` sets aside the KV of one request as long as the model's context, gives the slots what they need
(fewer slots if they do not fit beside that request, but always one) and turns the rest of the budget into whole KV
pages: a larger budget never gives fewer slots or a shorter context. Only the full-attention layers count toward KV
bytes, so a hybrid model (Qwen3.5, one layer in four) gets KV only where it needs it; its slots are planned the same
way once their state is counted (`StatePool.bytes_per_slot`, notebook 05), or capped at a share of the budget by
`plan_hybrid_memory` (hybrid_memory.py, notebook 06). Before either, the engine sets aside the bytes of the state
checkpoints its prefix cache may keep (notebook 07): `MemoryPlan.checkpoint_bytes`. Model weights are not part of
the budget: they are loaded before the plan is made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4.models.config import ModelConfig

# Bytes of one req_to_token entry (an int64 location).
TABLE_ENTRY_BYTES = 8
# Default budget on a CPU: there is no cheap, portable "free memory" query, and a few GiB is what a laptop can spare.
DEFAULT_CPU_BUDGET_BYTES = 2 << 30
# Default budget on an accelerator: this fraction of the memory free once the weights are loaded (activations and
# the allocator's fragmentation need the rest).
DEFAULT_DEVICE_MEMORY_FRACTION = 0.8


class MemoryPlanError(ValueError):
    """The budget cannot hold even one request slot and one KV page."""


@dataclass(frozen=True)
class MemoryLedger:
    """What a model costs per token and per request slot, in bytes."""

    kv_bytes_per_token: int
    table_bytes_per_slot: int
    state_bytes_per_slot: int = 0
    # Speculative decoding (a4/speculative): the states a slot's verify pass keeps, k + 1 of its state (0 without).
    verify_bytes_per_slot: int = 0

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        dtype: torch.dtype,
        *,
        state_bytes_per_slot: int = 0,
        draft_kv_layers: int = 0,
        verify_bytes_per_slot: int = 0,
    ) -> MemoryLedger:
        """`draft_kv_layers`: attention layers of a draft model (Qwen3.5's MTP module: one) that keep KV in the same
        pool, with the main model's KV heads and head size."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        kv_layers = len(config.full_attention_layers) + draft_kv_layers
        return cls(
            # K and V, for each KV head of each layer that keeps a KV cache.
            kv_bytes_per_token=2 * kv_layers * config.num_key_value_heads * config.head_dim * element_bytes,
            # A row spans the longest context the model accepts (the engine may use fewer entries).
            table_bytes_per_slot=config.max_position_embeddings * TABLE_ENTRY_BYTES,
            state_bytes_per_slot=state_bytes_per_slot,
            verify_bytes_per_slot=verify_bytes_per_slot,
        )

    @property
    def bytes_per_slot(self) -> int:
        """Fixed cost of one request slot, whatever the request's length."""
        return self.table_bytes_per_slot + self.state_bytes_per_slot + self.verify_bytes_per_slot

    def bytes_per_request(self, num_tokens: int) -> int:
        """What one request of num_tokens tokens costs: its slot plus the KV of its tokens."""
        return self.bytes_per_slot + num_tokens * self.kv_bytes_per_token


@dataclass(frozen=True)
class MemoryPlan:
    ledger: MemoryLedger
    budget_bytes: int
    page_size: int
    num_pages: int
    max_running_requests: int
    # Set aside for the prefix cache's state checkpoints (hybrid models, notebook 07): the engine plans slots and
    # pages in budget_bytes - checkpoint_bytes.
    checkpoint_bytes: int = 0

    @property
    def num_tokens(self) -> int:
        """KV pool capacity in tokens (all requests and the prefix cache together)."""
        return self.num_pages * self.page_size

    @property
    def kv_bytes(self) -> int:
        return self.num_tokens * self.ledger.kv_bytes_per_token

    @property
    def slot_bytes(self) -> int:
        return self.max_running_requests * self.ledger.bytes_per_slot

    @property
    def used_bytes(self) -> int:
        return self.kv_bytes + self.slot_bytes + self.checkpoint_bytes

    def describe(self) -> str:
        ledger = self.ledger
        lines = [
            f"budget            {_mib(self.budget_bytes)}",
            f"KV per token      {ledger.kv_bytes_per_token:,} B",
            f"per request slot  {ledger.bytes_per_slot:,} B (table row {ledger.table_bytes_per_slot:,} B"
            f" + state {ledger.state_bytes_per_slot:,} B"
            + (f" + verify states {ledger.verify_bytes_per_slot:,} B" if ledger.verify_bytes_per_slot else "")
            + ")",
        ]
        if self.checkpoint_bytes:
            # Listed first: set aside before the slots and pages share the rest.
            count = self.checkpoint_bytes // ledger.state_bytes_per_slot
            lines.append(f"state checkpoints {count} = {_mib(self.checkpoint_bytes)} (kept by the prefix cache)")
        lines += [
            f"request slots     {self.max_running_requests} = {_mib(self.slot_bytes)}",
            f"KV pool           {self.num_pages:,} pages of {self.page_size} = {self.num_tokens:,} tokens"
            f" = {_mib(self.kv_bytes)}",
        ]
        return "\n".join(lines)


def plan_memory(
    config: ModelConfig,
    *,
    budget_bytes: int,
    page_size: int,
    dtype: torch.dtype,
    max_running_requests: int,
    state_bytes_per_slot: int = 0,
    ledger: MemoryLedger | None = None,
) -> MemoryPlan:
    """One full-length request's KV, then request slots (as many as asked, or as many as fit), then KV pages.

    The engine's context is the shorter of the model's (`max_position_embeddings`) and the KV pool, so the pool
    first gets the pages of one request of the model's full context (or what the budget holds beside one slot).
    Only then do slots beyond the first come out of the budget, up to `max_running_requests`, and every byte left
    becomes KV pages. Had the slots come first beside a single page, a budget a little larger could buy one slot
    more out of the KV pool and shorten the context of every request: more memory, a worse engine. In this order a
    larger budget never gives fewer slots or a shorter context.

    `ledger` replaces the one built from the config and `state_bytes_per_slot` (the engine's, which may count a draft
    model's KV and the verify states of speculative decoding).
    """
    if budget_bytes <= 0 or page_size <= 0 or max_running_requests <= 0:
        raise ValueError(
            "plan_memory needs positive budget_bytes, page_size and max_running_requests, "
            f"got {budget_bytes}, {page_size} and {max_running_requests}"
        )
    ledger = ledger or MemoryLedger.from_config(config, dtype, state_bytes_per_slot=state_bytes_per_slot)
    page_bytes = page_size * ledger.kv_bytes_per_token
    if budget_bytes < ledger.bytes_per_slot + page_bytes:
        raise MemoryPlanError(
            f"a memory budget of {budget_bytes:,} B cannot hold one request slot ({ledger.bytes_per_slot:,} B) "
            f"and one KV page ({page_bytes:,} B)"
        )
    # Whole pages, like the engine's context; at least one, the smallest pool.
    context_bytes = max(config.max_position_embeddings // page_size, 1) * page_bytes
    slots = min(max_running_requests, max((budget_bytes - context_bytes) // ledger.bytes_per_slot, 1))
    num_pages = (budget_bytes - slots * ledger.bytes_per_slot) // page_bytes
    return MemoryPlan(ledger, budget_bytes, page_size, num_pages, slots)


def default_budget_bytes(
    ledger: MemoryLedger,
    *,
    max_running_requests: int,
    max_context_len: int,
    device: torch.device,
    checkpoint_bytes: int = 0,
) -> int:
    """Enough for every slot to hold a full context beside the `checkpoint_bytes` set aside for the prefix cache's
    state checkpoints, capped by what the device can spare."""
    wanted = checkpoint_bytes + max_running_requests * ledger.bytes_per_request(max_context_len)
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return min(wanted, int(free_bytes * DEFAULT_DEVICE_MEMORY_FRACTION))
    return min(wanted, DEFAULT_CPU_BUDGET_BYTES)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.2f} MiB"
