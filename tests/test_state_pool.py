"""The StatePool on its own: layout, bytes, clear, the reset of new requests' slots, save and restore, against sizes
computed from config.json.

The expected shapes and bytes come from the raw config.json fields (a4.course.checks.state_pool computes them
without a4's ModelConfig); behaviour is checked by writing known values through the accessors and reading them back.
The `state-reset` check is also run on wrong pools (mutants of the reference): it must fail on each.
"""

from __future__ import annotations

import pytest
import torch

from a4.checkpoints import preset_config
from a4.core import Req, SamplingParams
from a4.course.checks import CheckFailed, common
from a4.course.checks import state_pool as checks
from a4.kvcache.state_pool import StatePool, StateCheckpoint
from a4.models.config import parse_config


@pytest.fixture(scope="module")
def config(tiny_qwen3_5):
    return parse_config(common.read_config(tiny_qwen3_5))


def filled_pool(config, num_slots: int, dtype: torch.dtype = torch.float32) -> StatePool:
    """A pool whose every value is distinct (slot s, layer k, both kinds), so that any mix-up shows."""
    pool = StatePool(config, num_slots, dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    for k in range(pool.num_layers):
        for state in (pool.conv_state(k), pool.recurrent_state(k)):
            state.copy_(torch.randn(state.shape, generator=generator))
    return pool


def test_layout_one_conv_and_one_recurrent_state_per_gdn_layer(tiny_qwen3_5):
    checks.check_pool_layout(StatePool, tiny_qwen3_5)


def test_bytes_per_slot_matches_config_json(tiny_qwen3_5):
    checks.check_bytes_per_slot(StatePool.bytes_per_slot, tiny_qwen3_5)


def test_save_and_restore(tiny_qwen3_5):
    checks.check_save_restore(StatePool, tiny_qwen3_5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_bytes_are_slots_times_bytes_per_slot(tiny_qwen3_5, config, dtype):
    pool = StatePool(config, 5, dtype, "cpu")
    expected = 5 * common.expected_bytes_per_slot(common.read_config(tiny_qwen3_5), dtype)
    allocated = sum(pool.conv_state(k).nbytes + pool.recurrent_state(k).nbytes for k in range(pool.num_layers))
    assert pool.total_bytes == allocated == expected


def test_clear_zeroes_only_the_given_slots(config):
    pool = filled_pool(config, 4)
    before = [(pool.conv_state(k).clone(), pool.recurrent_state(k).clone()) for k in range(pool.num_layers)]
    pool.clear([0, 2])
    # Here and below, states are only zeroed or copied: the others equal, bit for bit.
    for k, (conv, recurrent) in enumerate(before):
        for now, was in ((pool.conv_state(k), conv), (pool.recurrent_state(k), recurrent)):
            assert not now[[0, 2]].any()
            assert torch.equal(now[[1, 3]], was[[1, 3]])
    pool.clear([])  # nothing to clear is not an error
    assert torch.equal(pool.conv_state(0)[1], before[0][0][1])


def admitted(slot: int, computed_len: int) -> Req:
    """A request in `slot` with computed_len tokens already in the pools."""
    req = Req(uid=slot, input_ids=list(range(computed_len + 4)), sampling_params=SamplingParams())
    req.slot, req.computed_len = slot, computed_len
    return req


def test_clear_new_requests_zeroes_only_the_slots_of_requests_with_nothing_cached(config):
    pool = filled_pool(config, 5)
    before = [(pool.conv_state(k).clone(), pool.recurrent_state(k).clone()) for k in range(pool.num_layers)]
    pool.clear_new_requests([admitted(4, 0), admitted(0, 30), admitted(2, 0), admitted(3, 1)])
    for k, (conv, recurrent) in enumerate(before):
        for now, was in ((pool.conv_state(k), conv), (pool.recurrent_state(k), recurrent)):
            assert not now[[2, 4]].any()
            assert torch.equal(now[[0, 1, 3]], was[[0, 1, 3]])
    pool.clear_new_requests([])  # a step without requests changes nothing
    assert torch.equal(pool.recurrent_state(0)[0], before[0][1][0])


def test_state_reset_check_passes_on_the_reference(tiny_qwen3_5):
    checks.check_state_reset(StatePool, tiny_qwen3_5)


class NoReset(StatePool):
    """Forgets the reset: a new request finds the previous request's state in its slot."""

    def clear_new_requests(self, reqs):
        pass


class ResetsEveryRequest(StatePool):
    """Resets every request of the step, also those that continue (a later chunk, a decode step, a prefix hit)."""

    def clear_new_requests(self, reqs):
        self.clear([req.slot for req in reqs])


class ResetsRecurrentOnly(StatePool):
    """Zeroes the recurrent states of new requests but leaves their conv windows."""

    def clear_new_requests(self, reqs):
        for k in range(self.num_layers):
            self.recurrent_state(k)[[req.slot for req in reqs if req.computed_len == 0]] = 0


@pytest.mark.parametrize(
    "mutant, message",
    [
        (NoReset, "does a new request start from zero state"),
        (ResetsEveryRequest, "continues at computed_len 17\\) was changed"),
        (ResetsRecurrentOnly, "does a new request start from zero state"),
    ],
)
def test_state_reset_check_fails_on_wrong_pools(tiny_qwen3_5, mutant, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_state_reset(mutant, tiny_qwen3_5)


def test_state_reset_check_sees_the_engine_skip_the_reset(tiny_qwen3_5, monkeypatch):
    """The engine part alone: the engine's pool (the reference StatePool) with its reset switched off."""
    monkeypatch.setattr(StatePool, "clear_new_requests", lambda self, reqs: None)
    problems = checks._engine_reset_problems(tiny_qwen3_5)
    assert problems and "does a new request start from zero state" in problems[0]


def test_checkpoint_moves_between_pools_of_the_same_model(config):
    source, target = filled_pool(config, 2, torch.bfloat16), StatePool(config, 3, torch.bfloat16, "cpu")
    saved = source.save(1)
    target.restore(saved, 2)
    for k in range(source.num_layers):
        assert torch.equal(target.conv_state(k)[2], source.conv_state(k)[1])
        assert torch.equal(target.recurrent_state(k)[2], source.recurrent_state(k)[1])
        assert not target.conv_state(k)[:2].any() and not target.recurrent_state(k)[:2].any()


def test_checkpoint_of_another_dtype_or_model_is_refused(config):
    pool = StatePool(config, 2, torch.float32, "cpu")
    bf16_checkpoint = StatePool(config, 2, torch.bfloat16, "cpu").save(0)
    with pytest.raises(ValueError, match="another model or dtype"):
        pool.restore(bf16_checkpoint, 0)
    fewer_layers = StateCheckpoint(conv=bf16_checkpoint.conv[:1].float(), recurrent=bf16_checkpoint.recurrent[:1])
    with pytest.raises(ValueError, match="another model or dtype"):
        pool.restore(fewer_layers, 0)


def test_bad_arguments(config):
    with pytest.raises(ValueError, match="num_slots"):
        StatePool(config, 0, torch.float32, "cpu")
    qwen3 = parse_config(preset_config("qwen3", "tiny"))
    with pytest.raises(ValueError, match="no Gated DeltaNet layers"):
        StatePool(qwen3, 2, torch.float32, "cpu")
    pool = StatePool(config, 2, torch.float32, "cpu")
    with pytest.raises(IndexError, match="slot"):
        pool.save(2)
    with pytest.raises(IndexError, match="slot"):
        pool.clear([0, -1])
    with pytest.raises(IndexError, match="slot"):
        pool.restore(pool.save(0), 5)
    with pytest.raises(IndexError, match="GDN layer"):
        pool.recurrent_state(pool.num_layers)


# ------------------------------------------------------------- an engine check failing for an earlier notebook


def norm_without_one(self, x: torch.Tensor) -> torch.Tensor:
    """Notebook 03's usual mistake: x̂ · w where the zero-centred norm scales by 1 + w."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def test_engine_check_failing_for_notebook_03_says_to_fix_notebook_03_first(tiny_qwen3_5, monkeypatch):
    import a4.layers.gated_attention

    monkeypatch.setattr(a4.layers.gated_attention.ZeroCenteredRMSNorm, "forward", norm_without_one)
    with pytest.raises(CheckFailed) as failure:
        checks.check_decode_single(tiny_qwen3_5)
    lines = str(failure.value).splitlines()
    assert lines[0].startswith("fix notebook 03's failing checks first (zero-centred-rmsnorm")
    assert any(line.startswith("this check's own failure: CheckFailed") for line in lines)


def test_engine_check_failing_for_its_own_code_reports_its_own_failure(tiny_qwen3_5, monkeypatch):
    import a4.engine.engine

    def wrong_tokens(self, *args, **kwargs):
        raise RuntimeError("the engine's own bug")

    monkeypatch.setattr(a4.engine.engine.Engine, "step", wrong_tokens)
    with pytest.raises(RuntimeError, match="the engine's own bug"):
        checks.check_decode_single(tiny_qwen3_5)


def test_poisoned_slots_read_by_new_requests_lead_to_the_zero_state_question(tiny_qwen3_5, monkeypatch):
    """No clear when a slot is given out: new requests continue from a finished request's state, and the check's
    failure asks whether a new request starts from zero state."""
    import a4.kvcache.state_pool

    monkeypatch.setattr(a4.kvcache.state_pool.StatePool, "clear_new_requests", lambda self, reqs: None)
    with pytest.raises(CheckFailed) as failure:
        checks.check_state_poisoned(tiny_qwen3_5)
    message = str(failure.value)
    assert "likely cause: if decode-single passes" in message
