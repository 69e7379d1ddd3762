"""a4's Gated DeltaNet against transformers' Qwen3.5 code: notebook 04's checks (a4.course.checks.deltanet), and the
chunked form against a naive float64 recurrence.

The checks: the conv (prefill and decode) against transformers' causal_conv1d_fn / causal_conv1d_update, the
recurrence and the chunked form against torch_recurrent_gated_delta_rule (lengths around the chunk boundaries, every
chunk size, a varlen batch), the within-chunk terms against what they stand for, the gated norm against
Qwen3_5RMSNormGated, the whole layer against Qwen3_5GatedDeltaNet with random weights (a batch of requests in reused
slots, a second prefill chunk, decode, the states against transformers' cache) in three shapes, and the whole model's
logits and greedy tokens against transformers on the tiny checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from a4.bench._states import LayerStates
from a4.course.checks import CheckFailed
from a4.course.checks import deltanet as checks
from a4.course.checks._harness import assert_close, randn
from a4.layers.deltanet import (
    GatedDeltaNet,
    GatedRMSNorm,
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    intra_chunk,
    recurrent_gated_delta_rule,
)


def test_conv_prefill_matches_transformers_for_each_sequence_of_a_batch():
    checks.check_conv_prefill(causal_conv1d_prefill)


def test_conv_decode_matches_transformers():
    checks.check_conv_decode(causal_conv1d_decode)


def test_recurrence_matches_transformers():
    checks.check_recurrence(recurrent_gated_delta_rule)


def test_intra_chunk_terms_are_what_they_stand_for():
    checks.check_intra_chunk(intra_chunk)


def test_chunked_matches_transformers_recurrence():
    checks.check_chunked(chunk_gated_delta_rule)


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("chunk_size", checks.CHUNK_SIZES)
def test_chunked_equals_float64_recurrence(chunk_size, with_initial_state):
    # Independent of transformers: the recurrence as the papers write it, in float64.
    heads, dk, dv = 2, 16, 8
    for length in sorted({1, chunk_size - 1, chunk_size, chunk_size + 1, 2 * chunk_size + 1, 300}):
        q, k, v, g, beta = checks.delta_rule_inputs((length,), heads, seed=length, dk=dk, dv=dv)
        state = randn(1, heads, dk, dv, seed=length) if with_initial_state else torch.zeros(1, heads, dk, dv)
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, length]), state, chunk_size=chunk_size)
        by_head = (x.transpose(0, 1) for x in (q, k, v, g, beta))  # [H, T, ...]
        expected_o, _, expected_final = checks.naive_delta_rule(*by_head, state[0])
        allowed = checks.delta_rule_tolerance(length, dk)
        assert_close(o, expected_o.transpose(0, 1), allowed, f"output, length {length}")
        assert_close(final[0], expected_final, allowed, f"final state, length {length}")


def test_gated_norm_matches_transformers():
    checks.check_gated_norm(GatedRMSNorm)


def test_layer_prefill_matches_transformers():
    checks.check_layer_prefill(GatedDeltaNet)


def test_layer_decode_matches_transformers():
    checks.check_layer_decode(GatedDeltaNet)


def test_layer_states_match_transformers_cache():
    checks.check_layer_states(GatedDeltaNet)



# ------------------------------------------------------------- what the checks say about the usual mistakes
# Mutant student implementations: each check must name the mistake in its first line, not only a number.


class NormGatedFirst(GatedRMSNorm):
    """norm(x · silu(z)) · w, where Qwen3.5 normalises first: norm(x) · w · silu(z)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        gated = (x.float() * torch.nn.functional.silu(z.float())).to(x.dtype).float()
        normed = (gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed).to(x.dtype)


class LayerOnPrivateStates(GatedDeltaNet):
    """Runs its backend on a zero state pool of its own instead of the step's: its first prefill is right, but the
    pool never learns the requests' states, and every later step starts them from zero again."""

    def forward(self, hidden, fb, gdn_layer):
        conv, recurrent = (torch.zeros_like(state) for state in (fb.state_pool.conv_state(0), fb.state_pool.recurrent_state(0)))
        own = LayerStates(conv, recurrent)
        return super().forward(hidden, dataclasses.replace(fb, state_pool=own), gdn_layer)


def first_line(check, *args) -> str:
    with pytest.raises(CheckFailed) as failure:
        check(*args)
    return str(failure.value).splitlines()[0]


def test_gated_norm_check_names_the_gate_applied_before_the_norm():
    line = first_line(checks.check_gated_norm, NormGatedFirst)
    assert line.startswith("likely cause: the output equals norm(x · silu(z)): the gate comes after the norm")


def test_layer_states_check_sees_states_kept_outside_the_pool():
    # transformers' cache holds each request's states; the step's state pool must hold the same.
    line = first_line(checks.check_layer_states, LayerOnPrivateStates)
    assert "state" in line
