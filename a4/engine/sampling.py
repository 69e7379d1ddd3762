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

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[Sample]:
        """One token (or an error) per row of logits [len(reqs), vocab] (float32)."""
        # One device-to-host copy for both: each copy waits for the GPU.
        tokens, finite = torch.stack((logits.argmax(dim=-1), torch.isfinite(logits).all(dim=-1).long())).tolist()
        samples = []
        for i, req in enumerate(reqs):
            params = req.sampling_params
            if not finite[i]:
                samples.append(Sample(None, _non_finite_error(logits[i])))
            elif params.temperature > 0:
                samples.append(self._draw(logits[i], req))
            else:
                samples.append(Sample(tokens[i]))
        return samples

    def _draw(self, logits: torch.Tensor, req: Req) -> Sample:
        params = req.sampling_params
        # A temperature below the smallest normal float32 would round to 0 in the division (0 / 0 = NaN at the
        # maximum); at that size every gap overflows to -inf either way.
        temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
        scaled = (logits - logits.max()) / temperature
        probs = torch.softmax(_filter_logits(scaled, params), dim=-1)
        try:
            return Sample(int(torch.multinomial(probs, 1, generator=self._generators.get(req.uid))[0]))
        except RuntimeError as e:
            return Sample(None, f"sampling failed with {params}: {e}")


def _non_finite_error(logits: torch.Tensor) -> str:
    nan, inf = int(logits.isnan().sum()), int(logits.isinf().sum())
    return (
        f"the model's logits are not finite ({nan} NaN, {inf} infinite of {logits.numel()}): "
        "check the checkpoint's weights and the layers' numerics"
    )


def _filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [vocab] with every token outside the top_k / top_p set at -inf."""
    if 0 < params.top_k < logits.numel():
        kth_largest = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p; the most likely token is always kept.
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits
