"""Exercises (notebook 04): the Gated DeltaNet (GDN) layer, Qwen3.5's linear-attention mixer.

A GDN layer keeps, per request, a fixed-size state instead of a growing KV cache:
- a conv state [conv_dim, K-1]: the last K-1 inputs of its causal depthwise convolution (K = conv kernel size);
- a recurrent state S [Hv, dk, dv] in float32: one dk x dv matrix per value head, updated by the gated delta rule

    S <- S * exp(g_t)                    forget a little (g_t <= 0)
    delta_t = beta_t * (v_t - S^T k_t)   what S still gets wrong about the pair (k_t, v_t)
    S <- S + k_t delta_t^T               correct it (beta_t in (0, 1) is the step size)
    o_t = S^T q_t                        read

Decode runs this recurrence, one token per request. Prefill runs the same rule in chunks: within a chunk the
sequential corrections are folded into a few matrix products (the WY / UT transform), and only the state passes from
chunk to chunk. Both agree with transformers' `torch_recurrent_gated_delta_rule` and `torch_chunk_gated_delta_rule`
to float32 rounding.

The layer, the conv and the chunked form work on a flattened batch: the tokens of every request in one row, request
i's tokens after those of request i-1, as in a4's ForwardBatch. The recurrence takes B sequences of equal length,
which is what a decode step is (one token each).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from a4.core import ForwardBatch
from a4.model_config import ModelConfig


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, seq_lens: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv1d, then silu, over a flattened batch of sequences, each with its own conv state.

    x: [T, D] the pre-conv inputs of all sequences, sequence i's seq_lens[i] tokens after sequence i-1's.
    weight: [D, 1, K], the `conv1d.weight` of the checkpoint (one length-K filter per channel, no bias).
    conv_states: [B, D, K-1], each sequence's last K-1 inputs before x (zeros for a sequence that starts here).
    Returns (y [T, D], new_conv_states [B, D, K-1]); the new state of a sequence is the last K-1 inputs of
    `state + its tokens`, so a sequence shorter than K-1 keeps part of its old state.

    Output t of a channel is silu(sum_j weight[j] * input[t - (K-1) + j]), the inputs before the sequence's first
    token taken from its conv state: the K products summed in float32, rounded to x's dtype, then silu (as
    transformers' torch `causal_conv1d_fn` computes it, whose depthwise conv accumulates in float32).
    """
    # BEGIN SOLUTION gdn-conv-prefill 04_gated_deltanet: causal depthwise conv1d + silu per sequence, from its state
    kernel = weight.shape[-1]
    taps = weight[:, 0].T.float()  # [K, D]: row j holds tap j of every channel's filter
    outputs, new_states = [], []
    for state, x_i in zip(conv_states, x.split(seq_lens)):
        window = torch.cat([state.T, x_i])  # [K-1 + L, D]: the state supplies the left context
        # No padding: output t sees window[t : t + K], token t and the K-1 inputs before it. Summed tap by tap over
        # whole rows, in float32 as a conv accumulates, rather than with F.conv1d, which wants channels before time:
        # on a CPU, transposing [L, D] there and back cost more than the conv itself.
        window32, length = window.float(), x_i.shape[0]
        y = window32[:length] * taps[0]
        for j in range(1, kernel):
            y.addcmul_(window32[j : j + length], taps[j])  # y += window32[j : j + length] * taps[j], in place
        outputs.append(y.to(x.dtype))
        new_states.append(window[window.shape[0] - (kernel - 1) :].T)
    return F.silu(torch.cat(outputs)), torch.stack(new_states)
    # END SOLUTION


def causal_conv1d_decode(
    x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token for each of B sequences: x [B, D], conv_states [B, D, K-1], weight [D, 1, K].

    Returns (y [B, D], new_conv_states [B, D, K-1]) with y = silu(conv over the K inputs `state + x`) and the new
    state = the last K-1 of those inputs. Same arithmetic as `causal_conv1d_prefill` for a one-token sequence, batched
    over the sequences; in x's dtype, as transformers' causal_conv1d_update.
    """
    # BEGIN SOLUTION gdn-conv-decode 04_gated_deltanet: one-token causal conv1d + silu for B sequences, new conv state
    window = torch.cat([conv_states, x[:, :, None]], dim=2)  # [B, D, K]
    y = F.conv1d(window, weight, groups=window.shape[1])[:, :, 0]
    return F.silu(y), window[:, :, 1:]
    # END SOLUTION


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule, one token at a time, for B sequences of T tokens each (decode: T = 1).

    q, k: [B, T, H, dk]; v: [B, T, H, dv]; g, beta: [B, T, H]; initial_state: [B, H, dk, dv]. All float32, one head
    per value head (key heads already repeated), q already scaled by dk^-0.5, q and k already l2-normalised.
    For each token t and head h, with S the head's [dk, dv] state:
        S <- S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t
    Returns (o [B, T, H, dv], final_state [B, H, dk, dv]); initial_state is not modified.
    Matches transformers' torch_recurrent_gated_delta_rule (fed unscaled q) to float32 rounding.
    """
    # BEGIN SOLUTION gdn-recurrence 04_gated_deltanet: the gated delta rule, one token at a time
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    # Sequences and heads are independent: fold them into one batch dim of small matrix products.
    state = initial_state.reshape(batch * heads, dk, dv).clone()
    o = v.new_empty(batch, length, heads, dv)
    decay = g.exp()
    for t in range(length):
        k_t = k[:, t].reshape(batch * heads, dk, 1)
        state.mul_(decay[:, t].reshape(batch * heads, 1, 1))
        predicted = torch.bmm(k_t.transpose(1, 2), state)  # S^T k: what the state recalls for k_t, [BH, 1, dv]
        delta = (v[:, t].reshape(batch * heads, 1, dv) - predicted) * beta[:, t].reshape(batch * heads, 1, 1)
        state.baddbmm_(k_t, delta)  # S += k delta^T, in place
        o[:, t] = torch.bmm(q[:, t].reshape(batch * heads, 1, dk), state).reshape(batch, heads, dv)
    return o, state.reshape(batch, heads, dk, dv)
    # END SOLUTION


class IntraChunk(NamedTuple):
    """What `intra_chunk` computes for n chunks of C tokens (H heads): everything that does not need the state."""

    u: torch.Tensor  # [n, H, C, dv]  delta of each token if the chunk's initial state were zero
    w: torch.Tensor  # [n, H, C, dk]  delta = u - w @ S0 for the chunk's initial state S0
    attn: torch.Tensor  # [n, H, C, C]  decayed causal scores: attn[i, j] = (q_i . k_j) exp(G_i - G_j) for j <= i
    q_decayed: torch.Tensor  # [n, H, C, dk]  q_i exp(G_i): reads S0 as it has decayed by token i
    k_decayed: torch.Tensor  # [n, H, C, dk]  k_j exp(G_last - G_j): writes delta_j as it will have decayed by the end
    chunk_decay: torch.Tensor  # [n, H]  exp(G_last): how much S0 decays over the whole chunk


def intra_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> IntraChunk:
    """The within-chunk half of the chunked gated delta rule (the WY / UT transform), for n chunks at once.

    q, k: [n, H, C, dk]; v: [n, H, C, dv]; g, beta: [n, H, C]; float32, as for `recurrent_gated_delta_rule`.
    Padding positions at the end of a chunk must have g = 0 and beta = 0 (they then change nothing).

    Within a chunk, with G_i = g_0 + ... + g_i and S0 the state before the chunk, the recurrence unrolls to
        delta_i = beta_i (v_i - exp(G_i) S0^T k_i - sum_{j<i} exp(G_i - G_j) (k_i . k_j) delta_j)
    i.e. (I + A) delta = beta v - beta exp(G) k S0 with A[i, j] = beta_i exp(G_i - G_j) (k_i . k_j) for j < i,
    a unit lower-triangular system. Solving it once per chunk gives delta = u - w S0 with
        u = (I + A)^-1 (beta v),   w = (I + A)^-1 (beta exp(G) k).
    Then o_i = exp(G_i) S0^T q_i + sum_{j<=i} attn[i, j] delta_j and the state after the chunk is
    exp(G_last) S0 + sum_j exp(G_last - G_j) k_j delta_j^T. Returns the `IntraChunk` terms of these formulas.
    """
    # BEGIN SOLUTION gdn-intra-chunk 04_gated_deltanet: the WY/UT transform of every chunk, all chunks at once
    chunk = g.shape[-1]
    # Every decay factor is exp of a sum of g over a stretch of the chunk: decay[i, j] = exp(G_i - G_j), the sum of
    # g over (j, i]. Summing each stretch from zero (a cumsum down the columns of a masked copy of g) rather than
    # subtracting two running sums G_i - G_j keeps it accurate: with strong decays G reaches -1000s within a chunk,
    # where one float32 ulp (~1e-4) would be the error of every difference.
    above_or_on = torch.ones(chunk, chunk, dtype=torch.bool, device=g.device).triu()
    stretch = g[..., :, None].expand(*g.shape, chunk).masked_fill(above_or_on, 0).cumsum(-2)
    # Above the diagonal (j > i) stretch is 0, not a decay: mask it to exp(-inf) = 0 there.
    decay = stretch.masked_fill_(above_or_on.triu(1), float("-inf")).exp_()  # [n, H, C, C]
    exp_g = decay[..., :, 0] * g[..., :1].exp()  # exp(G_i) = exp(g_0) exp(G_i - G_0)
    # beta and exp(G) scale rows or columns of the C x C matrices where the formulas allow it, rather than the [C, d]
    # operands: less arithmetic, as C <= d. Only the strictly lower triangle of `system` is read:
    # solve_triangular(unitriangular=True) takes the diagonal as ones, which makes it I + A.
    system = (k @ k.transpose(-1, -2)).mul_(decay).mul_(beta[..., :, None])
    identity = torch.eye(chunk, dtype=k.dtype, device=k.device)
    # One triangular solve for the inverse, then matmuls: on CPU, LAPACK's batched trsm runs one small matrix at a
    # time, so solving for the dk + dv right-hand sides directly would be several times slower.
    inverse_beta = torch.linalg.solve_triangular(system, identity, upper=False, unitriangular=True)
    inverse_beta.mul_(beta[..., None, :])  # (I + A)^-1 diag(beta)
    return IntraChunk(
        u=inverse_beta @ v,
        w=(inverse_beta * exp_g[..., None, :]) @ k,
        attn=(q @ k.transpose(-1, -2)).mul_(decay),
        q_decayed=q * exp_g[..., None],
        k_decayed=k * decay[..., -1, :, None],  # exp(G_last - G_j)
        chunk_decay=exp_g[..., -1],
    )
    # END SOLUTION


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of `chunk_size` tokens, for a flattened batch of B sequences (prefill).

    q, k: [T, H, dk]; v: [T, H, dv]; g, beta: [T, H]: float32, prepared as for `recurrent_gated_delta_rule`.
    cu_seqlens: [B+1] int64 on the CPU, even where the other tensors are on a GPU (the bounds are the host's to
    read: the engine's backend builds them from its host lengths), sequence i is tokens cu_seqlens[i] ..
    cu_seqlens[i+1]-1 (flash-linear-attention's varlen convention); any lengths, not only multiples of chunk_size
    (16, 32 or 64).
    initial_state: [B, H, dk, dv] float32, sequence i's state before its first token (not modified).
    Returns (o [T, H, dv], final_state [B, H, dk, dv]): the same as running `recurrent_gated_delta_rule` on each
    sequence alone, to float32 rounding.

    The default chunk size is the fastest on CPU at Qwen3.5's shapes: the within-chunk work per token grows with
    chunk_size, the sequential work per token does not (transformers and flash-linear-attention use 64; the results
    agree to float32 rounding either way).

    Each sequence is cut into chunks of chunk_size tokens (its last chunk padded). `intra_chunk` does the
    within-chunk work of many chunks in batched matrix products; only the state update from one chunk to the next is
    sequential. Speed matters, and `python -m a4 bench gdn` measures it: on CPU, at Qwen3.5-0.8B's shapes, the
    reference solution runs about 3x as many tokens/s as the recurrence and as transformers' chunked form, and the
    same tokens/s at any sequence length.
    """
    # BEGIN SOLUTION gdn-chunked 04_gated_deltanet: the chunked gated delta rule, varlen batch, state across chunks
    bounds = cu_seqlens.tolist()
    # Every chunk of every sequence, in token order, as (sequence, first token, end token).
    chunks = [
        (seq, start, min(start + chunk_size, end))
        for seq, (first, end) in enumerate(zip(bounds, bounds[1:]))
        for start in range(first, end, chunk_size)
    ]
    # Chunks go through in groups of about 128 tokens: enough chunks for batched matmuls, few enough that a group's
    # temporaries stay in cache, so tokens/s does not depend on T. (Tensors of all T tokens at once would fall out
    # of cache and, past glibc's 32 MB mmap threshold, be page-faulted afresh on every call: tokens/s would drop as
    # T grows. On the 0.8B shapes, groups of 512 tokens already run ~15% slower than groups of 128.)
    per_group = max(1, 128 // chunk_size)
    o = torch.empty_like(v)
    state = initial_state.clone()
    for group_start in range(0, len(chunks), per_group):
        group = chunks[group_start : group_start + per_group]

        def to_chunks(x: torch.Tensor) -> torch.Tensor:
            """[T, H, ...] -> [n, H, chunk_size, ...] for this group's chunks, zero-padded (so g = beta = 0)."""
            first, stop = group[0][1], group[-1][2]
            if stop - first == len(group) * chunk_size:  # all chunks full (the usual case): one copy
                return x[first:stop].unflatten(0, (len(group), chunk_size)).transpose(1, 2).contiguous()
            out = x.new_zeros(len(group), x.shape[1], chunk_size, *x.shape[2:])
            for i, (_, start, end) in enumerate(group):
                out[i, :, : end - start] = x[start:end].transpose(0, 1)
            return out

        terms = intra_chunk(*(to_chunks(x) for x in (q, k, v, g, beta)))
        for i, (seq, start, end) in enumerate(group):
            s = state[seq]  # [H, dk, dv], updated in place
            delta = torch.baddbmm(terms.u[i], terms.w[i], s, alpha=-1)  # u - w S0
            o_chunk = torch.bmm(terms.q_decayed[i], s).baddbmm_(terms.attn[i], delta)
            o[start:end] = o_chunk[:, : end - start].transpose(0, 1)
            s.mul_(terms.chunk_decay[i][:, None, None]).baddbmm_(terms.k_decayed[i].transpose(1, 2), delta)
    return o, state
    # END SOLUTION


class GatedDeltaInputs(NamedTuple):
    """The delta rule's inputs in the form the rule functions above take them (float32, one head per value head)."""

    q: torch.Tensor  # [..., Hv, dk], l2-normalised and scaled by dk^-0.5
    k: torch.Tensor  # [..., Hv, dk], l2-normalised
    v: torch.Tensor  # [..., Hv, dv]
    g: torch.Tensor  # [..., Hv], the log of each token's decay (<= 0)
    beta: torch.Tensor  # [..., Hv], each token's step size in (0, 1)


def gated_delta_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
) -> GatedDeltaInputs:
    """The layer's conv output and gate projections -> the inputs of `recurrent_gated_delta_rule` and
    `chunk_gated_delta_rule`, exactly as transformers' Qwen3_5GatedDeltaNet prepares them.

    q, k [..., Hk, dk] and v [..., Hv, dv] (model dtype): the conv output split into heads; a, b [..., Hv]: the
    in_proj_a / in_proj_b outputs; A_log, dt_bias [Hv]: the layer's parameters. In float32: q and k l2-normalised
    (x * rsqrt(sum(x^2) + 1e-6): transformers' l2norm, whose eps sits inside the root), q scaled by dk^-0.5, value
    head h reading key head h // (Hv / Hk) (repeat_interleave, not repeat: consecutive value heads share a key head);
    beta = sigmoid(b) (in b's dtype, then float32); g = -exp(A_log) * softplus(a + dt_bias).

    Given, not an exercise: every backend of the layer that runs the students' rule functions calls it (a GPU
    kernel does the same arithmetic inside itself), so it is written once.
    """
    group = v.shape[-2] // k.shape[-2]

    def normalised(x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + 1e-6)
        return x.repeat_interleave(group, dim=-2)

    return GatedDeltaInputs(
        q=normalised(q) * q.shape[-1] ** -0.5,
        k=normalised(k),
        v=v.float(),
        g=-A_log.float().exp() * F.softplus(a.float() + dt_bias),
        beta=b.sigmoid().float(),
    )


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head's dv channels, then a silu gate from z (`linear_attn.norm` in the checkpoint)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: [..., dv] in the model dtype -> [..., dv] in the model dtype.

        Normalise x in float32 (x * rsqrt(mean(x^2) + eps)), cast to x's dtype, multiply by weight, multiply by
        silu(z.float()), cast back: the order of transformers' Qwen3_5RMSNormGated (norm first, then gate).
        """
        # BEGIN SOLUTION gdn-gated-norm 04_gated_deltanet: RMSNorm per value head, then the silu(z) gate
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return ((self.weight * normed) * F.silu(z.float())).to(x.dtype)
        # END SOLUTION


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (`linear_attn` in the checkpoint), over a4's flattened ForwardBatch."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_k_heads = config.linear_num_key_heads
        self.num_v_heads = config.linear_num_value_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.conv_kernel = config.linear_conv_kernel_dim
        conv_dim = config.conv_dim
        # Parameter names are the checkpoint's, so weights load without renaming.
        self.in_proj_qkv = nn.Linear(config.hidden_size, conv_dim, bias=False)  # rows: all q | all k | all v
        self.in_proj_z = nn.Linear(config.hidden_size, config.linear_value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.num_v_heads, bias=False)
        # Only its weight [conv_dim, 1, K] is used (by the conv functions above), never its forward.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, self.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(config.linear_value_dim, config.hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch, gdn_layer: int) -> torch.Tensor:
        """hidden [T, hidden_size] (model dtype) -> [T, hidden_size], as transformers' Qwen3_5GatedDeltaNet.

        The layer's states are layer `gdn_layer` of fb.state_pool; the two steps that read and update them go
        through the step's backend (`fb.attn_backend`, a4/layers/gdn_backend.py), which runs the functions above
        for the step's mode (`fb.mode`) on each request's slot:
            x = fb.attn_backend.conv(mixed_qkv, self.conv1d.weight, gdn_layer, fb)            # [T, conv_dim]
            o = fb.attn_backend.delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, gdn_layer, fb)  # [T, Hv, dv] fp32
        The backend continues each request from what its slot holds (zeros for a request that starts here: the
        engine clears a slot when it gives it out, notebook 05).

        in_proj_qkv -> conv -> split into q [T, Hk, dk], k [T, Hk, dk], v [T, Hv, dv] (model dtype; the q rows of
        the conv output first, then k, then v) -> the delta rule with a = in_proj_a(hidden) and b =
        in_proj_b(hidden) [T, Hv] (the backend turns them into the gates with `gated_delta_inputs`) -> its output,
        cast to the model dtype, through the gated norm with z = in_proj_z(hidden) per value head, then out_proj.
        """
        # BEGIN SOLUTION gdn-layer 04_gated_deltanet: the Gated DeltaNet layer over a ForwardBatch, through its backend
        num_tokens = hidden.shape[0]
        backend = fb.attn_backend
        x = backend.conv(self.in_proj_qkv(hidden), self.conv1d.weight, gdn_layer, fb)
        key_dim = self.num_k_heads * self.head_k_dim
        q, k, v = x.split([key_dim, key_dim, self.num_v_heads * self.head_v_dim], dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        a, b = self.in_proj_a(hidden), self.in_proj_b(hidden)
        o = backend.delta_rule(q, k, v, a, b, self.A_log, self.dt_bias, gdn_layer, fb)
        z = self.in_proj_z(hidden).reshape(num_tokens, self.num_v_heads, self.head_v_dim)
        o = self.norm(o.to(hidden.dtype), z)
        return self.out_proj(o.reshape(num_tokens, -1))
        # END SOLUTION
