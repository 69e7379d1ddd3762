"""Checks of notebook 11: the verify pass and the commit of speculative decoding (`a4/speculative/verify.py`).

Ground truths:
- the conv and the delta rule over the L verify positions: transformers' one-token functions,
  `causal_conv1d_update` and `torch_recurrent_gated_delta_rule`, run one position at a time, give the output at
  each position and the state after it;
- greedy acceptance and the commit: a loop over the requests, written here;
- a poisoned state: a GDN layer's state part at the tiny model's shapes (conv, split into heads, the delta rule),
  verified and committed by the student's functions, then continued for a few tokens with transformers' functions
  from the pool row; the truth continues from the state after exactly the kept tokens, computed token by token. A
  commit one position too far or too short gives a state that looks like any other and a continuation that is
  silently wrong: the check names it.
- the engine: speculative greedy decoding of the tiny Qwen3.5 (`LLM(..., speculative_tokens=k)`, which calls the
  student's `greedy_accept` and `commit_verified_states_`) against transformers' greedy `generate`, token by token,
  with an oracle drafter forcing every acceptance pattern (drafts right for their first j tokens, j = 0..k); the
  drafts accepted against the length of the drafts' right prefixes, counted here as the drafter proposes them.

Every function runs as many tensor operations for 5 requests as for 2: no Python loop over the requests (the
recurrence walks the L verify positions, which is the same for any batch).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from a4.core import SamplingParams
from a4.course.checks import CheckFailed, conclude
from a4.course.checks._earlier import ENGINE, after_notebooks
from a4.course.checks._harness import DTYPES, compare, compare_dtype, randn, shape_problems, tolerance
from a4.course.checks.common import (
    MAX_NEW_TOKENS,
    gdn_shapes,
    read_config,
    reference_tokens,
    shared_prompts,
    text_config,
    token_problems,
)
from a4.course.checks.deltanet import (
    CONV_KERNELS,
    DK,
    DV,
    HEADS,
    delta_rule_inputs,
    delta_rule_tolerance,
    transformers_recurrence,
)
from a4.course.checks.gpu import (
    PoolWrites,
    batch_loop_problems,
    reads_values,
    transformers_conv,
    transformers_rule,
    unchanged_pool_problem,
)
from a4.speculative.drafter import OracleDrafter

# Verify lengths L = k + 1: no draft, fewer tokens than a conv state holds (K - 1 = 3 for kernel 4), more.
VERIFY_LENS = (1, 2, 5)
BATCH = 3
CONV_CHANNELS = 10
NUM_SLOTS = 7
# Requests in pool slots out of order; slots 0, 2, 4 belong to nobody in the batch and must keep their values.
SLOTS = [5, 1, 3]
# Kept verify tokens per request (accepted drafts + 1) for L = 4 (k = 3): the shortest (1), the whole verify (4),
# one in between.
COMMIT_LEN = 4
KEPT_LENS = [1, 4, 2]
# Tokens fed after the commit in the poisoned-state check.
CONTINUATION = 3


# ------------------------------------------------------------------------------------------------ the references


def position_by_position(step: Callable, inputs: list[torch.Tensor], state: torch.Tensor):
    """A one-token function at every verify position: step(*inputs at position j, state) -> (output, the state after
    it), for inputs [B, L, ...]. Returns (outputs [B, L, ...], the states after each position [B, L, ...])."""
    outputs, states = [], []
    for j in range(inputs[0].shape[1]):
        output, state = step(*(x[:, j] for x in inputs), state)
        outputs.append(output)
        states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


def transformers_conv_steps(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """transformers' causal_conv1d_update at every verify position: (y [B, L, D], states [B, L, D, K-1])."""
    return position_by_position(lambda x_j, state: transformers_conv(x_j, weight, state), [x], conv_state)


def transformers_rule_steps(q, k, v, g, beta, initial_state):
    """transformers' torch_recurrent_gated_delta_rule (a4's layout, q scaled) at every verify position:
    (o [B, L, H, dv], states [B, L, H, dk, dv])."""

    def step(q, k, v, g, beta, state):
        o, state = transformers_recurrence(*(x[:, None] for x in (q, k, v, g, beta)), state)
        return o[:, 0], state

    return position_by_position(step, [q, k, v, g, beta], initial_state)


def accepted_by_loop(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> list[int]:
    accepted = []
    for drafts, targets in zip(draft_ids.tolist(), target_ids.tolist()):
        a = 0
        while a < len(drafts) and drafts[a] == targets[a] and drafts[a] != -1:
            a += 1
        accepted.append(a)
    return accepted


def loop_problems(fn: Callable, make_kwargs: Callable[[int], dict]) -> list[str]:
    """A problem when fn(**make_kwargs(batch)) runs a different number of tensor operations for another batch size."""
    return batch_loop_problems(fn, make_kwargs, "Work on every request at once: each request is a row of the same "
                                                "tensor operations")


# ------------------------------------------------------------------------------------------- the verify functions


def conv_inputs(batch: int, length: int, kernel: int, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "x": randn(batch, length, CONV_CHANNELS, seed=seed, dtype=dtype),
        "weight": randn(CONV_CHANNELS, 1, kernel, seed=seed + 1, dtype=dtype),
        "conv_state": randn(batch, CONV_CHANNELS, kernel - 1, seed=seed + 2, dtype=dtype),
    }


def state_position_problems(label: str, states: torch.Tensor, expected: torch.Tensor, before: torch.Tensor,
                            same: Callable[[torch.Tensor, torch.Tensor], bool]) -> list[str]:
    """The state after each verify position j; the usual mistakes, the input state at every position and the state
    before each position, named as such."""
    wrong = [j for j in range(expected.shape[1]) if not same(states[:, j], expected[:, j])]
    if not wrong:
        return []
    length = expected.shape[1]
    if length > 1 and all(same(states[:, j], before) for j in range(length)):
        return [f"{label}: states[:, j] is the input state at every position j: the values are unchanged, as if no "
                "token had been fed; states[:, j] must be the state after token j"]
    shifted = torch.cat([before[:, None], expected[:, :-1]], dim=1)
    if all(same(states[:, j], shifted[:, j]) for j in range(expected.shape[1])):
        return [f"{label}: states[:, j] is the state before position j; it must be the state after it (after "
                "token j has been fed)"]
    return [f"{label}: the state after verify position(s) {wrong} is wrong"]


def verify_problems(label: str, got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor],
                    before: torch.Tensor, output_problems: Callable[[torch.Tensor, torch.Tensor], list[str]],
                    same_state: Callable[[torch.Tensor, torch.Tensor], bool]) -> list[str]:
    """A verify's (output, states) against the reference's: their shapes, the output (`output_problems(ours, want)`)
    and the state after each position (`same_state(ours, want)`); `before` is the state the verify started from."""
    (output, states), (want_output, want_states) = got, expected
    wrong = shape_problems(f"{label}: the output", output, want_output.shape)
    wrong += shape_problems(f"{label}: the states", states, want_states.shape)
    if wrong:
        return wrong
    if states.dtype != want_states.dtype:
        # The commit copies them into the pool, whose rows are in the dtype of the state the verify started from.
        wrong.append(f"{label}: the states are {states.dtype}; they must be {want_states.dtype}, the dtype of the "
                     "state they continue (the pool's rows, which the commit copies them into)")
    return wrong + output_problems(output, want_output) + state_position_problems(
        f"{label}: the states", states.to(want_states.dtype), want_states, before, same_state
    )


def check_conv_verify(conv_verify: Callable) -> None:
    """causal_conv1d_verify against transformers' causal_conv1d_update run one position at a time, for conv
    kernels 2, 3 and 4, verify lengths 1, 2 and 5, in float32 and bfloat16; the input conv state untouched."""
    problems = []
    for kernel in CONV_KERNELS:
        for dtype_name, dtype in DTYPES.items():
            for length in VERIFY_LENS:
                label = f"kernel {kernel}, {dtype_name}, L = {length}"
                i = conv_inputs(BATCH, length, kernel, dtype, seed=kernel + length)
                before = i["conv_state"].clone()
                expected = transformers_conv_steps(i["x"], i["weight"], before)
                problems += verify_problems(
                    label, conv_verify(**i), expected, before,
                    # A sum of `kernel` products per value, one rounding.
                    lambda y, want: compare_dtype(f"{label}: y", y, want, tolerance(dtype, kernel), elementwise=True),
                    torch.equal,  # the states are copies of inputs: equal, bit for bit
                )  # fmt: skip
                if not torch.equal(i["conv_state"], before):
                    problems.append(f"{label}: conv_state was modified (the pool's row must stay as it was until "
                                    "the commit)")
    problems += loop_problems(conv_verify, lambda batch: conv_inputs(batch, 4, 4, torch.float32))
    conclude(problems, "causal_conv1d_verify matches transformers' causal_conv1d_update position by position, with "
                       "the conv state after every position")


def rule_inputs(batch: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    q, k, v, g, beta = delta_rule_inputs((batch, length), seed=seed)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": randn(batch, HEADS, DK, DV, seed=seed + 5)}


def check_rule_verify(rule_verify: Callable) -> None:
    """gated_delta_rule_verify against transformers' torch_recurrent_gated_delta_rule run one position at a time,
    for verify lengths 1, 2 and 5 (slow and fast decays, a head that forgets everything at position 3)."""
    problems = []
    for length in VERIFY_LENS:
        label = f"L = {length}"
        i = rule_inputs(BATCH, length, seed=length)
        before = i["initial_state"].clone()
        expected = transformers_rule_steps(**{**i, "initial_state": before})
        allowed = delta_rule_tolerance(length)
        problems += verify_problems(
            label, rule_verify(**i), expected, before,
            lambda o, want: compare_dtype(f"{label}: o", o, want, allowed),
            lambda ours, want: not compare("", ours, want, allowed),
        )  # fmt: skip
        if not torch.equal(i["initial_state"], before):
            problems.append(f"{label}: initial_state was modified (work on a copy: the pool's row must stay as it was "
                            "until the commit)")
    problems += loop_problems(rule_verify, lambda batch: rule_inputs(batch, 4))
    conclude(problems, "gated_delta_rule_verify matches transformers' torch_recurrent_gated_delta_rule position by "
                     "position, with the state after every position")


# --------------------------------------------------------------------------------------------- accept and commit

# (draft_ids, target_ids) of the acceptance check, each row a case.
ACCEPT_CASES = {
    "every draft right": ([[4, 5, 6]], [[4, 5, 6, 7]]),
    "the first draft wrong": ([[9, 5, 6]], [[4, 5, 6, 7]]),
    "right again after a wrong one (still stops at the first)": ([[4, 9, 6]], [[4, 5, 6, 7]]),
    "the last draft wrong": ([[4, 5, 9]], [[4, 5, 6, 7]]),
    "padded with -1 after 1 draft": ([[4, -1, -1]], [[4, 5, 6, 7]]),
    "padded with -1, its one draft wrong": ([[8, -1, -1]], [[4, 5, 6, 7]]),
    "padded drafts against padded targets, as the engine pads them": ([[4, -1, -1]], [[4, 5, -1, -1]]),
    "a -1 draft against a -1 target (-1 is never accepted)": ([[4, -1, -1]], [[4, -1, -1, -1]]),
    "k = 1": ([[3], [2]], [[3, 1], [3, 1]]),
    "k = 0 (no draft)": ([[], []], [[3], [0]]),
}


def random_accept_case(batch: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    """target_ids from a vocabulary of 5 tokens; drafts equal to them but where a coin says otherwise."""
    generator = torch.Generator().manual_seed(seed)
    target_ids = torch.randint(0, 5, (batch, k + 1), generator=generator)
    wrong = torch.rand(batch, k, generator=generator) < 0.3
    draft_ids = torch.where(wrong, (target_ids[:, :-1] + 1) % 5, target_ids[:, :-1])
    return {"draft_ids": draft_ids, "target_ids": target_ids}


def check_greedy_accept(accept: Callable) -> None:
    """greedy_accept on hand-made cases (every pattern of agreement, -1 padding, k = 1 and 0) and on 64 random
    requests, against a loop over the requests; the result an int64 tensor [B]."""
    cases = {name: {"draft_ids": torch.tensor(d, dtype=torch.int64).reshape(len(d), -1),
                    "target_ids": torch.tensor(t, dtype=torch.int64)} for name, (d, t) in ACCEPT_CASES.items()}
    cases["64 random requests, k = 4"] = random_accept_case(64, 4, seed=0)
    problems = []
    for name, case in cases.items():
        expected = accepted_by_loop(case["draft_ids"], case["target_ids"])
        accepted = accept(**case)
        if not isinstance(accepted, torch.Tensor) or accepted.dtype != torch.int64 or accepted.shape != (len(expected),):
            what = f"{accepted.dtype} {tuple(accepted.shape)}" if isinstance(accepted, torch.Tensor) else type(accepted)
            problems.append(f"{name}: expected an int64 tensor of shape ({len(expected)},), got {what}")
        elif accepted.tolist() != expected:
            problems.append(f"{name}: accepted {accepted.tolist()}, expected {expected}")
    # A loop over `.tolist()` runs no tensor operation per request, so counting operations misses it; on `meta`
    # tensors (no values) it fails.
    if where := reads_values(accept, random_accept_case(5, 3, seed=5)):
        problems.append(f"run on `meta` tensors (shapes, no values), it reads tensor values into Python ({where}): "
                        "a Python loop over the requests' values (`.tolist()`, `.item()`, `if t:`) runs once per "
                        "request, and on a GPU each read waits for the GPU. Compare the drafts with the targets as "
                        "tensors: a running product (`cumprod`) of the agreements is 1 up to the first disagreement")
    else:
        problems += loop_problems(accept, lambda batch: random_accept_case(batch, 3, seed=batch))
    conclude(problems, "greedy_accept accepts the longest prefix of each draft that the model agrees with")


@dataclass
class CommitCase:
    """One GDN layer's pool tensors and a verify's states, as commit_verified_states_ takes them."""

    conv_state: torch.Tensor  # [NUM_SLOTS, D, K-1]
    recurrent_state: torch.Tensor  # [NUM_SLOTS, H, dk, dv]
    conv_states: torch.Tensor  # [B, L, D, K-1]
    recurrent_states: torch.Tensor  # [B, L, H, dk, dv]
    slots: torch.Tensor
    kept_lens: torch.Tensor

    def kwargs(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))


def commit_case(slots: list[int], kept_lens: list[int], length: int, dtype: torch.dtype, seed: int = 0) -> CommitCase:
    batch = len(slots)
    return CommitCase(
        conv_state=randn(NUM_SLOTS, CONV_CHANNELS, 3, seed=seed, dtype=dtype),
        recurrent_state=randn(NUM_SLOTS, 2, 4, 3, seed=seed + 1),
        conv_states=randn(batch, length, CONV_CHANNELS, 3, seed=seed + 2, dtype=dtype),
        recurrent_states=randn(batch, length, 2, 4, 3, seed=seed + 3),
        slots=torch.tensor(slots, dtype=torch.int64),
        kept_lens=torch.tensor(kept_lens, dtype=torch.int64),
    )


def committed_problems(label: str, pool: torch.Tensor, before: torch.Tensor, states: torch.Tensor, slots: list[int],
                       kept_lens: list[int], writes: PoolWrites) -> list[str]:
    """Pool row slots[i] = states[i, kept_lens[i] - 1] bit for bit (a copy), naming a commit one position off;
    the rows of no request untouched; the pool tensor itself written (`writes`: where the commit wrote)."""
    if torch.equal(pool, before):
        return [unchanged_pool_problem(label, pool, before, writes)]
    problems = []
    for i, (slot, kept) in enumerate(zip(slots, kept_lens)):
        if torch.equal(pool[slot], states[i, kept - 1]):
            continue
        off = [shift for shift in (1, -1) if 0 <= kept - 1 + shift < states.shape[1]
               and torch.equal(pool[slot], states[i, kept - 1 + shift])]
        where = f"{label}: request {i} (slot {slot}) kept {kept} of {states.shape[1]} verify tokens"
        if off == [1]:
            problems.append(f"{where}: its row holds the state after position {kept}, one position too far; it must "
                            f"hold the state after its last kept token, position kept_lens - 1 = {kept - 1}")
        elif off == [-1]:
            problems.append(f"{where}: its row holds the state after position {kept - 2}, one position too short; it "
                            f"must hold the state after its last kept token, position kept_lens - 1 = {kept - 1}")
        else:
            problems.append(f"{where}: its row must be a copy of its state after position kept_lens - 1 = {kept - 1}")
    changed = [s for s in range(pool.shape[0]) if s not in slots and not torch.equal(pool[s], before[s])]
    if changed:
        problems.append(f"{label}: slot(s) {changed} are not in `slots` {slots} but were changed: write only the "
                        "batch's rows")
    return problems


# A commit that indexes the states by kept_lens instead of kept_lens - 1 raises an IndexError where a request keeps
# all L tokens: position L is past the end.
PAST_THE_END = ("kept_lens counts tokens (1 to L: L when every draft is accepted) and the states are indexed by "
                "position (0 to L - 1): the state after the last kept token is `states[rows, kept_lens - 1]`, not "
                "`states[rows, kept_lens]`")


def raised_in(fn: Callable, error: BaseException) -> bool:
    """Whether `error` was raised inside fn (one of its frames is in its traceback)."""
    code = fn.__code__
    return any(frame.filename == code.co_filename and frame.name == code.co_name
               for frame in traceback.extract_tb(error.__traceback__))


def check_commit(commit: Callable) -> None:
    """commit_verified_states_ against a loop over the requests: slots out of order, kept lengths from 1 to L,
    conv states in float32 and bfloat16; both pool tensors written in place, no other row touched."""
    problems, index_errors = [], []  # index_errors: for each IndexError, whether a request kept all L tokens there
    cases = {"kept 1, L and 2 of L = 4": (KEPT_LENS, COMMIT_LEN), "every draft accepted": ([3, 3, 3], 3),
             "no draft accepted": ([1, 1, 1], 3), "k = 0 (L = 1)": ([1, 1, 1], 1)}
    for name, (kept_lens, length) in cases.items():
        for dtype_name, dtype in DTYPES.items():
            label = f"{name}, conv states in {dtype_name}"
            case = commit_case(SLOTS, kept_lens, length, dtype)
            before = {"conv": case.conv_state.clone(), "recurrent": case.recurrent_state.clone()}
            try:
                with PoolWrites(commit, [case.conv_state, case.recurrent_state]) as writes:
                    commit(**case.kwargs())
            except IndexError as e:
                problems.append(f"{label} (kept_lens {kept_lens} of L = {length}): IndexError: {e}")
                index_errors.append(length in kept_lens)
                continue
            problems += committed_problems(f"{label}, conv_state", case.conv_state, before["conv"], case.conv_states,
                                           SLOTS, kept_lens, writes)
            problems += committed_problems(f"{label}, recurrent_state", case.recurrent_state, before["recurrent"],
                                           case.recurrent_states, SLOTS, kept_lens, writes)

    def loop_case(batch: int) -> dict[str, torch.Tensor]:
        return commit_case(list(range(1, batch + 1)), [1 + i % 3 for i in range(batch)], 3, torch.float32).kwargs()

    if not index_errors:
        problems += loop_problems(commit, loop_case)
    # IndexErrors exactly where a request keeps all L tokens: the commit reads one position past the end.
    past_the_end = bool(index_errors) and all(index_errors)
    likely = f"an IndexError wherever a request keeps all L tokens: {PAST_THE_END}" if past_the_end else None
    conclude(problems, "commit_verified_states_ sets each request's pool rows to its states after its last kept "
                       "token, and touches no other row", likely)


# ----------------------------------------------------------------------------------------------- a poisoned state


@dataclass
class GDNStep:
    """One GDN layer's state part at the tiny model's shapes: random parameters, and per-token inputs (the in_proj
    outputs) for each request's L verify tokens followed by CONTINUATION more."""

    weight: torch.Tensor  # conv1d.weight [conv_dim, 1, K]
    A_log: torch.Tensor  # [Hv]
    dt_bias: torch.Tensor  # [Hv]
    mixed: torch.Tensor  # in_proj_qkv outputs [B, L + CONTINUATION, conv_dim]
    a: torch.Tensor  # in_proj_a outputs [B, L + CONTINUATION, Hv]
    b: torch.Tensor  # in_proj_b outputs [B, L + CONTINUATION, Hv]
    conv_state: torch.Tensor  # the pool [NUM_SLOTS, conv_dim, K-1]
    recurrent_state: torch.Tensor  # the pool [NUM_SLOTS, Hv, dk, dv]

    @classmethod
    def random(cls, seed: int = 0) -> GDNStep:
        s = gdn_shapes("tiny")
        tokens = COMMIT_LEN + CONTINUATION
        # Decays as trained models have them (Mamba's initialisation: dt in [0.001, 0.1], A in [1, 16]): a state
        # remembers many tokens, so a wrong one shows in the outputs that follow.
        dt = torch.exp(torch.empty(s.value_heads).uniform_(-6.9, -2.3, generator=torch.Generator().manual_seed(seed)))
        return cls(
            weight=randn(s.conv_dim, 1, s.kernel, seed=seed + 1) * 0.5,
            A_log=torch.linspace(1, 16, s.value_heads).log(),
            dt_bias=dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) = dt
            mixed=randn(len(SLOTS), tokens, s.conv_dim, seed=seed + 2),
            a=0.1 * randn(len(SLOTS), tokens, s.value_heads, seed=seed + 3),
            b=randn(len(SLOTS), tokens, s.value_heads, seed=seed + 4),
            conv_state=randn(NUM_SLOTS, s.conv_dim, s.kernel - 1, seed=seed + 5),
            recurrent_state=0.3 * randn(NUM_SLOTS, s.value_heads, s.dk, s.dv, seed=seed + 6),
        )

    def heads(self, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The conv output [..., conv_dim] split into q, k [..., Hk, dk] and v [..., Hv, dv], as the layer splits it."""
        s = gdn_shapes("tiny")
        q, k, v = y.split([s.key_heads * s.dk, s.key_heads * s.dk, s.value_heads * s.dv], dim=-1)
        shape = y.shape[:-1]
        return {"q": q.reshape(*shape, s.key_heads, s.dk), "k": k.reshape(*shape, s.key_heads, s.dk),
                "v": v.reshape(*shape, s.value_heads, s.dv)}

    def step_inputs(self, y: torch.Tensor, t: int) -> dict[str, torch.Tensor]:
        """What transformers_rule takes for token t of every request, from the conv output y [B, conv_dim]."""
        return {**self.heads(y), "a": self.a[:, t], "b": self.b[:, t], "A_log": self.A_log, "dt_bias": self.dt_bias}

    def prepared(self, y: torch.Tensor) -> dict[str, torch.Tensor]:
        """The verify's rule inputs from the conv output y [B, L, conv_dim], prepared as GatedDeltaNet.forward does
        (notebook 04): q, k l2-normalised and repeated to the value heads, q scaled, g and beta."""
        h = self.heads(y)
        repeat = h["v"].shape[-2] // h["q"].shape[-2]

        def norm(x: torch.Tensor) -> torch.Tensor:
            x = x.float()
            return (x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(repeat, dim=-2)

        length = y.shape[1]
        a, b = self.a[:, :length], self.b[:, :length]
        return {"q": norm(h["q"]) * h["q"].shape[-1] ** -0.5, "k": norm(h["k"]), "v": h["v"].float(),
                "g": -self.A_log.exp() * F.softplus(a + self.dt_bias), "beta": b.sigmoid()}

    def run(self, conv_state: torch.Tensor, recurrent_state: torch.Tensor, tokens: range):
        """transformers' one-token functions over `tokens` of every request, from these states [B, ...]:
        (outputs [B, len(tokens), Hv, dv], the states after each token as two lists)."""
        outputs, convs, recurrents = [], [], []
        for t in tokens:
            y, conv_state = transformers_conv(self.mixed[:, t], self.weight, conv_state)
            o, recurrent_state = transformers_rule(self.step_inputs(y, t), recurrent_state)
            outputs.append(o)
            convs.append(conv_state)
            recurrents.append(recurrent_state)
        return torch.stack(outputs, dim=1), convs, recurrents


def verify_and_commit(step: GDNStep, conv_verify: Callable, rule_verify: Callable, commit: Callable,
                      kept_lens: list[int]) -> None:
    """The verify pass of COMMIT_LEN tokens per request with the student's functions, then the commit of
    `kept_lens`, into step's pools."""
    slots = torch.tensor(SLOTS)
    y, conv_states = conv_verify(step.mixed[:, :COMMIT_LEN], step.weight, step.conv_state[slots])
    _, recurrent_states = rule_verify(**step.prepared(y), initial_state=step.recurrent_state[slots])
    commit(step.conv_state, step.recurrent_state, conv_states, recurrent_states, slots,
           torch.tensor(kept_lens, dtype=torch.int64))


def poisoned_allowed() -> float:
    """The conv, then the rule over the verify and the continuation: every token adds into the state through
    dk-long products (`_harness.tolerance`; one more token for the norms)."""
    s = gdn_shapes("tiny")
    return tolerance(torch.float32, s.kernel) + delta_rule_tolerance(COMMIT_LEN + CONTINUATION + 1, s.dk)


@dataclass(frozen=True)
class Continuation:
    """What request i does after the commit: its outputs' max error against the truth, their largest value, and
    the verify position whose true state its pool rows hold (None: none of them)."""

    error: float
    scale: float
    position: int | None


def continuations(step: GDNStep, before: GDNStep, kept_lens: list[int]) -> list[Continuation]:
    """Each request continued for CONTINUATION tokens from its committed pool rows in `step`, against the same
    tokens from its state after exactly kept_lens[i] tokens (transformers, token by token from `before`)."""
    slots = torch.tensor(SLOTS)
    _, convs, recurrents = before.run(before.conv_state[slots], before.recurrent_state[slots], range(COMMIT_LEN))
    follow = range(COMMIT_LEN, COMMIT_LEN + CONTINUATION)
    found = []
    for i, kept in enumerate(kept_lens):
        row = slice(i, i + 1)
        request = GDNStep(**{**vars(before), "mixed": before.mixed[row], "a": before.a[row], "b": before.b[row]})
        expected, _, _ = request.run(convs[kept - 1][row], recurrents[kept - 1][row], follow)
        got, _, _ = request.run(step.conv_state[SLOTS[i]][None], step.recurrent_state[SLOTS[i]][None], follow)
        # Conv states are copies of inputs (equal, bit for bit); recurrent states agree to rounding.
        position = next((p for p in range(COMMIT_LEN) if torch.equal(step.conv_state[SLOTS[i]], convs[p][i])
                         and not compare("", step.recurrent_state[SLOTS[i]], recurrents[p][i], poisoned_allowed())),
                        None)
        found.append(Continuation((got - expected).abs().max().item(), expected.abs().max().item(), position))
    return found


def poisoned_continuations(conv_verify: Callable, rule_verify: Callable, commit: Callable,
                           kept_lens: list[int]) -> dict[int, list[Continuation]]:
    """For the notebook: commit kept_lens + shift (shift -1, 0, +1) with the student's functions, and continue every
    request as `continuations` does against its state after kept_lens[i] tokens. kept_lens in 2..COMMIT_LEN - 1."""
    results = {}
    for shift in (-1, 0, 1):
        step = GDNStep.random()
        before = GDNStep(**{name: t.clone() for name, t in vars(step).items()})
        verify_and_commit(step, conv_verify, rule_verify, commit, [kept + shift for kept in kept_lens])
        results[shift] = continuations(step, before, kept_lens)
    return results


def check_poisoned_state(conv_verify: Callable, rule_verify: Callable, commit: Callable) -> None:
    """Verify 4 tokens for 3 requests at the tiny model's GDN shapes, commit 1, 4 and 2 of them, then continue each
    request for 3 tokens from its pool rows: the outputs must be those of the state after exactly its kept tokens
    (transformers, token by token). A commit one position off is named."""
    step = GDNStep.random()
    before = GDNStep(**{name: t.clone() for name, t in vars(step).items()})
    problems, likely = [], None
    try:
        verify_and_commit(step, conv_verify, rule_verify, commit, KEPT_LENS)
    except IndexError as e:
        in_commit = raised_in(commit, e)
        problems.append(f"{'the commit' if in_commit else 'the verify'} of kept_lens {KEPT_LENS} of L = {COMMIT_LEN} "
                        f"raised IndexError: {e}")
        likely = PAST_THE_END if in_commit and COMMIT_LEN in KEPT_LENS else None
    else:
        for i, c in enumerate(continuations(step, before, KEPT_LENS)):
            if c.error <= poisoned_allowed() * c.scale:
                continue
            kept = KEPT_LENS[i]
            where = f"request {i} (slot {SLOTS[i]}, kept {kept} of {COMMIT_LEN} verify tokens)"
            problems.append(f"{where}: the {CONTINUATION} tokens after the commit give outputs off by {c.error:.3g} "
                            f"(values up to {c.scale:.3g}): a silently wrong continuation")
            if c.position is not None and abs(c.position - (kept - 1)) == 1 and likely is None:
                how = "too far" if c.position > kept - 1 else "too short"
                likely = (f"{where}: its pool rows hold its state after verify position {c.position}, one position "
                          f"{how}; the commit must take the state after its last kept token, position kept_lens - 1 "
                          f"= {kept - 1}")
    conclude(problems, "after the commit, every request continues exactly as from its state after its kept tokens",
             likely)


# ------------------------------------------------------------------------------------------------------ the engine

# Drafts per decode step of the engine checks; every acceptance length 0..ENGINE_K is forced in turn.
ENGINE_K = 3
# The engine of the checks: fewer slots than prompts (slots reused), prompts longer than a prefill chunk.
ENGINE_OPTIONS = {"max_running_requests": 3, "max_prefill_tokens": 64}


class CountingOracle(OracleDrafter):
    """OracleDrafter that counts, as it proposes, how many of its drafts' leading tokens are the true ones: what
    greedy verification must accept (the model's tokens are the true ones, if the engine is right)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], correct: int, vocab_size: int) -> None:
        super().__init__(continuations, correct, vocab_size)
        self.drafted = 0
        self.right_prefixes = 0

    def propose(self, reqs, num_drafts):
        drafts = super().propose(reqs, num_drafts)
        for req, draft in zip(reqs, drafts):
            truth = self.continuations[tuple(req.input_ids)][len(req.output_ids) :]
            self.drafted += len(draft)
            self.right_prefixes += next((i for i, (d, t) in enumerate(zip(draft, truth)) if d != t),
                                        min(len(draft), len(truth)))
        return drafts


def speculative_run(checkpoint: str | Path, k: int, drafter: OracleDrafter | None = None):
    """The checks' prompts through an engine drafting k tokens per step (with `drafter`, or the checkpoint's MTP
    module): (outputs, the engine's stats)."""
    from a4.llm import LLM

    llm = LLM(checkpoint, speculative_tokens=k, drafter=drafter, **ENGINE_OPTIONS)
    outputs = llm.generate(shared_prompts(checkpoint), SamplingParams(max_new_tokens=MAX_NEW_TOKENS))
    return outputs, llm.stats


def counting_oracle(checkpoint: str | Path, correct: int) -> CountingOracle:
    """Drafts of transformers' greedy continuations of the checks' prompts, right for their first `correct` tokens."""
    prompts, expected = shared_prompts(checkpoint), reference_tokens(checkpoint)
    vocab = text_config(read_config(checkpoint))["vocab_size"]
    return CountingOracle({tuple(p): out for p, out in zip(prompts, expected)}, correct, vocab)


def engine_function_failures() -> list[str]:
    """This notebook's checks of the two functions the engine calls, on the student's code (a4/speculative/verify.py):
    "<check id>: <the first line of its failure>" for each that fails."""
    verify = importlib.import_module("a4.speculative.verify")
    failures = []
    for check_id, check, fn in (("spec-greedy-accept", check_greedy_accept, verify.greedy_accept),
                                ("spec-commit", check_commit, verify.commit_verified_states_)):
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # their "PASSED" lines are not the engine check's
                check(fn)
        except Exception as e:  # noqa: BLE001 - whatever it raised, that check fails
            text = str(e).strip()
            failures.append(f"{check_id}: {type(e).__name__}: {text.splitlines()[0] if text else ''}")
    return failures


# On the CPU the engine's verify pass runs this notebook's verify functions (a4/layers/gdn_backend.py), not
# notebook 10's decode step by slot: that one serves the static-buffer runner, whose check is notebook 10's.
@after_notebooks(*ENGINE, "05")
def check_speculative_greedy(checkpoint: str | Path, k: int = ENGINE_K) -> None:
    """For every acceptance length j = 0..k: drafts right for their first j tokens, and the engine's tokens equal to
    transformers' greedy ones, token by token (prompts of 1 to 300 tokens through 3 slots, chunked prefill); the
    engine accepted exactly the drafts' right prefixes."""
    prompts, expected = shared_prompts(checkpoint), reference_tokens(checkpoint)
    problems, seen = [], []
    for correct in range(k + 1):
        label = f"k = {k}, drafts right for their first {correct} token(s)"
        drafter = counting_oracle(checkpoint, correct)
        try:
            outputs, stats = speculative_run(checkpoint, k, drafter)
        except NotImplementedError:
            raise  # its message names the exercise to write
        except Exception as e:
            if not (failures := engine_function_failures()):
                raise  # not this notebook's functions: the error as it is
            raise CheckFailed(
                f"{label}: the engine stopped with {type(e).__name__}: {e}. It runs your greedy_accept and "
                "commit_verified_states_, and their own checks fail (below): a count one too large, for one, runs "
                "past the end of the drafts (the engine keeps drafts[:a] and the model's token target_ids[a]) or of "
                "the verify states (kept_lens). Fix them first\n" + "\n".join(f"  - {failure}" for failure in failures)
            ) from e
        problems += token_problems(label, outputs, prompts, expected)
        if stats.accepted_draft_tokens != drafter.right_prefixes:
            problems.append(f"{label}: the engine accepted {stats.accepted_draft_tokens} of {drafter.drafted} drafted "
                            f"tokens; their right prefixes hold {drafter.right_prefixes} (greedy_accept?)")
        seen.append(f"j = {correct}: {stats.acceptance_rate:.0%} accepted, {stats.tokens_per_decode_step:.2f} "
                    "tokens per step")
    conclude(problems, f"every acceptance length gives transformers' tokens ({'; '.join(seen)})")
