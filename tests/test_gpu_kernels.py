"""a4's GPU kernels (`a4.kernels`) against naive torch written here: loops over rows, heads and tokens.

- `conv_update_by_slot_` and `gated_delta_rule_update_by_slot_`: two decode steps in a row, float32 and bfloat16, at
  Qwen3.5-0.8B's and the tiny preset's GDN shapes, padded rows sharing one dummy slot; the rows of the pool that no
  request names stay bit-for-bit untouched;
- `paged_decode_attention`: lengths from 1 to past several splits, page sizes 1 and 16 (locations scattered through
  the pool, read through req_to_token), GQA, head_dim 256 / 128 / 32, a padded row;
- `conv_verify_by_slot_` and `gated_delta_rule_verify_by_slot_` (a verify pass's L tokens per request in one
  launch): bit for bit the decode kernels run token after token, the slot's own rows untouched, and against notebook
  11's `causal_conv1d_verify` / `gated_delta_rule_verify`;
- the three captured in one CUDA graph and replayed with other slots and lengths in the same buffers;
- the fused norms (`rmsnorm`): the zero-centred and the gated RMSNorm against the torch modules they replace, on
  contiguous rows and on strided heads; the residual add and the norm in one launch (`add_and_norm`) against the
  torch add and the module;
- q/k norm + partial RoPE + KV write (`rope`): the students' norm and `apply_partial_rope` on strided query heads and
  a merged key/value product, the pool's rows written and no other; `use_fused_attention`'s forward against the
  students' GatedAttention.forward, prefill then decode, outputs and pools;
- SwiGLU's activation and attention's output gate (`activation`): silu(gate) * up against torch's, on the two halves
  of one merged product, and a GatedMLP routed through it against the torch module; x * sigmoid(gate) on the gate
  halves of query heads;
- the small-batch linear layer (`gemv`): 1 to 4 rows of 0.8B-shaped and odd-sized projections against a float64 matmul,
  strided rows, and `use_gemv`'s routing (more rows, or lm_head's width, stay with F.linear);
- programmatic dependent launch (`pdl`): which grids launch with it;
- the greedy sampler's argmax and finiteness in one read (`greedy`): torch's argmax (ties, rows over many
  pieces) and `aminmax`'s verdict on NaN, infinite and large finite rows;
- the router and routed experts of a mixture of experts (`moe`): against the students' `route` and FusedExperts
  (notebook 09) at the tiny preset's, a wider and (on a GPU) 35B-A3B's shapes, one to 200 tokens, routing skewed
  onto few experts, and the whole block; captured in a CUDA graph and replayed with new routing;
- the fla prefill (where flash-linear-attention is importable): varlen batch, nonzero initial states from the pool,
  final states written back, against the token-by-token recurrence.

Skipped where CUDA is absent. For development without a GPU, A4_TRITON_INTERPRET=1 runs them on the CPU under
Triton's interpreter (Triton importable, e.g. PYTHONPATH=$PWD:/path/to/triton): slow, and without the fla tests.
"""

import copy
import math
import os

import pytest
import torch
import torch.nn.functional as F

from a4.checkpoints import preset_config

INTERPRET = os.environ.get("A4_TRITON_INTERPRET") == "1"
if INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernel modules are imported
DEVICE = "cpu" if INTERPRET else "cuda" if torch.cuda.is_available() else None
if DEVICE is None:
    pytest.skip("CUDA is absent (A4_TRITON_INTERPRET=1: Triton's CPU interpreter)", allow_module_level=True)
if INTERPRET:
    # Development-only shims for two gaps of Triton 3.6's interpreter (never active on a GPU): it turns a loop bound
    # read from memory into an int with int(array of shape [1]), which NumPy 2 refuses; and its tl.dot multiplies
    # bfloat16 operands as the uint16 words it stores them in.
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interpreter

    _patch_lang_tensor = interpreter._patch_lang_tensor
    _create_dot = interpreter.InterpreterBuilder.create_dot

    def _patch_with_index(tensor, scope):
        _patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def _create_dot_bf16(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a, b = (
                interpreter.TensorHandle(
                    interpreter._convert_float(x.data, tl.bfloat16, tl.float32, None).view(np.float32), tl.float32
                )
                for x in (a, b)
            )
        return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = _patch_with_index
    interpreter.InterpreterBuilder.create_dot = _create_dot_bf16

from a4.kernels.fla_prefill import (  # noqa: E402 - only where the kernels can run
    causal_conv1d_prefill as fla_conv1d_prefill,
    chunk_gated_delta_rule as fla_chunk_gated_delta_rule,
    fla_available,
)
from a4.kernels.gdn_decode import (  # noqa: E402
    conv_update_by_slot_,
    conv_verify_by_slot_,
    gated_delta_rule_update_by_slot_,
    gated_delta_rule_verify_by_slot_,
)
from a4.kernels.paged_attention import paged_decode_attention  # noqa: E402
from a4.kernels.extend_attention import extend_attention  # noqa: E402
from a4.kernels.activation import sigmoid_and_mul, silu_and_mul  # noqa: E402
from a4.kernels import greedy  # noqa: E402
from a4.kernels.gemv import MAX_ROWS, TILE, TILES, gemv, linear  # noqa: E402
from a4.kernels.rope import qk_norm_rope  # noqa: E402
from a4.layers.fused import (  # noqa: E402
    use_fused_activation, use_fused_attention, use_fused_experts, use_fused_norms, use_gemv,
)

DTYPES = [torch.float32, torch.bfloat16]
NUM_SLOTS = 7
DUMMY_SLOT = NUM_SLOTS - 1  # no request's slot: padded rows of a graph batch write here


def text_config(arch: str, preset: str) -> dict:
    config = preset_config(arch, preset)
    return config.get("text_config", config)


def gdn_shapes(preset: str) -> dict:
    t = text_config("qwen3_5", preset)
    hk, hv, dk, dv = (t[f"linear_{n}"] for n in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim"))
    return dict(hk=hk, hv=hv, dk=dk, dv=dv, kernel=t["linear_conv_kernel_dim"], conv_dim=2 * hk * dk + hv * dv)


def rule_tolerance(dtype: torch.dtype) -> dict:
    # The recurrence is float32 throughout on the same inputs; its one rounding to bfloat16 (beta, as the layer
    # takes the sigmoid in b's dtype) is exact on a GPU. Triton's interpreter truncates float32 -> bfloat16 instead
    # of rounding to nearest, so under it beta may be one ulp off.
    return dict(atol=5e-3, rtol=2e-2) if INTERPRET and dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-4)


def conv_tolerance(dtype: torch.dtype) -> dict:
    # The conv is rounded to the model dtype before silu and after: sums in another order may land one bfloat16 ulp
    # apart at either rounding.
    return dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


def randn(*shape, dtype=torch.float32, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen(seed), device=DEVICE) * scale).to(dtype)


# ------------------------------------------------------------------------------------------------ naive references


def naive_conv_update(x, weight, conv_state, slots):
    """Returns (y, new conv_state) for rows one by one, the window in float32 and the conv rounded to x's dtype."""
    y, state = torch.empty_like(x), conv_state.clone()
    taps = weight[:, 0].float()
    for row, slot in enumerate(slots.tolist()):
        window = torch.cat([conv_state[slot].float(), x[row].float()[:, None]], dim=1)  # [D, K]
        conv = (window * taps).sum(dim=1).to(x.dtype)
        y[row] = F.silu(conv.float()).to(x.dtype)
        state[slot] = window[:, 1:].to(state.dtype)
    return y, state


def naive_gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, slots):
    """Returns (o float32, new state), row by row, all value heads of a row at once."""
    _, hk, dk = k.shape
    _, hv, dv = v.shape
    key_head = torch.arange(hv, device=v.device) // (hv // hk)  # value head h reads key head h // (Hv / Hk)
    o, new_state = torch.empty(v.shape, dtype=torch.float32, device=v.device), state.clone()

    def l2norm(x):
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    for row, slot in enumerate(slots.tolist()):
        q_h, k_h = l2norm(q[row, key_head]) * dk**-0.5, l2norm(k[row, key_head])  # [Hv, dk]
        beta = torch.sigmoid(b[row]).float()  # in b's dtype, as the layer
        g = -A_log.float().exp() * F.softplus(a[row].float() + dt_bias.float())
        s = state[slot] * g.exp()[:, None, None]  # [Hv, dk, dv]
        delta = beta[:, None] * (v[row].float() - torch.einsum("hkv,hk->hv", s, k_h))
        s = s + k_h[:, :, None] * delta[:, None, :]
        o[row] = torch.einsum("hkv,hk->hv", s, q_h)
        new_state[slot] = s
    return o, new_state


def naive_paged_attention(q, k_buf, v_buf, req_to_token, slots, seq_lens, scale):
    """Gather each row's keys by location and run a float32 softmax per query head."""
    batch, num_heads, _ = q.shape
    group = num_heads // k_buf.shape[1]
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for row in range(batch):
        locations = req_to_token[slots[row], : seq_lens[row]]
        keys, values = k_buf[locations].float(), v_buf[locations].float()
        for h in range(num_heads):
            p = torch.softmax(keys[:, h // group] @ q[row, h].float() * scale, dim=0)
            o[row, h] = p @ values[:, h // group]
    return o


def naive_gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, initial, cu_seqlens):
    """The decode reference run token by token over each sequence of a varlen batch: (o float32, final states)."""
    o, final = torch.empty(v.shape, dtype=torch.float32, device=v.device), initial.clone()
    bounds = cu_seqlens.tolist()
    for seq, (start, end) in enumerate(zip(bounds, bounds[1:])):
        for t in range(start, end):
            one = slice(t, t + 1)
            o[one], final[seq : seq + 1] = naive_gated_delta_rule_update(
                q[one], k[one], v[one], a[one], b[one], A_log, dt_bias, final[seq : seq + 1], torch.tensor([0])
            )
    return o, final


def naive_conv_prefill(x, weight, initial, cu_seqlens):
    """Per sequence: window = its stored inputs then its tokens; y_t = silu(sum_j w_j window[t + j])."""
    kernel = weight.shape[-1]
    y, final = torch.empty_like(x), initial.clone()
    bounds = cu_seqlens.tolist()
    for seq, (start, end) in enumerate(zip(bounds, bounds[1:])):
        window = torch.cat([initial[seq].float(), x[start:end].T.float()], dim=1)  # [D, K-1 + L]
        length = end - start
        conv = sum(weight[:, 0, j, None].float() * window[:, j : j + length] for j in range(kernel))
        y[start:end] = F.silu(conv.to(x.dtype).float()).T.to(x.dtype)
        final[seq] = window[:, -(kernel - 1) :].to(final.dtype)
    return y, final


# -------------------------------------------------------------------------------------------- GDN decode kernels


def gdn_decode_inputs(shapes: dict, dtype: torch.dtype, batch: int, seed: int) -> dict:
    hk, hv, dk, dv = shapes["hk"], shapes["hv"], shapes["dk"], shapes["dv"]
    return dict(
        q=randn(batch, hk, dk, dtype=dtype, seed=seed),
        k=randn(batch, hk, dk, dtype=dtype, seed=seed + 1),
        v=randn(batch, hv, dv, dtype=dtype, seed=seed + 2),
        a=randn(batch, hv, dtype=dtype, seed=seed + 3),
        b=randn(batch, hv, dtype=dtype, seed=seed + 4),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", ["0.8b", "tiny"])
def test_gdn_decode_kernels_match_naive_over_two_steps(preset, dtype):
    shapes = gdn_shapes(preset)
    hv, dk, dv, kernel, dim = shapes["hv"], shapes["dk"], shapes["dv"], shapes["kernel"], shapes["conv_dim"]
    slots = torch.tensor([4, 1, 3, DUMMY_SLOT, DUMMY_SLOT], device=DEVICE)  # two padded rows, one dummy slot
    real = slice(0, 3)
    weight = randn(dim, 1, kernel, dtype=dtype, seed=10, scale=kernel**-0.5)
    A_log = torch.empty(hv, device=DEVICE).uniform_(0.05, 0.8, generator=gen(11)).log().to(dtype)
    dt_bias = torch.empty(hv, device=DEVICE).uniform_(-1.5, 0.5, generator=gen(12)).to(dtype)
    conv_state = randn(NUM_SLOTS, dim, kernel - 1, dtype=dtype, seed=13)
    state = randn(NUM_SLOTS, hv, dk, dv, seed=14, scale=0.1)
    conv_expected, state_expected = conv_state.clone(), state.clone()

    for step in range(2):
        x = randn(len(slots), dim, dtype=dtype, seed=20 + step)
        y = conv_update_by_slot_(x, weight, conv_state, slots)
        y_expected, conv_expected = naive_conv_update(x, weight, conv_expected, slots)
        torch.testing.assert_close(y[real], y_expected[real], **conv_tolerance(dtype))
        # The state update is a shift of stored values and x: exact.
        assert torch.equal(conv_state[:DUMMY_SLOT], conv_expected[:DUMMY_SLOT])

        inputs = gdn_decode_inputs(shapes, dtype, len(slots), seed=30 + 10 * step)
        # The engine's decode step asks for o in the model dtype; on a copy of the state, so that the float32 call
        # below starts from the same one.
        state_copy = state.clone()
        o_model_dtype = gated_delta_rule_update_by_slot_(
            **inputs, A_log=A_log, dt_bias=dt_bias, state=state_copy, slots=slots, out_dtype=dtype
        )
        o = gated_delta_rule_update_by_slot_(**inputs, A_log=A_log, dt_bias=dt_bias, state=state, slots=slots)
        o_expected, state_expected = naive_gated_delta_rule_update(
            **inputs, A_log=A_log, dt_bias=dt_bias, state=state_expected, slots=slots
        )
        assert o.dtype == torch.float32 and o.shape == (len(slots), hv, dv)
        torch.testing.assert_close(o[real], o_expected[real], **rule_tolerance(dtype))
        assert o_model_dtype.dtype == dtype
        torch.testing.assert_close(
            o_model_dtype[real].float(), o_expected[real].to(dtype).float(), **rule_tolerance(dtype)
        )
        torch.testing.assert_close(state[:DUMMY_SLOT], state_expected[:DUMMY_SLOT], **rule_tolerance(dtype))
    # Slots 0, 2 and 5 were in no batch: untouched, bit for bit (the naive copies never changed them).
    for untouched in (0, 2, 5):
        assert torch.equal(conv_state[untouched], conv_expected[untouched])
        assert torch.equal(state[untouched], state_expected[untouched])


def test_gdn_decode_reads_strided_views_of_the_conv_output():
    """q, k, v as the layer gets them: splits of one [B, conv_dim] row, not contiguous per tensor."""
    shapes = gdn_shapes("tiny")
    hk, hv, dk, dv = shapes["hk"], shapes["hv"], shapes["dk"], shapes["dv"]
    mixed = randn(3, shapes["conv_dim"], seed=40)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.unflatten(-1, (hk, dk)), k.unflatten(-1, (hk, dk)), v.unflatten(-1, (hv, dv))
    ab = randn(3, 2 * hv, seed=41)
    a, b = ab[:, :hv], ab[:, hv:]
    A_log, dt_bias = randn(hv, seed=42, scale=0.3), randn(hv, seed=43)
    state, slots = randn(NUM_SLOTS, hv, dk, dv, seed=44, scale=0.1), torch.tensor([2, 0, 5], device=DEVICE)
    o_expected, state_expected = naive_gated_delta_rule_update(q, k, v, a, b, A_log, dt_bias, state, slots)
    o = gated_delta_rule_update_by_slot_(q, k, v, a, b, A_log, dt_bias, state, slots)
    torch.testing.assert_close(o, o_expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state, state_expected, atol=1e-5, rtol=1e-4)


def test_gdn_decode_kernels_reject_mismatched_shapes():
    shapes = gdn_shapes("tiny")
    x = randn(2, shapes["conv_dim"], seed=50)
    with pytest.raises(ValueError, match="conv_state"):
        conv_update_by_slot_(x, randn(shapes["conv_dim"], 1, 4, seed=51), randn(3, 8, 3, seed=52), torch.zeros(2))
    inputs = gdn_decode_inputs(shapes, torch.float32, 2, seed=53)
    state = randn(3, shapes["hv"], shapes["dk"], shapes["dv"], dtype=torch.bfloat16, seed=54)
    params = randn(shapes["hv"], seed=55)
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_update_by_slot_(**inputs, A_log=params, dt_bias=params, state=state, slots=torch.zeros(2))


def gdn_verify_setup(shapes: dict, dtype: torch.dtype, length: int, seed: int):
    """A batch of three requests and two padded ones sharing the dummy slot, L tokens each, the layer's parameters,
    a random pool and zeroed verify buffers: (slots, x, inputs, params, conv_state, state, conv_verify,
    state_verify)."""
    hv, dk, dv, kernel, dim = shapes["hv"], shapes["dk"], shapes["dv"], shapes["kernel"], shapes["conv_dim"]
    slots = torch.tensor([4, 1, 3, DUMMY_SLOT, DUMMY_SLOT], device=DEVICE)
    rows = len(slots) * length
    x = randn(rows, dim, dtype=dtype, seed=seed)
    inputs = gdn_decode_inputs(shapes, dtype, rows, seed=seed + 1)
    params = dict(
        weight=randn(dim, 1, kernel, dtype=dtype, seed=seed + 10, scale=kernel**-0.5),
        A_log=torch.empty(hv, device=DEVICE).uniform_(0.05, 0.8, generator=gen(seed + 11)).log().to(dtype),
        dt_bias=torch.empty(hv, device=DEVICE).uniform_(-1.5, 0.5, generator=gen(seed + 12)).to(dtype),
    )
    conv_state = randn(NUM_SLOTS, dim, kernel - 1, dtype=dtype, seed=seed + 13)
    state = randn(NUM_SLOTS, hv, dk, dv, seed=seed + 14, scale=0.1)
    conv_verify = torch.zeros(NUM_SLOTS, length, dim, kernel - 1, dtype=dtype, device=DEVICE)
    state_verify = torch.zeros(NUM_SLOTS, length, hv, dk, dv, device=DEVICE)
    return slots, x, inputs, params, conv_state, state, conv_verify, state_verify


@pytest.mark.parametrize("length", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", ["0.8b", "tiny"])
def test_gdn_verify_kernels_are_the_decode_kernels_token_after_token(preset, dtype, length):
    """What makes a bfloat16 verify accept drafts taken from a plain run: each token's output and the state after
    it are, bit for bit, what decode steps of the same tokens give; the slots' own rows are only read."""
    shapes = gdn_shapes(preset)
    slots, x, inputs, params, conv_state, state, conv_verify, state_verify = gdn_verify_setup(
        shapes, dtype, length, seed=100
    )
    conv_before, state_before = conv_state.clone(), state.clone()
    y = conv_verify_by_slot_(x, params["weight"], conv_state, slots, conv_verify)
    o = gated_delta_rule_verify_by_slot_(
        **inputs, A_log=params["A_log"], dt_bias=params["dt_bias"], state=state, slots=slots,
        verify_states=state_verify, out_dtype=dtype,
    )  # fmt: skip
    assert torch.equal(conv_state, conv_before) and torch.equal(state, state_before)

    conv_decode, state_decode = conv_before.clone(), state_before.clone()
    real = slots != DUMMY_SLOT
    for j in range(length):
        at_j = slice(j, None, length)  # token j of every request
        y_j = conv_update_by_slot_(x[at_j], params["weight"], conv_decode, slots)
        o_j = gated_delta_rule_update_by_slot_(
            *(t[at_j] for t in inputs.values()), params["A_log"], params["dt_bias"], state_decode, slots,
            out_dtype=dtype,
        )  # fmt: skip
        assert torch.equal(y[at_j][real], y_j[real]), f"conv output of token {j}"
        assert torch.equal(o[at_j][real], o_j[real]), f"rule output of token {j}"
        for slot in slots[real].tolist():
            assert torch.equal(conv_verify[slot, j], conv_decode[slot]), f"conv state after token {j}, slot {slot}"
            assert torch.equal(state_verify[slot, j], state_decode[slot]), f"state after token {j}, slot {slot}"
    # Slots in no request: their verify rows are as they were.
    for untouched in (0, 2, 5):
        assert not conv_verify[untouched].any() and not state_verify[untouched].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gdn_verify_kernels_match_notebook_11s_verify_functions(dtype):
    from a4.layers.deltanet import gated_delta_inputs
    from a4.speculative.verify import causal_conv1d_verify, gated_delta_rule_verify

    shapes, length = gdn_shapes("0.8b"), 4
    slots, x, inputs, params, conv_state, state, conv_verify, state_verify = gdn_verify_setup(
        shapes, dtype, length, seed=200
    )
    real = slots[:3]  # the padded request's slot is shared garbage
    y = conv_verify_by_slot_(x, params["weight"], conv_state, slots, conv_verify)
    o = gated_delta_rule_verify_by_slot_(
        **inputs, A_log=params["A_log"], dt_bias=params["dt_bias"], state=state, slots=slots,
        verify_states=state_verify,
    )  # fmt: skip

    per_request = lambda t: t.unflatten(0, (len(slots), length))[:3]  # noqa: E731 - the real requests' tokens
    y_expected, conv_expected = causal_conv1d_verify(per_request(x), params["weight"], conv_state[real])
    torch.testing.assert_close(per_request(y), y_expected, **conv_tolerance(dtype))
    # Stored inputs, shifted: exact.
    assert torch.equal(conv_verify[real], conv_expected)
    prepared = gated_delta_inputs(**inputs, A_log=params["A_log"], dt_bias=params["dt_bias"])
    o_expected, states_expected = gated_delta_rule_verify(*(per_request(t) for t in prepared), state[real])
    torch.testing.assert_close(per_request(o), o_expected, **rule_tolerance(dtype))
    torch.testing.assert_close(state_verify[real], states_expected, **rule_tolerance(dtype))


def test_gdn_verify_kernels_reject_buffers_that_do_not_fit():
    shapes = gdn_shapes("tiny")
    slots, x, inputs, params, conv_state, state, conv_verify, state_verify = gdn_verify_setup(
        shapes, torch.float32, 2, seed=300
    )
    with pytest.raises(ValueError, match="verify_states"):
        conv_verify_by_slot_(x, params["weight"], conv_state, slots, conv_verify[:, :, 1:])
    with pytest.raises(ValueError, match="slots"):
        conv_verify_by_slot_(x, params["weight"], conv_state, slots[:3], conv_verify)
    with pytest.raises(ValueError, match="verify_states"):
        conv_verify_by_slot_(x, params["weight"], conv_state, slots, conv_verify.double())
    rule = dict(**inputs, A_log=params["A_log"], dt_bias=params["dt_bias"], state=state)
    with pytest.raises(ValueError, match="verify_states"):
        gated_delta_rule_verify_by_slot_(**rule, slots=slots, verify_states=state_verify[:4])
    with pytest.raises(ValueError, match="float32"):
        gated_delta_rule_verify_by_slot_(**rule, slots=slots, verify_states=state_verify.bfloat16())
    # 9 rows for 4 requests of 2 tokens (the kernel would leave the last row unwritten), and slots not [B].
    short = {name: t[:-1] if name in inputs else t for name, t in rule.items()}
    with pytest.raises(ValueError, match="slots"):
        gated_delta_rule_verify_by_slot_(**short, slots=slots[1:], verify_states=state_verify)
    with pytest.raises(ValueError, match="slots"):
        conv_verify_by_slot_(x, params["weight"], conv_state, slots[0], conv_verify)


# ---------------------------------------------------------------------------------------- paged decode attention


def paged_table(seq_lens: list[int], page_size: int, num_rows: int, max_context: int, seed: int):
    """req_to_token rows for the requests (row i for request i) with pages scattered over the pool at random, and
    the pool size. Rows past the requests hold location 0 (what a padded row reads)."""
    pages_per_row = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_row) + 3  # some pages no request owns
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    table = torch.zeros(num_rows, max_context, dtype=torch.int64)
    used = 0
    for row, (n, pages) in enumerate(zip(seq_lens, pages_per_row)):
        page_ids = order[used : used + pages]
        used += pages
        locations = (page_ids[:, None] * page_size + torch.arange(page_size)).flatten()
        table[row, :n] = locations[:n]
    return table.to(DEVICE), num_pages * page_size


ATTENTION_SHAPES = {  # (arch, preset): Qwen3.5's gated attention (head_dim 256), Qwen3 (128), the tiny one (32)
    "qwen3_5-0.8b": ("qwen3_5", "0.8b"),
    "qwen3-0.6b": ("qwen3", "0.6b"),
    "qwen3_5-tiny": ("qwen3_5", "tiny"),
}


@pytest.mark.parametrize("num_splits", [None, 3], ids=["default-splits", "3-splits"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_paged_decode_attention_matches_naive(shape, dtype, page_size, num_splits):
    t = text_config(*ATTENTION_SHAPES[shape])
    num_heads, num_kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    # 1 token; within one block; across blocks and (with 3 splits) across splits; long enough for many splits.
    seq_lens = [1, 20, 333, 77, 1100] if not INTERPRET else [1, 20, 140]
    max_context = 2048 if not INTERPRET else 256
    table, num_locations = paged_table(seq_lens, page_size, num_rows=8, max_context=max_context, seed=60)
    k_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=61)
    v_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=62)
    # Rows in another order than the table's, then a padded row: table row 7 (never written: location 0), length 1.
    order = [2, 0, 1, *range(3, len(seq_lens))]
    slots = torch.tensor([*order, 7], device=DEVICE)
    lens = torch.tensor([*(seq_lens[i] for i in order), 1], device=DEVICE)
    q = randn(len(slots), num_heads, head_dim, dtype=dtype, seed=63)
    scale = head_dim**-0.5 * 4  # sharper than uniform, as q/k-normed models are

    o = paged_decode_attention(q, k_buf, v_buf, table, slots, lens, scale, num_splits=num_splits)
    expected = naive_paged_attention(q, k_buf, v_buf, table, slots, lens, scale)
    assert o.dtype == dtype and o.shape == q.shape
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o.float(), expected, **tolerance)


def test_a_verify_steps_attention_rows_equal_the_decode_steps_of_their_tokens():
    """Speculative decoding: a verify step's L rows of one request, its context split as the backend splits it (by
    the number of requests), give bit for bit what L one-row decode steps give, each at its own length."""
    from a4.kernels.paged_attention import default_num_splits

    t = text_config("qwen3_5", "0.8b")
    num_heads, num_kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    max_context = 2048 if not INTERPRET else 256
    context = 1000 if not INTERPRET else 150
    table, num_locations = paged_table([context + 4], 16, num_rows=2, max_context=max_context, seed=70)
    k_buf = randn(num_locations, num_kv_heads, head_dim, dtype=torch.bfloat16, seed=71)
    v_buf = randn(num_locations, num_kv_heads, head_dim, dtype=torch.bfloat16, seed=72)
    q = randn(4, num_heads, head_dim, dtype=torch.bfloat16, seed=73)
    lens = torch.arange(context + 1, context + 5, device=DEVICE)  # the k + 1 = 4 verified tokens' key counts
    slots = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    splits = default_num_splits(1, num_kv_heads, max_context, head_dim, q.device)
    verify = paged_decode_attention(q, k_buf, v_buf, table, slots, lens, 0.0625, num_splits=splits)
    for j in range(4):
        decode = paged_decode_attention(q[j : j + 1], k_buf, v_buf, table, slots[:1], lens[j : j + 1], 0.0625)
        assert torch.equal(verify[j : j + 1], decode), f"verify row {j}"


# ------------------------------------------------------------------------------------------------ CUDA graph


# ---------------------------------------------------------------------------------------- prefill (EXTEND) attention


def naive_extend_attention(q, k, v, k_buf, v_buf, req_to_token, slots, prefix_lens, extend_lens, scale):
    """Per request and query head: its prefix's keys from the pool, then its new ones, a causal float32 softmax."""
    group = q.shape[1] // k.shape[1]
    o = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    start = 0
    for slot, prefix_len, extend_len in zip(slots.tolist(), prefix_lens, extend_lens):
        rows = slice(start, start + extend_len)
        start += extend_len
        locations = req_to_token[slot, :prefix_len]
        keys = torch.cat([k_buf[locations], k[rows]]).float()  # [seq_len, nKV, D]
        values = torch.cat([v_buf[locations], v[rows]]).float()
        hidden = torch.arange(prefix_len + extend_len)[None, :] > prefix_len + torch.arange(extend_len)[:, None]
        for h in range(q.shape[1]):
            scores = (q[rows, h].float() @ keys[:, h // group].T * scale).masked_fill(hidden.to(q.device), -math.inf)
            o[rows, h] = torch.softmax(scores, dim=-1) @ values[:, h // group]
    return o


@pytest.mark.parametrize("tile", [None, (16, 32, 4, 1)], ids=["TILES", "16x32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_extend_attention_matches_naive(shape, dtype, tile):
    t = text_config(*ATTENTION_SHAPES[shape])
    num_heads, num_kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    # Prompts of one token, exactly one block of queries and several; later chunks after prefixes, within a block and
    # across blocks, one token after a prefix of whole key blocks.
    prefix_lens = [0, 0, 0, 40, 7, 96, 64]
    extend_lens = [1, 64, 150, 70, 3, 33, 1] if not INTERPRET else [1, 64, 80, 70, 3, 33, 1]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    table, num_locations = paged_table(seq_lens, page_size=16, num_rows=8, max_context=256, seed=64)
    k_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=65)
    v_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=66)
    # The requests in another order than the table's rows.
    order = [3, 0, 5, 1, 6, 4, 2]
    slots = torch.tensor(order, device=DEVICE)
    prefix_lens, extend_lens = [prefix_lens[i] for i in order], [extend_lens[i] for i in order]
    num_tokens = sum(extend_lens)
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=67)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=68)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=69)
    cu_seqlens = torch.tensor([0, *extend_lens], device=DEVICE).cumsum(0)
    seq_lens_t = torch.tensor([p + n for p, n in zip(prefix_lens, extend_lens)], device=DEVICE)
    scale = head_dim**-0.5 * 4  # sharper than uniform, as q/k-normed models are

    # The grid's bound may exceed the longest request (a captured prefill's bucket).
    o = extend_attention(q, k, v, k_buf, v_buf, table, slots, seq_lens_t, cu_seqlens, max(extend_lens) + 20, scale,
                         tile)  # fmt: skip
    expected = naive_extend_attention(q, k, v, k_buf, v_buf, table, slots, prefix_lens, extend_lens, scale)
    assert o.dtype == dtype and o.shape == q.shape
    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(o.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_cuda_backend_attends_a_mixed_step_and_a_captured_prefill_as_torchs_does(dtype):
    """TritonAttnBackend against TorchAttnBackend (torch's SDPA) through `paged_attention`, each over its own pool:
    a MIXED step (a chunk after a prefix and a new prompt, then two decodes: the extend kernel on the prompts' part
    with its sliced lengths, the paged decode kernel on the rest), and a captured prefill's static context (one
    prompt padded to its bucket) against the prompt alone."""
    from a4.core import ForwardMode
    from a4.engine.forward_batch import build_forward_batch, static_extend_batch
    from a4.kvcache.kv_pool import KVPool
    from a4.layers.attention import TorchAttnBackend, TritonAttnBackend, paged_attention

    num_heads, num_kv_heads, head_dim, scale = 8, 2, 64, 0.3
    seq_lens = [9, 6, 12, 20]  # slot 0 and 2 decode, slot 1 takes a chunk after 5 cached tokens, slot 3 is new
    table, num_locations = paged_table([32] * 4, page_size=4, num_rows=5, max_context=32, seed=70)
    pools = [KVPool(1, 4, num_locations // 4, num_kv_heads, head_dim, dtype, DEVICE) for _ in range(2)]
    for pool in pools:  # the prefixes' keys, the same in both
        k_buf, v_buf = pool.get_kv(0)
        k_buf.copy_(randn(*k_buf.shape, dtype=dtype, seed=71))
        v_buf.copy_(randn(*v_buf.shape, dtype=dtype, seed=72))

    def attend(backend, pool, slots, prefix_lens, extend_lens, num_decodes, seed):
        mode = ForwardMode.MIXED if num_decodes else ForwardMode.EXTEND
        fb = build_forward_batch(mode, input_ids=[0] * sum(extend_lens), slots=slots, prefix_lens=prefix_lens,
                                 extend_lens=extend_lens, sample_indices=[], req_to_token=table, kv_pool=pool,
                                 attn_backend=backend, num_decodes=num_decodes)  # fmt: skip
        return paged_attention(*qkv(sum(extend_lens), seed), fb, 0, scale)

    def qkv(num_tokens, seed):
        return (randn(num_tokens, num_heads, head_dim, dtype=dtype, seed=seed),
                randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=seed + 1),
                randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, seed=seed + 2))  # fmt: skip

    tolerance = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    step = ([1, 3, 0, 2], [5, 0, 8, 11], [6, 20, 1, 1], 2)
    expected = attend(TorchAttnBackend(), pools[0], *step, seed=73)
    got = attend(TritonAttnBackend(), pools[1], *step, seed=73)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)
    torch.testing.assert_close(pools[1].get_kv(0)[0], pools[0].get_kv(0)[0])

    # A captured prefill's context: slot 4's 13 tokens padded to 16, against the 13 alone.
    q, k, v = qkv(16, seed=76)
    bucket = torch.arange(16, device=DEVICE)
    fb = static_extend_batch(input_ids=bucket, positions=bucket, slot=torch.tensor([4], device=DEVICE),
                             num_tokens=torch.tensor([13], device=DEVICE), padding_slot=3, req_to_token=table,
                             kv_pool=pools[1], state_pool=None, attn_backend=TritonAttnBackend())  # fmt: skip
    got = paged_attention(q, k, v, fb, 0, scale)[:13]
    fb = build_forward_batch(ForwardMode.EXTEND, input_ids=[0] * 13, slots=[4], prefix_lens=[0], extend_lens=[13],
                             sample_indices=[], req_to_token=table, kv_pool=pools[0], attn_backend=TorchAttnBackend())  # fmt: skip
    expected = paged_attention(q[:13], k[:13], v[:13], fb, 0, scale)
    torch.testing.assert_close(got.float(), expected.float(), **tolerance)


def test_extend_attention_rejects_shapes_that_do_not_fit():
    q, k = torch.zeros(4, 8, 32, device=DEVICE), torch.zeros(4, 3, 32, device=DEVICE)  # 3 kv heads for 8 heads
    buf, table = torch.zeros(16, 3, 32, device=DEVICE), torch.zeros(1, 16, dtype=torch.int64, device=DEVICE)
    one = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    cu_seqlens = torch.tensor([0, 4], device=DEVICE)
    with pytest.raises(ValueError, match="nKV dividing nH"):
        extend_attention(q, k, k, buf, buf, table, one, one + 4, cu_seqlens, 4, 1.0)
    q, k, buf = torch.zeros(4, 2, 512, device=DEVICE), torch.zeros(4, 1, 512, device=DEVICE), torch.zeros(16, 1, 512)
    with pytest.raises(ValueError, match="head_dim 512"):
        extend_attention(q, k, k, buf.to(DEVICE), buf.to(DEVICE), table, one, one + 4, cu_seqlens, 4, 1.0)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_decode_kernels_capture_in_a_cuda_graph_and_replay_with_new_slots_and_lengths():
    """Static buffers hold the inputs; the graph replays with other slots and lengths copied into them."""
    dtype = torch.bfloat16
    shapes = gdn_shapes("0.8b")
    hv, dk, dv, kernel, dim = shapes["hv"], shapes["dk"], shapes["dv"], shapes["kernel"], shapes["conv_dim"]
    batch = 4
    weight = randn(dim, 1, kernel, dtype=dtype, seed=70, scale=0.5)
    A_log, dt_bias = randn(hv, dtype=dtype, seed=71, scale=0.3), randn(hv, dtype=dtype, seed=72)
    conv_state = randn(NUM_SLOTS, dim, kernel - 1, dtype=dtype, seed=73)
    state = randn(NUM_SLOTS, hv, dk, dv, seed=74, scale=0.1)
    t = text_config("qwen3_5", "0.8b")
    num_heads, num_kv_heads, head_dim = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    table, num_locations = paged_table([5, 900, 64, 300], 16, num_rows=NUM_SLOTS, max_context=1024, seed=75)
    k_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=76)
    v_buf = randn(num_locations, num_kv_heads, head_dim, dtype=dtype, seed=77)

    static = dict(
        x=torch.zeros(batch, dim, dtype=dtype, device=DEVICE),
        **gdn_decode_inputs(shapes, dtype, batch, seed=78),
        q_attn=torch.zeros(batch, num_heads, head_dim, dtype=dtype, device=DEVICE),
        slots=torch.full((batch,), DUMMY_SLOT, device=DEVICE),
        seq_lens=torch.ones(batch, dtype=torch.int64, device=DEVICE),
    )

    def step():
        y = conv_update_by_slot_(static["x"], weight, conv_state, static["slots"])
        o = gated_delta_rule_update_by_slot_(
            static["q"], static["k"], static["v"], static["a"], static["b"], A_log, dt_bias, state, static["slots"]
        )
        attn = paged_decode_attention(
            static["q_attn"], k_buf, v_buf, table, static["slots"], static["seq_lens"], head_dim**-0.5
        )
        return y, o, attn

    saved = conv_state.clone(), state.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture, on the dummy slot only
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    conv_state.copy_(saved[0])
    state.copy_(saved[1])

    replays = [([0, 1, 2, 3], [5, 900, 64, 300]), ([3, 1, DUMMY_SLOT, DUMMY_SLOT], [300, 900, 1, 1])]
    for replay, (slot_list, len_list) in enumerate(replays):
        new = dict(
            x=randn(batch, dim, dtype=dtype, seed=80 + replay),
            **gdn_decode_inputs(shapes, dtype, batch, seed=90 + 10 * replay),
            q_attn=randn(batch, num_heads, head_dim, dtype=dtype, seed=85 + replay),
            slots=torch.tensor(slot_list, device=DEVICE),
            seq_lens=torch.tensor(len_list, device=DEVICE),
        )
        for name, value in new.items():
            static[name].copy_(value)
        real = [row for row, slot in enumerate(slot_list) if slot != DUMMY_SLOT]
        y_expected, conv_expected = naive_conv_update(new["x"], weight, conv_state, new["slots"])
        o_expected, state_expected = naive_gated_delta_rule_update(
            new["q"], new["k"], new["v"], new["a"], new["b"], A_log, dt_bias, state, new["slots"]
        )
        attn_expected = naive_paged_attention(
            new["q_attn"], k_buf, v_buf, table, new["slots"], new["seq_lens"], head_dim**-0.5
        )
        graph.replay()
        y, o, attn = outputs
        torch.testing.assert_close(y[real], y_expected[real], **conv_tolerance(dtype))
        torch.testing.assert_close(o[real], o_expected[real], **rule_tolerance(dtype))
        torch.testing.assert_close(attn[real].float(), attn_expected[real], atol=1e-2, rtol=1e-2)
        assert torch.equal(conv_state[:DUMMY_SLOT], conv_expected[:DUMMY_SLOT])
        torch.testing.assert_close(state[:DUMMY_SLOT], state_expected[:DUMMY_SLOT], **rule_tolerance(dtype))


# --------------------------------------------------------------------------------------------------- fla prefill

needs_fla = pytest.mark.skipif(
    DEVICE != "cuda" or not fla_available(), reason="flash-linear-attention is not importable (or no CUDA)"
)


@needs_fla
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("preset", ["0.8b", "tiny"])
def test_fla_prefill_matches_the_token_by_token_recurrence(preset, dtype):
    shapes = gdn_shapes(preset)
    hk, hv, dk, dv, kernel, dim = (shapes[n] for n in ("hk", "hv", "dk", "dv", "kernel", "conv_dim"))
    seq_lens = [1, 2, 63, 64, 150]  # shorter than the conv's K-1, one chunk exactly, several chunks with a tail
    cu_seqlens = torch.tensor([0, *seq_lens], device=DEVICE).cumsum(0)
    total, n = sum(seq_lens), len(seq_lens)

    conv_initial = randn(n, dim, kernel - 1, dtype=dtype, seed=100)
    initial = randn(n, hv, dk, dv, seed=101, scale=0.3)
    conv_initial[2], initial[2] = 0, 0  # a request that starts here: the engine cleared its slot when it gave it out

    x = randn(total, dim, dtype=dtype, seed=102)
    weight = randn(dim, 1, kernel, dtype=dtype, seed=103, scale=kernel**-0.5)
    y, conv_final = fla_conv1d_prefill(x, weight, conv_initial, cu_seqlens)
    y_expected, conv_final_expected = naive_conv_prefill(x, weight, conv_initial, cu_seqlens)
    torch.testing.assert_close(y, y_expected, **conv_tolerance(dtype))
    torch.testing.assert_close(conv_final, conv_final_expected)

    q = randn(total, hk, dk, dtype=dtype, seed=104)
    k = randn(total, hk, dk, dtype=dtype, seed=105)
    v = randn(total, hv, dv, dtype=dtype, seed=106)
    a, b = randn(total, hv, dtype=dtype, seed=107), randn(total, hv, dtype=dtype, seed=108)
    A_log = torch.empty(hv, device=DEVICE).uniform_(0.05, 0.8, generator=gen(109)).log().to(dtype)
    dt_bias = torch.empty(hv, device=DEVICE).uniform_(-1.5, 0.5, generator=gen(110)).to(dtype)
    o, final = fla_chunk_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, initial, cu_seqlens)
    o_expected, final_expected = naive_gated_delta_rule_prefill(q, k, v, a, b, A_log, dt_bias, initial, cu_seqlens)
    assert o.shape == (total, hv, dv) and final.dtype == torch.float32
    # fla runs the rule in its inputs' dtype (float32 products may use tf32): agreement to that dtype's precision.
    limit = 1e-2 if dtype == torch.float32 else 3e-2
    assert rel_err(o, o_expected) < limit
    assert rel_err(final, final_expected) < limit


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1024, 256, 16])
def test_fused_norms_match_the_modules_they_replace(dim, dtype):
    # The torch modules are the reference solutions of notebooks 03 and 04 (tests run with A4_SOLUTIONS=1).
    from a4.layers.deltanet import GatedRMSNorm
    from a4.layers.gated_attention import ZeroCenteredRMSNorm

    generator = torch.Generator().manual_seed(dim)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(DEVICE, dtype)

    norms = {}
    for cls in (ZeroCenteredRMSNorm, GatedRMSNorm):
        torch_norm, fused_norm = cls(dim, 1e-6).to(DEVICE, dtype), cls(dim, 1e-6).to(DEVICE, dtype)
        with torch.no_grad():
            torch_norm.weight.copy_(rand(dim, scale=0.3) + (cls is GatedRMSNorm))
            fused_norm.weight.copy_(torch_norm.weight)
        assert use_fused_norms(fused_norm) == 1
        norms[cls] = torch_norm, fused_norm
    # Rows of a decode batch, and the heads of a projection's output (a strided view, as q = q_and_gate[..., :D]).
    rows = rand(5, dim, scale=3.0)
    heads = rand(3, 4, 2 * dim)[..., :dim]
    # float32: rounding; bfloat16: one unit in the last place (the row statistic is summed in another order, which
    # can move a value across a rounding boundary). Triton's CPU interpreter truncates float32 to bfloat16 where the
    # GPU rounds to nearest: a few units there.
    bf16_rtol = 2**-5 if INTERPRET else 2**-7
    allowed = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=bf16_rtol)}[dtype]
    with torch.no_grad():
        torch_norm, fused_norm = norms[ZeroCenteredRMSNorm]
        for x in (rows, heads):
            torch.testing.assert_close(fused_norm(x), torch_norm(x), **allowed)
        torch_norm, fused_norm = norms[GatedRMSNorm]
        gate = rand(5, dim)
        torch.testing.assert_close(fused_norm(rows, gate), torch_norm(rows, gate), **allowed)
        assert fused_norm(rows[:0], gate[:0]).shape == (0, dim)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1024, 16])
def test_add_and_norm_in_one_launch_matches_the_torch_add_and_module(dim, dtype):
    from a4.layers.gated_attention import ZeroCenteredRMSNorm
    from a4.layers.norm import add_and_norm

    torch_norm = ZeroCenteredRMSNorm(dim, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        torch_norm.weight.copy_(randn(dim, seed=50, scale=0.3))
    fused_norm = copy.deepcopy(torch_norm)
    assert use_fused_norms(fused_norm) == 1 and hasattr(fused_norm, "add_norm")
    assert not hasattr(torch_norm, "add_norm")  # the torch path of add_and_norm: x + h, then the module
    x, h = randn(5, dim, dtype=dtype, seed=51, scale=3.0), randn(5, dim, dtype=dtype, seed=52)
    with torch.no_grad():
        total, normed = add_and_norm(x, h, fused_norm)
        expected_total = x + h
        # The sum is one rounding of the same float32 sum: exact on a GPU. The interpreter truncates to bfloat16
        # where the GPU rounds to nearest: one unit in the last place there.
        if INTERPRET:
            torch.testing.assert_close(total, expected_total, atol=0, rtol=2**-7)
        else:
            assert torch.equal(total, expected_total)
        allowed = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-5)}[dtype]
        torch.testing.assert_close(normed, torch_norm(expected_total), **allowed)
        assert add_and_norm(x[:0], h[:0], fused_norm)[1].shape == (0, dim)
    with pytest.raises(ValueError, match="residual"):
        fused_norm.add_norm(x, h[:, :-1])


def norm_rope_tolerance(dtype: torch.dtype, expected: torch.Tensor) -> dict:
    # float32: the sum of squares in another order. bfloat16: the normalised value may round one unit in the last
    # place apart, and each of RoPE's two products with it (the interpreter truncates each rounding besides): units
    # in the last place of the largest value, in a sum that may cancel.
    if dtype == torch.float32:
        return dict(atol=1e-5, rtol=1e-5)
    return dict(atol=4 * 2**-8 * expected.abs().max().item(), rtol=2**-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
# (tokens, query heads, kv heads, head_dim, rotary_dim): the 0.8B's, the tiny preset's, RoPE on the whole head.
@pytest.mark.parametrize(
    "shape", [(3, 8, 2, 256, 64), (1, 8, 2, 256, 64), (5, 4, 2, 32, 8), (2, 3, 1, 16, 16)], ids=str
)
def test_qk_norm_rope_is_the_students_norm_and_partial_rope_and_writes_the_pool(shape, dtype):
    import a4.layers.gated_attention as gated_attention
    from a4.layers.rope import RotaryEmbedding

    tokens, heads, kv_heads, head_dim, rotary_dim = shape
    # Position 0 turns nothing: a single token sits further on.
    cos, sin = RotaryEmbedding(rotary_dim, 1e7, 8192, device=DEVICE)(
        torch.tensor([17, 0, 4000, 5, 8191][:tokens], device=DEVICE), dtype
    )
    # The query as the layer makes it: the first half of each head's [query, gate], a strided view; key and value
    # two column ranges of one merged product.
    query = randn(tokens, heads, 2 * head_dim, dtype=dtype, seed=tokens * heads, scale=3.0)[..., :head_dim]
    kv = randn(tokens, 2 * kv_heads * head_dim, dtype=dtype, seed=7, scale=3.0)
    key, value = (x.view(tokens, kv_heads, head_dim) for x in kv.split(kv_heads * head_dim, dim=1))
    q_norm, k_norm = (gated_attention.ZeroCenteredRMSNorm(head_dim, 1e-6).to(DEVICE) for _ in range(2))
    with torch.no_grad():
        for i, norm in enumerate((q_norm, k_norm)):
            norm.weight.copy_(randn(head_dim, seed=20 + i, scale=0.3))
        expected_q = gated_attention.apply_partial_rope(q_norm(query), cos, sin)
        expected_k = gated_attention.apply_partial_rope(k_norm(key), cos, sin)
    k_buf, v_buf = (torch.zeros(11, kv_heads, head_dim, dtype=dtype, device=DEVICE) for _ in range(2))
    loc = torch.tensor([9, 2, 5, 0, 7][:tokens], device=DEVICE)
    weights = (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6)
    q, k = qk_norm_rope(query, key, *weights, cos, sin, (value, k_buf, v_buf, loc))
    torch.testing.assert_close(q, expected_q, **norm_rope_tolerance(dtype, expected_q))
    torch.testing.assert_close(k, expected_k, **norm_rope_tolerance(dtype, expected_k))
    # The pool holds the returned keys and the values at their locations, and nothing elsewhere.
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], value)
    elsewhere = torch.ones(11, dtype=torch.bool, device=DEVICE)
    elsewhere[loc] = False
    assert not k_buf[elsewhere].any() and not v_buf[elsewhere].any()
    # Without a pool to write: the same heads.
    q_alone, k_alone = qk_norm_rope(query, key, *weights, cos, sin)
    assert torch.equal(q_alone, q) and torch.equal(k_alone, k)
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope(query, key, *weights, cos[:, :-1], sin[:, :-1])
    with pytest.raises(ValueError, match="qk_norm_rope"):
        qk_norm_rope(query, key, *weights, cos, sin, (value, k_buf, v_buf, loc[:-1] if tokens > 1 else loc[:0]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("merged", [False, True], ids=["separate", "merged"])
def test_the_fused_attention_forward_is_the_students_forward(merged, dtype):
    """A GatedAttention with `use_fused_attention`'s forward and the CUDA backend (a4's paged decode and extend
    attention kernels) against the students' own forward and torch's SDPA, each over its own KV pool: a prefill, a
    decode step, then a chunk after a prefix beside a new prompt; the layer's outputs and the pools' keys and values,
    with q / k / v as separate projections and merged into one product (the GPU's default)."""
    import a4.layers.gated_attention as gated_attention
    from a4.layers.attention import TorchAttnBackend, TritonAttnBackend
    from a4.course.checks._model_runner import SlotTable
    from a4.kvcache.kv_pool import KVPool
    from a4.layers.merged_linear import merge_projections
    from a4.layers.rope import RotaryEmbedding
    from a4.models.config import parse_config

    config = parse_config(preset_config("qwen3_5", "tiny"))
    torch.manual_seed(3)
    students = gated_attention.GatedAttention(config, pool_layer=1).to(DEVICE, dtype)
    with torch.no_grad():
        for parameter in students.parameters():
            parameter.copy_(torch.randn_like(parameter) * 0.2)
    if merged:
        assert merge_projections(students) == 1
    fused = copy.deepcopy(students)
    assert use_fused_attention(torch.nn.Sequential(fused)) == 1
    assert gated_attention.GatedAttention.forward is not fused.forward.__func__
    rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.max_position_embeddings, device=DEVICE)
    pools = [KVPool(2, 16, 4, config.num_key_value_heads, config.head_dim, dtype, DEVICE) for _ in range(2)]
    table = SlotTable(pools[0].num_locations, num_slots=3, max_context=32)
    table.req_to_token = table.req_to_token.to(DEVICE)
    for step, new_tokens in enumerate(({0: 5, 1: 3}, {0: 1, 1: 1}, {0: 4, 2: 6})):
        fb = table.step(new_tokens, pools[0])
        hidden = randn(fb.positions.shape[0], config.hidden_size, dtype=dtype, seed=30 + step)
        cos, sin = rope(fb.positions, dtype)
        assert type(fb.attn_backend) is TorchAttnBackend
        with torch.no_grad():
            expected = students(hidden, cos, sin, fb)
            fb.kv_pool, fb.attn_backend = pools[1], TritonAttnBackend()
            fb.attn_backend.prepare(fb)
            got = fused(hidden, cos, sin, fb)
        # bfloat16: a key or query one unit in the last place apart (the norm's sum of squares in another order; the
        # interpreter truncates besides) moves the attention weights, then o_proj sums the heads: units in the last
        # place of the largest output, where a wrong head, sign or location is off by the output's own size.
        scale = expected.abs().max().item()
        allowed = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2**-5 * scale, rtol=2**-5)
        torch.testing.assert_close(got, expected, **allowed)
        for ours, theirs in zip(pools[1].get_kv(1), pools[0].get_kv(1)):
            torch.testing.assert_close(ours, theirs, **norm_rope_tolerance(dtype, theirs))
        assert not pools[1].get_kv(0)[0].any()  # the other layer's keys untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 33])
def test_silu_and_mul_matches_torch_on_the_halves_of_a_merged_product(rows, dtype):
    from a4.layers.mlp import GatedMLP

    width = 600  # two programs per row, the second one partly masked
    merged = randn(rows, 2 * width, dtype=dtype, seed=rows, scale=3.0)
    gate, up = merged[:, :width], merged[:, width:]
    expected = F.silu(gate) * up
    # float32: exp's rounding; bfloat16: at most one unit in the last place, and the interpreter's truncation.
    allowed = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-5)}[dtype]
    torch.testing.assert_close(silu_and_mul(gate, up), expected, **allowed)
    torch.testing.assert_close(silu_and_mul(gate[:, None], up[:, None]), expected[:, None], **allowed)
    with pytest.raises(ValueError, match="silu_and_mul"):
        silu_and_mul(gate, up[:, 1:])

    torch_mlp = GatedMLP(64, 48).to(DEVICE, dtype)
    fused_mlp = copy.deepcopy(torch_mlp)
    assert use_fused_activation(torch.nn.Sequential(fused_mlp)) == 1
    x = randn(rows, 64, dtype=dtype, seed=rows + 100)
    with torch.no_grad():
        torch.testing.assert_close(fused_mlp(x), torch_mlp(x), **allowed)


def test_pdl_launches_one_wave_grids_and_the_gemv(monkeypatch):
    """Programmatic dependent launch: on Hopper and later for a grid of one wave (a program per SM) or a decode-only
    kernel's grid, never on the CPU (Triton's interpreter) nor under A4_PDL=0."""
    from a4.kernels import pdl

    device = torch.device(DEVICE)
    pdl._one_wave.cache_clear()
    on = {"PDL": True, "launch_pdl": True}
    if device.type == "cuda" and torch.cuda.get_device_capability()[0] >= 9:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        assert pdl.pdl_launch(device, sms) == on
        assert pdl.pdl_launch(device, sms + 1) == {"PDL": False}
        assert pdl.pdl_launch(device, 100 * sms, decode_only=True) == on
    else:
        assert pdl.pdl_launch(device, 1, decode_only=True) == {"PDL": False}
    monkeypatch.setenv("A4_PDL", "0")
    pdl._one_wave.cache_clear()
    try:
        assert pdl.pdl_launch(device, 1, decode_only=True) == {"PDL": False}
    finally:
        monkeypatch.undo()
        pdl._one_wave.cache_clear()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
def test_sigmoid_and_mul_is_the_output_gate_of_gated_attention(tokens, dtype):
    # The gate as the layer makes it with merged projections: the second half of each head's [query, gate], in the
    # query's columns of a wider product (its rows are not heads * 2 * head_dim apart).
    heads, head_dim = 8, 256
    merged = randn(tokens, heads * 2 * head_dim + 1024, dtype=dtype, seed=tokens, scale=3.0)
    gate = merged[:, : heads * 2 * head_dim].view(tokens, heads, 2 * head_dim)[..., head_dim:]
    attn = randn(tokens, heads, head_dim, dtype=dtype, seed=tokens + 1)
    allowed = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-5)}[dtype]
    torch.testing.assert_close(sigmoid_and_mul(gate, attn), attn * torch.sigmoid(gate), **allowed)
    with pytest.raises(ValueError, match="sigmoid_and_mul"):
        sigmoid_and_mul(gate, attn[..., 1:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
@pytest.mark.parametrize("out_features, in_features", [(1024, 3584), (8224, 1024), (37, 100)])
# TILE, the tiles of TILES and others timed against them (a4/kernels/gemv.py): every one computes the product.
@pytest.mark.parametrize(
    "tile", sorted({TILE, *TILES.values(), (8, 512, 4, 4), (16, 256, 4, 4), (32, 256, 8, 4)}),
    ids=lambda t: "x".join(map(str, t)),
)
def test_gemv_matches_a_float64_matmul(rows, out_features, in_features, dtype, tile):
    generator = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, 2 * in_features, generator=generator)[:, :in_features].to(DEVICE, dtype)  # strided rows
    weight = (torch.randn(out_features, in_features, generator=generator) * in_features**-0.5).to(DEVICE, dtype)
    y = gemv(x, weight, tile)
    expected = x.double() @ weight.double().T
    assert y.dtype == dtype and y.shape == (rows, out_features)
    # float32: the sum in another order; bfloat16: the output's rounding (and the interpreter's truncation).
    allowed = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2**-5)}[dtype]
    torch.testing.assert_close(y.double(), expected, **allowed)


@pytest.mark.parametrize("out_features, in_features", [(1024, 3584), (8224, 1024)], ids=["narrow", "wide"])
def test_gemv_gives_a_row_the_same_bits_whatever_rows_share_its_call(out_features, in_features):
    """A verify step's rows must be what one-row decode steps compute (see the module's docstring)."""
    x = randn(MAX_ROWS, in_features, dtype=torch.bfloat16, seed=80)
    weight = randn(out_features, in_features, dtype=torch.bfloat16, seed=81, scale=in_features**-0.5)
    together = gemv(x, weight)
    for row in range(MAX_ROWS):
        assert torch.equal(gemv(x[row : row + 1], weight), together[row : row + 1]), f"row {row}"
    assert torch.equal(gemv(x[1:3], weight), together[1:3])
    assert torch.equal(gemv(x[:3], weight), together[:3])


def test_linear_takes_the_kernel_for_at_most_max_rows_rows(monkeypatch):
    import a4.kernels.gemv as gemv_module

    calls = []
    monkeypatch.setattr(gemv_module, "gemv", lambda x, weight: calls.append(weight.shape) or gemv(x, weight))
    layer = torch.nn.Linear(64, 16, bias=False).to(DEVICE)
    wide = torch.nn.Linear(64, 70, bias=False).to(DEVICE)
    assert use_gemv(torch.nn.Sequential(layer, wide)) == 2
    x = torch.randn(MAX_ROWS + 1, 64, device=DEVICE)
    with torch.no_grad():
        for batch in (x[:1], x[:MAX_ROWS], x):  # the kernel, the kernel, F.linear
            torch.testing.assert_close(layer(batch), F.linear(batch, layer.weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(wide(x[:1]), F.linear(x[:1], wide.weight), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(linear(x[:2, None], layer.weight), F.linear(x[:2, None], layer.weight))
    if DEVICE == "cuda":  # the interpreter's tensors are CPU ones, which `linear` leaves to F.linear
        assert calls == [layer.weight.shape] * 2 + [wide.weight.shape] + [layer.weight.shape]
    with pytest.raises(ValueError, match="gemv"):
        gemv(x, layer.weight)


# ------------------------------------------------------------------------------------------------ greedy sampler


@pytest.mark.parametrize(
    "vocab, chunk, pieces",
    [(5, greedy.CHUNK, greedy.PIECES), (1000, greedy.CHUNK, greedy.PIECES), (248320, greedy.CHUNK, greedy.PIECES),
     (64, 16, 4), (1000, 16, 4)],
)  # fmt: skip
def test_argmax_and_finite_is_torchs_argmax_and_the_rows_finiteness(vocab, chunk, pieces, monkeypatch):
    # Small pieces make a row span several passes of the second kernel, where ties between pieces are settled.
    monkeypatch.setattr(greedy, "CHUNK", chunk)
    monkeypatch.setattr(greedy, "PIECES", pieces)
    logits = randn(7, vocab, dtype=torch.float32, seed=vocab)
    logits[1, vocab // 3] = logits[1, vocab - 1] = 50.0  # a tie: torch gives the first
    logits[2, :] = -3.0  # all tied
    logits[3, vocab // 2] = float("nan")
    logits[4, vocab - 1] = float("inf")
    logits[5, 0] = float("-inf")
    logits[6, 1 % vocab] = 1e38  # finite, near float32's largest
    tokens, finite = greedy.argmax_and_finite(logits)
    low, high = torch.aminmax(logits, dim=-1)
    assert finite.tolist() == (low.isfinite() & high.isfinite()).tolist() == [True] * 3 + [False] * 3 + [True]
    expected = logits.argmax(dim=-1)
    assert tokens.dtype == torch.int64
    assert tokens[finite].tolist() == expected[finite].tolist()
    assert greedy.argmax_and_finite(logits[:0])[0].shape == (0,)


# --------------------------------------------------------------------------------------------- mixture of experts

# (experts, top k, hidden, intermediate): the tiny preset's, a wider one, and 35B-A3B's own on a GPU only (its
# 256 x 1024 x 2048 weights are too slow for the interpreter).
EXPERT_SHAPES = {"tiny": (8, 2, 64, 32), "wide": (32, 4, 256, 96)}
if DEVICE == "cuda":
    EXPERT_SHAPES["35b-a3b"] = (256, 8, 2048, 512)


def random_experts(shape: str, dtype: torch.dtype):
    """The students' FusedExperts (notebook 09, the reference) with random weights, and a kernel-routed copy."""
    from a4.layers.moe import FusedExperts

    num_experts, _, hidden, intermediate = EXPERT_SHAPES[shape]
    reference = FusedExperts(num_experts, hidden, intermediate).to(DEVICE, dtype)
    with torch.no_grad():
        reference.gate_up_proj.copy_(randn(num_experts, 2 * intermediate, hidden, seed=1, scale=hidden**-0.5))
        reference.down_proj.copy_(randn(num_experts, hidden, intermediate, seed=2, scale=intermediate**-0.5))
    fused = copy.deepcopy(reference)
    assert use_fused_experts(torch.nn.Sequential(fused)) == 1
    return reference, fused


def random_routing(num_tokens: int, shape: str, dtype: torch.dtype, skewed: bool = False):
    """expert_ids [T, k] distinct per row and weights [T, k] summing to one; `skewed`: every token picks from the
    first k + 1 experts, so that each expert's run is longer than a kernel block's 16 or 64 pairs."""
    num_experts, top_k, _, _ = EXPERT_SHAPES[shape]
    scores = torch.rand(num_tokens, top_k + 1 if skewed else num_experts, generator=gen(num_tokens), device=DEVICE)
    expert_ids = scores.topk(top_k, dim=-1).indices
    weights = torch.rand(num_tokens, top_k, generator=gen(num_tokens + 1), device=DEVICE) + 0.1
    return expert_ids, (weights / weights.sum(-1, keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, skewed", [(1, False), (3, False), (40, False), (200, False), (150, True)])
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES))
def test_fused_experts_match_the_students_module(shape, num_tokens, skewed, dtype):
    reference, fused = random_experts(shape, dtype)
    x = randn(num_tokens, EXPERT_SHAPES[shape][2], dtype=dtype, seed=3)
    expert_ids, weights = random_routing(num_tokens, shape, dtype, skewed)
    with torch.no_grad():
        actual, expected = fused(x, expert_ids, weights), reference(x, expert_ids, weights)
    assert actual.dtype == dtype and actual.shape == x.shape
    # float32: sums in another order; bfloat16: the module rounds gate, up, each expert's output and the running
    # sum to bfloat16, the kernels only silu(gate) * up and the result.
    allowed = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}[dtype]
    torch.testing.assert_close(actual, expected, **allowed)
    # float32 stays float32 (TF32 would be ~1e-3 off): 2048-long dot products in another order differ by ~1e-6.
    assert rel_err(actual, expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_expert_runs_are_the_students_groups_kept_on_the_device(num_tokens):
    from a4.kernels.moe import expert_runs
    from a4.layers.moe import group_by_expert

    expert_ids, _ = random_routing(num_tokens, "wide", torch.float32)
    num_experts = EXPERT_SHAPES["wide"][0]
    groups = group_by_expert(expert_ids, num_experts)
    runs = expert_runs(expert_ids, num_experts)
    active = len(groups.experts)
    assert runs.pairs.tolist() == groups.pairs.tolist()
    assert runs.experts[:active].tolist() == groups.experts and runs.counts[:active].tolist() == groups.counts
    assert runs.starts[:active].tolist() == [sum(groups.counts[:i]) for i in range(active)]
    assert runs.experts.numel() == min(expert_ids.numel(), num_experts) and not runs.counts[active:].any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("normalize", [True, False], ids=["normalised", "raw"])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
@pytest.mark.parametrize("shape", list(EXPERT_SHAPES))
def test_route_matches_the_students_router(shape, num_tokens, normalize, dtype):
    from a4.kernels.moe import fused_route
    from a4.layers.moe import route as students_route

    num_experts, top_k, _, _ = EXPERT_SHAPES[shape]
    logits = randn(num_tokens, 2 * num_experts, dtype=dtype, seed=num_tokens, scale=3.0)[:, ::2]  # strided rows
    weights, experts = fused_route(logits, top_k, normalize)
    expected = students_route(logits, top_k, normalize)
    assert experts.dtype == torch.int64 and weights.dtype == dtype
    # The same experts, most probable first, but where probabilities tie (bfloat16 logits tie often), where the
    # order between the tied ones is torch.topk's own: the chosen probabilities agree exactly.
    probs = logits.float().softmax(dim=-1)
    assert torch.equal(probs.gather(1, experts), probs.gather(1, expected.experts))
    if dtype == torch.float32:
        assert torch.equal(experts, expected.experts)
    torch.testing.assert_close(weights, expected.weights, atol=1e-6, rtol=1e-5 if dtype == torch.float32 else 1e-2)


def test_fused_moe_block_matches_the_students_block():
    from a4.layers.moe import SparseMoeBlock
    from a4.models.config import parse_config

    config = parse_config(preset_config("qwen3_5_moe", "tiny"))
    reference = SparseMoeBlock(config).to(DEVICE)
    with torch.no_grad():
        for i, parameter in enumerate(reference.parameters()):
            parameter.copy_(randn(*parameter.shape, seed=10 + i, scale=parameter.shape[-1] ** -0.5))
    fused = copy.deepcopy(reference)
    assert use_fused_experts(fused) == 2  # the block's router and its experts
    x = randn(7, config.hidden_size, seed=20)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), reference(x), atol=1e-5, rtol=1e-4)


def test_fused_experts_reject_weights_that_do_not_fit():
    _, fused = random_experts("tiny", torch.float32)
    x = randn(2, EXPERT_SHAPES["tiny"][2] + 1, seed=4)
    expert_ids, weights = random_routing(2, "tiny", torch.float32)
    with pytest.raises(ValueError, match="fused_experts"):
        fused(x, expert_ids, weights)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")
def test_fused_experts_capture_in_a_cuda_graph_and_replay_with_new_routing():
    reference, fused = random_experts("wide", torch.bfloat16)
    x = randn(4, EXPERT_SHAPES["wide"][2], dtype=torch.bfloat16, seed=5)
    expert_ids, weights = random_routing(4, "wide", torch.bfloat16)
    with torch.no_grad():
        fused(x, expert_ids, weights)  # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(x, expert_ids, weights)
        for seed in (6, 7):
            new_ids, new_weights = random_routing(4 + seed, "wide", torch.bfloat16)
            expert_ids.copy_(new_ids[:4])
            weights.copy_(new_weights[:4])
            x.copy_(randn(4, EXPERT_SHAPES["wide"][2], dtype=torch.bfloat16, seed=seed))
            graph.replay()
            torch.testing.assert_close(out, reference(x, expert_ids, weights), atol=3e-2, rtol=3e-2)
