"""Log-probabilities for the requests that ask (SamplingParams.logprobs, prompt_logprobs): of the tokens a step
sampled and of the prompt tokens it fed, computed on the device from the step's float32 logits and copied to the host
without waiting, like the tokens (sampling.py). A step whose requests ask for none computes nothing more.

They are the model's own distribution: log-softmax of the logits before temperature, top-k and top-p (vLLM's default
"raw" logprobs), so they are what transformers' logits give whatever the request samples with. Each position keeps
the token there (sampled, or the prompt's) and the k most likely tokens.

Prompt logprobs need the logits of every prompt position, not only the last: the model runner returns the rows of
such a request's prompt chunks after the sampled rows (`prompt_logprob_rows`), and the request skips the prefix
cache's lookup (a cached position has KV but no logits; a4/scheduler/cache.py), as vLLM does. Position j is scored by
the logits of position j - 1, so the first prompt token has no logprob (None, as in vLLM), a chunk's last row scores
the next chunk's first token, and the last chunk's last row is the one sampled from.

A speculative engine's verify step keeps a different number of tokens per request (its accepted drafts and the token
after them): each one's logprob comes from the verify row that scored it (`KeptLogprobs`), as vLLM's speculative
decoding returns the target model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from a4.core import Batch, Req, TokenLogprobs, to_device


@dataclass
class PendingLogprobs:
    """Some rows' log-probabilities on their way to the host: each row's scored token and its k most likely."""

    _values: torch.Tensor  # [R, 1 + k] float32: the scored token's logprob, then the k largest
    _ids: torch.Tensor  # [R, 1 + k] int64: the scored token, then the k most likely
    _copied: torch.cuda.Event | None  # recorded after the copy (None on the CPU: the copy is done)

    def result(self, ks: list[int]) -> list[TokenLogprobs]:
        """Wait for the copy; row r with its ks[r] most likely tokens."""
        if self._copied is not None:
            self._copied.synchronize()
        rows = zip(self._ids.tolist(), self._values.tolist(), ks)
        return [TokenLogprobs(ids[0], values[0], tuple(zip(ids[1 : k + 1], values[1 : k + 1])))
                for ids, values, k in rows]  # fmt: skip


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> PendingLogprobs:
    """log-softmax of logits [R, vocab] (float32): each row's value at token_ids [R] (on the device) and its k largest,
    copied to the host without waiting for the device."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top = logprobs.topk(k, dim=-1)
    values = torch.cat([logprobs.gather(-1, token_ids[:, None]), top.values], dim=1)
    ids = torch.cat([token_ids[:, None], top.indices], dim=1)
    if values.device.type != "cuda":
        return PendingLogprobs(values, ids, None)
    host_values = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host_values.copy_(values, non_blocking=True)
    host_ids.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return PendingLogprobs(host_values, host_ids, copied)


class PromptRows(NamedTuple):
    """The rows of one request's prompt chunk that score prompt tokens."""

    index: int  # the request's index in the batch
    first_row: int  # its first row among the step's tokens
    position: int  # the prompt position of that row (the chunk's first): it scores position + 1
    count: int  # rows that score a prompt token (0 for a one-token prompt)


def prompt_logprob_rows(batch: Batch) -> list[PromptRows]:
    """The prompt chunks of the batch whose request asks for prompt logprobs, and which of their rows score."""
    rows, first_row = [], 0
    for index, (req, prefix_len, extend_len, decode) in enumerate(
        zip(batch.reqs, batch.prefix_lens, batch.extend_lens, batch.decode_rows)
    ):
        if not decode and req.sampling_params.prompt_logprobs is not None:
            count = max(min(extend_len, len(req.input_ids) - 1 - prefix_len), 0)
            rows.append(PromptRows(index, first_row, prefix_len, count))
        first_row += extend_len
    return rows


@dataclass
class PromptLogprobs:
    """A step's prompt logprobs, on their way to the host."""

    rows: list[PromptRows]
    pending: PendingLogprobs

    @staticmethod
    def launch(logits: torch.Tensor, batch: Batch, rows: list[PromptRows]) -> PromptLogprobs:
        """logits [sum of counts, vocab]: the rows of `rows`, in order."""
        targets = [t for r in rows for t in batch.reqs[r.index].input_ids[r.position + 1 : r.position + 1 + r.count]]
        k = max(batch.reqs[r.index].sampling_params.prompt_logprobs for r in rows)
        return PromptLogprobs(rows, compute_logprobs(logits, to_device(targets, logits.device), k))

    def book(self, reqs: list[Req]) -> None:
        """Append each request's scored prompt tokens (and None for its first) to its prompt_logprobs."""
        ks = [reqs[r.index].sampling_params.prompt_logprobs for r in self.rows for _ in range(r.count)]
        entries = iter(self.pending.result(ks))
        for r in self.rows:
            req = reqs[r.index]
            if r.position == 0:
                req.prompt_logprobs.append(None)
            req.prompt_logprobs.extend(next(entries) for _ in range(r.count))


@dataclass
class KeptLogprobs:
    """A verify step's log-probabilities of the tokens its requests kept, on their way to the host."""

    kept: list[tuple[int, int]]  # (index in the batch, tokens kept) of each request that asks
    pending: PendingLogprobs

    @staticmethod
    def launch(logits: torch.Tensor, reqs: list[Req], next_tokens: list[list[int]]) -> KeptLogprobs | None:
        """logits [B, k + 1, vocab]: row j of a request scored its j-th kept token. None where no request asks."""
        kept = [(i, len(tokens)) for i, (req, tokens) in enumerate(zip(reqs, next_tokens))
                if req.sampling_params.logprobs is not None and tokens]  # fmt: skip
        if not kept:
            return None
        width = logits.shape[1]
        rows = to_device([i * width + j for i, n in kept for j in range(n)], logits.device)
        targets = to_device([token for i, n in kept for token in next_tokens[i][:n]], logits.device)
        k = max(reqs[i].sampling_params.logprobs for i, _ in kept)
        return KeptLogprobs(kept, compute_logprobs(logits.flatten(0, 1)[rows], targets, k))

    def book(self, reqs: list[Req], output_lens: list[int]) -> None:
        """Append to each request's output_logprobs those of the tokens the booking kept (its output grew from
        output_lens[i]; a stop string may have cut it shorter than the step kept)."""
        entries = iter(self.pending.result([reqs[i].sampling_params.logprobs for i, n in self.kept for _ in range(n)]))
        for i, n in self.kept:
            mine = [next(entries) for _ in range(n)]
            reqs[i].output_logprobs.extend(mine[: len(reqs[i].output_ids) - output_lens[i]])
