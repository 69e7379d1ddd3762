"""Exercise (notebook 06): the memory plan of a hybrid model, request slots that carry a state and KV pages.

A hybrid model (Qwen3.5) pays for memory in two currencies that come out of one budget:
- per token: the K and V of its full-attention layers only (one layer in four), `kv_bytes_per_token`;
- per request slot, whatever the request's length: its `req_to_token` row and, for every Gated DeltaNet layer, a
  conv state and a recurrent state (`StatePool.bytes_per_slot`, notebook 05): tens of MiB for the real models.

So a slot is expensive and a token is cheap, and the plan must choose how many of each. Two policies:
- slots first (`state_fraction=None`, the default): `max_running_requests` slots (fewer if the budget cannot hold
  them beside the KV of one request of the model's full context, but always one), and everything else as KV pages.
  `plan_memory` (memory_plan.py) does exactly this once the state is counted in the slot's cost, and the engine
  calls it directly.
- a share for the slots (`state_fraction=f`): the slots may take at most f of the budget, so that a large
  `max_running_requests` cannot starve the KV pool; the rest is KV pages. SGLang splits its memory by a ratio the
  same way (`--mamba-full-memory-ratio r` = state bytes / KV bytes, that is f = r / (1 + r)). The engine calls
  `plan_hybrid_memory` for this policy (`LLM(..., state_fraction=f)`), with what its prefix cache's state
  checkpoints leave of the budget.
"""

from __future__ import annotations

import torch

from a4.engine.memory_plan import MemoryLedger, MemoryPlan, MemoryPlanError, plan_memory
from a4.kvcache.state_pool import StatePool
from a4.models.config import ModelConfig


def hybrid_ledger(config: ModelConfig, dtype: torch.dtype) -> MemoryLedger:
    """What a hybrid model costs per token and per request slot, in bytes; `dtype` is the model's dtype.

    The ledger's three fields:
    - kv_bytes_per_token: K and V, for every KV head, of the full-attention layers only (GDN layers keep no KV);
      in `dtype`, like the KV pool;
    - state_bytes_per_slot: what the StatePool of notebook 05 holds for one slot: per GDN layer a conv state
      [conv_dim, linear_conv_kernel_dim - 1] in `dtype` and a recurrent state [Hv, dk, dv] in float32
      (`StatePool.bytes_per_slot(config, dtype)` counts it);
    - table_bytes_per_slot: the slot's row of `req_to_token`, as for every model.

    `MemoryLedger.from_config` (a4/engine/memory_plan.py) already counts the KV of `config.full_attention_layers`
    and the table row; read it, and give it the state.
    """
    # BEGIN SOLUTION memory-ledger 06_memory_plan: a hybrid model's ledger, KV per token and state per slot
    return MemoryLedger.from_config(config, dtype, state_bytes_per_slot=StatePool.bytes_per_slot(config, dtype))
    # END SOLUTION


def break_even_tokens(hybrid: MemoryLedger, all_attention: MemoryLedger) -> int:
    """The shortest request, in tokens, that costs strictly less memory in the hybrid model than in all_attention.

    A request of n tokens costs `ledger.bytes_per_request(n)`: the fixed cost of its slot plus n times the KV per
    token. A hybrid slot costs more (its state) and a hybrid token less (KV in fewer layers), so short requests
    cost more in the hybrid model and long ones less. Return the smallest n >= 0 with
    `hybrid.bytes_per_request(n) < all_attention.bytes_per_request(n)`: 0 when the hybrid request is cheaper from
    the start. Raise ValueError when no n qualifies (the hybrid slot costs at least as much and its tokens do not
    cost less). Integers only: a float division can land one token off for large byte counts.
    """
    # BEGIN SOLUTION memory-break-even 06_memory_plan: the request length from which the hybrid model costs less
    extra_per_slot = hybrid.bytes_per_slot - all_attention.bytes_per_slot
    saved_per_token = all_attention.kv_bytes_per_token - hybrid.kv_bytes_per_token
    if extra_per_slot < 0:
        return 0
    if saved_per_token <= 0:
        raise ValueError(
            f"the hybrid request never costs less: its slot costs {extra_per_slot:,} B more and its tokens "
            f"{-saved_per_token:,} B more each"
        )
    # The smallest n with n * saved_per_token > extra_per_slot.
    return extra_per_slot // saved_per_token + 1
    # END SOLUTION


def plan_hybrid_memory(
    config: ModelConfig,
    *,
    budget_bytes: int,
    page_size: int,
    dtype: torch.dtype,
    max_running_requests: int,
    state_fraction: float | None = None,
) -> MemoryPlan:
    """Split budget_bytes between request slots (table row + state each) and KV pages of page_size tokens.

    - state_fraction None (slots first): as many slots as asked, `max_running_requests`, fewer only if they do not
      fit beside the KV of one request of the model's full context (always one); all the rest becomes KV pages.
    - state_fraction f in (0, 1): at most `max_running_requests` slots, and no more than fit whole in
      int(f * budget_bytes) bytes; the rest of the budget, including whatever the slots leave of their share,
      becomes KV pages. If that share cannot hold one slot, raise MemoryPlanError naming state_fraction, the budget
      and the bytes of one slot.

    `plan_memory` does the rest once you know how many slots to ask for: it keeps a full-length request's KV,
    gives the slots that fit beside it, turns the rest into pages, and raises MemoryPlanError when not even one slot
    and one page fit. Use `hybrid_ledger` for the costs.
    """
    if state_fraction is not None and not 0 < state_fraction < 1:
        raise ValueError(f"state_fraction must be in (0, 1) or None, got {state_fraction!r}")
    # BEGIN SOLUTION memory-split 06_memory_plan: how many state slots and how many KV pages fit in the budget
    ledger = hybrid_ledger(config, dtype)
    slots = max_running_requests
    if state_fraction is not None:
        slot_share = int(budget_bytes * state_fraction)
        slots = min(slots, slot_share // ledger.bytes_per_slot)
        if slots < 1:
            raise MemoryPlanError(
                f"state_fraction {state_fraction} of a {budget_bytes:,} B budget is {slot_share:,} B: not enough for "
                f"one request slot ({ledger.bytes_per_slot:,} B = table row {ledger.table_bytes_per_slot:,} B + "
                f"state {ledger.state_bytes_per_slot:,} B)"
            )
    return plan_memory(
        config,
        budget_bytes=budget_bytes,
        page_size=page_size,
        dtype=dtype,
        max_running_requests=slots,
        state_bytes_per_slot=ledger.state_bytes_per_slot,
    )
    # END SOLUTION
