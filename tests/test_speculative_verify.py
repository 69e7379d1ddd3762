"""The verify pass of speculative decoding (notebook 11, a4/speculative/verify.py) against a naive reference: notebook
04's one-token functions (`causal_conv1d_decode`, `recurrent_gated_delta_rule`) run one verify position at a time,
and loops over the requests for acceptance and the commit. Then the notebook's checks (a4.course.checks.speculative)
pass on a4's functions and reject the usual mistakes, each planted in an otherwise right copy: a commit one position
too far or too short (or indexing past the last position), a commit into a copy of the pool told from no commit at
all, states before each position instead of after, the input state at every position, states in the wrong dtype, a
loop over the requests (of tensor operations, or over `.tolist()`), an acceptance that counts every agreeing draft or
accepts a -1 draft, a verify that updates the pool's state in place; and the engine check's error when the engine
fails on a wrong greedy_accept.
"""

from __future__ import annotations

import pytest
import torch

from a4.course.checks import CheckFailed
from a4.course.checks import speculative as checks
from a4.course.checks._harness import assert_close, compare_dtype, tolerance
from a4.course.checks.deltanet import DK, delta_rule_tolerance
from a4.layers.deltanet import causal_conv1d_decode, causal_conv1d_prefill, recurrent_gated_delta_rule
from a4.speculative.verify import (
    causal_conv1d_verify,
    commit_verified_states_,
    gated_delta_rule_verify,
    greedy_accept,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def naive_conv(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor):
    """Notebook 04's decode conv at every verify position: (y [B, L, D], the states after each [B, L, D, K-1])."""
    return checks.position_by_position(lambda x_j, state: causal_conv1d_decode(x_j, weight, state), [x], conv_state)


def naive_rule(q, k, v, g, beta, state):
    """Notebook 04's recurrence at every verify position: (o [B, L, H, dv], the states after each)."""

    def step(q, k, v, g, beta, state):
        o, state = recurrent_gated_delta_rule(*(x[:, None] for x in (q, k, v, g, beta)), state)
        return o[:, 0], state

    return checks.position_by_position(step, [q, k, v, g, beta], state)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
@pytest.mark.parametrize("kernel", [2, 4])
@pytest.mark.parametrize("length", [1, 2, 6])
def test_conv_verify_is_the_decode_conv_position_by_position(dtype, kernel, length):
    i = checks.conv_inputs(3, length, kernel, dtype, seed=length)
    before = i["conv_state"].clone()
    y, states = causal_conv1d_verify(**i)
    want_y, want_states = naive_conv(i["x"], i["weight"], before)
    assert not compare_dtype("y", y, want_y, tolerance(dtype, kernel), elementwise=True)
    assert states.dtype == dtype and torch.equal(states, want_states)  # copies of inputs: bit for bit
    assert torch.equal(i["conv_state"], before)
    # The same numbers as notebook 04's prefill conv over each request's L tokens (the contract's statement).
    prefill_y, final = causal_conv1d_prefill(i["x"].flatten(0, 1), i["weight"], before, [length] * 3)
    assert not compare_dtype("y", y.flatten(0, 1), prefill_y, tolerance(dtype, kernel))
    assert torch.equal(states[:, -1], final)


@pytest.mark.parametrize("length", [1, 3, 7])
def test_rule_verify_is_the_recurrence_position_by_position(length):
    i = checks.rule_inputs(3, length, seed=length)
    before = i["initial_state"].clone()
    o, states = gated_delta_rule_verify(**i)
    want_o, want_states = naive_rule(*(i[n] for n in ("q", "k", "v", "g", "beta")), before)
    allowed = delta_rule_tolerance(length, DK)
    assert_close(o, want_o, allowed, "o")
    assert_close(states, want_states, allowed, "states")
    assert torch.equal(i["initial_state"], before)
    # Its last state is what notebook 04's recurrence returns for all L tokens at once.
    _, final = recurrent_gated_delta_rule(*(i[n] for n in ("q", "k", "v", "g", "beta")), before)
    assert_close(states[:, -1], final, allowed, "final state")


def accepted_naively(drafts: list[list[int]], targets: list[list[int]]) -> list[int]:
    accepted = []
    for draft, target in zip(drafts, targets):
        a = 0
        for d, t in zip(draft, target):
            if d != t or d == -1:
                break
            a += 1
        accepted.append(a)
    return accepted


@pytest.mark.parametrize("k", [0, 1, 3, 6])
def test_greedy_accept_is_the_longest_agreeing_prefix(k):
    generator = torch.Generator().manual_seed(k)
    targets = torch.randint(0, 3, (50, k + 1), generator=generator)
    drafts = torch.where(torch.rand(50, k, generator=generator) < 0.25, (targets[:, :-1] + 1) % 3, targets[:, :-1])
    drafts[::7, k // 2 :] = -1  # requests that drafted fewer tokens, padded
    targets[::7, k // 2 + 1 :] = -1  # and their targets too, as the engine pads them
    accepted = greedy_accept(drafts, targets)
    assert accepted.dtype == torch.int64
    assert accepted.tolist() == accepted_naively(drafts.tolist(), targets.tolist())


def test_greedy_accept_extremes():
    targets = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, -1, -1]])
    drafts = torch.tensor([[5, 6, 7], [1, 6, 7], [5, -1, -1], [5, -1, -1]])  # the engine pads both rows with -1
    assert greedy_accept(drafts, targets).tolist() == [3, 0, 1, 1]


def test_greedy_accept_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"draft_ids must be \[B, k\] and target_ids \[B, k\+1\]"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES)
def test_commit_is_a_copy_per_request(dtype):
    slots, kept_lens, length = [6, 0, 3, 4], [1, 5, 3, 5], 5  # slots out of order; kept 1 and L
    case = checks.commit_case(slots, kept_lens, length, dtype, seed=7)
    conv_pool, recurrent_pool = case.conv_state, case.recurrent_state
    want_conv, want_recurrent = conv_pool.clone(), recurrent_pool.clone()
    for i, (slot, kept) in enumerate(zip(slots, kept_lens)):
        want_conv[slot] = case.conv_states[i, kept - 1]
        want_recurrent[slot] = case.recurrent_states[i, kept - 1]
    assert commit_verified_states_(**case.kwargs()) is None
    assert case.conv_state is conv_pool and torch.equal(conv_pool, want_conv)  # other rows untouched, in place
    assert case.recurrent_state is recurrent_pool and torch.equal(recurrent_pool, want_recurrent)


@pytest.mark.parametrize("kept_lens", [[0, 2], [2, 4], [1]])
def test_commit_rejects_kept_lens_outside_the_verify(kept_lens):
    case = checks.commit_case([1, 2], [1, 1], 3, torch.float32)
    case.kept_lens = torch.tensor(kept_lens)
    with pytest.raises(ValueError, match=r"kept_lens must hold one length in 1\.\.3 per slot"):
        commit_verified_states_(**case.kwargs())


def test_verify_accept_commit_leave_the_state_of_the_kept_tokens():
    """The whole step for one GDN layer: verify 4 tokens for 3 requests, accept greedily, commit; each pool row must
    be the state notebook 04's functions reach by feeding exactly the kept tokens one at a time."""
    k, slots = 3, torch.tensor([2, 0, 1])
    conv = checks.conv_inputs(3, k + 1, 4, torch.float32, seed=3)
    rule = checks.rule_inputs(3, k + 1, seed=3)
    conv_pool = torch.zeros(4, *conv["conv_state"].shape[1:])
    conv_pool[slots] = conv["conv_state"]
    recurrent_pool = torch.zeros(4, *rule["initial_state"].shape[1:])
    recurrent_pool[slots] = rule["initial_state"]
    targets = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    drafts = torch.tensor([[1, 2, 3], [9, 2, 3], [1, 2, 9]])

    _, conv_states = causal_conv1d_verify(conv["x"], conv["weight"], conv_pool[slots])
    _, states = gated_delta_rule_verify(**{**rule, "initial_state": recurrent_pool[slots]})
    accepted = greedy_accept(drafts, targets)
    commit_verified_states_(conv_pool, recurrent_pool, conv_states, states, slots, accepted + 1)

    assert accepted.tolist() == [3, 0, 2]
    for i, kept in enumerate((accepted + 1).tolist()):
        _, conv_after = naive_conv(conv["x"][i : i + 1, :kept], conv["weight"], conv["conv_state"][i : i + 1])
        _, rule_after = naive_rule(*(rule[n][i : i + 1, :kept] for n in ("q", "k", "v", "g", "beta")),
                                   rule["initial_state"][i : i + 1])  # fmt: skip
        assert torch.equal(conv_pool[slots[i]], conv_after[0, -1])
        assert_close(recurrent_pool[slots[i]], rule_after[0, -1], delta_rule_tolerance(kept, DK))
    assert not conv_pool[3].any() and not recurrent_pool[3].any()


# ------------------------------------------------------------------------------------------- the notebook's checks


def test_checks_pass_on_a4s_functions():
    checks.check_conv_verify(causal_conv1d_verify)
    checks.check_rule_verify(gated_delta_rule_verify)
    checks.check_greedy_accept(greedy_accept)
    checks.check_commit(commit_verified_states_)
    checks.check_poisoned_state(causal_conv1d_verify, gated_delta_rule_verify, commit_verified_states_)


def shifted_commit(shift: int):
    """A commit of the state `shift` positions after the right one (kept within the verify)."""

    def commit(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
        shifted = (kept_lens + shift).clamp(1, conv_states.shape[1])
        commit_verified_states_(conv_state, recurrent_state, conv_states, recurrent_states, slots, shifted)

    return commit


@pytest.mark.parametrize("shift, says", [(1, "one position too far"), (-1, "one position too short")])
def test_commit_checks_name_a_commit_one_position_off(shift, says):
    with pytest.raises(CheckFailed, match=says):
        checks.check_commit(shifted_commit(shift))
    with pytest.raises(CheckFailed, match=f"likely cause: .*{says}") as failure:
        checks.check_poisoned_state(causal_conv1d_verify, gated_delta_rule_verify, shifted_commit(shift))
    assert "a silently wrong continuation" in str(failure.value)


def test_poisoned_continuations_show_the_off_by_one_commits():
    """What the notebook shows: the continuations of commits one position off are far from the truth, the right
    commit's within rounding, and each pool row holds the state of the position committed."""
    kept_lens = [2, 3, 2]
    results = checks.poisoned_continuations(causal_conv1d_verify, gated_delta_rule_verify, commit_verified_states_,
                                            kept_lens)  # fmt: skip
    for shift, found in results.items():
        assert [c.position for c in found] == [kept - 1 + shift for kept in kept_lens]
        for c in found:
            assert (c.error <= checks.poisoned_allowed() * c.scale) == (shift == 0)


def test_conv_check_names_states_before_each_position():
    def states_before(x, weight, conv_state):
        y, states = causal_conv1d_verify(x, weight, conv_state)
        return y, torch.cat([conv_state[:, None], states[:, :-1]], dim=1)

    with pytest.raises(CheckFailed, match="is the state before position j; it must be the state after it"):
        checks.check_conv_verify(states_before)


def test_conv_check_names_states_left_at_the_input_state():
    def unchanged_states(x, weight, conv_state):
        y, _ = causal_conv1d_verify(x, weight, conv_state)
        return y, conv_state[:, None].expand(-1, x.shape[1], -1, -1).clone()

    with pytest.raises(CheckFailed, match="is the input state at every position j: the values are unchanged"):
        checks.check_conv_verify(unchanged_states)


def test_conv_check_rejects_states_in_another_dtype():
    def float32_states(x, weight, conv_state):
        y, states = causal_conv1d_verify(x, weight, conv_state)
        return y, states.float()

    with pytest.raises(CheckFailed) as failure:
        checks.check_conv_verify(float32_states)
    assert "bfloat16, L = 1: the states are torch.float32; they must be torch.bfloat16" in str(failure.value)
    assert "float32, L = 1: the states" not in str(failure.value)  # float32 inputs: float32 states are right


def test_rule_check_rejects_an_update_of_the_initial_state():
    def in_place(q, k, v, g, beta, initial_state):
        o, states = gated_delta_rule_verify(q, k, v, g, beta, initial_state)
        initial_state.copy_(states[:, -1])
        return o, states

    with pytest.raises(CheckFailed, match="initial_state was modified"):
        checks.check_rule_verify(in_place)


def test_accept_check_rejects_counting_every_agreeing_draft():
    def count_all(draft_ids, target_ids):
        return (draft_ids == target_ids[:, :-1]).sum(dim=1)

    with pytest.raises(CheckFailed, match=r"right again after a wrong one .*: accepted \[2\], expected \[1\]"):
        checks.check_greedy_accept(count_all)


def test_accept_check_rejects_accepting_a_minus_one_draft_against_a_minus_one_target():
    def agreeing_prefix(draft_ids, target_ids):  # forgets that -1 is no token
        return (draft_ids == target_ids[:, :-1]).long().cumprod(dim=1).sum(dim=1)

    with pytest.raises(CheckFailed, match=r"a -1 draft against a -1 target .*: accepted \[3\], expected \[1\]"):
        checks.check_greedy_accept(agreeing_prefix)


def tolist_accept(draft_ids, target_ids):
    """Right counts, one request at a time in Python: no tensor operation per request for a count to see."""
    accepted = []
    for drafts, targets in zip(draft_ids.tolist(), target_ids.tolist()):
        a = 0
        while a < len(drafts) and drafts[a] == targets[a] and drafts[a] != -1:
            a += 1
        accepted.append(a)
    return torch.tensor(accepted, dtype=torch.int64)


def test_accept_check_rejects_a_python_loop_over_tolist():
    with pytest.raises(CheckFailed) as failure:
        checks.check_greedy_accept(tolist_accept)
    message = str(failure.value)
    assert message.startswith("run on `meta` tensors (shapes, no values), it reads tensor values into Python (line ")
    assert "`for drafts, targets in zip(draft_ids.tolist(), target_ids.tolist()):`" in message.splitlines()[0]


def test_accept_check_rejects_a_loop_over_the_requests():
    def per_request(draft_ids, target_ids):
        return torch.cat([greedy_accept(draft_ids[i : i + 1], target_ids[i : i + 1]) for i in range(len(draft_ids))])

    with pytest.raises(CheckFailed, match="a Python loop over the requests"):
        checks.check_greedy_accept(per_request)


def test_commit_check_rejects_a_write_into_a_copy_of_the_pool():
    def into_copy(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
        pools = conv_state.clone(), recurrent_state.clone()
        commit_verified_states_(*pools, conv_states, recurrent_states, slots, kept_lens)

    with pytest.raises(CheckFailed) as failure:
        checks.check_commit(into_copy)
    first = str(failure.value).splitlines()[0]
    assert "the pool is unchanged: the new rows were written into a copy of it (line " in first, first
    assert "`pools = conv_state.clone(), recurrent_state.clone()`" in first, first


def test_commit_check_rejects_a_write_into_copies_of_the_rows():
    def into_rows(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
        rows = torch.arange(len(slots))
        conv_state[slots].copy_(conv_states[rows, kept_lens - 1])  # conv_state[slots] is a copy of the rows
        recurrent_state[slots].copy_(recurrent_states[rows, kept_lens - 1])

    with pytest.raises(CheckFailed) as failure:
        checks.check_commit(into_rows)
    lines = str(failure.value).splitlines()
    assert "conv_state: the pool is unchanged: the new rows were written into a copy of it (line " in lines[0]
    assert "`conv_state[slots].copy_(conv_states[rows, kept_lens - 1])" in lines[0]
    recurrent = [line for line in lines if "recurrent_state: the pool is unchanged" in line]
    assert recurrent and "`recurrent_state[slots].copy_(recurrent_states[rows, kept_lens - 1])`" in recurrent[0]


def test_commit_check_tells_a_commit_that_writes_nothing_from_a_copy():
    def nothing(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
        rows = torch.arange(len(slots))
        return conv_states[rows, kept_lens - 1], recurrent_states[rows, kept_lens - 1]  # computed, never written

    with pytest.raises(CheckFailed, match="the pool is unchanged: nothing was written into it"):
        checks.check_commit(nothing)


def past_the_end_commit(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
    """Indexes the states by the count of kept tokens instead of the position of the last one."""
    rows = torch.arange(len(slots))
    conv_state.index_copy_(0, slots, conv_states[rows, kept_lens])
    recurrent_state.index_copy_(0, slots, recurrent_states[rows, kept_lens])


def test_commit_checks_name_an_index_past_the_last_position():
    with pytest.raises(CheckFailed) as failure:
        checks.check_commit(past_the_end_commit)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("likely cause: an IndexError wherever a request keeps all L tokens: kept_lens counts "
                               "tokens"), lines[0]
    assert "`states[rows, kept_lens - 1]`, not `states[rows, kept_lens]`" in lines[0]
    assert any("every draft accepted, conv states in float32 (kept_lens [3, 3, 3] of L = 3): IndexError" in line
               for line in lines)
    assert any("no draft accepted" in line and "one position too far" in line for line in lines)  # no IndexError
    with pytest.raises(CheckFailed) as failure:
        checks.check_poisoned_state(causal_conv1d_verify, gated_delta_rule_verify, past_the_end_commit)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("likely cause: kept_lens counts tokens"), lines[0]
    assert lines[1] == "  - likely cause: " + lines[0][len("likely cause: ") :].split(" (and ")[0]
    assert lines[2].startswith("  - the commit of kept_lens [1, 4, 2] of L = 4 raised IndexError: index 4 is out")


def test_commit_check_rejects_writes_outside_the_batch():
    def first_rows(conv_state, recurrent_state, conv_states, recurrent_states, slots, kept_lens):
        rows = torch.arange(len(slots))
        commit_verified_states_(conv_state, recurrent_state, conv_states, recurrent_states, rows, kept_lens)

    with pytest.raises(CheckFailed, match=r"slot\(s\) \[.*\] are not in `slots`"):
        checks.check_commit(first_rows)


# ------------------------------------------------------------------------------------------ the engine-level check


def test_engine_check_passes_on_a4(tiny_qwen3_5):
    checks.check_speculative_greedy(tiny_qwen3_5)


def test_engine_check_rejects_a_commit_one_position_off(tiny_qwen3_5, monkeypatch):
    import a4.speculative.verify as verify  # the state pool's commit calls it by this name

    monkeypatch.setattr(verify, "commit_verified_states_", shifted_commit(1))
    with pytest.raises(CheckFailed, match="differs from transformers at output token"):
        checks.check_speculative_greedy(tiny_qwen3_5, k=2)


def test_engine_check_explains_the_engine_failing_on_a_wrong_greedy_accept(tiny_qwen3_5, monkeypatch):
    """An acceptance one too large makes the engine index past the model's tokens: the check says which of the
    student's functions fails its own check, instead of the engine's bare IndexError."""
    import a4.speculative.verify
    import a4.engine.speculative_worker

    def one_too_many(draft_ids, target_ids):
        return greedy_accept(draft_ids, target_ids) + 1

    # The speculative worker's name and the module's: the student's file defines the one the worker imports.
    monkeypatch.setattr(a4.engine.speculative_worker, "greedy_accept", one_too_many)
    monkeypatch.setattr(a4.speculative.verify, "greedy_accept", one_too_many)
    with pytest.raises(CheckFailed) as failure:
        checks.check_speculative_greedy(tiny_qwen3_5, k=1)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("k = 1, drafts right for their first "), lines[0]
    assert "the engine stopped with IndexError" in lines[0], lines[0]
    assert lines[1].startswith("  - spec-greedy-accept: CheckFailed: every draft right: accepted [4], expected [3]")
    assert not any("spec-commit" in line for line in lines)  # the commit is right


def test_engine_check_leaves_an_engine_error_of_its_own_as_it_is(tiny_qwen3_5, monkeypatch):
    import a4.engine.engine as engine_module

    def broken_step(self, *args, **kwargs):
        raise IndexError("the engine's own bug")

    monkeypatch.setattr(engine_module.Engine, "step", broken_step)
    with pytest.raises(IndexError, match="the engine's own bug"):
        checks.check_speculative_greedy(tiny_qwen3_5, k=1)


def test_engine_check_rejects_an_acceptance_that_accepts_nothing(tiny_qwen3_5, monkeypatch):
    """Accepting no draft keeps the tokens right (one per step): only the count of accepted drafts shows it."""
    import a4.engine.speculative_worker as worker  # the speculative worker's name for notebook 11's function

    monkeypatch.setattr(worker, "greedy_accept", lambda draft_ids, target_ids: draft_ids.new_zeros(len(draft_ids)))
    with pytest.raises(CheckFailed, match=r"the engine accepted 0 of \d+ drafted tokens; their right prefixes hold"):
        checks.check_speculative_greedy(tiny_qwen3_5, k=1)
