"""SpeculativeWorker: the steps of a speculative engine (notebook 11), drafted, verified in one forward, committed.

A decode step asks the drafter (a4/speculative/drafter.py) for k tokens per request and feeds every request its last
token and its drafts: a TARGET_VERIFY step of k + 1 tokens each, through the same static-buffer runner as a plain
decode step (captured on CUDA). A greedy request (temperature 0) keeps the drafts that agree with the model's own
tokens plus the model's token after them (`greedy_accept`): its output is plain greedy decoding's, token for token. A
sampled request accepts by rejection sampling (`rejection_accept`): each draft with probability p(draft) under the
distribution the plain sampler would draw from at that position, then one token drawn from the residual at the first
rejection, or from p after the last draft if all were accepted; its tokens are distributed as plain sampling's, and
its seed, if any, makes them reproducible (its random numbers come from its own generator). Both kinds share a batch.
A request that asks for logprobs gets each kept token's from the verify row that scored it (`KeptLogprobs`).
KV of rejected positions is simply overwritten later; a Gated DeltaNet
state cannot be cut, so the verify pass kept the state after every position in the state pool's verify buffers, and
the pool commits the one after the last kept token (`StatePool.commit_verified`, notebook 11's `spec-commit`) before
the scheduler books the step, so that a prefix-cache checkpoint only ever holds a committed state. Then the drafter
catches up with what was committed (`Drafter.observe`), from the final hidden state of every committed row.

A drafter may propose fewer than k tokens for a request (the protocol's "up to"): the missing ones are fed as token
0 and never accepted. More than k is the drafter's bug, refused with an error naming it. A request with penalties,
`logit_bias`, `min_tokens` or a grammar is not drafted at all (`drafted`): it is sampled from its first row, as a
decode step samples it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from a4.core import Batch, ForwardMode, Req
from a4.engine.logprobs import KeptLogprobs, prompt_logprob_rows
from a4.engine.model_runner import ModelRunner, forward_mode
from a4.engine.sampling import Sampler, logits_errors, sampling_distribution
from a4.engine.worker import LaunchedStep, ModelWorker
from a4.speculative.drafter import Drafter
from a4.speculative.verify import greedy_accept, rejection_accept

# The token fed where a drafter proposed fewer than k: any valid id will do, as neither acceptance rule accepts a -1
# draft.
FILLER_TOKEN = 0


@dataclass
class VerifiedStep(LaunchedStep):
    """A speculative step, done: per request the positions it committed, and the final hidden states of every row
    (the drafter catches up from the committed ones once the step is booked)."""

    committed: list[int] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    # The kept tokens' log-probabilities, for the requests that ask (SamplingParams.logprobs).
    kept_logprobs: KeptLogprobs | None = None

    @property
    def has_logprobs(self) -> bool:
        return super().has_logprobs or self.kept_logprobs is not None

    def book_logprobs(self, output_lens: list[int]) -> None:
        super().book_logprobs(output_lens)
        if self.kept_logprobs is not None:
            self.kept_logprobs.book(self.batch.reqs, output_lens)


def drafted(req: Req) -> bool:
    """Whether req's next tokens are drafted. Not where its sampler keeps state along its tokens (penalties and
    min_tokens count them, a grammar's matcher follows them) or changes its logits (logit_bias): a verify pass
    would need that state after each draft. As vLLM does (`is_spec_decode_unsupported`), such a request is served
    without drafts, one token a step from its verify block's first row, beside the drafted ones."""
    params = req.sampling_params
    return not params.processes_logits and params.grammar is None


class SpeculativeWorker(ModelWorker):
    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        drafter: Drafter,
        num_draft_tokens: int,
        keep_tokens,
    ) -> None:
        """`keep_tokens(req, tokens)`: the tokens req keeps of those offered, cut after one that finishes it (the
        scheduler's rule)."""
        super().__init__(runner, sampler)
        self.drafter, self.num_draft_tokens, self.keep_tokens = drafter, num_draft_tokens, keep_tokens

    def launch(self, batch: Batch) -> LaunchedStep:
        """Prefill, or draft, verify and commit, waiting for the device: a speculative engine books each step before
        it schedules the next, and the drafter needs the tokens kept."""
        if forward_mode(batch) is ForwardMode.EXTEND:
            out = self.runner.forward(batch, every_row=True)
            ends = list(itertools.accumulate(batch.extend_lens))
            last_rows = [end - 1 for end, sampled in zip(ends, batch.sample) if sampled]
            sampled_reqs = [req for req, sampled in zip(batch.reqs, batch.sample) if sampled]
            samples = self.sampler.sample(out.logits[last_rows], sampled_reqs) if sampled_reqs else None
            # Every row's logits are here already: those that score prompt tokens, in order.
            prompt_rows = prompt_logprob_rows(batch)
            prompt_logprobs = None
            if prompt_rows:
                scoring = [r.first_row + j for r in prompt_rows for j in range(r.count)]
                prompt_logprobs = self.sampler.prompt_logprobs(out.logits[scoring], batch, prompt_rows)
            return VerifiedStep(batch, samples, prompt_logprobs=prompt_logprobs, committed=list(batch.extend_lens),
                                hidden=out.hidden)  # fmt: skip
        drafts = self._drafts(batch.reqs)
        input_ids = [
            t if t >= 0 else FILLER_TOKEN for req, d in zip(batch.reqs, drafts) for t in (req.output_ids[-1], *d)
        ]
        out = self.runner.forward(batch, input_ids, every_row=True)
        next_tokens, errors, accepted = self._accept(batch, drafts, out.logits)
        draft_tokens = sum(t >= 0 for d in drafts for t in d)
        committed = [len(tokens) for tokens in next_tokens]
        scored = [[] if error is not None else tokens for tokens, error in zip(next_tokens, errors)]
        kept_logprobs = KeptLogprobs.launch(out.logits.view(len(batch.reqs), self.num_draft_tokens + 1, -1),
                                            batch.reqs, scored)  # fmt: skip
        return VerifiedStep(batch, None, (next_tokens, errors), draft_tokens, accepted, committed=committed,
                            hidden=out.hidden, kept_logprobs=kept_logprobs)

    def booked(self, step: VerifiedStep) -> None:
        self._observe(step.batch, step.committed, step.hidden)

    def _drafts(self, reqs: list[Req]) -> list[list[int]]:
        """k tokens per request, -1 where there is no draft: the drafter's, for as many tokens as the request may
        still keep after the model's own (at most k), padded where it proposed fewer."""
        k = self.num_draft_tokens
        wanted = [min(k, req.sampling_params.max_new_tokens - len(req.output_ids) - 1) if drafted(req) else 0
                  for req in reqs]  # fmt: skip
        proposed = self.drafter.propose(reqs, wanted)
        if len(proposed) != len(reqs):
            raise ValueError(
                f"{type(self.drafter).__name__}.propose returned drafts for {len(proposed)} requests, not {len(reqs)}"
            )
        for req, draft, n in zip(reqs, proposed, wanted):
            if len(draft) > n:
                raise ValueError(
                    f"{type(self.drafter).__name__}.propose returned {len(draft)} drafts for request {req.uid}, "
                    f"but {n} were asked for (speculative_tokens={k}): a drafter proposes at most that many"
                )
        return [list(d) + [-1] * (k - len(d)) for d in proposed]

    def _accept(self, batch: Batch, drafts: list[list[int]], logits: torch.Tensor):
        """Verification: each request keeps the drafts it accepts, then one more token from the model's logits after
        them (greedy or sampled, as it asks), cut at a token that finishes it; the state pool commits the states after
        the last token kept."""
        reqs, width = batch.reqs, self.num_draft_tokens + 1
        logits = logits.view(len(reqs), width, -1)
        accepted, last_tokens, errors = [0] * len(reqs), [-1] * len(reqs), [None] * len(reqs)
        kinds = [self._accept_undrafted if not drafted(req) else
                 self._accept_sampled if req.sampling_params.temperature > 0 else self._accept_greedy
                 for req in reqs]  # fmt: skip
        for accept in (self._accept_greedy, self._accept_sampled, self._accept_undrafted):
            rows = [i for i, kind in enumerate(kinds) if kind == accept]
            if rows:
                # All rows (the usual case) need no gather of the logits.
                mine = logits if len(rows) == len(reqs) else logits[rows]
                found = accept([reqs[i] for i in rows], [drafts[i] for i in rows], mine)
                for i, a, token, error in zip(rows, *found):
                    accepted[i], last_tokens[i], errors[i] = a, token, error
        next_tokens = [
            self.keep_tokens(req, d[:a] + [t]) for req, d, t, a in zip(reqs, drafts, last_tokens, accepted)
        ]
        if self.runner.state_pool is not None:
            slots = torch.tensor([req.slot for req in reqs])
            # At least the model's own token is kept: the last committed one was fed at verify position 0.
            kept_lens = torch.tensor([max(len(tokens), 1) for tokens in next_tokens])
            self.runner.state_pool.commit_verified(slots, kept_lens)
        return next_tokens, errors, sum(accepted)

    def _accept_greedy(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor):
        """Per greedy request: drafts accepted, the model's token after them, error (logits [B, k+1, vocab]). A
        drafted request has no processors and no grammar (`drafted`): its token at each row is the argmax."""
        errors = logits_errors(logits)
        # A request whose logits are not finite has no token there (-1): it accepts nothing and finishes with its error.
        targets = [row if error is None else [-1] * len(row)
                   for row, error in zip(logits.argmax(dim=-1).tolist(), errors)]  # fmt: skip
        # On the host, where the argmax tokens already are: a few ints are not worth launches and a sync.
        accepted = greedy_accept(torch.tensor(drafts), torch.tensor(targets)).tolist()
        return accepted, [t[a] for t, a in zip(targets, accepted)], errors

    def _accept_undrafted(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor):
        """Per request that was not drafted: none accepted, its token sampled from its first row as a decode step
        samples it (its processors and grammar applied once, their state advanced by that token), error."""
        samples = self.sampler.sample(logits[:, 0], reqs).result()
        return [0] * len(reqs), [s.token if s.token is not None else -1 for s in samples], [s.error for s in samples]

    def _accept_sampled(self, reqs: list[Req], drafts: list[list[int]], logits: torch.Tensor):
        """Per sampled request: drafts accepted, the token drawn after them, error (logits [B, k+1, vocab])."""
        errors = logits_errors(logits)
        device, (k, vocab) = self.runner.device, (logits.shape[1] - 1, logits.shape[2])
        # One request's k + 1 rows share its sampling parameters: one call per request, not per row.
        target_probs = torch.stack([sampling_distribution(rows, r.sampling_params) for rows, r in zip(logits, reqs)])
        # The random numbers come from each request's own generator, in a fixed order (k uniforms, then the draw's
        # noise): a seeded request's tokens do not depend on the rest of its batch.
        generators = [self.sampler.generator(req) for req in reqs]
        uniforms = torch.stack([torch.rand(k, generator=g, device=device) for g in generators])
        noise = torch.stack([torch.empty(vocab, device=device).exponential_(generator=g) for g in generators])
        accepted, next_probs = rejection_accept(torch.tensor(drafts, device=device), target_probs, uniforms)
        # The draw torch.multinomial makes for one sample (the largest p / Exp(1) noise is distributed as p), done
        # for the whole batch at once and without multinomial's host syncs. A request whose logits were not finite
        # draws garbage here; its error finishes it instead.
        tokens = (next_probs / noise).argmax(dim=1)
        accepted, tokens = torch.stack([accepted, tokens]).tolist()
        return accepted, tokens, errors

    def _observe(self, batch: Batch, committed: list[int], hidden: torch.Tensor) -> None:
        """The drafter catches up, once the step is booked, over each unfinished drafted request's committed rows
        (the first of its block); a request that is never drafted needs none of its state."""
        reqs = batch.reqs
        width = batch.extend_lens
        starts = [end - n for end, n in zip(itertools.accumulate(width), width)]
        going_on = [i for i, req in enumerate(reqs) if not req.finished and committed[i] > 0 and drafted(req)]
        if going_on:
            rows = [row for i in going_on for row in range(starts[i], starts[i] + committed[i])]
            self.drafter.observe([reqs[i] for i in going_on], [committed[i] for i in going_on], hidden[rows])
