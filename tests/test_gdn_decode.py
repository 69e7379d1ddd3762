"""The GDN decode step by slot (notebook 10): its checks (a4.course.checks.gpu) pass on a4's functions, and reject
the usual mistakes of a graph-safe step, each planted in an otherwise right copy: a Python loop over the requests,
a host sync (`.tolist()`, `.item()`), a write into a copy of the pool or of its rows (told from no write at all),
writes to rows outside the batch, a missing scale; and a graph break or a trace that holds the slot values as
constants, shown to the tracing check directly.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

from a4.course.checks import CheckFailed, common
from a4.course.checks import gpu as checks
from a4.layers.gdn_decode import conv_update_by_slot_, gated_delta_rule_update_by_slot_


def test_conv_by_slot_matches_transformers_in_the_pool():
    checks.check_conv_by_slot(conv_update_by_slot_)


def test_rule_by_slot_matches_transformers_in_the_pool():
    checks.check_rule_by_slot(gated_delta_rule_update_by_slot_)


def test_rule_check_feeds_transformers_query_and_key_heads_repeated_to_the_value_heads(monkeypatch):
    # transformers 5.17 (the H200's) expects q and k repeated to the value heads, as its layer feeds them; later
    # releases repeat them only where the counts differ. pyproject allows both: the check must run on either.
    import transformers.models.qwen3_5.modeling_qwen3_5 as hf

    grouping = hf.torch_recurrent_gated_delta_rule

    def without_grouping(query, key, value, *args, **kwargs):
        assert query.shape[2] == key.shape[2] == value.shape[2], "q, k and v must have as many heads"
        return grouping(query, key, value, *args, **kwargs)

    monkeypatch.setattr(hf, "torch_recurrent_gated_delta_rule", without_grouping)
    checks.check_rule_by_slot(gated_delta_rule_update_by_slot_)


def test_decode_step_by_slot_is_capturable():
    checks.check_graph_safe(conv_update_by_slot_, gated_delta_rule_update_by_slot_)


def test_decode_step_by_slot_runs_on_the_state_pool_of_a_model():
    """The functions on the pool layout of a4's StatePool (one GDN layer's views): the same numbers as the checks'
    reference, and only the batch's rows change."""
    from a4.checkpoints import preset_config
    from a4.kvcache.state_pool import StatePool
    from a4.models.config import parse_config

    config = parse_config(preset_config("qwen3_5", "tiny"))
    pool = StatePool(config, num_slots=5, dtype=torch.float32, device="cpu")
    shape = (config.linear_num_key_heads, config.linear_num_value_heads, config.linear_key_head_dim,
             config.linear_value_head_dim)  # fmt: skip
    inputs = checks.rule_inputs(2, shape, torch.float32)
    pool.recurrent_state(1).copy_(torch.randn_like(pool.recurrent_state(1)))
    before = pool.recurrent_state(1).clone()
    slots = [3, 1]
    expected_o, expected_states = checks.transformers_rule(inputs, before[slots])
    with checks.PoolWrites(gated_delta_rule_update_by_slot_, [pool.recurrent_state(1)]) as writes:
        o = gated_delta_rule_update_by_slot_(**{**inputs, "state": pool.recurrent_state(1)}, slots=torch.tensor(slots))
    allowed = checks.rule_tolerance(config.linear_key_head_dim)
    assert not checks.compare("o", o, expected_o, allowed)
    assert not checks.pool_problems("pool", pool.recurrent_state(1), before, slots, expected_states, allowed, writes)
    assert not pool.recurrent_state(0).any() and not pool.recurrent_state(2).any()  # other layers untouched


# ----------------------------------------------------------------------------------------------- planted mistakes


def loop_over_requests_conv(x, weight, conv_state, slots):
    """Right values, but one request at a time: every step of the loop is more kernels to launch."""
    ys = []
    for i in range(x.shape[0]):
        row = slots[i : i + 1]
        window = torch.cat([conv_state.index_select(0, row), x[i : i + 1, :, None]], dim=2)
        ys.append(F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0]))
        conv_state.index_copy_(0, row, window[:, :, 1:])
    return torch.cat(ys)


def index_assignment_conv(x, weight, conv_state, slots):
    """Right, written with indexing by the slots tensor: graph-safe (the index kernel reads the slots on the device),
    though PyTorch runs one operation more for it at batch 1 than at other batch sizes."""
    window = torch.cat([conv_state[slots], x[:, :, None]], dim=2)
    conv_state[slots] = window[:, :, 1:]
    return F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0])


def tolist_conv(x, weight, conv_state, slots):
    rows = slots.tolist()
    window = torch.cat([conv_state[rows], x[:, :, None]], dim=2)
    conv_state[rows] = window[:, :, 1:]
    return F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0])


def item_checked_conv(x, weight, conv_state, slots):
    if slots.max().item() >= conv_state.shape[0]:
        raise IndexError("slot out of range")
    return conv_update_by_slot_(x, weight, conv_state, slots)


def copy_of_pool_rule(q, k, v, a, b, A_log, dt_bias, state, slots):
    state = state.clone()  # the pool the caller holds never sees the update
    return gated_delta_rule_update_by_slot_(q, k, v, a, b, A_log, dt_bias, state, slots)


def copy_of_rows_conv(x, weight, conv_state, slots):
    """Writes the new rows into what `conv_state[slots]` returns: a copy of the rows, not the pool."""
    window = torch.cat([conv_state[slots], x[:, :, None]], dim=2)
    conv_state[slots].copy_(window[:, :, 1:])
    return F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0])


def unwritten_conv(x, weight, conv_state, slots):
    """Right outputs, and the new conv states never written anywhere."""
    window = torch.cat([conv_state.index_select(0, slots), x[:, :, None]], dim=2)
    return F.silu(F.conv1d(window, weight, groups=window.shape[1])[:, :, 0])


def first_rows_conv(x, weight, conv_state, slots):
    """Writes rows 0..B-1 instead of the slots' rows."""
    rows = torch.arange(x.shape[0])
    return conv_update_by_slot_(x, weight, conv_state, rows)


def unscaled_q_rule(q, k, v, a, b, A_log, dt_bias, state, slots):
    return gated_delta_rule_update_by_slot_(q * q.shape[-1] ** 0.5, k, v, a, b, A_log, dt_bias, state, slots)


@pytest.mark.parametrize(
    "conv, rule, says",
    [
        (loop_over_requests_conv, gated_delta_rule_update_by_slot_, "tensor operations differs with the batch"),
        (tolist_conv, gated_delta_rule_update_by_slot_, "`rows = slots.tolist()`"),
        (item_checked_conv, gated_delta_rule_update_by_slot_, "host sync"),
    ],
)
def test_capture_check_rejects(conv, rule, says):
    with pytest.raises(CheckFailed, match=f"{conv.__name__}: .*{re.escape(says)}"):
        checks.check_graph_safe(conv, rule)


def test_checks_accept_indexing_by_the_slots_tensor():
    checks.check_conv_by_slot(index_assignment_conv)
    checks.check_graph_safe(index_assignment_conv, gated_delta_rule_update_by_slot_)


def test_capture_check_names_the_line_of_a_host_sync():
    with pytest.raises(CheckFailed) as failure:
        checks.check_graph_safe(item_checked_conv, gated_delta_rule_update_by_slot_)
    assert "`if slots.max().item() >= conv_state.shape[0]:`" in str(failure.value)


def test_value_checks_reject_a_write_into_a_copy_of_the_pool_naming_the_line():
    with pytest.raises(CheckFailed) as failure:
        checks.check_rule_by_slot(copy_of_pool_rule)
    first = str(failure.value).splitlines()[0]
    assert "the pool is unchanged: the new rows were written into a copy of it (line " in first, first
    assert "`state = state.clone()" in first, first
    with pytest.raises(CheckFailed) as failure:
        checks.check_conv_by_slot(copy_of_rows_conv)
    first = str(failure.value).splitlines()[0]
    assert "written into a copy of it (line " in first and "`conv_state[slots].copy_(window[:, :, 1:])`" in first


def test_value_checks_tell_a_pool_never_written_from_a_copy():
    with pytest.raises(CheckFailed) as failure:
        checks.check_conv_by_slot(unwritten_conv)
    first = str(failure.value).splitlines()[0]
    assert "the pool is unchanged: nothing was written into it (nor into a copy of it)" in first, first


def test_value_checks_reject_writes_outside_the_batch():
    with pytest.raises(CheckFailed, match=r"slot\(s\) \[.*\] are not in `slots`"):
        checks.check_conv_by_slot(first_rows_conv)


def test_value_checks_reject_a_wrong_formula():
    with pytest.raises(CheckFailed, match="output: max error"):
        checks.check_rule_by_slot(unscaled_q_rule)


def test_padding_rows_may_compute_anything():
    """Rows of the dummy slot are garbage by contract: a version that writes NaN there still passes."""

    def nan_padding_conv(x, weight, conv_state, slots):
        y = conv_update_by_slot_(x, weight, conv_state, slots)
        padding = slots == checks.DUMMY_SLOT
        if padding.sum() > 1:
            conv_state[checks.DUMMY_SLOT] = float("nan")
            y[padding] = float("nan")
        return y

    checks.check_conv_by_slot(nan_padding_conv)


def test_tracing_check_reports_a_graph_break():
    def breaks(x, weight, conv_state, slots):
        torch._dynamo.graph_break()
        return conv_update_by_slot_(x, weight, conv_state, slots)

    problems = checks.graph_problems(lambda batch: (breaks, conv_kwargs(batch)))
    assert len(problems) == 1 and "cannot trace it as one graph (line " in problems[0]
    assert "`torch._dynamo.graph_break()`" in problems[0]


def conv_kwargs(batch: int) -> dict[str, torch.Tensor]:
    return {**checks.conv_inputs(batch, 4, torch.float32), "slots": torch.arange(batch)}


def test_gpu_report_reads_the_given_file(tmp_path, monkeypatch, capsys):
    path = tmp_path / "figures.json"
    path.write_text(json.dumps({"meta": {"device": "a GPU"}}))
    assert common.gpu_report(path) == {"meta": {"device": "a GPU"}}
    monkeypatch.setenv(common.GPU_REPORT_ENV, str(path))
    assert common.gpu_report() == {"meta": {"device": "a GPU"}}
    assert common.gpu_report(tmp_path / "none.json") is None
    assert "No H200 figures at" in capsys.readouterr().out


def test_engine_check_passes_on_a4(tiny_qwen3_5):
    checks.check_static_decode_engine(tiny_qwen3_5)


def test_engine_check_sees_a_wrong_conv_by_slot_and_names_its_check_first(tiny_qwen3_5, monkeypatch):
    """A conv by slot without its silu: the default engine (notebook 04's decode) would not notice; the static-buffer
    engine's tokens go wrong, and the failure names notebook 10's conv check before its own."""
    import a4.layers.gdn_decode

    def conv_without_silu(x, weight, conv_state, slots):
        window = torch.cat([conv_state.index_select(0, slots), x[:, :, None]], dim=2)
        conv_state.index_copy_(0, slots, window[:, :, 1:])
        return F.conv1d(window, weight, groups=window.shape[1])[:, :, 0]

    monkeypatch.setattr(a4.layers.gdn_decode, "conv_update_by_slot_", conv_without_silu)
    with pytest.raises(CheckFailed) as failure:
        checks.check_static_decode_engine(tiny_qwen3_5)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("fix notebook 10's failing checks first (gdn-conv-by-slot)"), lines[0]
    assert any(line.startswith("this check's own failure: CheckFailed") for line in lines)
