"""Exercises (notebook 11): the verify pass of speculative decoding, and the commit of the accepted length.

A decode step with speculation feeds each request L = k + 1 tokens at once: its last committed token and the k tokens
a drafter proposed after it. One forward of the main model over those tokens gives, at every position j, the
model's own next token `target_ids[:, j]`. The drafts are accepted as long as they agree with it (greedy
verification), and the request gains the accepted drafts plus the model's token after them.

The attention layers roll back for free: the KV of the rejected positions is forgotten (freed or overwritten). A
Gated DeltaNet layer cannot forget: its state after the verify has folded in every drafted token, rejected ones
included, and the state after an earlier position cannot be got back from it. So the verify pass keeps the state
after *every* position, and the commit copies into the pool the one after the last kept position. These functions
are that verify pass for one GDN layer (the conv and the delta rule, each returning its states position by
position), greedy acceptance, and the commit. Every request is a row of the same batched tensor operations: no
Python loop over the requests (the recurrence walks the L positions, as notebook 04's does).

A sampled request (temperature > 0) cannot compare drafts with one "model's token": its next token is a draw. It
accepts by rejection sampling instead (`rejection_accept`, given, not an exercise: notebook 11 shows it at work), so
that its tokens are distributed exactly as plain sampling's; how long a prefix it keeps is still a length a, and the
state half is the same commit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_verify(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv + silu over the L verify tokens of B requests, with the conv state after each token.

    x: [B, L, D] in the model dtype, each request's in_proj_qkv outputs for its L tokens. weight: [D, 1, K].
    conv_state: [B, D, K-1], each request's last K-1 inputs before x (not modified).

    Returns (y [B, L, D], conv_states [B, L, D, K-1]), both in x's dtype. y is what notebook 04's
    `causal_conv1d_prefill` computes for each request's L tokens: silu(sum_j weight[:, 0, j] * window[:, t + j]),
    window = cat(conv_state, x as columns). conv_states[:, j] is the conv state after token j: the last K-1
    inputs of cat(conv_state, the columns of x[:, :j+1]) (conv_states[:, L-1] is the state after all L tokens).
    """
    # BEGIN SOLUTION spec-conv-verify 11_speculative: the conv over L tokens per request, and its state after each
    kernel = weight.shape[-1]
    window = torch.cat([conv_state, x.transpose(1, 2)], dim=2)  # [B, D, K-1 + L]
    y = F.silu(F.conv1d(window, weight, groups=window.shape[1]))  # [B, D, L]
    # The K-1 columns starting at column j are the state before token j; those starting at j + 1, the state after.
    states = window.unfold(2, kernel - 1, 1)[:, :, 1:]  # [B, D, L, K-1]
    return y.transpose(1, 2), states.permute(0, 2, 1, 3).contiguous()
    # END SOLUTION


def gated_delta_rule_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the L verify tokens of B requests, with the recurrent state after each token.

    Inputs as for notebook 04's `recurrent_gated_delta_rule`: q, k [B, L, H, dk]; v [B, L, H, dv]; g, beta [B, L, H];
    initial_state [B, H, dk, dv] (not modified); float32, q scaled by dk^-0.5, q and k l2-normalised, key heads
    already repeated to the value heads. For each token t and head h, with S the head's [dk, dv] state:
        S <- S * exp(g_t);  delta = beta_t * (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t

    Returns (o [B, L, H, dv], states [B, L, H, dk, dv]): states[:, j] is S after token j (states[:, L-1] is what
    `recurrent_gated_delta_rule` returns as the final state).
    """
    # BEGIN SOLUTION spec-rule-verify 11_speculative: the delta rule over L tokens per request, and its state after each
    batch, length, heads, dk = k.shape
    dv = v.shape[-1]
    # Requests and heads are independent: one batch of B * H small matrix products, as in notebook 04.
    state = initial_state.reshape(batch * heads, dk, dv)
    o = v.new_empty(batch, length, heads, dv)
    states = v.new_empty(batch, length, heads, dk, dv)
    for t in range(length):
        k_t = k[:, t].reshape(batch * heads, dk, 1)
        state = state * g[:, t].exp().reshape(batch * heads, 1, 1)  # a new tensor: initial_state stays as it was
        predicted = torch.bmm(k_t.transpose(1, 2), state)  # S^T k, as a row: [B * H, 1, dv]
        delta = (v[:, t].reshape(batch * heads, 1, dv) - predicted) * beta[:, t].reshape(batch * heads, 1, 1)
        state = torch.baddbmm(state, k_t, delta)  # S + k delta^T
        o[:, t] = torch.bmm(q[:, t].reshape(batch * heads, 1, dk), state).reshape(batch, heads, dv)
        states[:, t] = state.reshape(batch, heads, dk, dv)
    return o, states
    # END SOLUTION


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """How many drafted tokens each request accepts under greedy verification.

    draft_ids: [B, k] int64, the drafted tokens; a request drafting fewer than k pads its row with -1 after its own
    drafts. target_ids: [B, k+1] int64, the main model's greedy token after each verify position: position 0 fed the
    last committed token, position j >= 1 fed draft_ids[:, j-1]; -1 where there is none (a padded position). A -1
    draft is never accepted, whatever target_ids holds there.

    Returns accepted [B] int64: accepted[i] is the largest a with draft_ids[i, :a] == target_ids[i, :a] (the drafts
    agree with the model up to there). The request gains a + 1 tokens: draft_ids[i, :a], then target_ids[i, a],
    the model's own token after the last accepted position.
    """
    if draft_ids.dim() != 2 or target_ids.shape != (draft_ids.shape[0], draft_ids.shape[1] + 1):
        raise ValueError(
            f"greedy_accept: draft_ids must be [B, k] and target_ids [B, k+1]; got {tuple(draft_ids.shape)} and "
            f"{tuple(target_ids.shape)}"
        )
    # BEGIN SOLUTION spec-greedy-accept 11_speculative: how long a prefix of each draft the model agrees with
    agrees = ((draft_ids == target_ids[:, :-1]) & (draft_ids >= 0)).long()  # [B, k]; padding never agrees
    # A running product is 1 up to the first disagreement and 0 from there: its sum is the accepted length.
    return agrees.cumprod(dim=1).sum(dim=1)
    # END SOLUTION


def rejection_accept(
    draft_ids: torch.Tensor, target_probs: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """How many drafted tokens each sampled request accepts, and the distribution its next token is drawn from:
    speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Given code.

    draft_ids: [B, k] int64, as for `greedy_accept` (-1 pads a request that drafted fewer than k). target_probs:
    [B, k+1, V] float32, the distribution p_j the request samples from after verify position j, its temperature,
    top_k and top_p applied (`a4.engine.sampling.sampling_distribution`). uniforms: [B, k] in [0, 1), one per draft.

    A drafter that drew x from its own distribution q accepts it with probability min(1, p(x) / q(x)) and, on a
    rejection, draws from the residual max(p - q, 0) / its sum instead; either way the token comes out with
    probability p(x). a4's drafters are greedy: q is one-hot on the draft, so draft j is accepted with probability
    p_j(draft j) (when uniforms[:, j] < p_j(draft j), the drafts before it accepted), and the residual is p_j with the
    draft's token removed, renormalised. A -1 draft is never accepted, and as nothing was proposed there, its
    "residual" is p_j itself.

    Returns (accepted [B] int64, next_probs [B, V]). The request gains draft_ids[i, :a] (a = accepted[i]), then one
    token drawn from next_probs[i]: the residual at position a if draft a was rejected, or p_k, the bonus token after
    the last draft, if all k were accepted.
    """
    batch, k = draft_ids.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1) or uniforms.shape != draft_ids.shape:
        raise ValueError(
            f"rejection_accept: draft_ids must be [B, k], target_probs [B, k+1, V] and uniforms [B, k]; got "
            f"{tuple(draft_ids.shape)}, {tuple(target_probs.shape)} and {tuple(uniforms.shape)}"
        )
    proposed = draft_ids >= 0
    # p_j(draft j), read at token 0 where there is no draft (masked out by `proposed`).
    draft_probs = target_probs[:, :k].gather(2, draft_ids.clamp(min=0).unsqueeze(2)).squeeze(2)
    agrees = ((uniforms < draft_probs) & proposed).long()
    # Accepted up to the first rejection, as in greedy_accept.
    accepted = agrees.cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=draft_ids.device)
    probs_at_a = target_probs[rows, accepted]
    # The draft rejected at position a: none (-1) after all k were accepted (the bonus draws from p_k) or on padding.
    no_draft = draft_ids.new_full((batch, 1), -1)
    rejected = torch.cat([draft_ids, no_draft], dim=1)[rows, accepted]
    residual = probs_at_a.scatter(1, rejected.clamp(min=0).unsqueeze(1), 0.0)
    residual = torch.where((rejected >= 0).unsqueeze(1), residual, probs_at_a)
    # Never all zero: a draft is rejected only when p(draft) <= u < 1, which leaves mass on other tokens.
    return accepted, residual / residual.sum(dim=1, keepdim=True)


def commit_verified_states_(
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    slots: torch.Tensor,
    kept_lens: torch.Tensor,
) -> None:
    """Set each request's state in the pool of one GDN layer to its state after the last verify token it keeps.

    conv_state [num_slots, D, K-1] and recurrent_state [num_slots, H, dk, dv]: the layer's state pool tensors, updated
    in place (rows not in `slots` untouched). conv_states [B, L, D, K-1] and recurrent_states [B, L, H, dk, dv]: the
    verify pass's states after each position (`causal_conv1d_verify`, `gated_delta_rule_verify`). slots [B] int64:
    each request's pool row. kept_lens [B] int64 in 1..L: how many verify tokens request i keeps (its accepted drafts
    + 1: the last committed token and the accepted drafts; fewer if it finished inside its draft).

    Row slots[i] of both pool tensors becomes request i's state after its verify token kept_lens[i] - 1.
    """
    length = conv_states.shape[1]
    in_range = ((kept_lens >= 1) & (kept_lens <= length)).all()
    if kept_lens.shape != slots.shape or not in_range:
        raise ValueError(
            f"commit_verified_states_: kept_lens must hold one length in 1..{length} per slot; got "
            f"{kept_lens.tolist()} for slots {slots.tolist()}"
        )
    # BEGIN SOLUTION spec-commit 11_speculative: copy each request's state after its last kept token into its pool row
    rows = torch.arange(len(slots), device=slots.device)
    last = kept_lens - 1
    conv_state.index_copy_(0, slots, conv_states[rows, last])
    recurrent_state.index_copy_(0, slots, recurrent_states[rows, last])
    # END SOLUTION
