"""Exercises (notebook 11): the verify pass of speculative decoding, and the commit of what it accepted.

(Temporary reference by the lead; helper nb11 writes the real one.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_verify(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, L, D], weight [D, 1, K], conv_state [B, D, K-1] -> (y [B, L, D], conv_states [B, L, D, K-1])."""
    # BEGIN SOLUTION spec-conv-verify 11_speculative: the causal conv over each request's verify tokens, and the conv state after each
    kernel = weight.shape[-1]
    length = x.shape[1]
    window = torch.cat([conv_state, x.transpose(1, 2)], dim=2)  # [B, D, K-1+L]
    y = F.silu(F.conv1d(window, weight, groups=window.shape[1])).transpose(1, 2)
    states = torch.stack([window[:, :, j + 1 : j + kernel] for j in range(length)], dim=1)
    return y, states
    # END SOLUTION


def gated_delta_rule_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As recurrent_gated_delta_rule; also returns states [B, L, H, dk, dv], the state after each token."""
    # BEGIN SOLUTION spec-rule-verify 11_speculative: the gated delta rule over the verify tokens, keeping the state after each
    batch, length, heads, dk = k.shape
    state = initial_state.clone()
    o = v.new_empty(batch, length, heads, v.shape[-1])
    states = []
    for t in range(length):
        state = state * g[:, t, :, None, None].exp()
        delta = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t]))
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
        states.append(state)
    return o, torch.stack(states, dim=1)
    # END SOLUTION


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """draft_ids [B, k], target_ids [B, k+1] -> accepted [B]: the longest prefix of drafts the targets agree with."""
    # BEGIN SOLUTION spec-accept 11_speculative: how many drafts greedy verification accepts
    agree = (draft_ids == target_ids[:, :-1]).long()
    return agree.cumprod(dim=1).sum(dim=1)
    # END SOLUTION


def commit_verified_states_(
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    slots: torch.Tensor,
    kept_lens: torch.Tensor,
) -> None:
    """pool[slots[i]] <- states[i, kept_lens[i] - 1], for one GDN layer's conv and recurrent states."""
    # BEGIN SOLUTION spec-commit 11_speculative: write the state after the last kept token into each request's slot
    rows = torch.arange(len(slots), device=slots.device)
    conv_state[slots] = conv_states[rows, kept_lens - 1]
    recurrent_state[slots] = recurrent_states[rows, kept_lens - 1]
    # END SOLUTION
