"""The StatePool on its own: layout, bytes, clear, the reset of new requests' slots, save and restore, against sizes
computed from config.json.

The expected shapes and bytes come from the raw config.json fields (a4.course.checks.state_pool computes them
without a4's ModelConfig); behaviour is checked by writing known values through the accessors and reading them back.
The `state-reset` check is also run on wrong pools (mutants of the reference): it must fail on each.
"""

from __future__ import annotations

import pytest
import torch

from a4.checkpoints import preset_config, tiny_checkpoint
from a4.core import Req, SamplingParams
from a4.course.checks import CheckFailed
from a4.course.checks import state_pool as checks
from a4.kvcache.state_pool import StatePool, StateCheckpoint
from a4.models.config import parse_config


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_checkpoint("qwen3_5")


@pytest.fixture(scope="module")
def config(checkpoint):
    return parse_config(checks.read_config(checkpoint))


def filled_pool(config, num_slots: int, dtype: torch.dtype = torch.float32) -> StatePool:
    """A pool whose every value is distinct (slot s, layer k, both kinds), so that any mix-up shows."""
    pool = StatePool(config, num_slots, dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    for k in range(pool.num_layers):
        for state in (pool.conv_state(k), pool.recurrent_state(k)):
            state.copy_(torch.randn(state.shape, generator=generator))
    return pool


def test_layout_one_conv_and_one_recurrent_state_per_gdn_layer(checkpoint):
    checks.check_pool_layout(StatePool, checkpoint)


def test_bytes_per_slot_matches_config_json(checkpoint):
    checks.check_bytes_per_slot(StatePool.bytes_per_slot, checkpoint)


def test_save_and_restore(checkpoint):
    checks.check_save_restore(StatePool, checkpoint)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_bytes_are_slots_times_bytes_per_slot(checkpoint, config, dtype):
    pool = StatePool(config, 5, dtype, "cpu")
    expected = 5 * checks.expected_bytes_per_slot(checks.read_config(checkpoint), dtype)
    allocated = sum(pool.conv_state(k).nbytes + pool.recurrent_state(k).nbytes for k in range(pool.num_layers))
    assert pool.total_bytes == allocated == expected


def test_clear_zeroes_only_the_given_slots(config):
    pool = filled_pool(config, 4)
    before = [(pool.conv_state(k).clone(), pool.recurrent_state(k).clone()) for k in range(pool.num_layers)]
    pool.clear([0, 2])
    for k, (conv, recurrent) in enumerate(before):
        for now, was in ((pool.conv_state(k), conv), (pool.recurrent_state(k), recurrent)):
            assert not now[[0, 2]].any()
            assert torch.equal(now[[1, 3]], was[[1, 3]])
    pool.clear([])  # nothing to clear is not an error
    assert torch.equal(pool.conv_state(0)[1], before[0][0][1])


def admitted(slot: int, cached_len: int) -> Req:
    """A request in `slot` with cached_len tokens already in the pools."""
    req = Req(uid=slot, input_ids=list(range(cached_len + 4)), sampling_params=SamplingParams())
    req.table_idx, req.cached_len = slot, cached_len
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


def test_state_reset_check_passes_on_the_reference(checkpoint):
    checks.check_state_reset(StatePool, checkpoint)


class NoReset(StatePool):
    """Forgets the reset: a new request finds the previous request's state in its slot."""

    def clear_new_requests(self, reqs):
        pass


class ResetsEveryRequest(StatePool):
    """Resets every request of the step, also those that continue (a later chunk, a decode step, a prefix hit)."""

    def clear_new_requests(self, reqs):
        self.clear([req.table_idx for req in reqs])


class ResetsRecurrentOnly(StatePool):
    """Zeroes the recurrent states of new requests but leaves their conv windows."""

    def clear_new_requests(self, reqs):
        for k in range(self.num_layers):
            self.recurrent_state(k)[[req.table_idx for req in reqs if req.cached_len == 0]] = 0


@pytest.mark.parametrize(
    "mutant, message",
    [
        (NoReset, "does a new request start from zero state"),
        (ResetsEveryRequest, "continues at cached_len 17\\) was changed"),
        (ResetsRecurrentOnly, "does a new request start from zero state"),
    ],
)
def test_state_reset_check_fails_on_wrong_pools(checkpoint, mutant, message):
    with pytest.raises(CheckFailed, match=message):
        checks.check_state_reset(mutant, checkpoint)


def test_state_reset_check_sees_the_engine_skip_the_reset(checkpoint, monkeypatch):
    """The engine part alone: the engine's pool (the reference StatePool) with its reset switched off."""
    monkeypatch.setattr(StatePool, "clear_new_requests", lambda self, reqs: None)
    problems = checks._engine_reset_problems(checkpoint)
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
