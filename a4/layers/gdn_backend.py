"""The Gated DeltaNet layers' backends: the two steps of the layer that touch its state, for each kind of step.

`GatedDeltaNet.forward` (notebook 04) is written once. For the two steps that read and update a request's state,
the causal conv and the delta rule, it calls the step's backend, as an attention layer calls its attention backend
(SGLang's linear-attention backend beside its full-attention one):

    backend.conv(x, weight, gdn_layer, fb)                            -> y [T, conv_dim]
    backend.delta_rule(q, k, v, a, b, A_log, dt_bias, gdn_layer, fb)  -> o [T, Hv, dv] float32

Both read the states of pool layer `gdn_layer` (`fb.state_pool.conv_state(gdn_layer)`, `recurrent_state`) at the
rows `fb.state_slots` (the requests' slots, see ForwardBatch), and branch only on `fb.mode`:
- EXTEND: each request from its slot over its new tokens, final states written back;
- DECODE: one token per request, the same;
- TARGET_VERIFY (speculative decoding): L tokens per request from its slot, the state after every one of them kept
  in the pool's verify buffers (`StatePool.verify_conv_states`); the slot itself is left alone until the engine
  commits the accepted length (`StatePool.commit_verified`).

The backends, and whose functions they are made of:
- `TorchGDNBackend` (eager steps on the CPU): notebook 04's conv and rule for EXTEND and DECODE, notebook 11's
  verify functions for TARGET_VERIFY;
- `BySlotGDNBackend` (the static-buffer runner on the CPU, a4/engine/graph_runner.py): notebook 10's graph-safe
  by-slot step for DECODE, notebook 11's verify functions (graph-safe too) for TARGET_VERIFY;
- `TritonGDNBackend` (CUDA): a4's Triton by-slot kernels for DECODE, and the same kernels walking a request's L
  tokens for TARGET_VERIFY, so that a verify computes what decode steps compute (their o comes already rounded to
  the model dtype, the value the layer's cast gives it, so that cast launches nothing); flash-linear-attention's
  varlen kernels for a bfloat16 EXTEND where installed (the `gpu` extra), else notebook 04's functions. Tested
  against the students' reference functions.

`HybridAttnBackend` is what a hybrid model's ForwardBatch carries: the attention backend for the full-attention
layers and one of these for the GDN layers, both prepared once per step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import ModuleType

import torch

from a4.core import AttentionBackend, ForwardBatch, ForwardMode
from a4.layers.deltanet import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    gated_delta_inputs,
    recurrent_gated_delta_rule,
)


@dataclass
class PaddedPrefill:
    """What every GDN layer of a padded prefill (a static EXTEND step: one request's tokens, then padding) needs to
    keep the padding out of the states, computed on the device once per step, not once per layer."""

    padding: torch.Tensor  # [T, 1] bool: the rows after the request's tokens
    # The request's last K-1 inputs, the conv state it leaves: rows `conv_rows` of x where `conv_from_x` [K-1, 1],
    # else columns `state_columns` of the state it started from (a request of fewer than K-1 tokens).
    conv_rows: torch.Tensor
    conv_from_x: torch.Tensor
    state_columns: torch.Tensor

    @staticmethod
    def build(num_rows: int, num_tokens: torch.Tensor, width: int) -> PaddedPrefill:
        """num_rows rows, the first num_tokens ([1], on the device: a slice's bounds would be the host's to read) of
        them the request's; width = K-1."""
        device = num_tokens.device
        rows = num_tokens - width + torch.arange(width, device=device)  # x's rows; row -j is the state's j-th last
        return PaddedPrefill(
            padding=(torch.arange(num_rows, device=device) >= num_tokens)[:, None],
            conv_rows=rows.clamp(min=0),
            conv_from_x=(rows >= 0)[:, None],
            state_columns=(rows + width).clamp(max=width - 1),
        )


class TorchGDNBackend:
    """Eager steps: the students' notebook 04 functions (EXTEND, DECODE) and notebook 11's (TARGET_VERIFY)."""

    def __init__(self, verify: ModuleType | None = None) -> None:
        # Notebook 11's module (a4.speculative.verify), handed in by whoever builds the backend
        # (a4/engine/factories.py): the layers sit below the speculative package. None: it runs no TARGET_VERIFY step.
        self.verify = verify

    def prepare(self, fb: ForwardBatch) -> None:
        """Each request continues from its slot (cleared when it was given out). A padded prefill (a static EXTEND
        step, `fb.num_token_non_padded` set) gets its `PaddedPrefill`."""
        if fb.num_token_non_padded is not None:
            width = fb.state_pool.conv_state(0).shape[-1]
            fb.gdn_metadata = PaddedPrefill.build(fb.input_ids.shape[0], fb.num_token_non_padded, width)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        conv_state = fb.state_pool.conv_state(gdn_layer)
        states_in = conv_state[fb.state_slots]
        if fb.mode is ForwardMode.TARGET_VERIFY:
            y, states = self._verify().causal_conv1d_verify(_per_request(x, fb), weight, states_in)
            fb.state_pool.verify_conv_states(gdn_layer)[fb.state_slots] = states
            return y.flatten(0, 1)
        if fb.mode is ForwardMode.DECODE:
            y, states_out = causal_conv1d_decode(x, weight, states_in)
        else:
            y, states_out = self.conv_prefill(x, weight, states_in, fb)
            if fb.num_token_non_padded is not None:
                # The padding came after the request's tokens (it cannot reach their outputs, the conv is causal),
                # but the state must be the last K-1 inputs before it.
                states_out = _conv_state_before_padding(x, states_in, fb.gdn_metadata)
        conv_state[fb.state_slots] = states_out
        return y

    def _verify(self) -> ModuleType:
        if self.verify is None:
            raise RuntimeError(f"{type(self).__name__} was built without verify= (a4.speculative.verify): it runs no "
                               "TARGET_VERIFY step")  # fmt: skip
        return self.verify

    def conv_prefill(
        self, x: torch.Tensor, weight: torch.Tensor, states_in: torch.Tensor, fb: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """EXTEND's conv over every request's tokens from its state: (y, final states)."""
        return causal_conv1d_prefill(x, weight, states_in, fb.extend_lens)

    def delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        A_log: torch.Tensor,
        dt_bias: torch.Tensor,
        gdn_layer: int,
        fb: ForwardBatch,
    ) -> torch.Tensor:
        state = fb.state_pool.recurrent_state(gdn_layer)
        state_in = state[fb.state_slots]
        if fb.mode is ForwardMode.EXTEND:
            if fb.num_token_non_padded is not None:
                # A padding token with a = b = -inf has decay exp(g) = 1 and step size beta = 0, and with k = v = 0
                # it writes nothing: S passes through it as it is, even were the padding's own values not finite
                # (0 * nan is nan). torch.where, one launch each, where masked_fill of a view copies it first.
                padding = fb.gdn_metadata.padding
                a, b = torch.where(padding, float("-inf"), a), torch.where(padding, float("-inf"), b)
                k, v = torch.where(padding[..., None], 0.0, k), torch.where(padding[..., None], 0.0, v)
            o, state_out = self.delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, state_in, fb)
            state[fb.state_slots] = state_out
            return o
        inputs = gated_delta_inputs(q, k, v, a, b, A_log, dt_bias)
        if fb.mode is ForwardMode.TARGET_VERIFY:
            o, states = self._verify().gated_delta_rule_verify(*(_per_request(x, fb) for x in inputs), state_in)
            fb.state_pool.verify_recurrent_states(gdn_layer)[fb.state_slots] = states
            return o.flatten(0, 1)
        # DECODE: one token per request, the requests are the batch of the recurrence.
        o, state_out = recurrent_gated_delta_rule(*(x[:, None] for x in inputs), state_in)
        state[fb.state_slots] = state_out
        return o[:, 0]

    def delta_rule_prefill(self, q, k, v, a, b, A_log, dt_bias, state_in: torch.Tensor, fb: ForwardBatch):
        """EXTEND's rule over every request's tokens from its state: (o [T, Hv, dv], final states)."""
        # The boundaries from the host's lengths: notebook 04 reads them as Python ints, and reading the context's
        # device tensor would wait for the GPU (and cannot be captured in a graph).
        cu_seqlens = torch.tensor([0, *itertools.accumulate(fb.extend_lens)])
        return chunk_gated_delta_rule(*gated_delta_inputs(q, k, v, a, b, A_log, dt_bias), cu_seqlens, state_in)


class BySlotGDNBackend(TorchGDNBackend):
    """The static-buffer runner's backend: DECODE by slot index in place, with no host list and no host sync, so
    that a CUDA graph could capture it. On the CPU its primitives are notebook 10's torch functions."""

    def __init__(self, ops: ModuleType | None = None, verify: ModuleType | None = None) -> None:
        super().__init__(verify)
        if ops is None:
            from a4.layers import gdn_decode as ops
        # The by-slot primitives: `conv_update_by_slot_` and `gated_delta_rule_update_by_slot_`.
        self.ops = ops

    def conv(self, x: torch.Tensor, weight: torch.Tensor, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        if fb.mode is not ForwardMode.DECODE:
            return super().conv(x, weight, gdn_layer, fb)
        return self.ops.conv_update_by_slot_(x, weight, fb.state_pool.conv_state(gdn_layer), fb.state_slots)

    def delta_rule(self, q, k, v, a, b, A_log, dt_bias, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        if fb.mode is not ForwardMode.DECODE:
            return super().delta_rule(q, k, v, a, b, A_log, dt_bias, gdn_layer, fb)
        state = fb.state_pool.recurrent_state(gdn_layer)
        return self.ops.gated_delta_rule_update_by_slot_(q, k, v, a, b, A_log, dt_bias, state, fb.state_slots)


class TritonGDNBackend(BySlotGDNBackend):
    """CUDA: a4's Triton by-slot kernels (decode, and verify in one launch per layer), flash-linear-attention for a
    bfloat16 prefill where it is installed: notebook 04's chunked rule loops over chunks in Python, thousands of
    launches for a long prompt."""

    def __init__(self, dtype: torch.dtype) -> None:
        from a4.kernels import gdn_decode
        from a4.kernels.fla_prefill import fla_available

        super().__init__(gdn_decode)
        # fla's kernels compute float32 products in TF32: a float32 model keeps notebook 04's exact arithmetic.
        self.fla_prefill = dtype != torch.float32 and fla_available()

    def conv(self, x: torch.Tensor, weight: torch.Tensor, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        if fb.mode is ForwardMode.TARGET_VERIFY:
            conv_state, verify_states = fb.state_pool.conv_state(gdn_layer), fb.state_pool.verify_conv_states(gdn_layer)
            return self.ops.conv_verify_by_slot_(x, weight, conv_state, fb.state_slots, verify_states)
        return super().conv(x, weight, gdn_layer, fb)

    def conv_prefill(self, x, weight, states_in, fb):
        if not self.fla_prefill:
            return super().conv_prefill(x, weight, states_in, fb)
        from a4.kernels.fla_prefill import causal_conv1d_prefill as fla_conv1d_prefill

        return fla_conv1d_prefill(x, weight, states_in, fb.cu_seqlens)

    def delta_rule(self, q, k, v, a, b, A_log, dt_bias, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        state = fb.state_pool.recurrent_state(gdn_layer)
        # o comes in the model dtype, the value the layer's cast would give it: that cast launches nothing.
        if fb.mode is ForwardMode.DECODE:
            return self.ops.gated_delta_rule_update_by_slot_(
                q, k, v, a, b, A_log, dt_bias, state, fb.state_slots, out_dtype=v.dtype
            )
        if fb.mode is ForwardMode.TARGET_VERIFY:
            verify_states = fb.state_pool.verify_recurrent_states(gdn_layer)
            return self.ops.gated_delta_rule_verify_by_slot_(
                q, k, v, a, b, A_log, dt_bias, state, fb.state_slots, verify_states, out_dtype=v.dtype
            )
        return super().delta_rule(q, k, v, a, b, A_log, dt_bias, gdn_layer, fb)

    def delta_rule_prefill(self, q, k, v, a, b, A_log, dt_bias, state_in, fb):
        if not self.fla_prefill:
            return super().delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, state_in, fb)
        from a4.kernels.fla_prefill import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

        return fla_chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state_in, fb.cu_seqlens)


class HybridAttnBackend:
    """A hybrid model's backend: `forward` for the full-attention layers (the attention backend), `conv` and
    `delta_rule` for the Gated DeltaNet layers; `prepare` prepares both once per step."""

    def __init__(self, attention: AttentionBackend, gdn: TorchGDNBackend) -> None:
        self.attention, self.gdn = attention, gdn

    def prepare(self, fb: ForwardBatch) -> None:
        self.attention.prepare(fb)
        self.gdn.prepare(fb)

    def forward(self, q, k, v, fb: ForwardBatch, pool_layer: int, scale: float) -> torch.Tensor:
        return self.attention.forward(q, k, v, fb, pool_layer, scale)

    def conv(self, x: torch.Tensor, weight: torch.Tensor, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        return self.gdn.conv(x, weight, gdn_layer, fb)

    def delta_rule(self, q, k, v, a, b, A_log, dt_bias, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        return self.gdn.delta_rule(q, k, v, a, b, A_log, dt_bias, gdn_layer, fb)


def _conv_state_before_padding(x: torch.Tensor, states_in: torch.Tensor, padded: PaddedPrefill) -> torch.Tensor:
    """The conv state [1, D, K-1] of a padded prefill's request after its tokens, the rows of x [T, D] before the
    padding, from states_in [1, D, K-1]: its last K-1 inputs, from x, or from the old state where the request has
    fewer than K-1 tokens."""
    from_x = x[padded.conv_rows]  # [K-1, D]
    from_state = states_in[0].T[padded.state_columns]
    return torch.where(padded.conv_from_x, from_x, from_state).T[None]


def _per_request(x: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
    """[T, ...] -> [B, L, ...]: a verify step's tokens, L per request."""
    return x.unflatten(0, (fb.batch_size, fb.tokens_per_request))
