"""Sampler: next tokens from the logits of one step.

Greedy (temperature 0, the default) is an argmax over float32 logits, as transformers' `generate` does, so the
engine can be checked against it token by token. Otherwise the logits are divided by the temperature, cut to the
top_k most likely tokens and to the smallest set whose probability reaches top_p, and one token is drawn. A request
with a seed draws from its own torch.Generator, so its tokens do not depend on which other requests share its batch.

The logits are shifted so that their largest is 0 before they are divided by the temperature: the distribution is
the same, and a temperature so small that the gaps overflow gives -inf to every token but the most likely ones, i.e.
the greedy limit of T -> 0 (a draw among the tokens tied for the largest logit), instead of inf - inf = NaN.

A request whose logits are not finite (a model or checkpoint gone wrong) gets an error instead of a token, and
finishes alone: the other requests of its batch are served as usual.

Sampling never waits for the device: `sample` returns the tokens as a device tensor (the next decode step reads them
there) and starts one non-blocking copy of them, with each row's finiteness, to the host; `SampledTokens.result()`
waits for that copy alone. So the engine can launch the next step before it books this one (overlap scheduling).

A request with a grammar (structured output, grammar.py) samples from logits whose tokens the grammar forbids are
-inf: `apply_grammar_masks`, on the device, before the sampler picks.

A speculative engine (speculative_worker.py) verifies a sampled request's drafts against the very distribution this
sampler draws from (`sampling_distribution`), with random numbers from the request's own generator (`generator`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from a4.core import Req, SamplingParams
from a4.engine.grammar import RequestGrammar, apply_grammar_masks


class Sample(NamedTuple):
    token: int | None
    # Why no token could be drawn for this request (then token is None), or None.
    error: str | None = None


@dataclass
class SampledTokens:
    """One step's tokens, drawn on the device and on their way to the host."""

    tokens: torch.Tensor  # [S] int64 on the device: what the next decode step feeds
    logits: torch.Tensor  # [S, vocab]: kept to say what is wrong with a row that is not finite
    _host: torch.Tensor  # [2, S]: tokens and row finiteness, filled by a non-blocking copy
    _copied: torch.cuda.Event | None  # recorded after that copy (None on the CPU: the copy is done)

    def result(self) -> list[Sample]:
        """Wait for the copy; one token (or an error) per row."""
        if self._copied is not None:
            self._copied.synchronize()
        tokens, finite = self._host.tolist()
        errors = _errors(finite, self.logits)
        return [Sample(None, error) if error is not None else Sample(token) for token, error in zip(tokens, errors)]


class Sampler:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._generators: dict[int, torch.Generator] = {}
        self._grammars: dict[int, RequestGrammar] = {}

    def add_req(self, req: Req) -> None:
        seed = req.sampling_params.seed
        if seed is not None:
            self._generators[req.uid] = torch.Generator(device=self.device).manual_seed(seed)
        if req.sampling_params.grammar is not None:
            self._grammars[req.uid] = RequestGrammar(req.sampling_params.grammar)

    def remove_req(self, req: Req) -> None:
        self._generators.pop(req.uid, None)
        self._grammars.pop(req.uid, None)

    def generator(self, req: Req) -> torch.Generator | None:
        """The generator req draws from: its own when it has a seed, else None (torch's default one)."""
        return self._generators.get(req.uid)

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampledTokens:
        """One token per row of logits [len(reqs), vocab] (float32), drawn on the device without waiting for it."""
        finite = _rows_finite(logits)  # before the grammars' masks, whose -inf are no fault of the model's
        grammars = {}
        if self._grammars:  # a batch without any costs no lookup per row
            grammars = {i: self._grammars[req.uid] for i, req in enumerate(reqs) if req.uid in self._grammars}
            apply_grammar_masks(logits, grammars)
        tokens = logits.argmax(dim=-1)
        for i, req in enumerate(reqs):
            if req.sampling_params.temperature > 0:
                tokens[i] = self._draw(logits[i], req, finite[i])
        packed = torch.stack([tokens, finite.long()])
        if self.device.type != "cuda":
            return _sampled_by(grammars, SampledTokens(tokens, logits, packed, None))
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return _sampled_by(grammars, SampledTokens(tokens, logits, host, copied))

    def _draw(self, logits: torch.Tensor, req: Req, finite: torch.Tensor) -> torch.Tensor:
        probs = sampling_distribution(logits, req.sampling_params)
        # A row that is not finite gets an error, not this token; its NaN probabilities would fail the draw (on a
        # GPU, as a device-side assert that ends the process), so it draws from uniform weights instead.
        probs = torch.where(finite, probs, 1.0)
        return torch.multinomial(probs, 1, generator=self.generator(req))[0]


def _sampled_by(grammars: dict[int, RequestGrammar], sampled: SampledTokens) -> SampledTokens:
    """Give each grammar (by row) the step's tokens, for its matcher to accept before its next mask."""
    for row, grammar in grammars.items():
        grammar.sampled(sampled, row)
    return sampled


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
    return _errors(_rows_finite(logits.flatten(1)).tolist(), logits)


def _rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """Per row of logits [N, vocab]: whether every element is finite. A row's minimum and maximum are finite exactly
    when all of it is (min and max propagate NaN), and one reduction costs less than `isfinite(logits).all()`, which
    writes a mask first: on an H200 at batch 128 (127 MB of float32 logits) five launches and ~0.19 ms a step. (A sum
    would overflow on finite rows near the float32 maximum.)"""
    low, high = torch.aminmax(logits, dim=-1)
    return low.isfinite() & high.isfinite()


def _errors(finite: list, logits: torch.Tensor) -> list[str | None]:
    """finite: per row, whether it is finite (bools, or 0 / 1). Only a row that is not is indexed: iterating over
    logits would make a view of every row, ~0.4 µs each on the host."""
    return [None if ok else _non_finite_error(logits[i]) for i, ok in enumerate(finite)]


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
