"""Checks of notebook 05: the StatePool, and Qwen3.5 served by the engine, against independent references.

Two ground truths:
- the pool's shapes, dtypes and bytes are computed from config.json's own fields (the raw file, not a4's
  ModelConfig: `expected_state_layout` in `a4.course.checks.common`), with the formula of the real checkpoints: per
  GDN layer conv_dim x (K-1) values in the model dtype and Hv x dk x dv values in float32;
- the tokens are transformers' greedy generation of each prompt alone (`a4.reference.hf_greedy`). Each engine check
  serves the same prompts under one policy (one batch, chunked prefill, slot reuse, poisoned slots) and compares
  every token. Those prompts and reference generations are shared with the later notebooks' engine checks
  (`a4.course.checks.common`), computed once per process.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from a4.checkpoints import preset_config
from a4.core import Output, SamplingParams
from a4.course.checks import CheckFailed, conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks.common import (
    MAX_NEW_TOKENS,
    PROMPT_LENGTHS,
    QWEN3_5_PRESETS,
    expected_bytes_per_slot,
    expected_state_layout,
    first_difference,
    read_config,
    reference_tokens,
    shared_prompts,
    token_problems,
)
from a4.dtypes import DTYPES
from a4.models.config import parse_config

# Prefill budgets of the chunked check: each cuts some prompts before, at or after a GDN chunk boundary.
CHUNK_BUDGETS = (1, 7, 63, 64, 65)


# ------------------------------------------------------------------------------------------- sizes from config.json


def _configs(checkpoint: str | Path) -> dict[str, dict[str, Any]]:
    """The tiny checkpoint's config.json and the five real ones, by label."""
    configs = {"tiny checkpoint": read_config(checkpoint)}
    configs |= {f"{arch} {preset}": preset_config(arch, preset) for arch, preset in QWEN3_5_PRESETS}
    return configs


@after_notebooks("01")
def check_pool_layout(state_pool_class: type, checkpoint: str | Path, num_slots: int = 3) -> None:
    """One conv and one recurrent state per GDN layer, of the right shapes and dtypes, zero, and views of the pool.

    The real configs are allocated on the `meta` device (shapes without memory); the tiny one on the CPU, where the
    check also writes through the accessors to see that each (layer, slot) is its own memory.
    """
    problems = []
    configs = _configs(checkpoint)
    for label, raw in configs.items():
        config = parse_config(raw)
        for dtype_name, dtype in DTYPES.items():
            device = "cpu" if label == "tiny checkpoint" else "meta"
            pool = state_pool_class(config, num_slots, dtype, device)
            problems += _layout_problems(f"{label}, {dtype_name}", pool, raw, num_slots, dtype, device)
    conclude(problems, f"one conv and one recurrent state per GDN layer, right shapes, for {len(configs)} configs")


def _layout_problems(
    label: str, pool, raw: dict[str, Any], num_slots: int, dtype: torch.dtype, device: str
) -> list[str]:
    num_gdn, conv_shape, recurrent_shape = expected_state_layout(raw)
    expected = {
        "conv_state": ((num_slots, *conv_shape), dtype),
        "recurrent_state": ((num_slots, *recurrent_shape), torch.float32),
    }
    problems = []
    for accessor, (shape, dtype_wanted) in expected.items():
        for k in range(num_gdn):
            tensor = getattr(pool, accessor)(k)
            got = (tuple(tensor.shape), tensor.dtype, tensor.device.type)
            if got != (shape, dtype_wanted, device):
                problems.append(f"{label}: {accessor}({k}) is {got[0]} {got[1]} on {got[2]}; "
                                f"expected {shape} {dtype_wanted} on {device}")
        try:
            getattr(pool, accessor)(num_gdn)
        except IndexError:
            pass
        else:
            problems.append(f"{label}: {accessor}({num_gdn}) exists, but the model has only {num_gdn} GDN layers")
    if problems or device == "meta":
        return problems
    # Every state starts at zero, and every (layer, slot) is its own memory: a write through one accessor shows up
    # there, and nowhere else.
    for accessor in expected:
        states = [getattr(pool, accessor)(k) for k in range(num_gdn)]
        if any(bool(state.any()) for state in states):
            problems.append(f"{label}: a new pool's {accessor}s are not all zero")
            continue
        states[num_gdn - 1][num_slots - 1].fill_(1)
        written = [int(getattr(pool, accessor)(k).count_nonzero()) for k in range(num_gdn)]
        one_slot = states[0][0].numel()
        if written != [0] * (num_gdn - 1) + [one_slot]:
            problems.append(
                f"{label}: filling slot {num_slots - 1} of GDN layer {num_gdn - 1} through {accessor}({num_gdn - 1}) "
                f"changed {written} values per layer; expected {one_slot} in that layer only (accessors must return "
                "views of separate memory, not copies)"
            )
    return problems


@after_notebooks("01")
def check_bytes_per_slot(bytes_per_slot, checkpoint: str | Path) -> None:
    """StatePool.bytes_per_slot(config, dtype) equals the bytes computed from config.json, for every config."""
    problems = []
    configs = _configs(checkpoint)
    for label, raw in configs.items():
        config = parse_config(raw)
        for dtype_name, dtype in DTYPES.items():
            got, wanted = bytes_per_slot(config, dtype), expected_bytes_per_slot(raw, dtype)
            if got != wanted:
                problems.append(f"{label}, {dtype_name}: bytes_per_slot gives {got:,} B; expected {wanted:,} B")
    conclude(problems, f"bytes_per_slot matches config.json for {len(configs)} configs in float32 and bfloat16")


@after_notebooks("01")
def check_save_restore(state_pool_class: type, checkpoint: str | Path, num_slots: int = 4) -> None:
    """save copies one slot's whole state; restore copies it into one slot and leaves every other slot alone."""
    raw = read_config(checkpoint)
    config = parse_config(raw)
    problems = []
    for dtype_name, dtype in DTYPES.items():
        label = f"tiny checkpoint, {dtype_name}"
        pool = state_pool_class(config, num_slots, dtype, "cpu")
        generator = torch.Generator().manual_seed(0)
        for k in range(len(config.linear_attention_layers)):
            for state in (pool.conv_state(k), pool.recurrent_state(k)):
                state.copy_(torch.randn(state.shape, generator=generator))
        before = _snapshot(pool)

        saved = pool.save(1)
        if not _same_states(_snapshot(pool), before):
            problems.append(f"{label}: save(1) changed the pool")
        if saved.nbytes != expected_bytes_per_slot(raw, dtype):
            problems.append(f"{label}: the checkpoint holds {saved.nbytes:,} B; one slot's state is "
                            f"{expected_bytes_per_slot(raw, dtype):,} B")
        if _slot_values(pool, 1) != _checkpoint_values(saved):
            problems.append(f"{label}: save(1) does not hold slot 1's conv and recurrent states of every GDN layer")
            continue
        _fill_slot(pool, 1, 7.0)
        if _slot_values(before, 1) != _checkpoint_values(saved):
            problems.append(f"{label}: writing to slot 1 after save(1) changed the checkpoint (save must copy)")
            continue

        pool.restore(saved, 3)
        after = _snapshot(pool)
        if _slot_values(after, 3) != _slot_values(before, 1):
            problems.append(f"{label}: after restore(save(1), 3) slot 3 does not hold slot 1's saved state")
        changed = [slot for slot in (0, 2) if _slot_values(after, slot) != _slot_values(before, slot)]
        if changed:
            problems.append(f"{label}: restore into slot 3 changed slot(s) {changed}")
        _fill_slot(pool, 3, -7.0)
        pool.restore(saved, 0)
        if _slot_values(pool, 0) != _slot_values(before, 1):
            problems.append(f"{label}: the checkpoint could not be restored a second time (restore must not alias it)")
    conclude(problems, "save copies a slot's whole state; restore puts it back into any slot, touching no other")


def _snapshot(pool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A copy of every GDN layer's (conv, recurrent) states, all slots."""
    return [(pool.conv_state(k).clone(), pool.recurrent_state(k).clone()) for k in range(pool.num_layers)]


def _same_states(a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Equal, bit for bit: saving and restoring states only copies them."""
    return all(torch.equal(x, y) for layer_a, layer_b in zip(a, b, strict=True) for x, y in zip(layer_a, layer_b))


def _slot_values(pool_or_snapshot, slot: int) -> list[list[float]]:
    """One slot's states as plain lists (compared exactly), from a pool or a _snapshot."""
    layers = pool_or_snapshot if isinstance(pool_or_snapshot, list) else _snapshot(pool_or_snapshot)
    return [[conv[slot].float().flatten().tolist(), recurrent[slot].flatten().tolist()] for conv, recurrent in layers]


def _checkpoint_values(saved) -> list[list[float]]:
    return [
        [conv.float().flatten().tolist(), recurrent.flatten().tolist()]
        for conv, recurrent in zip(saved.conv, saved.recurrent, strict=True)
    ]


def _fill_slot(pool, slot: int, value: float) -> None:
    for k in range(pool.num_layers):
        pool.conv_state(k)[slot].fill_(value)
        pool.recurrent_state(k)[slot].fill_(value)


# ------------------------------------------------------------------------------------- the engine against transformers


def _llm(checkpoint: str | Path, **kwargs):
    """The engine as notebook 05 leaves it: a hybrid model reuses no cached prefix (saved states are notebook 07's)."""
    from a4.llm import LLM

    return LLM(checkpoint, hybrid_prefix_policy="refuse", **kwargs)


def gdn_chunk_size() -> int:
    """The chunk size of a4's GDN prefill: `chunk_gated_delta_rule`'s default, which the layer uses."""
    from a4.layers.deltanet import chunk_gated_delta_rule

    return inspect.signature(chunk_gated_delta_rule).parameters["chunk_size"].default


def describe_chunks(length: int) -> str:
    """How a prompt of `length` tokens falls into the GDN layer's prefill chunks, e.g. "5 GDN chunks of 32, the last
    of 2 tokens"."""
    size = gdn_chunk_size()
    full, rest = divmod(length, size)
    if rest == 0:
        return f"{full} GDN chunk{'s' * (full > 1)} of {size}, all full"
    if full == 0:
        return f"one partial GDN chunk ({rest} of {size} tokens)"
    return f"{full + 1} GDN chunks of {size}, the last of {rest} token{'s' * (rest > 1)}"


@after_notebooks(*ENGINE)
def check_decode_single(checkpoint: str | Path) -> None:
    """One request alone: a 130-token prompt, several GDN chunks, the last one partial."""
    prompts = shared_prompts(checkpoint)
    pick = PROMPT_LENGTHS.index(130)
    outputs = _llm(checkpoint).generate([prompts[pick]], SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    expected = reference_tokens(checkpoint)
    conclude(
        token_problems("one request", outputs, [prompts[pick]], [expected[pick]]),
        f"one request of {PROMPT_LENGTHS[pick]} prompt tokens ({describe_chunks(PROMPT_LENGTHS[pick])}): "
        f"{len(outputs[0].token_ids)} tokens as transformers'",
    )


@after_notebooks(*ENGINE)
def check_decode_varlen(checkpoint: str | Path) -> None:
    """Every prompt (1 to 300 tokens) prefilled in one step and decoded in one batch."""
    prompts = shared_prompts(checkpoint)
    llm = _llm(checkpoint, max_running_requests=len(prompts), max_prefill_tokens=sum(PROMPT_LENGTHS))
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    problems = token_problems("one batch", outputs, prompts, reference_tokens(checkpoint))
    if llm.stats.prefill_steps != 1:
        problems.append(f"the {len(prompts)} prompts took {llm.stats.prefill_steps} prefill steps; the check needs one")
    conclude(
        problems,
        f"{len(prompts)} requests of {min(PROMPT_LENGTHS)} to {max(PROMPT_LENGTHS)} prompt tokens in one batch: "
        f"{sum(len(o.token_ids) for o in outputs)} tokens equal to transformers'",
    )


@after_notebooks(*ENGINE)
def check_decode_chunked(checkpoint: str | Path, budgets: Sequence[int] = CHUNK_BUDGETS) -> None:
    """Prompts prefilled in chunks of each budget, cut before, at and after the GDN layer's chunk boundaries.

    Budget 1 feeds prompts of 7 and 40 tokens one token per step; the other budgets feed prompts of 63, 64, 65 and
    130 tokens, several requests per step, so that chunks end at every kind of position.
    """
    prompts = shared_prompts(checkpoint)
    problems = []
    for budget in budgets:
        lengths = (7, 40) if budget == 1 else (63, 64, 65, 130)
        picked = [PROMPT_LENGTHS.index(n) for n in lengths]
        llm = _llm(checkpoint, max_running_requests=len(picked), max_prefill_tokens=budget)
        outputs = llm.generate([prompts[i] for i in picked], SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
        expected = reference_tokens(checkpoint)
        problems += token_problems(
            f"max_prefill_tokens={budget}", outputs, [prompts[i] for i in picked], [expected[i] for i in picked]
        )
    conclude(problems, f"chunked prefill with budgets {list(budgets)}: every token equal to transformers'")


@after_notebooks(*ENGINE)
def check_decode_slot_reuse(checkpoint: str | Path, num_slots: int = 3) -> None:
    """12 requests through 3 slots: staggered lengths and max_new_tokens, arriving in two generate calls."""
    prompts = shared_prompts(checkpoint)
    llm = _llm(checkpoint, max_running_requests=num_slots, max_prefill_tokens=128)
    if llm.memory_plan.max_running_requests != num_slots:
        planned = llm.memory_plan.max_running_requests
        raise CheckFailed(f"the engine planned {planned} request slots; the check needs {num_slots}")
    # Greedy generation is a prefix: the first n tokens of a longer run are the run of n tokens.
    order = [7, 0, 5, 1, 6, 2, 3, 4, 6, 1, 7, 3]
    new_tokens = [2 + (i * 5) % (MAX_NEW_TOKENS - 1) for i in range(len(order))]
    problems, served = [], 0
    for batch in (slice(0, 7), slice(7, None)):
        picked, limits = order[batch], new_tokens[batch]
        outputs = llm.generate([prompts[i] for i in picked], [SamplingParams(max_new_tokens=n) for n in limits])
        expected = reference_tokens(checkpoint)
        problems += token_problems(
            f"generate call {1 + (batch.start > 0)}",
            outputs,
            [prompts[i] for i in picked],
            [expected[i][:n] for i, n in zip(picked, limits)],
        )
        served += len(picked)
    conclude(problems, f"{served} requests through {num_slots} slots: every token equal to transformers'")


def poison(state_pool, generator: torch.Generator) -> None:
    """Fill every slot of every GDN layer with large finite garbage (what a reused slot may hold, and worse)."""
    for k in range(state_pool.num_layers):
        for state in (state_pool.conv_state(k), state_pool.recurrent_state(k)):
            state.copy_(torch.randn(state.shape, generator=generator) * 1e3)


@after_notebooks(*ENGINE)
def check_state_poisoned(checkpoint: str | Path, num_slots: int = 5) -> None:
    """Garbage in every slot before requests arrive: tokens unchanged, and slots no request used keep it bit for bit.

    Three requests run at once on a 5-slot engine, twice (the second time in slots the first run used, poisoned
    again), then six requests through the same slots. The engine is stepped by hand to see which slot each request
    has.
    """
    prompts = shared_prompts(checkpoint)
    llm = _llm(checkpoint, max_running_requests=num_slots, max_prefill_tokens=256)
    engine, pool = llm.engine, llm.engine.state_pool
    generator = torch.Generator().manual_seed(1)
    problems, wrong_tokens = [], False
    for label, picked in (("first run", [6, 0, 3]), ("second run", [2, 7, 4]), ("third run", [1, 5, 3, 0, 6, 2])):
        poison(pool, generator)
        before = _snapshot(pool)
        reqs = [engine.add_request(prompts[i], SamplingParams(max_new_tokens=MAX_NEW_TOKENS)) for i in picked]
        used: set[int] = set()
        while not all(req.finished for req in reqs):
            engine.step()
            used |= {req.slot for req in reqs if req.admitted}
        outputs = [Output(req.output_ids, req.prefix_hit_len, req.finish_reason, req.error) for req in reqs]
        expected = reference_tokens(checkpoint)
        found = token_problems(label, outputs, [prompts[i] for i in picked], [expected[i] for i in picked])
        wrong_tokens |= bool(found)
        problems += found
        after = _snapshot(pool)
        touched = [s for s in range(num_slots) if s not in used and _slot_values(after, s) != _slot_values(before, s)]
        if touched:
            problems.append(f"{label}: slot(s) {touched} held no request, yet their state changed")
    # The usual mistake, when the same requests in clean slots are right (decode-single): reading what a slot held.
    likely = (
        "if decode-single passes, a request read what its slot held before it: does a new request start from zero "
        "state (its conv and recurrent state), whatever the slot holds?"
    )
    success = "requests in poisoned slots match transformers, and no unused slot was written"
    conclude(problems, success, likely if wrong_tokens else None)


def check_state_reset(state_pool_class: type, checkpoint: str | Path) -> None:
    """A new request starts from a zero slot, and nothing else is cleared: `clear_new_requests` on its own, then the
    pool as the engine's model finds it at every step.

    The GDN layers also start a request with prefix_lens 0 from zero states (notebook 04), so tokens alone cannot
    show a missing reset: the check looks at the slots themselves. On its own: garbage in five slots, a batch with
    two new requests, two that continue (a later prefill chunk, a restored prefix hit) and one slot without a
    request. In the engine: five requests of 1 to 65 tokens through three garbage-filled slots, prefilled in chunks
    of 24 tokens; before each forward, every new request's slot must be zero and every continuing one's must hold
    exactly what the previous step left there.
    """
    from a4.core import Req

    raw = read_config(checkpoint)
    pool = state_pool_class(parse_config(raw), 5, torch.float32, "cpu")
    poison(pool, torch.Generator().manual_seed(2))
    before = _snapshot(pool)
    batch = {3: 0, 1: 17, 0: 0, 4: 40}  # slot: computed_len
    reqs = []
    for slot, computed_len in batch.items():
        req = Req(uid=slot, input_ids=[0] * (computed_len + 1), sampling_params=SamplingParams())
        req.slot, req.computed_len = slot, computed_len
        reqs.append(req)
    pool.clear_new_requests(reqs)
    problems = []
    for slot in range(pool.num_slots):
        values = _slot_tensors(pool, slot)
        if batch.get(slot) == 0:
            if not _is_zero(values):
                problems.append(f"clear_new_requests: slot {slot} (a new request, computed_len 0) still holds the "
                                "previous request's state afterwards: does a new request start from zero state?")
        elif not _equal(values, _slot_tensors(before, slot)):
            why = (f"a request that continues at computed_len {batch[slot]}" if slot in batch
                   else "no request of the batch")
            problems.append(f"clear_new_requests: slot {slot} ({why}) was changed; only a request with "
                            "computed_len 0 starts from zero")
    if not problems:
        problems += _engine_reset_problems(checkpoint)
    conclude(problems, "new requests start from zero slots, continuing ones from their own, in the pool and in the "
                       "engine (5 requests through 3 slots, chunked prefill)")


def _engine_reset_problems(checkpoint: str | Path, num_slots: int = 3) -> list[str]:
    """Step the engine and look at the state pool just before each forward (a hook on the model)."""
    prompts = shared_prompts(checkpoint)
    llm = _llm(checkpoint, max_running_requests=num_slots, max_prefill_tokens=24)
    engine, pool = llm.engine, llm.engine.state_pool
    poison(pool, torch.Generator().manual_seed(3))
    left_by_last_step = _snapshot(pool)
    problems: list[str] = []

    def before_forward(model, args) -> None:
        fb = args[0]
        for slot, prefix_len in zip(fb.slots.tolist(), fb.prefix_lens):
            values = _slot_tensors(pool, slot)
            if prefix_len == 0 and not _is_zero(values):
                problems.append(f"engine: a new request in slot {slot} would start from the state left there "
                                "(clear_new_requests did not zero it): does a new request start from zero state?")
            elif prefix_len > 0 and not _equal(values, _slot_tensors(left_by_last_step, slot)):
                problems.append(f"engine: the request continuing at token {prefix_len} in slot {slot} does not find "
                                "the state its previous step left there (was its slot cleared?)")

    hook = engine.model.register_forward_pre_hook(before_forward)
    try:
        picked = [PROMPT_LENGTHS.index(n) for n in (40, 7, 65, 1, 63)]
        reqs = [engine.add_request(prompts[i], SamplingParams(max_new_tokens=3)) for i in picked]
        while not all(req.finished for req in reqs) and not problems:
            engine.step()
            left_by_last_step = _snapshot(pool)
    finally:
        hook.remove()
    return problems


def _slot_tensors(pool_or_snapshot, slot: int) -> list[torch.Tensor]:
    """One slot's conv and recurrent states of every GDN layer (views), from a pool or a _snapshot."""
    if isinstance(pool_or_snapshot, list):
        layers = pool_or_snapshot
    else:
        layers = [(pool_or_snapshot.conv_state(k), pool_or_snapshot.recurrent_state(k))
                  for k in range(pool_or_snapshot.num_layers)]
    return [state[slot] for layer in layers for state in layer]


def _is_zero(states: list[torch.Tensor]) -> bool:
    return not any(bool(state.any()) for state in states)


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def bfloat16_agreement(checkpoint: str | Path) -> tuple[int, int, int, int]:
    """a4 against transformers, both in bfloat16, on shared_prompts.

    Returns (tokens that agree before each request's first difference, tokens, requests identical, requests).
    """
    prompts = shared_prompts(checkpoint)
    outputs = _llm(checkpoint, dtype="bfloat16").generate(prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    expected = reference_tokens(checkpoint, "bfloat16")
    agreeing = sum(first_difference(out.token_ids, want) for out, want in zip(outputs, expected))
    identical = sum(out.token_ids == want for out, want in zip(outputs, expected))
    return agreeing, sum(len(want) for want in expected), identical, len(prompts)
