"""DecodeManager: the requests whose prompt is done; each decode step feeds every one of them `tokens_per_step`
tokens: its last token (1), or with speculative decoding its last token and k drafts (k + 1, the same for every
request, so that a verify step has one shape and can be captured). The scheduler does not know what the extra tokens
are; the KV reserved at admission covers them (`CacheManager.lookahead`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a4.core import Batch, Req


@dataclass
class DecodeManager:
    tokens_per_step: int = 1
    # In the order their prefill finished (a list, not a set, so that batches are reproducible).
    running: list[Req] = field(default_factory=list)

    def add_req(self, req: Req) -> None:
        self.running.append(req)

    def remove_req(self, req: Req) -> None:
        """Take req out of the running list, if it is there."""
        if req in self.running:
            self.running.remove(req)

    def decodable(self) -> list[Req]:
        """The running requests that may sample another token: under overlap scheduling, one whose token in flight
        is its last (`max_new_tokens`) only waits for that step's booking to finish it."""
        return [req for req in self.running if req.num_sampled < req.sampling_params.max_new_tokens]

    def batch(self, reqs: list[Req]) -> Batch | None:
        """A decode step over reqs (`decodable()`), or None for none."""
        if not reqs:
            return None
        num_reqs = len(reqs)
        phase = "decode" if self.tokens_per_step == 1 else "verify"
        return Batch(reqs, phase=phase, extend_lens=[self.tokens_per_step] * num_reqs, sample=[True] * num_reqs)

    @property
    def runnable(self) -> bool:
        return bool(self.running)
