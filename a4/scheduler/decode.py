"""DecodeManager: the requests whose prompt is done; each decode step feeds every one of them its last token.

With speculative decoding (`num_draft_tokens` k > 0) a request also feeds up to k drafts after its last token, all
verified in the same step; never more than it may still generate less one, so that what it writes stays within the
KV reserved for it at admission (prompt + max_new_tokens - 1 positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from a4.core import Batch, Req
from a4.scheduler.cache import CacheManager


@dataclass
class DecodeManager:
    cache_manager: CacheManager
    num_draft_tokens: int = 0
    # In the order their prefill finished (a list, not a set, so that batches are reproducible).
    running: list[Req] = field(default_factory=list)

    def add_req(self, req: Req) -> None:
        self.running.append(req)

    def remove_req(self, req: Req) -> None:
        """Take req out of the running list, if it is there."""
        if req in self.running:
            self.running.remove(req)

    @property
    def reserved_pages(self) -> int:
        """Pages still promised to the running requests (see the admission policy in prefill.py)."""
        return sum(self.cache_manager.pages_to_finish(req, req.computed_len) for req in self.running)

    def schedule_next_batch(self) -> Batch | None:
        if not self.running:
            return None
        extend_lens = [1 + min(self.num_draft_tokens, self._tokens_left(req) - 1) for req in self.running]
        return Batch(reqs=list(self.running), phase="decode", extend_lens=extend_lens, sample=[True] * len(extend_lens))

    @staticmethod
    def _tokens_left(req: Req) -> int:
        return req.sampling_params.max_new_tokens - len(req.output_ids)

    @property
    def runnable(self) -> bool:
        return bool(self.running)
