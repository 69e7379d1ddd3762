# GENERATED from solutions/a4/speculative/verify.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/speculative/verify.py instead
# and run `python -m a4.course sync`.
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
    raise NotImplementedError("Exercise spec-conv-verify: the causal conv over each request's verify tokens, and the conv state after each (notebooks/11_speculative.ipynb)")


def gated_delta_rule_verify(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As recurrent_gated_delta_rule; also returns states [B, L, H, dk, dv], the state after each token."""
    raise NotImplementedError("Exercise spec-rule-verify: the gated delta rule over the verify tokens, keeping the state after each (notebooks/11_speculative.ipynb)")


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """draft_ids [B, k], target_ids [B, k+1] -> accepted [B]: the longest prefix of drafts the targets agree with."""
    raise NotImplementedError("Exercise spec-accept: how many drafts greedy verification accepts (notebooks/11_speculative.ipynb)")


def commit_verified_states_(
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    conv_states: torch.Tensor,
    recurrent_states: torch.Tensor,
    slots: torch.Tensor,
    kept_lens: torch.Tensor,
) -> None:
    """pool[slots[i]] <- states[i, kept_lens[i] - 1], for one GDN layer's conv and recurrent states."""
    raise NotImplementedError("Exercise spec-commit: write the state after the last kept token into each request's slot (notebooks/11_speculative.ipynb)")
