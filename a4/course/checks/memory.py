"""Checks of notebook 06: the hybrid memory plan against arithmetic done here, from config.json alone.

Every expected figure is computed in this module from the text_config fields of the file (`figures`), never from
a4's ModelConfig or ledger: KV per token of the full-attention layers, the conv and recurrent states of the GDN
layers, the table row. The figures of the course's reference table (0.8B and 35B-A3B, `PUBLISHED`) cross-check that
arithmetic. The engine checks measure the pools' tensors themselves, and take transformers' greedy generation as
the ground truth of every token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from a4.checkpoints import preset_config
from a4.core import Req, SamplingParams
from a4.course.checks import conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks.common import QWEN3_5_PRESETS
from a4.engine.memory_plan import MemoryLedger, MemoryPlan, MemoryPlanError
from a4.models.config import ModelConfig, load_model_config, parse_config

if TYPE_CHECKING:
    from a4 import LLM
    from a4.engine.engine import Engine

# Written out rather than asked of torch: the check should not share a helper with the code it checks.
ELEMENT_BYTES = {torch.float32: 4, torch.bfloat16: 2}
# A req_to_token entry is an int64 KV location, one per position the model accepts.
TABLE_ENTRY_BYTES = 8
# (arch, preset) of every model the ledger check covers: the tiny test models and the five real configs.
LEDGER_PRESETS = (("qwen3_5", "tiny"), ("qwen3_5_moe", "tiny"), *QWEN3_5_PRESETS)


@dataclass(frozen=True)
class Figures:
    """One hybrid model's memory figures in bytes, computed from its config.json by `figures`."""

    full_layers: int
    gdn_layers: int
    conv_dim: int
    kv_bytes_per_token: int  # K and V of the full-attention layers
    all_attention_kv_bytes_per_token: int  # the same if every layer were full attention
    conv_state_bytes: int  # one GDN layer, one slot, model dtype
    recurrent_state_bytes: int  # one GDN layer, one slot, float32
    table_bytes_per_slot: int
    max_position_embeddings: int  # the longest request the model accepts

    @property
    def state_bytes_per_slot(self) -> int:
        return self.gdn_layers * (self.conv_state_bytes + self.recurrent_state_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.table_bytes_per_slot + self.state_bytes_per_slot

    def ledger(self) -> MemoryLedger:
        return MemoryLedger(self.kv_bytes_per_token, self.table_bytes_per_slot, self.state_bytes_per_slot)

    def all_attention_ledger(self) -> MemoryLedger:
        """The same model with every layer full attention: KV in every layer, no state."""
        return MemoryLedger(self.all_attention_kv_bytes_per_token, self.table_bytes_per_slot)


def figures(raw: dict[str, Any], dtype: torch.dtype) -> Figures:
    """The memory figures of a Qwen3.5 config.json (its text_config), for a model run in dtype."""
    t = raw["text_config"]
    element = ELEMENT_BYTES[dtype]
    full = t["layer_types"].count("full_attention")
    kv_per_layer = 2 * t["num_key_value_heads"] * t["head_dim"] * element
    conv_dim = 2 * t["linear_num_key_heads"] * t["linear_key_head_dim"] + (
        t["linear_num_value_heads"] * t["linear_value_head_dim"]
    )
    return Figures(
        full_layers=full,
        gdn_layers=t["layer_types"].count("linear_attention"),
        conv_dim=conv_dim,
        kv_bytes_per_token=full * kv_per_layer,
        all_attention_kv_bytes_per_token=t["num_hidden_layers"] * kv_per_layer,
        conv_state_bytes=conv_dim * (t["linear_conv_kernel_dim"] - 1) * element,
        recurrent_state_bytes=t["linear_num_value_heads"] * t["linear_key_head_dim"] * t["linear_value_head_dim"] * 4,
        table_bytes_per_slot=t["max_position_embeddings"] * TABLE_ENTRY_BYTES,
        max_position_embeddings=t["max_position_embeddings"],
    )


@dataclass(frozen=True)
class Published:
    """A row of the reference table of the course (qwen3_5-configs.md), for a bfloat16 model."""

    conv_dim: int
    recurrent_state_bytes: int
    gdn_layers: int
    state_bytes_per_gdn_layer: int
    kv_bytes_per_token: int
    all_attention_kv_bytes_per_token: int
    state_in_tokens: int  # the state equals the KV of this many tokens


PUBLISHED = {
    ("qwen3_5", "0.8b"): Published(6144, 1_048_576, 18, 1_085_440, 12_288, 49_152, 1590),
    ("qwen3_5_moe", "35b-a3b"): Published(8192, 2_097_152, 30, 2_146_304, 20_480, 81_920, 3144),
}


def _published_problems(label: str, want: Published, fig: Figures, ledger: MemoryLedger) -> list[str]:
    got = {
        "conv_dim (from config.json)": (fig.conv_dim, want.conv_dim),
        "recurrent state per GDN layer (from config.json)": (fig.recurrent_state_bytes, want.recurrent_state_bytes),
        "GDN layers (from config.json)": (fig.gdn_layers, want.gdn_layers),
        "state per GDN layer (from config.json)": (
            fig.conv_state_bytes + fig.recurrent_state_bytes,
            want.state_bytes_per_gdn_layer,
        ),
        "KV if every layer were full attention (from config.json)": (
            fig.all_attention_kv_bytes_per_token,
            want.all_attention_kv_bytes_per_token,
        ),
        "your kv_bytes_per_token": (ledger.kv_bytes_per_token, want.kv_bytes_per_token),
        "your state_bytes_per_slot": (ledger.state_bytes_per_slot, want.gdn_layers * want.state_bytes_per_gdn_layer),
        "your state / KV per token, in tokens": (
            ledger.state_bytes_per_slot // max(ledger.kv_bytes_per_token, 1),
            want.state_in_tokens,
        ),
    }
    return [f"{label} (published figure): {name}: expected {w:,}, got {g:,}" for name, (g, w) in got.items() if g != w]


@after_notebooks("01")
def check_ledger(
    hybrid_ledger: Callable[[ModelConfig, torch.dtype], MemoryLedger],
    break_even_tokens: Callable[[MemoryLedger, MemoryLedger], int],
) -> None:
    """Your ledger and break-even length for every model, in bfloat16 and float32, against config.json arithmetic."""
    problems = []
    for arch, preset in LEDGER_PRESETS:
        raw = preset_config(arch, preset)
        config = parse_config(raw)
        for dtype in (torch.bfloat16, torch.float32):
            label = f"{preset} {arch} in {dtype}"
            fig = figures(raw, dtype)
            ledger = hybrid_ledger(config, dtype)
            for name, want in (
                ("kv_bytes_per_token", fig.kv_bytes_per_token),
                ("state_bytes_per_slot", fig.state_bytes_per_slot),
                ("table_bytes_per_slot", fig.table_bytes_per_slot),
            ):
                got = getattr(ledger, name)
                if got != want:
                    problems.append(f"{label}: {name}: expected {want:,}, got {got:,}")
            if (arch, preset) in PUBLISHED and dtype == torch.bfloat16:
                problems += _published_problems(label, PUBLISHED[(arch, preset)], fig, ledger)
            problems += break_even_problems(break_even_tokens, fig.ledger(), fig.all_attention_ledger(), label)
    problems += break_even_edge_problems(break_even_tokens)
    conclude(
        problems,
        f"{len(LEDGER_PRESETS)} models x 2 dtypes: KV per token, state and table row per slot and the break-even "
        "length match config.json; 0.8B and 35B-A3B match the published figures",
    )


def break_even_problems(
    break_even_tokens: Callable[[MemoryLedger, MemoryLedger], int],
    hybrid: MemoryLedger,
    all_attention: MemoryLedger,
    label: str,
) -> list[str]:
    """Whether break_even_tokens(hybrid, all_attention) is the shortest request that costs less in the hybrid."""

    def request_bytes(ledger: MemoryLedger, n: int) -> int:
        # Written out rather than ledger.bytes_per_request: the check does its own arithmetic.
        return ledger.table_bytes_per_slot + ledger.state_bytes_per_slot + n * ledger.kv_bytes_per_token

    def hybrid_cheaper(n: int) -> bool:
        return request_bytes(hybrid, n) < request_bytes(all_attention, n)

    n = break_even_tokens(hybrid, all_attention)
    if not isinstance(n, int) or n < 0:
        return [f"{label}: break_even_tokens must return a non-negative int, got {n!r}"]
    if not hybrid_cheaper(n):
        return [f"{label}: break_even_tokens: a request of {n:,} tokens does not cost less in the hybrid model"]
    if n > 0 and hybrid_cheaper(n - 1):
        return [f"{label}: break_even_tokens returned {n:,}, but {n - 1:,} tokens already cost less in the hybrid"]
    return []


def break_even_edge_problems(break_even_tokens: Callable[[MemoryLedger, MemoryLedger], int]) -> list[str]:
    """Made-up ledgers: a tie one token short of the answer, a hybrid cheaper from the start, one never cheaper."""
    all_attention = MemoryLedger(kv_bytes_per_token=100, table_bytes_per_slot=1000)
    problems = []
    # 10 extra bytes of slot, 5 saved per token: at 2 tokens the two cost the same, so the answer is 3.
    problems += break_even_problems(
        break_even_tokens, MemoryLedger(95, 1000, 10), all_attention, "tie at 2 tokens (made up)"
    )
    problems += break_even_problems(
        break_even_tokens, MemoryLedger(50, 900), all_attention, "hybrid cheaper from the start (made up)"
    )
    label = "a hybrid never cheaper (made up)"
    try:
        n = break_even_tokens(MemoryLedger(100, 1000, 10), all_attention)
        problems.append(f"{label}: expected a ValueError, got {n!r}")
    except ValueError:
        pass
    except ArithmeticError as e:  # a division by the zero saving per token
        problems.append(f"{label}: expected a ValueError, got {type(e).__name__}: {e}")
    return problems


# ------------------------------------------------------------------------------------------------------ the split


def expected_split(
    fig: Figures, *, budget_bytes: int, page_size: int, max_running_requests: int, state_fraction: float | None
) -> tuple[int, int] | None:
    """(slots, pages) the notebook's policy gives, or None when even one slot and one page do not fit."""
    page_bytes = page_size * fig.kv_bytes_per_token
    if budget_bytes < fig.slot_bytes + page_bytes:
        return None
    slots = max_running_requests
    if state_fraction is not None:
        slots = min(slots, int(budget_bytes * state_fraction) // fig.slot_bytes)
        if slots < 1:
            return None
    # Slots beyond the first only beside the KV of one request of the model's full context, in whole pages.
    context_bytes = max(fig.max_position_embeddings // page_size, 1) * page_bytes
    slots = min(slots, max((budget_bytes - context_bytes) // fig.slot_bytes, 1))
    return slots, (budget_bytes - slots * fig.slot_bytes) // page_bytes


def split_cases(fig: Figures) -> list[dict[str, Any]]:
    """Budgets from a bare minimum to hundreds of slots, page sizes 1 and 4, both policies."""
    slot, token, context = fig.slot_bytes, fig.kv_bytes_per_token, fig.max_position_embeddings
    # One byte short of a third slot beside a full-length request: two slots.
    budgets = [slot + 4 * token, slot + 4 * token - 1, 3 * slot + context * token - 1, 40 * slot + 5000 * token,
               400 * slot]
    return [
        dict(budget_bytes=b, page_size=p, max_running_requests=m, state_fraction=f)
        for b in budgets
        for p in (1, 4)
        for m in (1, 8, 1000)
        for f in (None, 0.25, 0.6)
    ]


@after_notebooks("01")
def check_split(plan_hybrid_memory: Callable[..., MemoryPlan], model_dir: str | Path) -> None:
    """Your plan for the tiny model over many budgets, page sizes and both policies, against the arithmetic here."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    config = load_model_config(model_dir)
    problems = []
    count = 0
    for dtype in (torch.float32, torch.bfloat16):
        fig = figures(raw, dtype)
        for case in split_cases(fig):
            count += 1
            label = ", ".join(f"{k}={v}" for k, v in case.items()) + f", {dtype}"
            problems += _split_problems(plan_hybrid_memory, config, fig, dtype, case, label)
    conclude(problems, f"{count} plans: slots and pages as the policy says, always within the budget")


def _split_problems(
    plan_hybrid_memory: Callable[..., MemoryPlan],
    config: ModelConfig,
    fig: Figures,
    dtype: torch.dtype,
    case: dict[str, Any],
    label: str,
) -> list[str]:
    want = expected_split(fig, **case)
    try:
        plan = plan_hybrid_memory(config, dtype=dtype, **case)
    except MemoryPlanError as e:
        if want is not None:
            return [f"{label}: expected (slots, pages) = {want}, got MemoryPlanError: {e}"]
        if f"{fig.slot_bytes:,}" not in str(e) and str(fig.slot_bytes) not in str(e):
            return [f"{label}: the MemoryPlanError should name the bytes of one slot ({fig.slot_bytes:,}): {e}"]
        return []
    if want is None:
        return [f"{label}: one slot and one page do not fit, expected a MemoryPlanError, got {plan}"]
    problems = []
    got = (plan.max_running_requests, plan.num_pages)
    if got != want:
        problems.append(f"{label}: expected (slots, pages) = {want}, got {got}")
    used = got[0] * fig.slot_bytes + got[1] * case["page_size"] * fig.kv_bytes_per_token
    if used > case["budget_bytes"]:
        problems.append(f"{label}: {got[0]} slots and {got[1]} pages use {used:,} B, over the budget")
    return problems


# ---------------------------------------------------------------------------------------------------- the engine


def pool_bytes(engine: Engine) -> dict[str, int]:
    """Bytes of the tensors the engine allocated for its requests, measured on the tensors themselves."""
    kv = sum(t.nbytes for layer in range(engine.kv_pool.num_layers) for t in engine.kv_pool.get_kv(layer))
    states = engine.state_pool
    num_gdn = len(engine.model_config.linear_attention_layers)
    state = sum(states.conv_state(k).nbytes + states.recurrent_state(k).nbytes for k in range(num_gdn))
    return {"KV pool": kv, "state pool": state, "req_to_token": engine.table_manager.req_to_token.nbytes}


def engine_cases(fig: Figures) -> list[dict[str, Any]]:
    """LLM settings whose slots are limited by the budget, by max_running_requests and by state_fraction.

    The prefix cache is on (the default), so the engine first sets aside `max_state_checkpoints` states for it
    (notebook 07) unless hybrid_prefix_policy is "refuse"; the budgets are sized to hold them, and the KV of one
    full-length request, without which the plan gives one slot only.
    """
    slot, state = fig.slot_bytes, fig.state_bytes_per_slot
    token, context = fig.kv_bytes_per_token, fig.max_position_embeddings
    return [
        dict(memory_budget_bytes=3 * slot + (context + 200) * token, max_running_requests=8, page_size=1,
             state_fraction=None, hybrid_prefix_policy="refuse"),
        dict(memory_budget_bytes=2 * state + 6 * slot + (context + 300) * token, max_running_requests=8, page_size=4,
             state_fraction=None, hybrid_prefix_policy="checkpoint", max_state_checkpoints=2),
        dict(memory_budget_bytes=16 * state + 20 * slot + (context + 8) * token, max_running_requests=16,
             page_size=4, state_fraction=0.1, hybrid_prefix_policy="checkpoint", max_state_checkpoints=16),
    ]


def expected_checkpoint_bytes(fig: Figures, case: dict[str, Any]) -> int:
    """What the engine sets aside for the prefix cache's state checkpoints: one slot's state each."""
    if case["hybrid_prefix_policy"] == "refuse":
        return 0
    return case["max_state_checkpoints"] * fig.state_bytes_per_slot


@after_notebooks(*ENGINE, "05")
def check_engine_memory(model_dir: str | Path) -> None:
    """The engine's plan and pools for the tiny model: state checkpoints set aside first, KV only for full attention,
    slots and pages as planned in what the checkpoints leave, within the budget."""
    from a4 import LLM

    fig = figures(json.loads((Path(model_dir) / "config.json").read_text()), torch.float32)
    cases = engine_cases(fig)
    problems = []
    for case in cases:
        label = ", ".join(f"{k}={v}" for k, v in case.items())
        engine = LLM(model_dir, dtype="float32", **case).engine
        budget, checkpoint_bytes = case["memory_budget_bytes"], expected_checkpoint_bytes(fig, case)
        # Slots and pages share what the checkpoints leave.
        slots, pages = expected_split(
            fig,
            budget_bytes=budget - checkpoint_bytes,
            page_size=case["page_size"],
            max_running_requests=case["max_running_requests"],
            state_fraction=case["state_fraction"],
        )
        plan = engine.memory_plan
        if (plan.budget_bytes, plan.checkpoint_bytes) != (budget, checkpoint_bytes):
            problems.append(
                f"{label}: expected a plan of {budget:,} B with {checkpoint_bytes:,} B set aside for state "
                f"checkpoints, got {plan.budget_bytes:,} B and {plan.checkpoint_bytes:,} B"
            )
        if engine.kv_pool.num_layers != fig.full_layers:
            problems.append(
                f"{label}: the KV pool has {engine.kv_pool.num_layers} layers, the model has {fig.full_layers} "
                "full-attention layers"
            )
        got_slots = (engine.table_manager.max_running_requests, engine.state_pool.conv_state(0).shape[0])
        if got_slots != (slots, slots):
            problems.append(
                f"{label}: expected {slots} request slots, got {got_slots[0]} table rows and {got_slots[1]} state slots"
            )
        if engine.kv_pool.num_locations != pages * case["page_size"]:
            problems.append(f"{label}: expected {pages} pages, the KV pool has {engine.kv_pool.num_pages}")
        measured = pool_bytes(engine)
        if sum(measured.values()) + checkpoint_bytes > budget:
            problems.append(
                f"{label}: the pools hold {sum(measured.values()):,} B ({measured}), over what the "
                f"{checkpoint_bytes:,} B of state checkpoints leave of the budget"
            )
    conclude(
        problems,
        f"{len(cases)} engines: state checkpoints set aside, KV pool layers = full-attention layers, pools within "
        "the budget",
    )


# --------------------------------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class StepTrace:
    """The engine after one step: which requests hold a slot, which wait, what is free."""

    step: int
    phase: str
    running: tuple[int, ...]  # uids of the requests holding a slot
    waiting: tuple[int, ...]  # uids of the requests queued without one
    free_slots: int
    free_pages: int


def run_traced(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[list[Req], list[StepTrace]]:
    """Queue every prompt, step the engine until all are finished, and record each step."""
    engine = llm.engine
    reqs = [engine.add_request(prompt, params) for prompt in prompts]
    trace = []
    while not all(req.finished for req in reqs):
        prefill_steps = engine.stats.prefill_steps
        engine.step()
        trace.append(
            StepTrace(
                step=len(trace) + 1,
                phase="prefill" if engine.stats.prefill_steps > prefill_steps else "decode",
                running=tuple(req.uid for req in reqs if req.admitted),
                waiting=tuple(req.uid for req in reqs if not req.finished and not req.admitted),
                free_slots=engine.table_manager.available_size,
                free_pages=engine.cache_manager.allocator.num_free_pages,
            )
        )
    return reqs, trace


# Three prompts of ids below 1000 (the tiny checkpoints' stop tokens are 1000 and 1002), and their output length.
ADMISSION_PROMPTS = ([11, 12, 13, 14, 15, 16], [21, 22, 23, 24, 25, 26, 27, 28, 29], [31, 32, 33, 34, 35, 36, 37])
ADMISSION_NEW_TOKENS = 6
# The context of the model the admission runs use (`tiny_checkpoint("qwen3_5", max_position_embeddings=16)`): the
# plan gives a second slot only beside the KV of one full-length request, so with the 4,096 tokens of the tiny
# preset these three short requests could never run short of pages.
ADMISSION_CONTEXT = 16


def admission_settings(model_dir: str | Path, limit: str) -> dict[str, Any]:
    """LLM settings (float32, page_size 1, no prefix cache) under which one of ADMISSION_PROMPTS must wait.

    limit "slots": max_running_requests 3, but a budget for 2 slots (and KV for all three requests);
    limit "pages": 3 slots, but KV for the worst case of the first two requests only.
    """
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    fig = figures(raw, torch.float32)
    # A request stores at most prompt + max_new_tokens - 1 tokens (its last token is never fed back).
    worst = [len(prompt) + ADMISSION_NEW_TOKENS - 1 for prompt in ADMISSION_PROMPTS]
    if not max(worst) < fig.max_position_embeddings <= worst[0] + worst[1]:
        raise ValueError(
            f"admission_settings needs a model whose context holds each request but not the first two together "
            f"({max(worst) + 1}..{worst[0] + worst[1]} tokens), got max_position_embeddings "
            f"{fig.max_position_embeddings}: use tiny_checkpoint('qwen3_5', "
            f"max_position_embeddings={ADMISSION_CONTEXT})"
        )
    if limit == "slots":
        budget = 2 * fig.slot_bytes + sum(worst) * fig.kv_bytes_per_token
        # The pages beyond a full context must be worth less than a slot, or they would buy a third slot.
        spare = sum(worst) - fig.max_position_embeddings
        assert spare * fig.kv_bytes_per_token < fig.slot_bytes, "admission_settings: pages exceed a slot"
    elif limit == "pages":
        budget = 3 * fig.slot_bytes + (worst[0] + worst[1]) * fig.kv_bytes_per_token
    else:
        raise ValueError(f"limit must be 'slots' or 'pages', got {limit!r}")
    return dict(dtype="float32", max_running_requests=3, page_size=1, enable_prefix_cache=False,
                memory_budget_bytes=budget)


@after_notebooks(*ENGINE, "05")
def check_admission(plan_hybrid_memory: Callable[..., MemoryPlan], model_dir: str | Path) -> None:
    """Three requests where only two fit (by slots, then by pages): your plan and the engine's hold the slots and
    pages computed here, a request waits, and every token equals transformers'."""
    from a4 import LLM
    from a4.reference import hf_greedy

    config = load_model_config(model_dir)
    fig = figures(json.loads((Path(model_dir) / "config.json").read_text()), torch.float32)
    prompts = [list(p) for p in ADMISSION_PROMPTS]
    reference = hf_greedy(model_dir, prompts, ADMISSION_NEW_TOKENS)
    problems = []
    for limit in ("slots", "pages"):
        settings = admission_settings(model_dir, limit)
        split = dict(budget_bytes=settings["memory_budget_bytes"], page_size=settings["page_size"],
                     max_running_requests=settings["max_running_requests"])
        want_split = expected_split(fig, **split, state_fraction=None)
        yours = plan_hybrid_memory(config, dtype=torch.float32, **split)
        llm = LLM(model_dir, **settings)
        plans = {"your plan_hybrid_memory": yours, "the engine": llm.memory_plan}
        wrong = [f"{name} gives {(plan.max_running_requests, plan.num_pages)}" for name, plan in plans.items()
                 if (plan.max_running_requests, plan.num_pages) != want_split]
        if wrong:
            problems.append(f"limit {limit}: expected (slots, pages) = {want_split}, but " + " and ".join(wrong))
            continue
        reqs, trace = run_traced(llm, prompts, SamplingParams(max_new_tokens=ADMISSION_NEW_TOKENS))
        for req, want in zip(reqs, reference):
            if req.error is not None or req.output_ids != want:
                problems.append(f"limit {limit}: request {req.uid}: expected {want}, got {req.output_ids} "
                                f"(error: {req.error})")
        if max(len(row.running) for row in trace) > 2:
            problems.append(f"limit {limit}: three requests ran at once, but memory holds two")
        # Waiting for a slot: none free. Waiting for pages: a slot free, yet the request not admitted.
        waited = [row for row in trace if row.waiting and (row.free_slots == 0) == (limit == "slots")]
        if not waited:
            problems.append(f"limit {limit}: no step shows a request waiting for {limit}")
    conclude(problems, "two memory limits (slots, pages): planned as computed here, a request waited each time, "
                       "then all three finished with transformers' tokens")
