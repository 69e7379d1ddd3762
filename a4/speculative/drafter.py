"""Drafters: who proposes the tokens a speculative decode step verifies.

A decode step with speculation (Engine, `speculative_tokens=k`) asks its drafter for up to k tokens per request,
feeds the main model each request's last token followed by its drafts, and keeps the drafts verification accepts
plus one token of the model's own. Whatever the drafts, the output is the model's greedy output, or for a sampled
request a draw from its sampling distribution (rejection sampling): a bad draft only costs the work of verifying
it. Both drafters are greedy (a draft is one token, not a distribution). Two drafters:

- `MTPDrafter`: Qwen3.5's multi-token-prediction module (a4/models/qwen3_5_mtp.py), one decoder layer that reads the
  main model's last hidden state and the next token (Qwen3.5-MoE's layer has a mixture of experts as its MLP). It
  keeps KV of its own, one more layer of the engine's KV pool, at the same locations as the main model's. After
  every forward of the main model it catches up over the positions that forward committed (`observe`): at position
  p it reads (h_p, token p + 1), writes its KV at p and, from the last committed position, drafts the first token.
  `propose` chains the rest: draft i + 1 is read from the module's own output and draft i, at the next position.
  Those chained positions' KV is provisional: the next `observe` rewrites it from the main model's true hidden
  states.
- `OracleDrafter`: drafts from a known greedy continuation, right for its first `correct` tokens and wrong after,
  so that tests and notebook 11 can force every acceptance length.

What a prefix-cache hit gives the MTP module: its KV for the cached positions, written by the request that cached
them. At the last cached position that KV was computed from the token that request had next, which a new request may
not share: its first draft may then be worse. The drafts are only ever proposals, so the output does not change.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Protocol

import torch

from a4.core import ForwardMode, Req


class Drafter(Protocol):
    # Attention layers the drafter keeps in the engine's KV pool, after the main model's (the memory plan counts them).
    kv_layers: int

    def propose(self, reqs: Sequence[Req], num_drafts: Sequence[int]) -> list[list[int]]:
        """Up to num_drafts[i] tokens to follow reqs[i]'s last token (its next computed_len positions have KV
        locations, for a drafter that writes KV there)."""
        ...

    def observe(self, reqs: Sequence[Req], committed: Sequence[int], hidden: torch.Tensor) -> None:
        """The main model has just committed reqs[i]'s last committed[i] positions; hidden [sum(committed), H] holds
        its final hidden states there, request after request. Finished requests are not passed."""
        ...


class OracleDrafter:
    """Drafts from known continuations: right for the first `correct` tokens of every draft, wrong after.

    continuations: prompt token ids -> the model's greedy output for that prompt (a4.reference.hf_greedy). A wrong
    token is the right one + 1 (mod vocab_size), so it can never be accepted; past the continuation's end every
    draft is wrong.
    """

    kv_layers = 0

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], correct: int, vocab_size: int) -> None:
        self.continuations = {tuple(prompt): list(output) for prompt, output in continuations.items()}
        self.correct = correct
        self.vocab_size = vocab_size

    def propose(self, reqs: Sequence[Req], num_drafts: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, n in zip(reqs, num_drafts):
            truth = self.continuations[tuple(req.input_ids)]
            # The request's next output token is output_ids[len(output_ids)]: drafts start there.
            start = len(req.output_ids)
            right = truth[start : start + min(n, self.correct)]
            wrong_from = start + len(right)
            wrong = [(truth[i] + 1) % self.vocab_size if i < len(truth) else 0 for i in range(wrong_from, start + n)]
            drafts.append(right + wrong)
        return drafts

    def observe(self, reqs: Sequence[Req], committed: Sequence[int], hidden: torch.Tensor) -> None:
        pass


class MTPDrafter:
    """Qwen3.5's MTP module as a drafter; its KV is the engine's KV pool's layer `mtp.pool_layer`, and its steps are
    built by the engine's model runner (a4/engine/model_runner.py)."""

    def __init__(self, mtp: torch.nn.Module, runner) -> None:
        self.mtp, self.runner = mtp, runner
        self.kv_layers = len(mtp.layers)
        hidden_size, dtype = mtp.fc.out_features, mtp.fc.weight.dtype
        num_slots, device = runner.table_manager.max_running_requests, runner.device
        # Per slot, from the last `observe`: the first draft and the module's output it came from (the next chained
        # draft's hidden state).
        self.first_draft = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.draft_hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=device)

    def observe(self, reqs: Sequence[Req], committed: Sequence[int], hidden: torch.Tensor) -> None:
        # Row r of request i is position p = computed_len - committed[i] + r; its next token is all_ids[p + 1].
        starts = [req.computed_len - n for req, n in zip(reqs, committed)]
        next_ids = [t for req, p, n in zip(reqs, starts, committed) for t in req.ids_between(p + 1, p + n + 1)]
        last_rows = [end - 1 for end in itertools.accumulate(committed)]
        out = self._forward(ForwardMode.EXTEND, next_ids, reqs, starts, committed, hidden, last_rows)
        slots = torch.tensor([req.slot for req in reqs], device=hidden.device)
        self.draft_hidden[slots] = out
        self.first_draft[slots] = self.mtp.logits(out).argmax(-1)

    def propose(self, reqs: Sequence[Req], num_drafts: Sequence[int]) -> list[list[int]]:
        slots = torch.tensor([req.slot for req in reqs], device=self.runner.device)
        tokens, hidden = self.first_draft[slots], self.draft_hidden[slots]  # the batch's current draft, per request
        drafts = [tokens]
        # Draft i + 1 (i >= 1) is read at position computed_len + i - 1 from draft i and the module's last output.
        for i in range(1, max(num_drafts, default=0)):
            chained = [r for r, n in enumerate(num_drafts) if n > i]
            rows = torch.tensor(chained, device=slots.device)
            chained_reqs = [reqs[r] for r in chained]
            positions = [req.computed_len + i - 1 for req in chained_reqs]
            one_each = [1] * len(chained)
            rows_out = list(range(len(chained)))
            out = self._forward(ForwardMode.DECODE, tokens[rows], chained_reqs, positions, one_each, hidden[rows], rows_out)
            hidden = hidden.index_copy(0, rows, out)
            tokens = tokens.index_copy(0, rows, self.mtp.logits(out).argmax(-1))
            drafts.append(tokens)
        table = torch.stack(drafts, dim=1).tolist()
        return [row[:n] for row, n in zip(table, num_drafts)]

    def _forward(self, mode, input_ids, reqs, prefix_lens, extend_lens, hidden, sample_indices) -> torch.Tensor:
        fb = self.runner.forward_batch(mode, input_ids, [req.slot for req in reqs], prefix_lens, extend_lens,
                                       sample_indices)  # fmt: skip
        return self.mtp(fb, hidden)


def load_mtp_module(config, model_config, model: torch.nn.Module, shard=None) -> torch.nn.Module:
    """The checkpoint's MTP module, the default drafter of an EngineConfig with speculative_tokens: Qwen3.5's, dense
    or MoE (a ValueError naming why for a model without one). `shard`: a tensor-parallel rank's cut, as for
    `load_model`."""
    if not model_config.is_hybrid:
        raise ValueError(
            f"speculative_tokens needs a draft: {model_config.architecture} checkpoints have no MTP module (only "
            "Qwen3.5's do); give the Engine a drafter (a4.speculative.drafter) or set speculative_tokens=0"
        )
    # Imported here: serving Qwen3 must not depend on Qwen3.5's modules.
    from a4.models.qwen3_5_mtp import load_mtp

    return load_mtp(
        model,
        config.model_dir,
        dtype=config.torch_dtype,
        device=config.torch_device,
        merge_projections=config.merge_projections,
        shard=shard,
        load_format=config.load_format,
    )[0]
