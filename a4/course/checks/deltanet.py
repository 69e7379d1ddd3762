"""Checks of notebook 04: the Gated DeltaNet layer against transformers' Qwen3.5 code, and the whole model.

Ground truths:
- transformers' own functions and modules on random inputs: `causal_conv1d_fn` / `causal_conv1d_update` for the
  conv, `torch_recurrent_gated_delta_rule` for the recurrence and for the chunked form, `Qwen3_5RMSNormGated`, and
  `Qwen3_5GatedDeltaNet` with random weights and one DynamicCache per request for the layer and its states;
- for the within-chunk terms (`intra_chunk`), the recurrence written here in float64, token by token, which records
  what the terms stand for (each token's delta, from a zero state and from a random one), and the decay formulas;
- for the whole model, transformers' `Qwen3_5ForConditionalGeneration` on the tiny checkpoint (its greedy `generate`
  and its logits).

The layer checks use shapes that neither the notebook nor the tiny checkpoint has (value heads 3x key heads or as
many, dk != dv, conv kernels 2, 3 and 4), so nothing in the code under test may assume a particular shape. How close
is close enough comes from `a4.course.checks._harness.tolerance`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from a4.checkpoints import tiny_checkpoint
from a4.course.checks import conclude
from a4.course.checks._harness import (
    GDN_ROUNDINGS,
    compare,
    compare_dtype,
    dtype_name,
    gdn_reduction_length,
    model_reduction_length,
    randn,
    rms_normalised,
    shape_problems,
    tolerance,
)
from a4.course.checks._model_runner import ModelRunner, SlotTable, ZeroStates
from a4.course.checks.gated_attention import a4_config
from a4.dtypes import DTYPES
from a4.models.config import LINEAR_ATTENTION

# (key heads, value heads, dk, dv, conv kernel) of the layer checks.
SHAPES = {
    "3 value heads per key head, dk 16, dv 8, kernel 2": (2, 6, 16, 8, 2),
    "1 key head for 3 value heads, dk 8, dv 24, kernel 3": (1, 3, 8, 24, 3),
    "as many value heads as key heads, dk 16, dv 16, kernel 4": (2, 2, 16, 16, 4),
}
CONV_KERNELS = (2, 3, 4)
# Delta-rule shapes of the function checks: heads (already repeated to the value heads), dk, dv.
HEADS, DK, DV = 6, 16, 8
CHUNK_SIZES = (16, 32, 64)
# Lengths of the chunked check: around the boundaries of every chunk size, and long ones.
CHUNKED_LENGTHS = (1, 2, 15, 16, 17, 33, 63, 64, 65, 100, 129, 300)
VARLEN_SEQ_LENS = [5, 64, 1, 130, 17]
NUM_SLOTS = 4


# ------------------------------------------------------------------------------------------------ the causal conv


def check_conv_prefill(conv_prefill: Callable) -> None:
    """causal_conv1d_prefill on a batch of sequences, each from its own conv state (one fresh, one shorter than the
    state), against transformers' causal_conv1d_fn; the new states against the last K-1 inputs of each sequence."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    problems = []
    channels = 10
    for kernel in CONV_KERNELS:
        for name, dtype in DTYPES.items():
            label = f"kernel {kernel}, {name}"
            weight = randn(channels, 1, kernel, seed=kernel, dtype=dtype)
            seq_lens = [1, 9, 20, 2]
            x = randn(sum(seq_lens), channels, seed=1, dtype=dtype)
            states = randn(len(seq_lens), channels, kernel - 1, seed=2, dtype=dtype)
            states[2] = 0  # a sequence that starts here
            y, new_states = conv_prefill(x, weight, states.clone(), seq_lens)
            wrong = shape_problems(f"{label}: the output", y, x.shape)
            wrong += shape_problems(f"{label}: the new conv states", new_states, states.shape)
            if wrong:
                problems += wrong
                continue
            start = 0
            for i, x_i in enumerate(x.split(seq_lens)):
                # transformers' conv starts from zeros: give it the state as leading inputs and drop their outputs.
                inputs = torch.cat([states[i], x_i.T], dim=1)[None]  # [1, D, K-1 + L]
                expected = causal_conv1d_fn(inputs, weight.squeeze(1), activation="silu")[0, :, kernel - 1 :].T
                y_i = y[start : start + len(x_i)]
                start += len(x_i)
                where = f"{label}, sequence {i} ({len(x_i)} tokens)"
                # A sum of `kernel` products per value, one rounding.
                problems += compare_dtype(where, y_i, expected, tolerance(dtype, kernel), elementwise=True)
                # The new state is a copy of inputs: equal, bit for bit.
                if not torch.equal(new_states[i], inputs[0, :, -(kernel - 1) :]):
                    problems.append(
                        f"{label}, sequence {i} ({len(x_i)} tokens): its new conv state must be the last {kernel - 1} "
                        "inputs of (old state + its tokens)"
                    )
    conclude(problems, "the prefill conv matches transformers' causal_conv1d_fn, and the new states are right")


def check_conv_decode(conv_decode: Callable) -> None:
    """causal_conv1d_decode for 3 sequences against transformers' causal_conv1d_update, which keeps K inputs where
    a4 keeps K-1 (the oldest of transformers' K is never read by a one-token step)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update

    problems = []
    channels, batch = 10, 3
    for kernel in CONV_KERNELS:
        for name, dtype in DTYPES.items():
            label = f"kernel {kernel}, {name}"
            weight = randn(channels, 1, kernel, seed=kernel, dtype=dtype)
            x = randn(batch, channels, seed=1, dtype=dtype)
            hf_state = randn(batch, channels, kernel, seed=2, dtype=dtype)
            y, new_state = conv_decode(x, weight, hf_state[:, :, 1:].clone())
            expected = causal_conv1d_update(x[:, :, None], hf_state, weight.squeeze(1), activation="silu")[:, :, 0]
            problems += compare_dtype(f"{label}, output", y, expected, tolerance(dtype, kernel), elementwise=True)
            # transformers updated its state in place; both states are copies of inputs: equal, bit for bit.
            expected_state = hf_state[:, :, 1:]
            if new_state.shape != expected_state.shape or not torch.equal(new_state, expected_state):
                problems.append(f"{label}: the new conv state must be the last {kernel - 1} inputs (old state + x)")
    conclude(problems, "the decode conv matches transformers' causal_conv1d_update, and the new states are right")


# ------------------------------------------------------------------------------------------- the gated delta rule


def delta_rule_inputs(
    shape: tuple[int, ...], heads: int = HEADS, seed: int = 0, dk: int = DK, dv: int = DV
) -> tuple[torch.Tensor, ...]:
    """float32 q (l2-normalised, scaled by dk^-0.5), k (l2-normalised), v, g <= 0 and beta in (0, 1), as the layer
    makes them; the leading dims are `shape` (e.g. [B, T] or [T]) then the heads.

    The first half of the heads forget slowly (g around -0.05: a chunk's decay stays well above 0), the second half
    quickly (g around -1), and in those every 7th token forgets almost everything (g = -60): a chunk's cumulative
    decay then underflows to 0, which must not turn into inf or NaN.
    """
    q = F.normalize(randn(*shape, heads, dk, seed=seed), dim=-1) * dk**-0.5
    k = F.normalize(randn(*shape, heads, dk, seed=seed + 1), dim=-1)
    v = randn(*shape, heads, dv, seed=seed + 2)
    slow = torch.arange(heads) < heads // 2
    g = -F.softplus(2 * randn(*shape, heads, seed=seed + 3) - 4 * slow)
    g[..., 3::7, heads // 2 :] = -60.0
    beta = torch.sigmoid(randn(*shape, heads, seed=seed + 4))
    return q, k, v, g, beta


def transformers_recurrence(q, k, v, g, beta, initial_state):
    """transformers' torch_recurrent_gated_delta_rule on a4's layout ([B, T, H, ...], q already scaled)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    return torch_recurrent_gated_delta_rule(
        q * q.shape[-1] ** 0.5, k, v, g, beta, initial_state=initial_state.clone(), output_final_state=True
    )


def delta_rule_tolerance(length: int, dk: int = DK) -> float:
    """The delta rule over `length` tokens, in float32 (see `_harness.tolerance`): every token adds into the state
    through a dk-long product (S^T k), and each output reads the state through one more."""
    return tolerance(torch.float32, (length + 1) * dk)


def check_recurrence(recurrence: Callable) -> None:
    """recurrent_gated_delta_rule on 2 sequences of 9 tokens, from a random state, against transformers'."""
    batch, length = 2, 9
    q, k, v, g, beta = delta_rule_inputs((batch, length), seed=3)
    state = randn(batch, HEADS, DK, DV, seed=4)
    original = state.clone()
    expected_o, expected_final = transformers_recurrence(q, k, v, g, beta, state)
    o, final = recurrence(q, k, v, g, beta, state)
    allowed = delta_rule_tolerance(length)
    problems = compare("outputs o", o, expected_o, allowed) + compare("final state", final, expected_final, allowed)
    if not torch.equal(state, original):  # untouched: equal, bit for bit
        problems.append("initial_state was modified (work on a copy)")
    conclude(problems, "the recurrence matches transformers' torch_recurrent_gated_delta_rule")


def naive_delta_rule(q, k, v, g, beta, state):
    """The recurrence as the papers write it, token by token in float64, from `state` [H, dk, dv]: each token's
    output [H, T, dv], its delta [H, T, dv] and the final state. q, k, v: [H, T, d]; g, beta: [H, T]."""
    q, k, v, g, beta, state = (x.double() for x in (q, k, v, g, beta, state))
    state = state.clone()
    outputs, deltas = torch.empty_like(v), torch.empty_like(v)
    for t in range(q.shape[1]):
        state *= g[:, t].exp()[:, None, None]
        deltas[:, t] = beta[:, t, None] * (v[:, t] - torch.einsum("hkv,hk->hv", state, k[:, t]))
        state += torch.einsum("hk,hv->hkv", k[:, t], deltas[:, t])
        outputs[:, t] = torch.einsum("hkv,hk->hv", state, q[:, t])
    return outputs, deltas, state


def chunk_inputs(num_chunks: int, chunk: int, padding: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Inputs [n, H, C, ...] of n chunks; the last `padding` positions of the last chunk are padding (all zero)."""
    q, k, v, g, beta = (
        x.reshape(num_chunks, chunk, *x.shape[1:]).transpose(1, 2).contiguous()
        for x in delta_rule_inputs((num_chunks * chunk,), seed=seed)
    )
    for x in (q, k, v, g, beta):
        x[-1, :, chunk - padding :] = 0
    return q, k, v, g, beta


def check_intra_chunk(intra_chunk: Callable) -> None:
    """intra_chunk's terms against what they stand for, for 3 chunks of 16 and of 32 tokens (the last one padded):
    u = the deltas of a chunk that starts from a zero state, u - w S0 = its deltas from a random state S0 (token
    by token in float64), and the decayed scores, queries, keys and chunk decay from their formulas."""
    problems = []
    for chunk in (16, 32):
        q, k, v, g, beta = chunk_inputs(3, chunk, padding=chunk // 4, seed=chunk)
        terms = intra_chunk(q, k, v, g, beta)
        label = f"chunks of {chunk}"
        shapes = {"u": v.shape, "w": k.shape, "attn": (*g.shape, chunk), "q_decayed": q.shape,
                  "k_decayed": k.shape, "chunk_decay": g.shape[:2]}  # fmt: skip
        wrong = [
            problem
            for name, shape in shapes.items()
            for problem in shape_problems(f"{label}: {name}", getattr(terms, name), shape)
        ]
        if wrong:
            problems += wrong
            continue
        s0 = randn(3, HEADS, DK, DV, seed=5)
        # Within a chunk, each token's delta depends on every earlier token's (a triangular solve over the chunk).
        allowed = delta_rule_tolerance(chunk)
        for i in range(3):
            where = f"{label}, chunk {i}"
            _, zero_deltas, _ = naive_delta_rule(q[i], k[i], v[i], g[i], beta[i], torch.zeros(HEADS, DK, DV))
            _, deltas, _ = naive_delta_rule(q[i], k[i], v[i], g[i], beta[i], s0[i])
            problems += compare(f"{where}: u (the deltas from a zero state)", terms.u[i], zero_deltas, allowed)
            from_s0 = terms.u[i] - terms.w[i] @ s0[i]
            problems += compare(f"{where}: u - w @ S0 (the deltas from state S0)", from_s0, deltas, allowed)
        # The decay factors from their definitions, in float64: G_i = g_0 + ... + g_i.
        G = g.double().cumsum(-1)
        causal = torch.ones(chunk, chunk, dtype=torch.bool).tril()
        decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
        expected = {
            "attn": (q.double() @ k.double().transpose(-1, -2)) * decay,
            "q_decayed": q.double() * G.exp()[..., None],
            "k_decayed": k.double() * (G[..., -1:] - G).exp()[..., None],
            "chunk_decay": G[..., -1].exp(),
        }
        for name, value in expected.items():
            problems += compare(f"{label}: {name}", getattr(terms, name), value, allowed)
    conclude(problems, "the within-chunk terms (u, w, attn, decays) are what the chunked form needs")


def check_chunked(chunked: Callable) -> None:
    """chunk_gated_delta_rule against transformers' recurrence: 12 lengths from 1 to 300, chunk sizes 16, 32 and 64,
    from a zero and from a random initial state; then a varlen batch of 5 sequences, each against itself alone."""
    problems = []
    for length in CHUNKED_LENGTHS:
        q, k, v, g, beta = delta_rule_inputs((length,), seed=length)
        for initial in ("zero", "random"):
            state = torch.zeros(1, HEADS, DK, DV) if initial == "zero" else randn(1, HEADS, DK, DV, seed=length)
            expected_o, expected_final = transformers_recurrence(q[None], k[None], v[None], g[None], beta[None], state)
            for chunk in CHUNK_SIZES:
                label = f"length {length}, chunk size {chunk}, {initial} initial state"
                o, final = chunked(q, k, v, g, beta, torch.tensor([0, length]), state.clone(), chunk_size=chunk)
                problems += compare(f"{label}: outputs", o, expected_o[0], delta_rule_tolerance(length))
                problems += compare(f"{label}: final state", final, expected_final, delta_rule_tolerance(length))
    problems += _varlen_problems(chunked)
    conclude(problems, f"the chunked form equals the recurrence for {len(CHUNKED_LENGTHS)} lengths, 3 chunk sizes and "
             "a varlen batch")  # fmt: skip


def _varlen_problems(chunked: Callable) -> list[str]:
    q, k, v, g, beta = delta_rule_inputs((sum(VARLEN_SEQ_LENS),), seed=7)
    states = randn(len(VARLEN_SEQ_LENS), HEADS, DK, DV, seed=8)
    original = states.clone()
    cu_seqlens = torch.tensor([0, *VARLEN_SEQ_LENS]).cumsum(0)
    bounds = list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()))
    # Each sequence alone through transformers' recurrence.
    expected = [
        transformers_recurrence(*(x[None, start:end] for x in (q, k, v, g, beta)), states[i : i + 1])
        for i, (start, end) in enumerate(bounds)
    ]
    problems = []
    for chunk in CHUNK_SIZES:
        o, final = chunked(q, k, v, g, beta, cu_seqlens, states, chunk_size=chunk)
        for i, ((start, end), (expected_o, expected_final)) in enumerate(zip(bounds, expected)):
            label = f"varlen batch {VARLEN_SEQ_LENS}, chunk size {chunk}, sequence {i}"
            allowed = delta_rule_tolerance(end - start)
            problems += compare(f"{label}: outputs", o[start:end], expected_o[0], allowed)
            problems += compare(f"{label}: final state", final[i : i + 1], expected_final, allowed)
        if not torch.equal(states, original):  # untouched: equal, bit for bit
            problems.append("initial_state was modified (work on a copy)")
            break
    return problems


# ----------------------------------------------------------------------------------------------- the gated norm


def check_gated_norm(norm_class: type) -> None:
    """GatedRMSNorm(dv, eps)(x, z) against transformers' Qwen3_5RMSNormGated, random weights, two dtypes."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    problems = []
    likely = None
    for dv in (8, 24):
        for name, dtype in DTYPES.items():
            reference = Qwen3_5RMSNormGated(dv, eps=1e-6)
            with torch.no_grad():
                reference.weight.copy_(1 + 0.5 * randn(dv, seed=dv))
            ours = norm_class(dv, 1e-6)
            ours.load_state_dict(reference.state_dict())
            reference.to(dtype)
            ours.to(dtype)
            x = 3 * randn(5, 3, dv, seed=1, dtype=dtype)
            z = randn(5, 3, dv, seed=2, dtype=dtype)
            # A sum over dv; rounded after the norm and after the gate.
            allowed = tolerance(dtype, dv, roundings=2)
            with torch.no_grad():
                output = ours(x, z)
                found = compare_dtype(f"dv {dv}, {name}", output, reference(x, z), allowed, elementwise=True)
                # The usual mistake: gating first, then normalising (what some gated norms elsewhere do).
                gated_first = rms_normalised((x.float() * F.silu(z.float())).to(dtype), 1e-6)
                if found and not compare("", output, reference.weight.float() * gated_first, allowed):
                    likely = "the output equals norm(x · silu(z)): the gate comes after the norm, norm(x) · silu(z)"
                problems += found
    conclude(problems, "the gated RMSNorm matches transformers' Qwen3_5RMSNormGated in float32 and bfloat16", likely)



# ------------------------------------------------------------------------------------------------------ the layer


def gdn_text_config(shape: tuple[int, int, int, int, int]):
    """transformers' text config with one GDN layer of this shape."""
    from transformers import Qwen3_5TextConfig

    key_heads, value_heads, dk, dv, kernel = shape
    return Qwen3_5TextConfig(
        vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
        linear_key_head_dim=dk, linear_value_head_dim=dv, linear_conv_kernel_dim=kernel,
        layer_types=[LINEAR_ATTENTION],
    )  # fmt: skip


class LayerPair:
    """transformers' Qwen3_5GatedDeltaNet with random weights (one DynamicCache per request) and a4's layer with the
    same weights, whose requests keep their states in rows of a4's state tensors (NUM_SLOTS rows)."""

    def __init__(self, layer_class: type, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        self.text_config = gdn_text_config(shape)
        config = a4_config(self.text_config)
        self.config = config
        torch.manual_seed(0)
        self.reference = Qwen3_5GatedDeltaNet(self.text_config, layer_idx=0)
        with torch.no_grad():  # weights transformers initialises to constants: randomise them too
            self.reference.dt_bias.copy_(randn(config.linear_num_value_heads, seed=1))
            self.reference.norm.weight.copy_(1 + 0.3 * randn(config.linear_value_head_dim, seed=2))
        self.ours = layer_class(config)
        self.ours.load_state_dict(self.reference.state_dict())  # the checkpoint's parameter names
        self.reference.to(dtype)
        self.ours.to(dtype)
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.states = ZeroStates(config, NUM_SLOTS, dtype)
        self.conv_state, self.recurrent_state = self.states.conv_state(0), self.states.recurrent_state(0)
        self.table = SlotTable(NUM_SLOTS * 256)
        self.caches: dict[int, Any] = {}

    def step(self, new_tokens: dict[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random hidden states for new_tokens[slot] tokens of each slot: (a4's output, transformers' output)."""
        from transformers import DynamicCache

        hiddens = [randn(n, self.hidden_size, seed=seed + slot, dtype=self.dtype) for slot, n in new_tokens.items()]
        # As the engine does when it gives a request its slot: a request that starts here starts from zeros.
        self.states.clear([slot for slot in new_tokens if self.table.lens[slot] == 0])
        # A GDN layer never touches the KV pool; its states are the pool's GDN layer 0.
        fb = self.table.step(new_tokens, kv_pool=None, state_pool=self.states)
        expected = []
        with torch.no_grad():
            ours = self.ours(torch.cat(hiddens), fb, 0)
            for slot, prefix_len, hidden in zip(new_tokens, fb.prefix_lens, hiddens):
                if prefix_len == 0:
                    self.caches[slot] = DynamicCache(config=self.text_config)
                expected.append(self.reference(hidden[None], cache=self.caches[slot])[0])
        return ours, torch.cat(expected)

    def output_tolerance(self) -> float:
        """For the layer's outputs and states: the sums over the longest context so far."""
        context = max(self.table.lens)
        return tolerance(self.dtype, gdn_reduction_length(self.config, context), roundings=GDN_ROUNDINGS)

    def step_problems(self, what: str, new_tokens: dict[int, int], seed: int) -> list[str]:
        """One `step`: a4's outputs against transformers'."""
        return compare_dtype(what, *self.step(new_tokens, seed), self.output_tolerance())

    def state_problems(self, label: str) -> list[str]:
        """a4's state rows of every request against transformers' cache of that request."""
        problems = []
        for slot, cache in self.caches.items():
            layer = cache.layers[0]
            # transformers keeps the last K conv inputs, a4 the last K-1: compare the overlap. The conv state holds
            # in_proj's outputs; the recurrent state (float32) sums bfloat16-rounded inputs over the context.
            conv, recurrent = layer.conv_states[0][0, :, 1:], layer.recurrent_states[0][0]
            conv_tolerance = tolerance(self.dtype, self.config.hidden_size)
            problems += compare_dtype(f"{label}, slot {slot}, conv state", self.conv_state[slot], conv, conv_tolerance)
            problems += compare_dtype(
                f"{label}, slot {slot}, recurrent state", self.recurrent_state[slot], recurrent, self.output_tolerance()
            )
        return problems


# The layer scenario: three requests prefilled together (one of a single token, one spanning several chunks), the
# long one continued by a second prefill chunk; then three decode steps of all three. Slot 2, which no request uses,
# holds NaN states that nothing may read or write.
FIRST_PREFILL = {3: 70, 0: 1, 1: 129}
SECOND_CHUNK = {1: 37}
DECODE_STEPS = 3


def run_layer_scenario(layer_class: type, shape_name: str, dtype: torch.dtype) -> dict[str, list[str]]:
    """The layer scenario for one shape and dtype: problems of each part ("prefill", "decode", "states"), and
    "likely": the probable cause of any of them, when a cheap test of a usual mistake finds one."""
    pair = LayerPair(layer_class, SHAPES[shape_name], dtype)
    pair.conv_state[2], pair.recurrent_state[2] = float("nan"), float("nan")
    label = f"{shape_name}, {dtype_name(dtype)}"
    problems = {"prefill": [], "decode": [], "states": [], "likely": []}
    lengths = ", ".join(map(str, FIRST_PREFILL.values()))
    first_label = f"{label}, prefill of requests of {lengths} tokens"
    ours, expected = pair.step(FIRST_PREFILL, seed=1)
    problems["prefill"] += compare_dtype(first_label, ours, expected, pair.output_tolerance())
    # The only NaN in sight is in slot 2's rows, which belong to no request of the step.
    if ours.isnan().any():
        problems["likely"].append(
            "NaN in the output: the only NaN states are in a slot no request of the step uses; does the layer pass "
            "its own pool layer and the step's ForwardBatch to the backend (fb.attn_backend.conv / delta_rule)?"
        )
    problems["states"] += pair.state_problems(f"{label}, after the prefill")
    second_label = f"{label}, second prefill chunk of {SECOND_CHUNK[1]} tokens"
    problems["prefill"] += pair.step_problems(second_label, SECOND_CHUNK, seed=2)
    for i in range(DECODE_STEPS):
        decode = {slot: 1 for slot in FIRST_PREFILL}
        problems["decode"] += pair.step_problems(f"{label}, decode step {i + 1} of 3 requests", decode, seed=10 * i)
    problems["states"] += pair.state_problems(f"{label}, after {DECODE_STEPS} decode steps")
    return problems


def _layer_check(layer_class: type, part: str, success: str) -> None:
    problems, likely = [], []
    for shape_name in SHAPES:
        for dtype in DTYPES.values():
            scenario = run_layer_scenario(layer_class, shape_name, dtype)
            problems += scenario[part]
            likely += scenario["likely"]
    conclude(problems, success, likely[0] if likely else None)


def check_layer_prefill(layer_class: type) -> None:
    """Prefill of a batch of three requests (two in reused slots) and a second chunk, against Qwen3_5GatedDeltaNet."""
    _layer_check(layer_class, "prefill", f"prefill outputs match transformers ({len(SHAPES)} shapes, 2 dtypes)")


def check_layer_decode(layer_class: type) -> None:
    """Three decode steps of the three requests after their prefill, against Qwen3_5GatedDeltaNet."""
    _layer_check(layer_class, "decode", f"decode outputs match transformers ({len(SHAPES)} shapes, 2 dtypes)")


def check_layer_states(layer_class: type) -> None:
    """The conv and recurrent states a4 keeps, after the prefill and after decoding, against transformers' cache."""
    _layer_check(layer_class, "states", "conv and recurrent states match transformers' cache after prefill and decode")


# ------------------------------------------------------------------------------------------------ the whole model


MODEL_PROMPT = [3, 141, 59, 265, 358, 979, 323, 846, 264, 338, 327, 950]
MODEL_DECODE_STEPS = 10


def check_model_logits() -> None:
    """a4's Qwen3.5 (your layers in a4's model) on the tiny checkpoint, float32: the logits of every prompt position
    and of ten greedy decode steps against transformers, and the greedy tokens against its `generate`."""
    from a4.models.registry import load_model
    from a4.reference import cached_hf_model, hf_greedy_with_logits

    checkpoint = tiny_checkpoint("qwen3_5")
    _, model, _ = load_model(checkpoint, dtype=torch.float32, device="cpu", progress=False)
    with torch.no_grad():
        expected_prefill = cached_hf_model(checkpoint, torch.float32)(torch.tensor([MODEL_PROMPT])).logits[0].float()
    expected_tokens, generated_logits = hf_greedy_with_logits(checkpoint, MODEL_PROMPT, MODEL_DECODE_STEPS + 1)
    expected_decode = generated_logits[1:]

    runner = ModelRunner(model)
    slot = 1
    prefill = runner.forward({slot: MODEL_PROMPT})[slot]
    tokens = [int(prefill[-1].argmax())]
    decode = []
    # transformers stops after an eos token; so does an engine.
    while len(tokens) < len(expected_tokens):
        decode.append(runner.forward({slot: tokens[-1:]})[slot][0])
        tokens.append(int(decode[-1].argmax()))
    # Logits differ by float32 roundings accumulated over every layer, and GDN's chunked vs step forms.
    allowed = tolerance(torch.float32, model_reduction_length(model.config, len(MODEL_PROMPT) + len(decode)))
    problems = compare(f"prefill logits ({len(MODEL_PROMPT)} positions)", prefill, expected_prefill, allowed)
    if decode:
        problems += compare(f"logits of {len(decode)} decode steps", torch.stack(decode), expected_decode, allowed)
    if tokens != expected_tokens:
        problems.append(f"greedy tokens {tokens}, transformers' generate: {expected_tokens}")
    conclude(problems, f"prefill and {len(decode)} decode steps: logits and greedy tokens match transformers")
