"""Sampler: next tokens from the logits of one step.

Greedy (temperature 0, the default) is an argmax over float32 logits, as transformers' `generate` does, so the
engine can be checked against it token by token. Otherwise the logits are divided by the temperature, cut to the
top_k most likely tokens and to the smallest set whose probability reaches top_p, and one token is drawn. A request
with a seed draws from its own torch.Generator, so its tokens do not depend on which other requests share its batch.
"""

from __future__ import annotations

import torch

from a4.core import Req, SamplingParams


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

    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        """One token per row of logits [len(reqs), vocab] (float32)."""
        tokens = logits.argmax(dim=-1)
        for i, req in enumerate(reqs):
            params = req.sampling_params
            if params.temperature > 0:
                probs = torch.softmax(_filter_logits(logits[i] / params.temperature, params), dim=-1)
                tokens[i] = torch.multinomial(probs, 1, generator=self._generators.get(req.uid))[0]
        return tokens.tolist()


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
