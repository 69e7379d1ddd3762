"""ModelWorker: what one scheduler batch turns into, the model's forward and the tokens sampled from it.

The engine hands every batch to its worker and books what comes back. A plain engine's worker runs the model runner's
forward and samples one token for each request that samples (`ModelWorker`); a speculative engine's worker drafts,
verifies and commits (a4/speculative/worker.py). The engine does not know which one it has (`create_worker` in
factories.py chooses).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from a4.core import Batch, Req
from a4.engine.model_runner import ModelRunner
from a4.engine.sampling import Sampler


# Books a step with the scheduler (Engine._book): per request its new token, a list of them (a verify step) or None
# (a chunk that does not sample), and why its logits could not be sampled or None. Returns the requests finished.
Book = Callable[[list, list], list[Req]]


class StepResult(NamedTuple):
    finished: list[Req]
    decode_tokens: int  # tokens the batch's requests gained, for a decode step's statistics
    # Speculative decoding: drafts proposed and accepted in the step.
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0


class ModelWorker:
    def __init__(self, runner: ModelRunner, sampler: Sampler) -> None:
        self.runner, self.sampler = runner, sampler

    def run_batch(self, batch: Batch, book: Book) -> StepResult:
        """Run the batch and book it with `book`, which the engine gives."""
        logits = self.runner.forward(batch).logits
        return StepResult(book(*self.sample(batch, logits)), decode_tokens=len(batch.reqs))

    def sample(self, batch: Batch, logits) -> tuple[list[int | None], list[str | None]]:
        """Each request's next token (None where the step does not sample it) and error, from the logits [S, vocab]
        of the sampled requests' last rows."""
        sampled_reqs = [req for req, sampled in zip(batch.reqs, batch.sample) if sampled]
        samples = iter(self.sampler.sample(logits, sampled_reqs))
        next_tokens, errors = zip(*(next(samples) if sampled else (None, None) for sampled in batch.sample))
        return list(next_tokens), list(errors)
