"""a4's Gated DeltaNet against transformers' Qwen3.5 code and a naive float64 recurrence.

The pieces (conv prefill/decode, the recurrence, the gated norm) against transformers' own functions and modules; the
chunked form against a token-by-token recurrence written here in float64, for lengths around the chunk boundaries,
every chunk size, with and without an initial state, one sequence or a varlen batch; the whole layer against
Qwen3_5GatedDeltaNet built from a small config with random weights, in prefill, in a second prefill chunk and in
decode, with transformers' cache as the reference for the states. Several shapes: key heads shared by several value
heads, dk != dv, conv kernels 2, 3 and 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, Qwen3_5Config, Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5GatedDeltaNet,
    Qwen3_5RMSNormGated,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

import a4.reference  # noqa: F401  (refuses to run where fla / causal-conv1d would change transformers' numerics)
from a4.core import ForwardBatch
from a4.layers.deltanet import (
    GatedDeltaNet,
    GatedRMSNorm,
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)
from a4.models.config import ModelConfig, parse_config
from layer_checks import RELATIVE_TOLERANCE, assert_close, assert_same_roundings, randn

DTYPES = [torch.float32, torch.bfloat16]

# (key heads, value heads, dk, dv, conv kernel): the first is the 0.8B layout in miniature.
SHAPES = {
    "equal heads, kernel 4": (2, 2, 16, 16, 4),
    "value heads 3x key heads, dk != dv, kernel 2": (2, 6, 16, 8, 2),
    "one key head, kernel 3": (1, 3, 8, 24, 3),
}
NUM_SLOTS = 4


# --- the causal conv -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [2, 4])
def test_conv_prefill_matches_transformers_for_each_sequence_of_a_batch(kernel, dtype):
    channels = 12
    weight = randn(channels, 1, kernel, seed=0, dtype=dtype)
    # With kernel 4 the first sequence is shorter than the state: its new state keeps part of the old one.
    seq_lens = [1, kernel - 1, 9]
    x = randn(sum(seq_lens), channels, seed=1, dtype=dtype)
    states = randn(len(seq_lens), channels, kernel - 1, seed=2, dtype=dtype)
    states[0] = 0  # a fresh sequence
    y, new_states = causal_conv1d_prefill(x, weight, states, seq_lens)
    assert y.dtype == dtype and new_states.shape == states.shape

    for i, x_i in enumerate(x.split(seq_lens)):
        # transformers' prefill conv starts from zeros; giving it the state as extra leading inputs and dropping
        # their outputs is the same as starting from the state.
        inputs = torch.cat([states[i], x_i.T], dim=1)[None]  # [1, D, K-1 + L]
        expected = causal_conv1d_fn(inputs, weight.squeeze(1), activation="silu")[0, :, kernel - 1 :].T
        y_i = y[sum(seq_lens[:i]) : sum(seq_lens[: i + 1])]
        assert_close(y_i, expected, RELATIVE_TOLERANCE[dtype])
        if dtype == torch.bfloat16:
            assert_same_roundings(y_i, expected)
        assert torch.equal(new_states[i], inputs[0, :, -(kernel - 1) :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_conv_decode_matches_transformers(kernel, dtype):
    channels, batch = 10, 3
    weight = randn(channels, 1, kernel, seed=0, dtype=dtype)
    x = randn(batch, channels, seed=1, dtype=dtype)
    # transformers keeps the last K inputs, a4 the last K-1: the oldest one is never read by a one-token step.
    hf_state = randn(batch, channels, kernel, seed=2, dtype=dtype)
    y, new_state = causal_conv1d_decode(x, weight, hf_state[:, :, 1:].clone())
    expected = causal_conv1d_update(x[:, :, None], hf_state, weight.squeeze(1), activation="silu")[:, :, 0]
    assert_close(y, expected, RELATIVE_TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        assert_same_roundings(y, expected)
    assert torch.equal(new_state, hf_state[:, :, 1:])


# --- the gated delta rule --------------------------------------------------------------------------------------------


def delta_rule_inputs(length: int, heads: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    """float32 q (l2-normalised, scaled), k (l2-normalised), v, g <= 0 and beta in (0, 1), as the layer makes them.

    The leading dims are [length, heads]. g spans weak and strong decay, and every 7th token forgets almost
    everything (g = -60): a chunk's cumulative decay then underflows to 0, which must not turn into inf or NaN.
    """
    q = F.normalize(randn(length, heads, dk, seed=seed), dim=-1) * dk**-0.5
    k = F.normalize(randn(length, heads, dk, seed=seed + 1), dim=-1)
    v = randn(length, heads, dv, seed=seed + 2)
    g = -F.softplus(2 * randn(length, heads, seed=seed + 3))
    g[3::7] = -60.0
    beta = torch.sigmoid(randn(length, heads, seed=seed + 4))
    return q, k, v, g, beta


def naive_delta_rule(q, k, v, g, beta, state):
    """The recurrence as the papers write it, token by token, in float64. Shapes as `delta_rule_inputs`."""
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    state = state.double().clone()  # [H, dk, dv]
    out = torch.empty(v.shape, dtype=torch.float64)
    for t in range(q.shape[0]):
        state *= g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", state, k[t]))
        state += torch.einsum("hk,hv->hkv", k[t], delta)
        out[t] = torch.einsum("hkv,hk->hv", state, q[t])
    return out, state


def test_recurrence_matches_transformers():
    batch, length, heads, dk, dv = 3, 7, 4, 16, 8
    per_seq = [delta_rule_inputs(length, heads, dk, dv, seed=10 * i) for i in range(batch)]
    q, k, v, g, beta = (torch.stack(xs) for xs in zip(*per_seq))  # [B, T, H, ...]
    state = randn(batch, heads, dk, dv, seed=99)
    o, final = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    # transformers scales q by dk^-0.5 itself.
    expected_o, expected_final = torch_recurrent_gated_delta_rule(
        q * dk**0.5, k, v, g, beta, initial_state=state.clone(), output_final_state=True
    )
    assert_close(o, expected_o, 1e-5)
    assert_close(final, expected_final, 1e-5, "final state")
    assert torch.equal(state, randn(batch, heads, dk, dv, seed=99)), "initial_state was modified"


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_chunked_equals_recurrence(chunk_size, with_initial_state):
    heads, dk, dv = 2, 16, 8
    c = chunk_size
    for length in sorted({1, c - 1, c, c + 1, 2 * c + 1, 300}):
        q, k, v, g, beta = delta_rule_inputs(length, heads, dk, dv, seed=length)
        state = randn(1, heads, dk, dv, seed=length) if with_initial_state else torch.zeros(1, heads, dk, dv)
        o, final = chunk_gated_delta_rule(q, k, v, g, beta, torch.tensor([0, length]), state, chunk_size=c)
        expected_o, expected_final = naive_delta_rule(q, k, v, g, beta, state[0])
        assert_close(o, expected_o, 1e-5, f"output, length {length}")
        assert_close(final[0], expected_final, 1e-5, f"final state, length {length}")


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_varlen_batch_equals_each_sequence_alone(chunk_size):
    heads, dk, dv = 3, 8, 16
    seq_lens = [5, 64, 1, 130, 17]
    q, k, v, g, beta = delta_rule_inputs(sum(seq_lens), heads, dk, dv, seed=7)
    states = randn(len(seq_lens), heads, dk, dv, seed=8)
    cu_seqlens = torch.tensor([0, *seq_lens]).cumsum(0)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, states, chunk_size=chunk_size)
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        seq = (x[start:end] for x in (q, k, v, g, beta))
        expected_o, expected_final = naive_delta_rule(*seq, states[i])
        assert_close(o[start:end], expected_o, 1e-5, f"output of sequence {i}")
        assert_close(final[i], expected_final, 1e-5, f"final state of sequence {i}")


# --- the gated norm --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_norm_matches_transformers(dtype):
    dv = 24
    reference = Qwen3_5RMSNormGated(dv, eps=1e-6)
    ours = GatedRMSNorm(dv, eps=1e-6)
    with torch.no_grad():
        reference.weight.copy_(1 + 0.5 * randn(dv, seed=0))
    ours.load_state_dict(reference.state_dict())
    reference.to(dtype)
    ours.to(dtype)
    x = 3 * randn(5, 4, dv, seed=1, dtype=dtype)
    z = randn(5, 4, dv, seed=2, dtype=dtype)
    out = ours(x, z)
    assert out.dtype == dtype
    assert_close(out, reference(x, z), RELATIVE_TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        assert_same_roundings(out, reference(x, z))


# --- the layer -------------------------------------------------------------------------------------------------------


def layer_configs(shape: tuple[int, int, int, int, int]) -> tuple[Qwen3_5TextConfig, ModelConfig]:
    """transformers' text config with one GDN layer of this shape, and a4's ModelConfig of the same file."""
    key_heads, value_heads, dk, dv, kernel = shape
    text = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=kernel,
        layer_types=["linear_attention"],
    )
    config_json = Qwen3_5Config(text_config=text.to_dict(), architectures=["Qwen3_5ForConditionalGeneration"])
    return text, parse_config(config_json.to_dict())


class LayerPair:
    """transformers' Qwen3_5GatedDeltaNet with random weights, a4's GatedDeltaNet with the same weights, and a4's
    state tensors (NUM_SLOTS rows) next to one transformers cache per request."""

    def __init__(self, shape: tuple[int, int, int, int, int], dtype: torch.dtype) -> None:
        self.text_config, config = layer_configs(shape)
        torch.manual_seed(0)
        self.reference = Qwen3_5GatedDeltaNet(self.text_config, layer_idx=0)
        with torch.no_grad():  # weights transformers initialises to constants: randomise them too
            self.reference.dt_bias.copy_(randn(config.linear_num_value_heads, seed=1))
            self.reference.norm.weight.copy_(1 + 0.3 * randn(config.linear_value_head_dim, seed=2))
        self.ours = GatedDeltaNet(config)
        # Same parameter names as the checkpoint (strict load).
        self.ours.load_state_dict(self.reference.state_dict())
        self.reference.to(dtype)
        self.ours.to(dtype)
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.conv_state = torch.zeros(NUM_SLOTS, config.conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype)
        self.recurrent_state = torch.zeros(
            NUM_SLOTS,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            dtype=torch.float32,
        )
        self.caches: dict[int, DynamicCache] = {}  # slot -> transformers' cache of the request there
        self.lengths: dict[int, int] = {}

    def hidden(self, n: int, seed: int) -> torch.Tensor:
        return randn(n, self.hidden_size, seed=seed, dtype=self.dtype)

    def step(self, slots: list[int], hiddens: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward of a4 over the flattened batch, and transformers once per request; (ours, reference)."""
        extend_lens = [h.shape[0] for h in hiddens]
        prefix_lens = [self.lengths.get(slot, 0) for slot in slots]
        fb = ForwardBatch(
            phase="decode" if all(n == 1 for n in extend_lens) and all(prefix_lens) else "prefill",
            input_ids=torch.zeros(sum(extend_lens), dtype=torch.long),
            positions=torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)]),
            req_slots=torch.tensor(slots),
            extend_lens=extend_lens,
            prefix_lens=prefix_lens,
            out_cache_loc=torch.zeros(sum(extend_lens), dtype=torch.long),
            sample_indices=torch.tensor([], dtype=torch.long),
            req_to_token=torch.zeros(NUM_SLOTS, 1, dtype=torch.long),
            kv_pool=None,  # a GDN layer never touches the KV pool
        )
        with torch.no_grad():
            ours = self.ours(torch.cat(hiddens), fb, self.conv_state, self.recurrent_state)
            expected = []
            for slot, hidden in zip(slots, hiddens):
                if self.lengths.get(slot, 0) == 0:
                    self.caches[slot] = DynamicCache(config=self.text_config)
                expected.append(self.reference(hidden[None], cache=self.caches[slot])[0])
                self.lengths[slot] = self.lengths.get(slot, 0) + hidden.shape[0]
        return ours, torch.cat(expected)

    def release(self, slot: int) -> None:
        """The request in `slot` finishes: the next one there is new, but a4's state rows keep what they hold."""
        del self.lengths[slot], self.caches[slot]

    def assert_states_match(self, slot: int) -> None:
        """a4's state rows of `slot` against transformers' cache of the request there."""
        layer = self.caches[slot].layers[0]
        # transformers keeps the last K conv inputs, a4 the last K-1: compare the overlap.
        tolerance = RELATIVE_TOLERANCE[self.dtype]
        assert_close(self.conv_state[slot], layer.conv_states[0][0, :, 1:], tolerance, "conv state")
        assert_close(self.recurrent_state[slot], layer.recurrent_states[0][0], tolerance, "recurrent state")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_layer_prefill_second_chunk_and_decode_match_transformers(shape, dtype):
    pair = LayerPair(shape, dtype)
    tolerance = RELATIVE_TOLERANCE[dtype]
    slot = 2
    assert_close(*pair.step([slot], [pair.hidden(150, seed=1)]), tolerance, "prefill")
    pair.assert_states_match(slot)
    # A second prefill chunk continues from the states the first one left (chunked prefill).
    assert_close(*pair.step([slot], [pair.hidden(37, seed=2)]), tolerance, "second prefill chunk")
    for i in range(4):
        assert_close(*pair.step([slot], [pair.hidden(1, seed=10 + i)]), tolerance, f"decode step {i}")
    pair.assert_states_match(slot)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_varlen_batch_equals_each_request_alone(dtype):
    pair = LayerPair(SHAPES["value heads 3x key heads, dk != dv, kernel 2"], dtype)
    tolerance = RELATIVE_TOLERANCE[dtype]
    slots = [3, 0, 1]
    # Transformers runs each request alone; a4 runs them as one flattened batch, in prefill then in decode.
    assert_close(*pair.step(slots, [pair.hidden(n, seed=n) for n in (70, 1, 129)]), tolerance, "batched prefill")
    for i in range(3):
        hiddens = [pair.hidden(1, seed=100 * i + j) for j in range(len(slots))]
        assert_close(*pair.step(slots, hiddens), tolerance, f"batched decode step {i}")
    for slot in slots:
        pair.assert_states_match(slot)


def test_layer_fresh_request_ignores_what_its_slot_holds():
    pair = LayerPair(SHAPES["equal heads, kernel 4"], torch.float32)
    tolerance = RELATIVE_TOLERANCE[torch.float32]
    pair.step([0, 1], [pair.hidden(30, seed=1), pair.hidden(9, seed=2)])
    pair.step([0, 1], [pair.hidden(1, seed=3), pair.hidden(1, seed=4)])
    # The request in slot 1 finishes; its states stay in the slot, as in a real state pool. Slot 2 holds garbage:
    # NaN leaks through any arithmetic that merely scales the old state by 0.
    pair.release(1)
    pair.conv_state[2] = float("nan")
    pair.recurrent_state[2] = float("nan")
    # One prefill batch: request 0 continues (prefix 31), two new requests start in the used slots.
    ours, expected = pair.step([0, 1, 2], [pair.hidden(5, seed=5), pair.hidden(20, seed=6), pair.hidden(1, seed=7)])
    assert_close(ours, expected, tolerance)
    for slot in (0, 1, 2):
        pair.assert_states_match(slot)
