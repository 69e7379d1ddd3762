"""ModelWorker: what one scheduler batch turns into, the model's forward and the tokens sampled from it, launched
without waiting for them.

`launch(batch)` runs the model runner's forward and samples on the device (a4/engine/sampling.py); the tokens stay on
the device too, in the runner's table of each slot's last token, where the next decode step reads its input ids, and
come back to the host with one non-blocking copy that `LaunchedStep.result()` waits for. The engine books a step's
result when it chooses: at once, or after it has launched the next step (overlap scheduling, engine.py). A
speculative engine's worker drafts, verifies and commits (speculative_worker.py); its steps come back done. The
engine does not know which worker it has (`create_worker` in factories.py chooses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4.core import Batch
from a4.engine.logprobs import PromptLogprobs, prompt_logprob_rows
from a4.engine.model_runner import ModelRunner
from a4.engine.sampling import SampledTokens, Sampler


@dataclass
class LaunchedStep:
    """A batch whose forward and sampling are launched; `result()` gives what the scheduler books."""

    batch: Batch
    samples: SampledTokens | None  # the sampled requests' tokens (None: a step that samples nothing)
    # Speculative decoding: the tokens each request kept (a list each) and why it could not be sampled, already on
    # the host; drafts proposed and accepted in the step.
    verified: tuple[list, list] | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # The prompt logprobs of the chunks it fed, for the requests that ask (SamplingParams.prompt_logprobs).
    prompt_logprobs: PromptLogprobs | None = None

    def result(self) -> tuple[list, list[str | None]]:
        """Per request of the batch: its new token (a list of them for a verify step, None for a chunk that does
        not sample) and why its logits could not be sampled, or None. Waits for the device's copy."""
        if self.verified is not None:
            return self.verified
        samples = iter(self.samples.result() if self.samples is not None else [])
        next_tokens, errors = zip(*(next(samples) if sampled else (None, None) for sampled in self.batch.booked_sample))
        return list(next_tokens), list(errors)

    @property
    def has_logprobs(self) -> bool:
        """Whether the step computed log-probabilities for any of its requests (most steps: none)."""
        return self.prompt_logprobs is not None or (self.samples is not None and self.samples.logprobs is not None)

    def book_logprobs(self, output_lens: list[int]) -> None:
        """Give the batch's requests (its forks too) the log-probabilities they asked for, once the step is booked: of
        the prompt tokens it fed, and of its token where the booking kept it (a request's output grew from
        output_lens, one per booked request)."""
        batch = self.batch
        if self.prompt_logprobs is not None:
            self.prompt_logprobs.book(batch.reqs)
        for row, fork in batch.forks:
            # A fork's prompt is its parent's, scored once by the parent's prefill.
            if fork.sampling_params.prompt_logprobs is not None:
                fork.prompt_logprobs = list(batch.reqs[row].prompt_logprobs)
        if self.samples is None or self.samples.logprobs is None:
            return
        booked = zip(batch.booked_reqs, output_lens, batch.booked_sample, strict=True)
        sampled = [(req, n) for req, n, sampled in booked if sampled]
        for (req, output_len), entry in zip(sampled, self.samples.token_logprobs()):
            if entry is not None and len(req.output_ids) > output_len:
                req.output_logprobs.append(entry)


class ModelWorker:
    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler

    def launch(self, batch: Batch) -> LaunchedStep:
        """Run the batch's forward and sample its sampled requests' next tokens, on the device."""
        logits = self.runner.forward(batch).logits
        sampled_reqs = [req for req, sampled in zip(batch.reqs, batch.sample) if sampled]
        # The runner returns the rows that score prompt tokens after the sampled ones.
        prompt_rows = prompt_logprob_rows(batch) if batch.phase in ("prefill", "mixed") else []
        prompt_logprobs = None
        if prompt_rows:
            prompt_logprobs = self.sampler.prompt_logprobs(logits[len(sampled_reqs) :], batch, prompt_rows)
        if not sampled_reqs:
            return LaunchedStep(batch, None, prompt_logprobs=prompt_logprobs)
        logits = logits[: len(sampled_reqs)]
        if batch.forks:
            # Each fork draws its first token from its prompt's logits: their rows again, after the batch's own.
            logits_row = {row: i for i, row in enumerate(r for r, sampled in enumerate(batch.sample) if sampled)}
            logits = torch.cat([logits, logits[[logits_row[row] for row, _ in batch.forks]]])
            sampled_reqs += [fork for _, fork in batch.forks]
        samples = self.sampler.sample(logits, sampled_reqs)
        self.runner.keep_last_tokens(sampled_reqs, samples.tokens)
        return LaunchedStep(batch, samples, prompt_logprobs=prompt_logprobs)

    def booked(self, step: LaunchedStep) -> None:
        """The step is booked (the speculative worker's drafter catches up here)."""
