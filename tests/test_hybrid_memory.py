"""The hybrid memory plan (notebook 06): the ledger, the break-even length, the budget split, the engine under it.

Every expected byte count is computed in this file from config.json's fields (`costs`), or is a published figure of
the real Qwen3.5 configs; generated tokens are compared with transformers' greedy generation (a4.reference).
"""

from __future__ import annotations

import json

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.checkpoints import preset_config, tiny_checkpoint
from a4.engine.hybrid_memory import break_even_tokens, hybrid_ledger, plan_hybrid_memory
from a4.engine.memory_plan import MemoryLedger, MemoryPlanError
from a4.models.config import load_model_config, parse_config
from a4.reference import hf_greedy

MODELS = [("qwen3_5", "tiny"), ("qwen3_5_moe", "tiny"), ("qwen3_5", "0.8b"), ("qwen3_5_moe", "35b-a3b")]
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2}
DTYPES = list(ELEMENT_BYTES)


def costs(raw: dict, dtype: torch.dtype) -> dict[str, int]:
    """Bytes per token (kv; all_kv if every layer were attention) and per slot (state, table) from config.json."""
    t = raw["text_config"]
    element = ELEMENT_BYTES[dtype]
    full = t["layer_types"].count("full_attention")
    gdn = t["layer_types"].count("linear_attention")
    kv_per_layer = 2 * t["num_key_value_heads"] * t["head_dim"] * element
    conv_dim = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"] + (
        t["linear_num_value_heads"] * t["linear_value_head_dim"]
    )
    conv_state = conv_dim * (t["linear_conv_kernel_dim"] - 1) * element
    recurrent_state = t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"] * 4
    return {
        "kv": full * kv_per_layer,
        "all_kv": t["num_hidden_layers"] * kv_per_layer,
        "state": gdn * (conv_state + recurrent_state),
        # One int64 KV location per position the model accepts.
        "table": t["max_position_embeddings"] * 8,
    }


# The plan gives slots beyond the first only beside the KV of one request of the model's full context. A context of
# 16 tokens lets budgets of a few slots and a few dozen tokens hold several slots, and three requests of a dozen
# tokens fill them.
CONTEXT = 16


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("qwen3_5", max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def tiny(ckpt):
    """(ModelConfig, costs in float32) of the tiny checkpoint."""
    return load_model_config(ckpt), costs(read_config(ckpt), torch.float32)


def read_config(ckpt) -> dict:
    return json.loads((ckpt / "config.json").read_text())


# ---------------------------------------------------------------------------------------------------------- ledger


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch, preset", MODELS)
def test_ledger_counts_attention_kv_per_token_and_gdn_state_per_slot(arch, preset, dtype):
    raw = preset_config(arch, preset)
    want = costs(raw, dtype)
    ledger = hybrid_ledger(parse_config(raw), dtype)
    assert ledger.kv_bytes_per_token == want["kv"]
    assert ledger.state_bytes_per_slot == want["state"]
    assert ledger.table_bytes_per_slot == want["table"]
    assert ledger.bytes_per_request(1000) == want["table"] + want["state"] + 1000 * want["kv"]


def test_ledger_of_the_real_models_matches_the_published_figures():
    # qwen3_5-configs.md, bfloat16: KV per token and 18 (30) GDN layers' conv + float32 recurrent state per request.
    small = hybrid_ledger(parse_config(preset_config("qwen3_5", "0.8b")), torch.bfloat16)
    assert (small.kv_bytes_per_token, small.state_bytes_per_slot) == (12_288, 18 * 1_085_440)
    moe = hybrid_ledger(parse_config(preset_config("qwen3_5_moe", "35b-a3b")), torch.bfloat16)
    assert (moe.kv_bytes_per_token, moe.state_bytes_per_slot) == (20_480, 30 * 2_146_304)


# ------------------------------------------------------------------------------------------------------ break-even


def request_bytes(slot: int, per_token: int, n: int) -> int:
    return slot + n * per_token


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch, preset", MODELS)
def test_break_even_is_the_shortest_request_that_costs_less_in_the_hybrid(arch, preset, dtype):
    c = costs(preset_config(arch, preset), dtype)
    hybrid = MemoryLedger(c["kv"], c["table"], c["state"])
    all_attention = MemoryLedger(c["all_kv"], c["table"])
    n = break_even_tokens(hybrid, all_attention)
    hybrid_slot = c["table"] + c["state"]
    assert request_bytes(hybrid_slot, c["kv"], n) < request_bytes(c["table"], c["all_kv"], n)
    assert request_bytes(hybrid_slot, c["kv"], n - 1) >= request_bytes(c["table"], c["all_kv"], n - 1)


def test_break_even_edge_cases():
    all_attention = MemoryLedger(kv_bytes_per_token=100, table_bytes_per_slot=1000)
    # 10 bytes more per slot, 5 fewer per token: equal at 2 tokens, so 3 is the first that is strictly cheaper.
    assert break_even_tokens(MemoryLedger(95, 1000, 10), all_attention) == 3
    assert break_even_tokens(MemoryLedger(50, 900), all_attention) == 0
    assert break_even_tokens(MemoryLedger(100, 990, 0), all_attention) == 0
    with pytest.raises(ValueError, match="never costs less"):
        break_even_tokens(MemoryLedger(100, 1000, 10), all_attention)


# ----------------------------------------------------------------------------------------------------- the split


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_slots_first_honours_max_running_requests_and_gives_the_rest_to_kv_pages(ckpt, dtype, page_size):
    config = load_model_config(ckpt)
    c = costs(read_config(ckpt), dtype)
    slot, page = c["table"] + c["state"], page_size * c["kv"]
    budget = 5 * slot + 123 * page + 17
    plan = plan_hybrid_memory(config, budget_bytes=budget, page_size=page_size, dtype=dtype, max_running_requests=5)
    assert (plan.max_running_requests, plan.num_pages) == (5, 123)
    assert plan.used_bytes == 5 * slot + 123 * page <= budget < plan.used_bytes + page
    # Fewer slots when the budget cannot hold the ones asked for beside the KV of one full-length request.
    context_pages = max(CONTEXT // page_size, 1)
    few = plan_hybrid_memory(config, budget_bytes=3 * slot + context_pages * page, page_size=page_size, dtype=dtype,
                             max_running_requests=8)
    assert (few.max_running_requests, few.num_pages) == (3, context_pages)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("max_running_requests", [2, 1000])
def test_state_fraction_caps_the_slots_share_of_the_budget(tiny, fraction, max_running_requests):
    config, c = tiny
    slot = c["table"] + c["state"]
    budget = 50 * slot + 999
    plan = plan_hybrid_memory(config, budget_bytes=budget, page_size=1, dtype=torch.float32,
                              max_running_requests=max_running_requests, state_fraction=fraction)
    slots = min(max_running_requests, int(budget * fraction) // slot)
    assert plan.max_running_requests == slots
    assert plan.num_pages == (budget - slots * slot) // c["kv"]
    assert plan.slot_bytes <= fraction * budget


def test_kv_share_grows_as_the_state_fraction_shrinks(tiny):
    config, c = tiny
    budget = 100 * (c["table"] + c["state"]) + 1000
    plans = [plan_hybrid_memory(config, budget_bytes=budget, page_size=1, dtype=torch.float32,
                                max_running_requests=1000, state_fraction=f) for f in (0.8, 0.5, 0.2)]
    assert [p.max_running_requests for p in plans] == [80, 50, 20]
    assert plans[0].num_pages < plans[1].num_pages < plans[2].num_pages


def test_budget_too_small_for_one_slot_and_one_page_names_the_numbers(tiny):
    config, c = tiny
    slot = c["table"] + c["state"]
    budget = slot + 4 * c["kv"] - 1
    with pytest.raises(MemoryPlanError) as error:
        plan_hybrid_memory(config, budget_bytes=budget, page_size=4, dtype=torch.float32, max_running_requests=1)
    message = str(error.value)
    assert f"{budget:,}" in message and f"{slot:,}" in message and f"{4 * c['kv']:,}" in message


def test_state_fraction_too_small_for_one_slot_names_the_numbers(tiny):
    config, c = tiny
    slot = c["table"] + c["state"]
    with pytest.raises(MemoryPlanError) as error:
        plan_hybrid_memory(config, budget_bytes=10 * slot, page_size=1, dtype=torch.float32,
                           max_running_requests=4, state_fraction=0.05)
    assert "state_fraction 0.05" in str(error.value) and f"{slot:,}" in str(error.value)


@pytest.mark.parametrize("fraction", [0, 1, -0.5, 1.5])
def test_state_fraction_outside_zero_one_is_rejected(ckpt, tiny, fraction):
    config, _ = tiny
    with pytest.raises(ValueError, match="state_fraction"):
        plan_hybrid_memory(config, budget_bytes=10**8, page_size=1, dtype=torch.float32, max_running_requests=4,
                           state_fraction=fraction)
    with pytest.raises(ValueError, match="state_fraction"):
        LLM(ckpt, state_fraction=fraction)


def test_state_fraction_is_refused_for_an_all_attention_model(tiny_qwen3):
    with pytest.raises(ValueError, match="state_fraction"):
        LLM(tiny_qwen3, state_fraction=0.5)


def test_qwen3_plans_its_memory_without_the_hybrid_exercises(run_python):
    code = (
        "import sys\n"
        "from a4 import LLM\n"
        "from a4.checkpoints import tiny_checkpoint\n"
        "LLM(tiny_checkpoint('qwen3'))\n"
        "loaded = {'a4.engine.hybrid_memory', 'a4.kvcache.state_pool'} & set(sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr


# ------------------------------------------------------------------------------------------------------ the engine


def measured_pool_bytes(engine) -> int:
    kv = sum(t.nbytes for layer in range(engine.kv_pool.num_layers) for t in engine.kv_pool.get_kv(layer))
    states = engine.state_pool
    gdn_layers = len(engine.model_config.linear_attention_layers)
    state = sum(states.conv_state(k).nbytes + states.recurrent_state(k).nbytes for k in range(gdn_layers))
    return kv + state + engine.table_manager.req_to_token.nbytes


@pytest.mark.parametrize(
    "slots_budget, tokens_budget, page_size, max_running_requests, fraction, checkpoints",
    [(3, 40, 1, 8, None, 0), (3, 200, 1, 4, None, 2), (6, 300, 4, 8, None, 16), (20, 8, 4, 8, 0.3, 3)],
)
def test_engine_pools_hold_kv_for_full_attention_only_and_fit_the_budget(
    ckpt, tiny, slots_budget, tokens_budget, page_size, max_running_requests, fraction, checkpoints
):
    _, c = tiny
    slot, page = c["table"] + c["state"], page_size * c["kv"]
    # The prefix cache's state checkpoints (one slot's state each) come out of the budget before slots and pages.
    budget = checkpoints * c["state"] + slots_budget * slot + tokens_budget * c["kv"]
    engine = LLM(ckpt, memory_budget_bytes=budget, max_running_requests=max_running_requests, page_size=page_size,
                 state_fraction=fraction, max_state_checkpoints=checkpoints).engine
    rest = budget - checkpoints * c["state"]
    # As many slots as asked, within the share, and beside the KV of one full-length request.
    slots = min(max_running_requests, (rest - CONTEXT * c["kv"]) // slot)
    if fraction is not None:
        slots = min(slots, int(rest * fraction) // slot)
    raw = read_config(ckpt)["text_config"]
    assert engine.memory_plan.checkpoint_bytes == checkpoints * c["state"]
    assert engine.kv_pool.num_layers == raw["layer_types"].count("full_attention")
    assert engine.table_manager.max_running_requests == engine.state_pool.conv_state(0).shape[0] == slots
    assert engine.kv_pool.num_pages == (rest - slots * slot) // page
    assert measured_pool_bytes(engine) + checkpoints * c["state"] <= budget


@pytest.mark.parametrize("arch, policy", [("qwen3", "checkpoint"), ("qwen3_5", "checkpoint"), ("qwen3_5", "refuse")])
@pytest.mark.parametrize("max_running_requests", [1, 3])
def test_the_default_budget_gives_every_slot_a_full_context(arch, policy, max_running_requests):
    """The default budget counts the state checkpoints too: with one slot they used to cut the context to 3,568."""
    llm = LLM(tiny_checkpoint(arch), max_running_requests=max_running_requests, hybrid_prefix_policy=policy)
    context = 4096  # max_position_embeddings of both tiny presets
    assert llm.engine.max_context_len == context
    assert llm.memory_plan.max_running_requests == max_running_requests
    assert llm.memory_plan.num_tokens == max_running_requests * context


def test_a_larger_budget_never_gives_the_engine_fewer_slots_or_a_shorter_context(ckpt, tiny):
    """Budgets from one slot and one page to four slots beside a full context, state checkpoints set aside first."""
    _, c = tiny
    slot = c["table"] + c["state"]
    seen = []
    for step in range(14):
        budget = 2 * c["state"] + slot + 4 * c["kv"] + step * (slot // 3)
        engine = LLM(ckpt, memory_budget_bytes=budget, max_running_requests=4, page_size=4,
                     max_state_checkpoints=2).engine
        seen.append((engine.table_manager.max_running_requests, engine.max_context_len))
    assert seen == sorted(seen) and seen[0] == (1, 4) and seen[-1] == (4, CONTEXT), seen
    assert all(context == CONTEXT for slots, context in seen if slots > 1), seen


def test_the_engine_plans_with_notebook_06s_ledger_and_qwen3_needs_none_of_it(run_python):
    """The state pool counts towards the memory plan through notebook 06's `hybrid_ledger`, on the default path as
    with a state_fraction; an all-attention model's engine does not import notebook 06's module at all."""
    code = (
        "import sys\n"
        "from a4 import LLM\n"
        "from a4.checkpoints import tiny_checkpoint\n"
        "LLM(tiny_checkpoint('qwen3'))\n"
        "assert 'a4.engine.hybrid_memory' not in sys.modules\n"
        "import a4.engine.hybrid_memory as nb06\n"
        "seen = []\n"
        "ledger = nb06.hybrid_ledger\n"
        "nb06.hybrid_ledger = lambda config, dtype: seen.append(dtype) or ledger(config, dtype)\n"
        "llm = LLM(tiny_checkpoint('qwen3_5'))\n"
        "assert seen, 'the default plan did not ask hybrid_ledger'\n"
        "assert llm.ledger == ledger(llm.engine.model_config, llm.engine.config.torch_dtype)\n"
    )
    run = run_python(code)
    assert run.returncode == 0, run.stderr


PROMPTS = [[11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31, 32, 33, 34, 35, 36, 37]]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def reference(ckpt):
    return hf_greedy(ckpt, PROMPTS, NEW_TOKENS)


def run_and_watch(llm: LLM) -> tuple[list, list[tuple[int, int, int]]]:
    """Run PROMPTS step by step; per step (requests holding a slot, requests waiting, free slots)."""
    engine = llm.engine
    reqs = [engine.add_request(p, SamplingParams(max_new_tokens=NEW_TOKENS)) for p in PROMPTS]
    steps = []
    while not all(r.finished for r in reqs):
        engine.step()
        running = sum(r.admitted for r in reqs)
        waiting = sum(not r.finished and not r.admitted for r in reqs)
        steps.append((running, waiting, engine.table_manager.available_size))
    return reqs, steps


@pytest.mark.parametrize("limit", ["slots", "pages"])
def test_a_request_waits_for_memory_and_all_finish_with_transformers_tokens(ckpt, tiny, reference, limit):
    _, c = tiny
    slot = c["table"] + c["state"]
    # The most a request stores: its prompt and all but its last output token.
    worst = [len(p) + NEW_TOKENS - 1 for p in PROMPTS]
    if limit == "slots":  # a budget for 2 slots and everyone's KV
        budget, want_slots = 2 * slot + sum(worst) * c["kv"], 2
    else:  # 3 slots, but KV for only the first two requests
        budget, want_slots = 3 * slot + (worst[0] + worst[1]) * c["kv"], 3
    llm = LLM(ckpt, memory_budget_bytes=budget, max_running_requests=3, page_size=1, enable_prefix_cache=False)
    assert llm.memory_plan.max_running_requests == want_slots
    reqs, steps = run_and_watch(llm)
    assert [r.output_ids for r in reqs] == reference
    assert all(r.error is None for r in reqs)
    assert max(running for running, _, _ in steps) == 2
    if limit == "slots":
        assert any(waiting and free_slots == 0 for _, waiting, free_slots in steps)
    else:
        assert any(waiting and free_slots > 0 for _, waiting, free_slots in steps)
