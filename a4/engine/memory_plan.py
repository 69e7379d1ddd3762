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
checkpoints its prefix cache may keep (notebook 07): `MemoryPlan.checkpoint_bytes`. `plan_engine_memory` is the
engine's whole plan, from its settings and the model's ledger (notebook 06's `hybrid_ledger` for a hybrid model).
Model weights are not part of the budget: they are loaded before the plan is made.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from a4.models.config import ModelConfig

if TYPE_CHECKING:
    from a4.engine.config import EngineConfig

# Bytes of one req_to_token entry (an int64 location).
TABLE_ENTRY_BYTES = 8
# Default budget on a CPU: there is no cheap, portable "free memory" query, and a few GiB is what a laptop can spare.
DEFAULT_CPU_BUDGET_BYTES = 2 << 30
# Default budget on an accelerator: this fraction of the memory free once the weights are loaded (activations and
# the allocator's fragmentation need the rest).
DEFAULT_DEVICE_MEMORY_FRACTION = 0.8


class MemoryPlanError(ValueError):
    """The budget cannot hold even one request slot and one KV page."""


def kv_bytes_per_layer_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token in one attention layer: every KV head, in the model's dtype."""
    return 2 * config.num_key_value_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class MemoryLedger:
    """What a model costs per token and per request slot, in bytes."""

    kv_bytes_per_token: int
    table_bytes_per_slot: int
    state_bytes_per_slot: int = 0
    # Speculative decoding (a4/speculative): the states a slot's verify pass keeps, k + 1 of its state (0 without).
    verify_bytes_per_slot: int = 0

    @classmethod
    def from_config(cls, config: ModelConfig, dtype: torch.dtype, *, state_bytes_per_slot: int = 0) -> MemoryLedger:
        """KV of the model's full-attention layers per token, the table row and `state_bytes_per_slot` per slot."""
        return cls(
            kv_bytes_per_token=len(config.full_attention_layers) * kv_bytes_per_layer_token(config, dtype),
            # A row spans the longest context the model accepts (the engine may use fewer entries).
            table_bytes_per_slot=config.max_position_embeddings * TABLE_ENTRY_BYTES,
            state_bytes_per_slot=state_bytes_per_slot,
        )

    @classmethod
    def all_attention(cls, config: ModelConfig, dtype: torch.dtype) -> MemoryLedger:
        """The same model with every layer full attention: KV in every layer, no state (what a hybrid saves)."""
        return cls(
            kv_bytes_per_token=config.num_hidden_layers * kv_bytes_per_layer_token(config, dtype),
            table_bytes_per_slot=config.max_position_embeddings * TABLE_ENTRY_BYTES,
        )

    def with_speculation(self, config: ModelConfig, dtype: torch.dtype, draft_kv_layers: int, num_tokens: int):
        """This ledger plus what speculative decoding adds: a draft model's attention layers (Qwen3.5's MTP module:
        one), which keep KV in the same pool with the main model's heads, and the states a verify pass of
        `num_tokens` positions keeps."""
        return replace(
            self,
            kv_bytes_per_token=self.kv_bytes_per_token + draft_kv_layers * kv_bytes_per_layer_token(config, dtype),
            verify_bytes_per_slot=num_tokens * self.state_bytes_per_slot,
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
    # Hybrid models: the shortest request that costs less memory than in the same model with every layer attention
    # (notebook 06's `break_even_tokens`, asked by `describe`).
    break_even: Callable[[], int] | None = None

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
        if self.break_even is not None:
            try:
                cheaper = f"requests of {self.break_even():,}+ tokens cost less than with every layer attention"
            except ValueError as e:  # the hybrid request never costs less: say so
                cheaper = str(e)
            lines.append(f"break-even        {cheaper}")
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


# How a budget is split between slots and pages: `plan_memory`, or notebook 06's `plan_hybrid_memory` with a share.
Split = Callable[..., MemoryPlan]


def plan_engine_memory(
    config: EngineConfig,
    model_config: ModelConfig,
    ledger: MemoryLedger,
    *,
    num_checkpoints: int,
    split: Split | None = None,
) -> MemoryPlan:
    """The engine's plan: `num_checkpoints` state checkpoints for the prefix cache set aside first (the default budget
    adds them to what full contexts need), then the rest split by `split` (default: slots first, `plan_memory`
    with `ledger`), called with the budget, page size, dtype and `max_running_requests`."""
    dtype, device = config.torch_dtype, config.torch_device
    checkpoint_bytes = num_checkpoints * ledger.state_bytes_per_slot
    budget = config.memory_budget_bytes or default_budget_bytes(
        ledger,
        max_running_requests=config.max_running_requests,
        max_context_len=model_config.max_position_embeddings,
        device=device,
        checkpoint_bytes=checkpoint_bytes,
    )
    # What must remain beside the checkpoints: one request slot and one KV page, the smallest plan.
    if checkpoint_bytes and budget - checkpoint_bytes < ledger.bytes_per_request(config.page_size):
        raise MemoryPlanError(
            f"max_state_checkpoints={num_checkpoints} state checkpoints take {checkpoint_bytes:,} B "
            f"of the {budget:,} B memory budget, leaving less than one request slot and one KV page "
            f"({ledger.bytes_per_request(config.page_size):,} B): lower max_state_checkpoints, raise "
            f"memory_budget_bytes, or set hybrid_prefix_policy='refuse'"
        )
    split = split or (lambda model_config, **sizes: plan_memory(model_config, ledger=ledger, **sizes))
    plan = split(
        model_config,
        budget_bytes=budget - checkpoint_bytes,
        page_size=config.page_size,
        dtype=dtype,
        max_running_requests=config.max_running_requests,
    )
    return replace(plan, budget_bytes=budget, checkpoint_bytes=checkpoint_bytes)


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
        # The driver counts as used what torch's caching allocator keeps of the blocks freed while the weights were
        # loaded (each random tensor drawn in float32, the projections merged from their parts). Give them back
        # first, as SGLang does, so that they count as free.
        torch.cuda.empty_cache()
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return min(wanted, int(free_bytes * DEFAULT_DEVICE_MEMORY_FRACTION))
    return min(wanted, DEFAULT_CPU_BUDGET_BYTES)


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.2f} MiB"
