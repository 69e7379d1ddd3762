"""Exceptions inside a step (issue: an interrupted `generate` must never poison the engine).

Each test injects a KeyboardInterrupt (what Kernel -> Interrupt raises in a notebook) at one stage of one step of an
`LLM.generate` call: the forward of a chosen layer in a prefill chunk or a decode step, the sampler, the prefix
cache's insert, or its state checkpoint save / restore. The call must raise, and leave the engine as if its requests
had never been submitted: every slot free, no page owned by anyone but the allocator or the prefix cache, no lock,
every state checkpoint still the state after exactly its tokens (checked against transformers' cache). Later calls,
including ones that hit the cache on the interrupted prompts, must equal transformers' greedy tokens.

Models: Qwen3 (radix cache) and Qwen3.5 under both hybrid policies, chunked prefill on, prefix cache on; and Qwen3.5
with overlap scheduling and mixed steps (tests/test_step_loop.py), where the step that raises has another in flight
and the requests of both are aborted.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from a4 import LLM, SamplingParams
from a4.core import Req
from a4.course.checks._harness import assert_close, model_reduction_length, tolerance
from a4.models.config import load_model_config
from a4.reference import hf_greedy, hf_prefill_capture

MAX_NEW = 6
# Chunked prefill: the 40-token prompt runs in three prefill steps.
MAX_PREFILL = 16
WARM = list(range(3, 40, 1))  # fills the cache first, so that the interrupted call also has a prefix hit
PROMPTS = [WARM + [7, 8, 9], [11, 12, 13, 14, 15], list(range(100, 140))]

# (arch, hybrid policy, page size, overlap scheduling and mixed steps)
ENGINES = [
    ("qwen3", "checkpoint", 1, False), ("qwen3_5", "checkpoint", 1, False), ("qwen3_5", "refuse", 1, False),
    ("qwen3_5", "checkpoint", 4, False), ("qwen3_5", "checkpoint", 1, True),
]  # fmt: skip


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, also where the test runner was started with SIGINT ignored (in the
    background), as a notebook kernel does."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Interrupt:
    """Wraps `obj.name` so that its `at`-th call (counted from 1) raises KeyboardInterrupt, before or after it runs."""

    def __init__(self, monkeypatch, obj, name: str, at: int, *, after: bool = False, when=lambda *a, **k: True):
        self.calls = 0
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            if when(*args, **kwargs):
                self.calls += 1
                if self.calls == at and not after:
                    raise KeyboardInterrupt(f"injected before {name}")
                result = real(*args, **kwargs)
                if self.calls == at:
                    raise KeyboardInterrupt(f"injected after {name}")
                return result
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, wrapper)


class SigintAfter:
    """Wraps `obj.name` so that its `at`-th call sends this process SIGINT (Ctrl-C) right after it returns."""

    def __init__(self, monkeypatch, obj, name: str, at: int):
        self.calls = 0
        real = getattr(obj, name)

        def wrapper(*args, **kwargs):
            result = real(*args, **kwargs)
            self.calls += 1
            if self.calls == at:
                os.kill(os.getpid(), signal.SIGINT)
            return result

        monkeypatch.setattr(obj, name, wrapper)


class LayerInterrupt:
    """A forward hook on one decoder layer that raises in the forward of the `step`-th step (counted from 0) of a phase
    from now on: prefill (EXTEND steps, mixed ones included) or decode."""

    def __init__(self, engine, layer: int, phase: str, step: int):
        steps = []

        def hook(module, args, output):
            if args[-1].mode.is_extend() == (phase == "prefill"):
                steps.append(phase)
                if len(steps) == step + 1:
                    raise KeyboardInterrupt(f"injected in layer {layer}, {phase} step {step}")

        self.handle = engine.model.model.layers[layer].register_forward_hook(hook)


def build(checkpoint_dir, policy: str = "checkpoint", page_size: int = 1, in_flight: bool = False) -> LLM:
    """`in_flight`: overlap scheduling and mixed steps on, so that a step runs with the one before it unbooked."""
    return LLM(
        checkpoint_dir,
        max_running_requests=3,
        max_prefill_tokens=MAX_PREFILL,
        page_size=page_size,
        enable_prefix_cache=True,
        hybrid_prefix_policy=policy,
        overlap_schedule=in_flight,
        enable_mixed_chunk=in_flight,
    )


def inject(stage: str, llm: LLM, monkeypatch) -> None:
    engine = llm.engine
    cache = engine.cache_manager.prefix_cache
    middle = len(engine.model.model.layers) // 2
    if stage == "prefill-forward":
        LayerInterrupt(engine, middle, "prefill", step=1)  # the second prefill step: chunks already fed
    elif stage == "decode-forward":
        LayerInterrupt(engine, middle, "decode", step=2)
    elif stage == "sampling":
        Interrupt(monkeypatch, engine.sampler, "sample", at=4)
    elif stage == "cache-insert-before":
        Interrupt(monkeypatch, cache, "insert_prefix", at=2)
    elif stage == "ctrl-c-after-cache-insert":
        # A real SIGINT between the tree's insert and the request's bookkeeping: held until the booking is done.
        SigintAfter(monkeypatch, cache, "insert_prefix", at=3)
    elif stage == "state-save":
        Interrupt(monkeypatch, cache, "save_state", at=2, after=True)
    elif stage == "state-restore":
        Interrupt(monkeypatch, cache, "restore_state", at=1, when=lambda handle, slot: handle.cached_len > 0)
    else:
        raise AssertionError(stage)


def assert_clean(llm: LLM, checkpoint_dir) -> None:
    """Idle engine: nothing but the prefix cache holds memory, nothing is locked, every checkpoint is right."""
    engine = llm.engine
    cache_manager = engine.cache_manager
    cache = cache_manager.prefix_cache
    assert not engine.has_unfinished_requests
    assert engine.table_manager.available_size == engine.memory_plan.max_running_requests, "a slot was not freed"
    assert cache.protected_size == 0, "a lock of an aborted request was not released"
    allocator = cache_manager.allocator
    cached_pages = cache.evictable_size // allocator.page_size
    # The padding slot's pages (CUDA graphs, overlap scheduling) are nobody's to give back.
    padding_pages = engine.runner.padding_pages
    assert allocator.num_free_pages + cached_pages + padding_pages == allocator.num_pages, "pages leaked"
    if hasattr(cache, "checkpoints"):
        assert cache.num_checkpoints <= cache.max_checkpoints
        for tokens, checkpoint in cache.checkpoints():
            assert_checkpoint_is_transformers_state(checkpoint_dir, tokens, checkpoint)


def assert_checkpoint_is_transformers_state(checkpoint_dir, tokens, checkpoint) -> None:
    capture = hf_prefill_capture(checkpoint_dir, tokens)
    gdn = [layer for layer in capture.layers if layer.kind == "linear_attention"]
    # The float32 states of a4 and transformers differ in rounding order only, over every layer below the state.
    allowed = tolerance(torch.float32, model_reduction_length(load_model_config(checkpoint_dir), len(tokens)))
    for k, layer in enumerate(gdn):
        # transformers keeps the last `kernel` conv inputs; a4 keeps the last kernel - 1.
        for name, ours, theirs in (
            ("conv", checkpoint.conv[k], layer.conv_state[:, 1:]),
            ("recurrent", checkpoint.recurrent[k], layer.recurrent_state),
        ):
            where = f"checkpoint after {len(tokens)} tokens, GDN layer {k}: {name} state"
            assert_close(ours.float(), theirs, allowed, where)


STAGES = [
    "prefill-forward",
    "decode-forward",
    "sampling",
    "cache-insert-before",
    "ctrl-c-after-cache-insert",
    "state-save",
    "state-restore",
]


def _cases():
    for arch, policy, page_size, in_flight in ENGINES:
        for stage in STAGES:
            keeps_states = arch == "qwen3_5" and policy == "checkpoint"
            if stage.startswith("state-") and not keeps_states:
                continue  # only the checkpoint policy saves and restores states
            if page_size > 1 and stage not in ("prefill-forward", "decode-forward", "state-restore"):
                continue  # page_size > 1 runs the paths whose bookkeeping differs (partial pages)
            loop = "-overlap-mixed" if in_flight else ""
            yield pytest.param(arch, policy, page_size, in_flight, stage, id=f"{arch}-{policy}-page{page_size}{loop}-{stage}")


@pytest.mark.parametrize("arch, policy, page_size, in_flight, stage", list(_cases()))
def test_interrupted_generate_leaves_the_engine_clean(request, monkeypatch, arch, policy, page_size, in_flight, stage):
    checkpoint_dir = request.getfixturevalue(f"tiny_{arch}")
    llm = build(checkpoint_dir, policy, page_size, in_flight)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    expected = hf_greedy(checkpoint_dir, PROMPTS, MAX_NEW)
    assert llm.generate([WARM], params)[0].token_ids == hf_greedy(checkpoint_dir, [WARM], MAX_NEW)[0]

    with monkeypatch.context() as patch:
        inject(stage, llm, patch)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, params)
    for module in llm.engine.model.modules():
        module._forward_hooks.clear()
    assert_clean(llm, checkpoint_dir)

    # The same prompts again, then each extended by its answer and two more tokens: hits on what was cached.
    outputs = llm.generate(PROMPTS, params)
    assert [out.token_ids for out in outputs] == expected
    follow_ups = [prompt + out.token_ids + [21, 22] for prompt, out in zip(PROMPTS, outputs)]
    outputs = llm.generate(follow_ups, params)
    assert [out.token_ids for out in outputs] == hf_greedy(checkpoint_dir, follow_ups, MAX_NEW)
    if policy == "checkpoint" or arch == "qwen3":
        assert all(out.cached_tokens > 0 for out in outputs), "the follow-ups should hit the cache"
    assert_clean(llm, checkpoint_dir)


def test_interrupted_step_aborts_only_its_batch(tiny_qwen3_5, monkeypatch):
    """Engine.step(): the interrupted step's requests are aborted; a request still queued runs on, correctly."""
    llm = build(tiny_qwen3_5)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=MAX_NEW)
    # One slot's worth of prefill budget per step: the first step takes PROMPTS[0]'s first chunk only (and samples
    # nothing: its forward is interrupted).
    first, second = (engine.add_request(prompt, params) for prompt in PROMPTS[:2])
    with monkeypatch.context() as patch:
        Interrupt(patch, engine.runner, "forward", at=1)
        with pytest.raises(KeyboardInterrupt):
            while True:
                engine.step()
    assert first.finished and first.finish_reason == "abort" and "KeyboardInterrupt" in first.error
    assert first.slot is None and first.cache_handle is None
    engine.run([second])
    assert second.output_ids == hf_greedy(tiny_qwen3_5, [PROMPTS[1]], MAX_NEW)[0]
    assert_clean(llm, tiny_qwen3_5)


def test_abort_req_frees_a_running_request(tiny_qwen3, tiny_qwen3_5):
    for checkpoint_dir in (tiny_qwen3, tiny_qwen3_5):
        llm = build(checkpoint_dir)
        engine = llm.engine
        reqs = [engine.add_request(prompt, SamplingParams(max_new_tokens=MAX_NEW)) for prompt in PROMPTS]
        for _ in range(5):
            engine.step()
        engine.abort_req(reqs[1], "cancelled by the caller")
        assert reqs[1].finish_reason == "abort" and reqs[1].error == "cancelled by the caller"
        engine.run([reqs[0], reqs[2]])
        expected = hf_greedy(checkpoint_dir, PROMPTS, MAX_NEW)
        assert [reqs[0].output_ids, reqs[2].output_ids] == [expected[0], expected[2]]
        assert_clean(llm, checkpoint_dir)


# ----------------------------------------------------------------------- one request the sampler cannot serve


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_non_finite_logits_fail_one_request_alone(request, monkeypatch, arch):
    """With 2 slots, a request whose logits turn NaN finishes with an error; its batch and later calls are right."""
    checkpoint_dir = request.getfixturevalue(f"tiny_{arch}")
    llm = LLM(checkpoint_dir, max_running_requests=2, max_prefill_tokens=MAX_PREFILL)
    engine = llm.engine
    real_sample = engine.sampler.sample
    poisoned_uid = engine._next_uid + 1  # the second prompt of the next call

    def sample_with_nan(logits, reqs):
        logits = logits.clone()
        for i, req in enumerate(reqs):
            if req.uid == poisoned_uid and req.output_ids:
                logits[i, 5] = float("nan")
        return real_sample(logits, reqs)

    monkeypatch.setattr(engine.sampler, "sample", sample_with_nan)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    outputs = llm.generate(PROMPTS, params)
    expected = hf_greedy(checkpoint_dir, PROMPTS, MAX_NEW)
    assert outputs[1].finish_reason == "error" and "not finite" in outputs[1].error and "1 NaN" in outputs[1].error
    assert outputs[1].token_ids == expected[1][:1], "the tokens before the NaN step stay"
    assert [outputs[0].token_ids, outputs[2].token_ids] == [expected[0], expected[2]]
    monkeypatch.undo()
    assert [out.token_ids for out in llm.generate(PROMPTS, params)] == expected
    assert_clean(llm, checkpoint_dir)


def test_sampler_flags_exactly_the_rows_that_are_not_finite():
    """The sampler's check (each row's minimum and maximum) against isfinite() of every element: a NaN, an infinity of
    either sign, and finite rows whose sums would overflow to +-inf."""
    from a4.engine.sampling import Sampler, logits_errors

    logits = torch.randn(7, 50)
    logits[1, 3] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 49] = float("-inf")
    logits[4] = 3e38  # finite, sum +inf
    logits[5] = -3e38  # finite, sum -inf
    logits[6, :2] = torch.tensor([3e38, float("-inf")])
    expected = [bool(row.isfinite().all()) for row in logits]
    reqs = [Req(uid=i, input_ids=[1], sampling_params=SamplingParams()) for i in range(len(logits))]
    samples = Sampler(torch.device("cpu")).sample(logits, reqs).result()
    assert [sample.error is None for sample in samples] == expected == [True, False, False, False, True, True, False]
    assert [sample.token for sample in samples if sample.error is None] == [int(logits[i].argmax()) for i in (0, 4, 5)]
    assert [error is None for error in logits_errors(logits[:, None])] == expected


def test_tiny_temperature_is_the_greedy_limit(tiny_qwen3_5):
    """T -> 0: logits are shifted to a maximum of 0 before dividing, so 1e-45 samples the argmax, no NaN."""
    llm = LLM(tiny_qwen3_5)
    expected = hf_greedy(tiny_qwen3_5, PROMPTS, MAX_NEW)
    for temperature in (1e-45, 1e-300, 1e-6):
        params = SamplingParams(max_new_tokens=MAX_NEW, temperature=temperature, seed=3)
        outputs = llm.generate(PROMPTS, params)
        assert [out.token_ids for out in outputs] == expected, f"temperature {temperature}"


def test_generate_checks_every_request_before_queueing_any(tiny_qwen3):
    llm = LLM(tiny_qwen3)
    params = SamplingParams(max_new_tokens=MAX_NEW)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(PROMPTS[:2], [params, {"max_new_tokens": 3}])
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate(PROMPTS[:2], {"max_new_tokens": 3})
    assert not llm.engine.has_unfinished_requests
    outputs = llm.generate(PROMPTS[:2], params)
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3, PROMPTS[:2], MAX_NEW)
    assert llm.stats.prefill_tokens + llm.stats.cached_tokens == sum(map(len, PROMPTS[:2]))
