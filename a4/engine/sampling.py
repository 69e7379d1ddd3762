"""Sampler: next tokens from the logits of one step.

Greedy (temperature 0, the default) is an argmax over float32 logits, as transformers' `generate` does, so the
engine can be checked against it token by token. Otherwise the logits are divided by the temperature, cut to the
top_k most likely tokens and to the smallest set whose probability reaches top_p, and one token is drawn. A request
with a seed draws from its own torch.Generator, so its tokens do not depend on which other requests share its batch.

The logits are shifted so that their largest is 0 before they are divided by the temperature: the distribution is
the same, and a temperature so small that the gaps overflow gives -inf to every token but the most likely ones, i.e.
the greedy limit of T -> 0 (a draw among the tokens tied for the largest logit), instead of inf - inf = NaN.

A request whose logits are not finite (a model or checkpoint gone wrong) or cannot be sampled gets an error instead
of a token, and finishes alone: the other requests of its batch are served as usual.

A speculative engine (a4/speculative/worker.py) verifies a sampled request's drafts against the very distribution this
sampler draws from (`sampling_distribution`), with random numbers from the request's own generator (`generator`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from a4.core import Req, SamplingParams


class Sample(NamedTuple):
    token: int | None
    # Why no token could be drawn for this request (then token is None), or None.
    error: str | None = None


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}

    def add_req(self, req: Req) -> None:
        seed = req.sampling_params.seed
        if seed is not None:
            self._generators[req.uid] = torch.Generator(device=self.device).manual_seed(seed)

    def remove_req(self, req: Req) -> None:
        self._generators.pop(req.uid, None)

    def generator(self, req: Req) -> torch.Generator | None:
        """The generator req draws from: its own when it has a seed, else None (torch's default one)."""
        return self._generators.get(req.uid)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[Sample]:
        """One token (or an error) per row of logits [len(reqs), vocab] (float32)."""
        # One copy to the host for the whole step: the greedy tokens and which rows may not be finite.
        tokens, sum_finite = torch.stack([logits.argmax(dim=-1), _sum_is_finite(logits).long()]).tolist()
        errors = _errors(sum_finite, logits)
        samples = []
        for i, req in enumerate(reqs):
            if errors[i] is not None:
                samples.append(Sample(None, errors[i]))
            elif req.sampling_params.temperature > 0:
                samples.append(self._draw(logits[i], req))
            else:
                samples.append(Sample(tokens[i]))
        return samples

    def _draw(self, logits: torch.Tensor, req: Req) -> Sample:
        probs = sampling_distribution(logits, req.sampling_params)
        try:
            return Sample(int(torch.multinomial(probs, 1, generator=self.generator(req))[0]))
        except RuntimeError as e:
            return Sample(None, f"sampling failed with {req.sampling_params}: {e}")


def sampling_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampled request (temperature > 0) draws its next token from, for each row of logits
    [..., vocab] (float32): the temperature, then the top_k / top_p cut, then softmax."""
    # A temperature below the smallest normal float32 would round to 0 in the division (0 / 0 = NaN at the maximum);
    # at that size every gap overflows to -inf either way.
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / temperature
    return torch.softmax(_filter_logits(scaled, params), dim=-1)


def logits_errors(logits: torch.Tensor) -> list[str | None]:
    """Per row of logits [N, ...]: why it cannot be sampled (it is not finite), or None."""
    return _errors(_sum_is_finite(logits.flatten(1)).tolist(), logits)


def _sum_is_finite(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, vocab]: whether its sum is finite. A NaN or an infinity anywhere in a row makes the sum
    NaN or infinite, and one reduction costs less than `isfinite(logits).all()`, which writes a mask first: on an
    H200 at batch 128 (127 MB of float32 logits) five launches and ~0.19 ms a step. A finite row can still have an
    infinite sum (values near the float32 maximum): `_errors` checks such a row element by element."""
    return logits.sum(dim=-1).isfinite()


def _errors(sum_finite: list, logits: torch.Tensor) -> list[str | None]:
    """sum_finite: per row, whether its sum is finite (bools, or 0 / 1); a row whose sum is not is checked whole.
    Only such a row is indexed: iterating over logits would make a view of every row, ~0.4 µs each on the host."""
    return [None if ok else _row_error(logits[i]) for i, ok in enumerate(sum_finite)]


def _row_error(row: torch.Tensor) -> str | None:
    """Why one row of logits cannot be sampled, or None where every element is finite."""
    return None if bool(torch.isfinite(row).all()) else _non_finite_error(row)


def _non_finite_error(logits: torch.Tensor) -> str:
    nan, inf = int(logits.isnan().sum()), int(logits.isinf().sum())
    return (
        f"the model's logits are not finite ({nan} NaN, {inf} infinite of {logits.numel()}): "
        "check the checkpoint's weights and the layers' numerics"
    )


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., vocab] with every token outside each row's top_k / top_p set at -inf."""
    if 0 < params.top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, params.top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token is always kept.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
