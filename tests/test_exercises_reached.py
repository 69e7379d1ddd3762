"""Every exercise is on a path the engine runs, checked against transformers.

An exercise is only worth writing if the engine uses it: a function that no engine run calls can be wrong (or
unwritten) while every token the engine produces still equals transformers', and a student would never find out.
So for EVERY exercise parsed from solutions/ (`a4.course.exercises.all_exercises`: a new exercise is covered
without touching this file), the reference solution is made to raise as the first statement of its region, and an
engine configuration assigned to the exercise's notebook (NOTEBOOK_CONFIGURATIONS) must see that raise: the
RuntimeError propagating out of `LLM(...)` or `generate`, or reported in an `Output.error` of a request the
engine finished with it. Each of those configurations is one whose output is compared token by token with
transformers' greedy generation (`test_configuration_matches_transformers`), so an exercise it reaches is checked
against transformers. A notebook with exercises but no configuration fails too.

How the raise is put in, in process: the solution file's source with its `# BEGIN SOLUTION <id>` comment line
replaced by `raise RuntimeError("reached exercise <id>")` at the same indentation (the same line numbers, so the
code objects line up and tracebacks point at the real lines) is compiled, and the code object of the function
holding the region replaces the `__code__` of the live function object for the run, restored afterwards. Swapping
`__code__` rather than a module attribute reaches every reference to the function: `from x import f` copies
elsewhere, methods on classes and their subclasses, callbacks stored on objects. Every run builds a fresh LLM (a
cached model or plan would hide a call).

Exercises that no configuration of their notebook reaches are collected and reported in one failure, so that one
run lists them all.
"""

from __future__ import annotations

import importlib
import json
import random
import re
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from a4 import LLM, SamplingParams
from a4._overlay import REPO_ROOT, solutions_enabled
from a4.course.exercises import Exercise, all_exercises
from a4.reference import hf_greedy
from a4.speculative.drafter import OracleDrafter

if not solutions_enabled():
    pytest.skip("makes the reference solutions raise: needs A4_SOLUTIONS=1", allow_module_level=True)

EXERCISES = all_exercises()
MESSAGE = "reached exercise {}"

# --------------------------------------------------------------------------------------------- the workload, the runs

MAX_NEW_TOKENS = 4
_rng = random.Random(11)
# Ids below 1000: the tiny checkpoints' stop tokens never appear inside a prompt. The 40-token prompt prefills in
# three chunks of max_prefill_tokens=16 (chunk-boundary checkpoints); the second turn continues the first prompt's
# conversation and hits the checkpoint saved at its end (match, restore); every save runs the checkpoint eviction.
FIRST, SECOND, FOLLOW_UP = ([_rng.randrange(1000) for _ in range(n)] for n in (40, 23, 5))
# Two slots: both first-turn prompts run at once, prefill and decode batched.
ENGINE = dict(max_running_requests=2, max_prefill_tokens=16, enable_prefix_cache=True)


@dataclass(frozen=True)
class Configuration:
    """An engine configuration: a tiny checkpoint, LLM options, and, for speculative decoding, an OracleDrafter of
    transformers' continuations whose drafts are right for their first `oracle_correct` tokens."""

    model: str  # a4.checkpoints.tiny_checkpoint's name
    options: dict[str, Any] = field(default_factory=dict)
    oracle_correct: int | None = None


CONFIGURATIONS = {
    # The default engine: memory plan slots first, prefix cache with state checkpoints, chunked prefill, eager decode.
    "qwen3_5": Configuration("qwen3_5", ENGINE),
    # Notebook 06's plan_hybrid_memory: the slots capped at a share of the budget.
    "qwen3_5 state_fraction=0.5": Configuration("qwen3_5", {**ENGINE, "state_fraction": 0.5}),
    "qwen3_5_moe": Configuration("qwen3_5_moe", ENGINE),
    # The static-buffer decode runner, run eagerly on the CPU: GDN decode by slot (notebook 10).
    "qwen3_5 cuda_graphs=True": Configuration("qwen3_5", {**ENGINE, "cuda_graphs": True}),
    # Speculative decoding (notebook 11): 2 drafts per step, the first right and the second wrong (a rollback).
    "qwen3_5 speculative_tokens=2": Configuration("qwen3_5", {**ENGINE, "speculative_tokens": 2}, oracle_correct=1),
    # Tensor parallelism (notebook 13): rank 0 in this process, where the exercise is made to raise, shards its model.
    "qwen3_5 tensor_parallel_size=2": Configuration("qwen3_5", {**ENGINE, "tensor_parallel_size": 2}),
}

# The configurations that may reach each notebook's exercises, tried in this order until one does.
NOTEBOOK_CONFIGURATIONS = {
    # The MoE fields (config-moe) are parsed for the MoE checkpoint only.
    "01_config": ("qwen3_5", "qwen3_5_moe"),
    "02_weights": ("qwen3_5",),
    "03_gated_attention": ("qwen3_5",),
    "04_gated_deltanet": ("qwen3_5",),
    "05_state_pool": ("qwen3_5",),
    "06_memory_plan": ("qwen3_5", "qwen3_5 state_fraction=0.5"),
    "07_radix_cache": ("qwen3_5",),
    "09_moe": ("qwen3_5_moe",),
    "10_gpu": ("qwen3_5 cuda_graphs=True",),
    "11_speculative": ("qwen3_5 speculative_tokens=2",),
    "13_tensor_parallel": ("qwen3_5 tensor_parallel_size=2",),
}


@dataclass(frozen=True)
class Workload:
    """Two turns of prompts for one checkpoint, and transformers' greedy continuation of every prompt."""

    turns: list[list[list[int]]]
    reference: dict[tuple[int, ...], list[int]]
    vocab_size: int


def workload(checkpoint: Path) -> Workload:
    first_turn = [FIRST, SECOND]
    continuations = hf_greedy(checkpoint, first_turn, MAX_NEW_TOKENS)
    second_turn = [FIRST + continuations[0] + FOLLOW_UP]
    continuations += hf_greedy(checkpoint, second_turn, MAX_NEW_TOKENS)
    reference = {tuple(p): out for p, out in zip(first_turn + second_turn, continuations)}
    vocab_size = json.loads((Path(checkpoint) / "config.json").read_text())["text_config"]["vocab_size"]
    return Workload([first_turn, second_turn], reference, vocab_size)


@pytest.fixture(scope="module")
def workloads(tiny_qwen3_5, tiny_qwen3_5_moe) -> dict[str, tuple[Path, Workload]]:
    # Computed before anything is made to raise: only the engine runs under a patch.
    checkpoints = {"qwen3_5": tiny_qwen3_5, "qwen3_5_moe": tiny_qwen3_5_moe}
    return {name: (ckpt, workload(ckpt)) for name, ckpt in checkpoints.items()}


@dataclass
class Run:
    outputs: list  # a4.core.Output of every prompt of both turns, in order
    llm: LLM


def run_configuration(name: str, workloads: dict[str, tuple[Path, Workload]]) -> Run:
    """Both turns of the workload through a fresh LLM of configuration `name`, its memory plan described; closed
    after (a process runs one tensor-parallel LLM at a time)."""
    configuration = CONFIGURATIONS[name]
    checkpoint, work = workloads[configuration.model]
    drafter = None
    if configuration.oracle_correct is not None:
        drafter = OracleDrafter(work.reference, correct=configuration.oracle_correct, vocab_size=work.vocab_size)
    with LLM(checkpoint, drafter=drafter, **configuration.options) as llm:
        llm.memory_plan.describe()  # the plan as the demo and notebook 06 show it, with its break-even length
        params = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)
        return Run([out for prompts in work.turns for out in llm.generate(prompts, params)], llm)


@pytest.mark.parametrize("name", CONFIGURATIONS)
def test_configuration_matches_transformers(name, workloads):
    """What makes a configuration worth reaching an exercise from: its tokens are transformers' greedy tokens, and it
    runs the paths it is there for (a prefix-cache hit on the second turn; drafts verified)."""
    run = run_configuration(name, workloads)
    _, work = workloads[CONFIGURATIONS[name].model]
    prompts = [prompt for turn in work.turns for prompt in turn]
    for prompt, out in zip(prompts, run.outputs, strict=True):
        assert out.error is None, f"{name}: prompt of {len(prompt)} tokens: {out.finish_reason}: {out.error}"
        assert out.token_ids == work.reference[tuple(prompt)], f"{name}: prompt of {len(prompt)} tokens"
    assert run.outputs[-1].cached_tokens > 0, f"{name}: the second turn did not hit the first turn's checkpoint"
    if CONFIGURATIONS[name].oracle_correct is not None:
        assert run.llm.stats.draft_tokens > 0 and run.llm.stats.accepted_draft_tokens > 0


# ------------------------------------------------------------------------------------- making an exercise raise


class PatchError(Exception):
    """The exercise's function cannot be made to raise by swapping its code (say why)."""


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield const
            yield from _code_objects(const)


def _functions_of(module: types.ModuleType) -> Iterator[types.FunctionType]:
    """Every function object defined in the module: at top level, and in its classes (methods, static and class
    methods, property accessors), decorated ones through `__wrapped__`."""
    seen: set[int] = set()

    def unwrap(value: object) -> Iterator[object]:
        if isinstance(value, (staticmethod, classmethod)):
            yield from unwrap(value.__func__)
        elif isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                yield from unwrap(accessor)
        elif value is not None:
            yield value
            if hasattr(value, "__wrapped__"):
                yield from unwrap(value.__wrapped__)

    def visit(namespace: object) -> Iterator[types.FunctionType]:
        for value in vars(namespace).values():
            if isinstance(value, type):
                if value.__module__ == module.__name__ and id(value) not in seen:
                    seen.add(id(value))
                    yield from visit(value)
                continue
            for obj in unwrap(value):
                if isinstance(obj, types.FunctionType) and id(obj) not in seen:
                    seen.add(id(obj))
                    yield obj

    yield from visit(module)


def module_of(exercise: Exercise) -> types.ModuleType:
    """The module `import a4.<path>` loads; under A4_SOLUTIONS=1 that must be the reference solution file."""
    name = ".".join(exercise.student_path.with_suffix("").parts)
    module = importlib.import_module(name)
    solution = (REPO_ROOT / exercise.solution_path).resolve()
    if Path(module.__file__).resolve() != solution:
        raise PatchError(f"`import {name}` loaded {module.__file__}, not {solution}")
    return module


def raising_code(exercise: Exercise) -> tuple[types.FunctionType, types.CodeType]:
    """The live function that holds the exercise's region, and its code with the region's first statement raising."""
    module = module_of(exercise)
    path = REPO_ROOT / exercise.solution_path
    lines = path.read_text().splitlines(keepends=True)
    # The BEGIN line is a comment: the raise takes its place, and every other line keeps its number.
    lines[exercise.begin] = f'{exercise.indent}raise RuntimeError("{MESSAGE.format(exercise.id)}")\n'
    module_code = compile("".join(lines), str(Path(module.__file__)), "exec", dont_inherit=True)
    raise_line = exercise.line
    holders = [code for code in _code_objects(module_code) if any(ln == raise_line for *_, ln in code.co_lines())]
    if len(holders) != 1:
        where = "module level" if not holders else ", ".join(code.co_qualname for code in holders)
        raise PatchError(f"the region's first line is not in exactly one function ({where})")
    patched = holders[0]
    matches = [
        function
        for function in _functions_of(module)
        if (function.__code__.co_qualname, function.__code__.co_firstlineno, function.__code__.co_filename)
        == (patched.co_qualname, patched.co_firstlineno, patched.co_filename)
    ]
    if len(matches) != 1:
        raise PatchError(
            f"{len(matches)} live function objects of {module.__name__} have the code of {patched.co_qualname} "
            f"(line {patched.co_firstlineno}): a nested function or one the module does not keep cannot be patched"
        )
    function = matches[0]
    if function.__code__.co_freevars != patched.co_freevars:
        raise PatchError(
            f"{patched.co_qualname}: the raising code's free variables {patched.co_freevars} differ from the "
            f"function's {function.__code__.co_freevars}: the code objects cannot be swapped"
        )
    return function, patched


@contextmanager
def raising(exercise: Exercise) -> Iterator[None]:
    """While inside, the exercise's region raises RuntimeError("reached exercise <id>") wherever it is called from."""
    function, patched = raising_code(exercise)
    original = function.__code__
    function.__code__ = patched
    try:
        yield
    finally:
        function.__code__ = original


def _mentions(text: str, exercise: Exercise) -> bool:
    # Not followed by more of an id: "reached exercise gdn-conv" must not count for "gdn-conv-prefill".
    return re.search(re.escape(MESSAGE.format(exercise.id)) + r"(?![a-z0-9-])", text) is not None


def _raised_from(error: BaseException, exercise: Exercise) -> bool:
    """Whether `error` is the exercise's RuntimeError, was raised from it, or quotes it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if _mentions(str(error), exercise):
            return True
        error = error.__cause__ or error.__context__
    return False


def reach(exercise: Exercise, run: Callable[[str], Run]) -> str | None:
    """None if a configuration of the exercise's notebook sees its raise; else what happened instead."""
    names = NOTEBOOK_CONFIGURATIONS.get(exercise.notebook)
    if not names:
        return f"no engine configuration is assigned to notebook {exercise.notebook} (NOTEBOOK_CONFIGURATIONS)"
    try:
        raising_code(exercise)
    except PatchError as e:
        return f"cannot make it raise: {e}"
    missed = []
    for name in names:
        with raising(exercise):
            try:
                outputs = run(name).outputs
            except Exception as e:
                if _raised_from(e, exercise):
                    return None
                missed.append(f"[{name}] raised {type(e).__name__} instead: {str(e)[:200]}")
                continue
        if any(out.error and _mentions(out.error, exercise) for out in outputs):
            return None
        reasons = sorted({str(out.finish_reason) for out in outputs})
        missed.append(f"[{name}] ran to the end ({'/'.join(reasons)}) without calling it")
    return "; ".join(missed)


def test_the_raise_reaches_every_reference_to_the_function():
    """The technique itself: a region made to raise does so through another module's `from x import f` copy (the
    engine's greedy_accept), as a static method, and called directly; and the code is restored after."""
    import a4.engine.speculative_worker as worker_module
    from a4.kvcache.state_pool import StatePool
    from a4.speculative.verify import causal_conv1d_verify

    by_id = {exercise.id: exercise for exercise in EXERCISES}
    calls = {
        "spec-greedy-accept": lambda: worker_module.greedy_accept(torch.zeros(1, 2, dtype=torch.int64),
                                                                  torch.zeros(1, 3, dtype=torch.int64)),
        "state-bytes-per-slot": lambda: StatePool.bytes_per_slot(None, torch.float32),
        "spec-conv-verify": lambda: causal_conv1d_verify(torch.zeros(1, 2, 3), torch.zeros(3, 1, 4),
                                                         torch.zeros(1, 3, 3)),
    }
    for exercise_id, call in calls.items():
        with raising(by_id[exercise_id]):
            with pytest.raises(RuntimeError, match=f"^{re.escape(MESSAGE.format(exercise_id))}$"):
                call()
    assert causal_conv1d_verify(torch.zeros(1, 2, 3), torch.zeros(3, 1, 4), torch.zeros(1, 3, 3))[0].shape == (1, 2, 3)


def test_every_exercise_is_reached_by_its_notebooks_engine(workloads):
    assert EXERCISES, "no exercises parsed from solutions/"
    not_reached = []
    for exercise in EXERCISES:
        try:
            function, _ = raising_code(exercise)
            original = function.__code__
        except PatchError:
            function = None  # reach() reports it
        why = reach(exercise, lambda name: run_configuration(name, workloads))
        if function is not None:
            assert function.__code__ is original, f"{exercise.id}: {function.__qualname__} was left patched"
        if why is not None:
            not_reached.append(f"{exercise.id} ({exercise.solution_path}:{exercise.line}): {why}")
    reached = len(EXERCISES) - len(not_reached)
    print(f"{reached} of {len(EXERCISES)} exercises reached by their notebook's engine configurations")
    assert not not_reached, (
        f"{len(not_reached)} of {len(EXERCISES)} exercises are not on a path that the engine configurations of their "
        "notebook run (each one's region made to raise as its first statement; no run saw the raise):\n  "
        + "\n  ".join(not_reached)
    )
