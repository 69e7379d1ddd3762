"""DecodeManager: the requests whose prompt is done; each decode step feeds every one of them its last token."""

from __future__ import annotations

from dataclasses import dataclass, field

from a4.core import Batch, Req
from a4.scheduler.cache import CacheManager


@dataclass
class DecodeManager:
    cache_manager: CacheManager
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
        n = len(self.running)
        return Batch(reqs=list(self.running), phase="decode", extend_lens=[1] * n, sample=[True] * n)

    @property
    def runnable(self) -> bool:
        return bool(self.running)
