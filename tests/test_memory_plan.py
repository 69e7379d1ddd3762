"""The memory plan's arithmetic, recomputed here from the config fields, and checked against a real KVPool."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from a4.engine.memory_plan import MemoryLedger, MemoryPlanError, default_budget_bytes, plan_memory
from a4.kvcache.kv_pool import KVPool
from a4.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig

QWEN3 = ModelConfig(
    architecture="Qwen3ForCausalLM",
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    rotary_dim=32,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    eos_token_ids=(1,),
    layer_types=(FULL_ATTENTION,) * 4,
)
# Qwen3.5's pattern: one full-attention layer in four.
HYBRID = replace(
    QWEN3,
    architecture="Qwen3_5ForConditionalGeneration",
    num_hidden_layers=8,
    layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8)),
)


@pytest.mark.parametrize("dtype, element_bytes", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_ledger_counts_k_and_v_of_the_attention_layers(dtype, element_bytes):
    ledger = MemoryLedger.from_config(QWEN3, dtype)
    assert ledger.kv_bytes_per_token == 2 * 4 * 2 * 32 * element_bytes
    assert ledger.table_bytes_per_slot == 4096 * 8
    assert ledger.bytes_per_request(100) == 4096 * 8 + 100 * ledger.kv_bytes_per_token
    pool = KVPool(num_layers=4, num_pages=3, page_size=5, num_kv_heads=2, head_dim=32, dtype=dtype, device="cpu")
    assert ledger.kv_bytes_per_token == pool.bytes_per_token


def test_hybrid_ledger_has_kv_only_for_full_attention_layers_and_a_state_cost_per_slot():
    ledger = MemoryLedger.from_config(HYBRID, torch.float32, state_bytes_per_slot=12345)
    assert ledger.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # 2 of 8 layers keep KV
    assert ledger.bytes_per_slot == 4096 * 8 + 12345


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("budget", [10**6, 3 * 10**6 + 17])
def test_plan_gives_slots_first_then_whole_pages(page_size, budget):
    plan = plan_memory(QWEN3, budget_bytes=budget, page_size=page_size, dtype=torch.float32, max_running_requests=8)
    kv_per_token, per_slot = 2 * 4 * 2 * 32 * 4, 4096 * 8
    assert plan.max_running_requests == 8
    assert plan.num_pages == (budget - 8 * per_slot) // (page_size * kv_per_token)
    assert plan.num_tokens == plan.num_pages * page_size
    assert plan.used_bytes == 8 * per_slot + plan.num_tokens * kv_per_token <= budget
    assert plan.used_bytes + page_size * kv_per_token > budget  # one more page would not fit
    pool = KVPool(4, plan.num_pages, page_size, 2, 32, torch.float32, "cpu")
    assert pool.total_bytes == plan.kv_bytes


def test_state_cost_per_slot_comes_out_of_the_kv_pages():
    kwargs = dict(budget_bytes=4 * 10**6, page_size=1, dtype=torch.float32, max_running_requests=4)
    without = plan_memory(HYBRID, **kwargs)
    with_state = plan_memory(HYBRID, **kwargs, state_bytes_per_slot=100_000)
    kv_per_token = 2 * 2 * 2 * 32 * 4
    assert without.num_pages - with_state.num_pages == pytest.approx(4 * 100_000 / kv_per_token, abs=1)


def test_small_budget_gets_fewer_slots_and_a_budget_too_small_is_an_error():
    per_slot, page_bytes = 4096 * 8, 2 * 4 * 2 * 32 * 4
    budget = 3 * per_slot + 10 * page_bytes
    plan = plan_memory(QWEN3, budget_bytes=budget, page_size=1, dtype=torch.float32, max_running_requests=8)
    assert plan.max_running_requests == 3 and plan.num_pages == 10
    with pytest.raises(MemoryPlanError, match="cannot hold one request slot"):
        plan_memory(QWEN3, budget_bytes=per_slot, page_size=1, dtype=torch.float32, max_running_requests=1)
    with pytest.raises(ValueError, match="positive"):
        plan_memory(QWEN3, budget_bytes=10**6, page_size=0, dtype=torch.float32, max_running_requests=1)


def test_default_budget_asks_for_full_contexts_capped_on_cpu():
    ledger = MemoryLedger.from_config(QWEN3, torch.float32)
    wanted = 2 * (4096 * 8 + 4096 * ledger.kv_bytes_per_token)
    cpu = torch.device("cpu")
    assert default_budget_bytes(ledger, max_running_requests=2, max_context_len=4096, device=cpu) == wanted
    huge = default_budget_bytes(ledger, max_running_requests=10**6, max_context_len=4096, device=cpu)
    assert 0 < huge < 10**6 * wanted
