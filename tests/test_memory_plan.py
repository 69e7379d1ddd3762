"""The memory plan's arithmetic, recomputed here from the config fields, and checked against a real KVPool.

The last test is a property test over budgets (hypothesis): for random models (KV heads, head size, GDN state,
context length), page sizes, `max_running_requests`, both policies of notebook 06 (slots first, `plan_memory`; a
share for the slots, `plan_hybrid_memory`) and two budgets b <= b + extra, every plan stays within its budget, gives
every byte its slots leave to KV pages, gives between 1 and `max_running_requests` slots and a full context whenever
it gives more than one; and the larger budget gives at least as many slots and at least as long a context. The
context is the engine's: the shorter of the model's and the KV pool, in whole pages (Engine.__init__).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from a4.engine.hybrid_memory import plan_hybrid_memory
from a4.engine.memory_plan import MemoryLedger, MemoryPlan, MemoryPlanError, default_budget_bytes, plan_memory
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
# Qwen3.5's pattern: one full-attention layer in four, and a GDN state per slot.
HYBRID = replace(
    QWEN3,
    architecture="Qwen3_5ForConditionalGeneration",
    num_hidden_layers=8,
    layer_types=tuple(FULL_ATTENTION if (i + 1) % 4 == 0 else LINEAR_ATTENTION for i in range(8)),
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
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


KV_PER_TOKEN, PER_SLOT = 2 * 4 * 2 * 32 * 4, 4096 * 8  # QWEN3 in float32
FULL_CONTEXT = 4096 * KV_PER_TOKEN  # the KV of one request as long as QWEN3 accepts


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("budget", [10**7, 3 * 10**7 + 17])
def test_plan_gives_slots_first_then_whole_pages(page_size, budget):
    plan = plan_memory(QWEN3, budget_bytes=budget, page_size=page_size, dtype=torch.float32, max_running_requests=8)
    assert plan.max_running_requests == 8
    assert plan.num_pages == (budget - 8 * PER_SLOT) // (page_size * KV_PER_TOKEN)
    assert plan.num_tokens == plan.num_pages * page_size
    assert plan.used_bytes == 8 * PER_SLOT + plan.num_tokens * KV_PER_TOKEN <= budget
    assert plan.used_bytes + page_size * KV_PER_TOKEN > budget  # one more page would not fit
    pool = KVPool(4, plan.num_pages, page_size, 2, 32, torch.float32, "cpu")
    assert pool.total_bytes == plan.kv_bytes


def test_state_cost_per_slot_comes_out_of_the_kv_pages():
    kwargs = dict(budget_bytes=10**7, page_size=1, dtype=torch.float32, max_running_requests=4)
    without = plan_memory(HYBRID, **kwargs)
    with_state = plan_memory(HYBRID, **kwargs, state_bytes_per_slot=100_000)
    kv_per_token = 2 * 2 * 2 * 32 * 4
    assert without.num_pages - with_state.num_pages == pytest.approx(4 * 100_000 / kv_per_token, abs=1)


def test_slots_beyond_the_first_only_beside_a_full_context_and_a_budget_too_small_is_an_error():
    # A full context and two and a half slots: two slots, and the half slot's bytes become 8 more tokens.
    budget = FULL_CONTEXT + 2 * PER_SLOT + PER_SLOT // 2
    plan = plan_memory(QWEN3, budget_bytes=budget, page_size=1, dtype=torch.float32, max_running_requests=8)
    assert plan.max_running_requests == 2 and plan.num_pages == 4096 + 8
    # Less than a full context beside one slot: one slot, and every other byte is KV.
    short = plan_memory(QWEN3, budget_bytes=3 * PER_SLOT + 10 * KV_PER_TOKEN, page_size=1, dtype=torch.float32,
                        max_running_requests=8)
    assert short.max_running_requests == 1 and short.num_pages == 2 * PER_SLOT // KV_PER_TOKEN + 10
    with pytest.raises(MemoryPlanError, match="cannot hold one request slot"):
        plan_memory(QWEN3, budget_bytes=PER_SLOT, page_size=1, dtype=torch.float32, max_running_requests=1)
    with pytest.raises(ValueError, match="positive"):
        plan_memory(QWEN3, budget_bytes=10**6, page_size=0, dtype=torch.float32, max_running_requests=1)


def test_a_larger_budget_never_gives_a_shorter_context():
    """The issue's counterexample: 30 tokens' worth more budget used to buy two slots out of the KV pool."""
    kwargs = dict(page_size=1, dtype=torch.float32, max_running_requests=8)
    small = plan_memory(QWEN3, budget_bytes=PER_SLOT + 10 * KV_PER_TOKEN, **kwargs)
    large = plan_memory(QWEN3, budget_bytes=PER_SLOT + 40 * KV_PER_TOKEN, **kwargs)
    assert (small.max_running_requests, small.num_tokens) == (1, 10)
    assert (large.max_running_requests, large.num_tokens) == (1, 40)  # was 3 slots and 8 tokens


def test_default_budget_asks_for_full_contexts_capped_on_cpu():
    ledger = MemoryLedger.from_config(QWEN3, torch.float32)
    wanted = 2 * (4096 * 8 + 4096 * ledger.kv_bytes_per_token)
    cpu = torch.device("cpu")
    assert default_budget_bytes(ledger, max_running_requests=2, max_context_len=4096, device=cpu) == wanted
    huge = default_budget_bytes(ledger, max_running_requests=10**6, max_context_len=4096, device=cpu)
    assert 0 < huge < 10**6 * wanted


@pytest.mark.parametrize("max_running_requests", [1, 3])
def test_default_budget_holds_full_contexts_beside_the_checkpoints(max_running_requests):
    ledger = MemoryLedger.from_config(HYBRID, torch.float32, state_bytes_per_slot=12345)
    checkpoints = 16 * 12345
    budget = default_budget_bytes(ledger, max_running_requests=max_running_requests, max_context_len=4096,
                                  device=torch.device("cpu"), checkpoint_bytes=checkpoints)
    assert budget == checkpoints + max_running_requests * (4096 * 8 + 12345 + 4096 * ledger.kv_bytes_per_token)
    # What the engine plans in: the budget less the checkpoints.
    plan = plan_memory(HYBRID, budget_bytes=budget - checkpoints, page_size=1, dtype=torch.float32,
                       max_running_requests=max_running_requests, state_bytes_per_slot=12345)
    assert plan.max_running_requests == max_running_requests
    assert plan.num_tokens == max_running_requests * 4096


# --------------------------------------------------------------------------------- property test over budgets


ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2}


@dataclass(frozen=True)
class Case:
    config: ModelConfig
    dtype: torch.dtype
    page_size: int
    max_running_requests: int
    state_fraction: float | None  # None: slots first

    @property
    def kv_per_token(self) -> int:
        c = self.config
        return 2 * c.layer_types.count(FULL_ATTENTION) * c.num_key_value_heads * c.head_dim * ELEMENT_BYTES[self.dtype]

    @property
    def slot_bytes(self) -> int:
        c = self.config
        value_dim = c.linear_num_value_heads * c.linear_value_head_dim
        conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + value_dim
        conv = conv_dim * (c.linear_conv_kernel_dim - 1) * ELEMENT_BYTES[self.dtype]
        recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4
        return c.max_position_embeddings * 8 + c.layer_types.count(LINEAR_ATTENTION) * (conv + recurrent)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_per_token

    @property
    def full_context(self) -> int:
        """The longest request the engine could ever hold: the model's context, in whole pages."""
        mpe = self.config.max_position_embeddings
        return mpe - mpe % self.page_size

    def plan(self, budget: int) -> MemoryPlan | None:
        kwargs = dict(budget_bytes=budget, page_size=self.page_size, dtype=self.dtype,
                      max_running_requests=self.max_running_requests)
        try:
            if self.state_fraction is None:
                state = self.slot_bytes - self.config.max_position_embeddings * 8
                return plan_memory(self.config, state_bytes_per_slot=state, **kwargs)
            return plan_hybrid_memory(self.config, state_fraction=self.state_fraction, **kwargs)
        except MemoryPlanError:
            return None

    def context(self, plan: MemoryPlan) -> int:
        context = min(self.config.max_position_embeddings, plan.num_tokens)
        return context - context % self.page_size


@st.composite
def cases(draw: st.DrawFn) -> Case:
    page_size = draw(st.integers(1, 8))
    head_dim = draw(st.sampled_from([8, 32]))
    config = replace(
        draw(st.sampled_from([QWEN3, HYBRID])),
        num_key_value_heads=draw(st.sampled_from([1, 2, 4])),
        head_dim=head_dim,
        rotary_dim=head_dim,
        # Short contexts, so that the budgets below reach every regime: below one full context, slots beside one,
        # all the slots asked for. A context shorter than a page is an error of the engine's, not of the plan.
        max_position_embeddings=draw(st.integers(page_size, 300)),
    )
    if config.is_hybrid:
        config = replace(config, linear_value_head_dim=draw(st.sampled_from([1, 4, 16])))
    fractions = st.none() | st.floats(0.01, 0.99) if config.is_hybrid else st.none()
    return Case(config, draw(st.sampled_from(list(ELEMENT_BYTES))), page_size, draw(st.integers(1, 12)),
                draw(fractions))


def check_plan(case: Case, budget: int, plan: MemoryPlan | None) -> None:
    """What any plan of the policy must satisfy on its own."""
    slot, page = case.slot_bytes, case.page_bytes
    share_too_small = case.state_fraction is not None and int(budget * case.state_fraction) < slot
    if plan is None:
        assert budget < slot + page or share_too_small, f"no plan for a budget of {budget:,} B"
        return
    assert not share_too_small and budget >= slot + page
    slots = plan.max_running_requests
    assert 1 <= slots <= case.max_running_requests
    assert plan.slot_bytes == slots * slot and plan.kv_bytes == plan.num_pages * page
    # Within the budget, and every byte the slots leave is KV: one more page would not fit.
    assert plan.used_bytes <= budget < plan.used_bytes + page
    if slots > 1:
        assert case.context(plan) == case.full_context, "a second slot shortened the context"
    # As many slots as asked, unless one more would not fit beside a full context (or in the share).
    if slots < case.max_running_requests:
        beside_full_context = (slots + 1) * slot + case.full_context * case.kv_per_token <= budget
        in_share = case.state_fraction is None or (slots + 1) * slot <= int(budget * case.state_fraction)
        assert not (beside_full_context and in_share), f"{slots} slots, but one more fits"
    if case.state_fraction is not None:
        assert plan.slot_bytes <= budget * case.state_fraction


@given(case=cases(), budget=st.integers(1, 4 * 10**6), extra=st.integers(0, 4 * 10**6))
def test_a_larger_budget_never_gives_fewer_slots_or_a_shorter_context(case, budget, extra):
    small, large = case.plan(budget), case.plan(budget + extra)
    check_plan(case, budget, small)
    check_plan(case, budget + extra, large)
    if small is not None:
        assert large is not None
        assert large.max_running_requests >= small.max_running_requests
        assert case.context(large) >= case.context(small)
