"""CacheManager: a request's KV memory from admission to release (pages, prefix cache, its row of the table).

Memory of the KV pool is always in exactly one of three states:
- free: on the allocator's free list;
- in the prefix cache: owned by the radix tree; evictable while no running request has it locked;
- owned by a running request: allocated for it and not (yet) in the tree.

A request's row of `req_to_token` points at pages of the last two kinds. When its prefill writes new tokens they are
inserted into the tree (so later requests can share them) and when it finishes whatever the tree cannot keep (a
partial last page, or everything when the cache is disabled) goes back to the free list.

A hybrid model's request also has a state in its slot (StatePool), which describes exactly the tokens fed so far.
Each time KV is handed to the tree, a copy of that state is offered to the prefix cache too (`save_state`: kept by
the hybrid model's cache, notebook 07), and a request just admitted gets its state once, in `give_state`: the one
saved where its prefix hit ends (`restore_state`), or zeros (`StatePool.clear_new_requests`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from a4.core import Req
from a4.kvcache.allocator import PageAllocator
from a4.kvcache.radix_cache import BasePrefixCache, CacheHandle, MatchResult
from a4.scheduler.table import TableManager

if TYPE_CHECKING:
    from a4.kvcache.kv_pool import KVPool
    from a4.kvcache.state_pool import StatePool


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class CacheManager:
    def __init__(
        self,
        allocator: PageAllocator,
        prefix_cache: BasePrefixCache,
        table_manager: TableManager,
        state_pool: StatePool | None = None,
        lookahead: int = 0,
        kv_pool: KVPool | None = None,
    ) -> None:
        """`state_pool`: a hybrid model's states, given to each request with its slot. `lookahead`: positions a
        decode step may write beyond the last one a request keeps (speculative decoding's drafts), reserved too."""
        if allocator.page_size != prefix_cache.page_size:
            raise ValueError(
                f"allocator page_size {allocator.page_size} != prefix cache page_size {prefix_cache.page_size}"
            )
        self.allocator = allocator
        self.prefix_cache = prefix_cache
        self.table_manager = table_manager
        self.state_pool = state_pool
        self.kv_pool = kv_pool  # what a fork's copy of a partial page is copied in
        self.lookahead = lookahead
        self.page_size = allocator.page_size
        # Pages promised to the admitted requests and not allocated to them yet: each request's worst case, counted
        # once at admission (`reserve`) and paid off as its steps allocate (see the admission policy in prefill.py).
        self.reserved_pages = 0

    @property
    def available_pages(self) -> int:
        """Pages a request could get now: the free ones plus those that unlocked cache entries can give back."""
        return self.allocator.num_free_pages + self.prefix_cache.evictable_size // self.page_size

    def match_req(self, req: Req) -> MatchResult:
        # The last prompt token is never matched: the model must run on at least one token to produce the logits
        # that the first output token is sampled from. A request that asks for prompt logprobs needs the logits of
        # every prompt position, which a cached prefix does not have: it matches nothing (as in vLLM), and its KV
        # still enters the cache for others.
        matched = 0 if req.sampling_params.prompt_logprobs is not None else len(req.input_ids) - 1
        return self.prefix_cache.match_prefix(req.input_ids[:matched])

    def lock(self, handle: CacheHandle) -> None:
        self.prefix_cache.lock(handle)

    def unlock(self, handle: CacheHandle) -> None:
        self.prefix_cache.unlock(handle)

    def give_state(self, req: Req) -> None:
        """Give a request just admitted into its slot the state it starts from, the one place a slot's state is
        set: on a prefix hit (req.cache_handle) the checkpoint saved where the hit ends (notebook 07), otherwise
        zeros (notebook 05's `clear_new_requests`; the slot may hold a finished request's state)."""
        self.prefix_cache.restore_state(req.cache_handle, req.slot)
        if self.state_pool is not None:
            self.state_pool.clear_new_requests([req])

    def prefill_pause(self, req: Req) -> int:
        """The prompt position where the request's prefill should pause for the cache (its length: nowhere)."""
        return self.prefix_cache.prefill_pause(len(req.input_ids))

    def reserve(self, req: Req, num_pages: int) -> None:
        """Promise an admitted request `num_pages` more pages (its worst case, `pages_to_finish`)."""
        req.reserved_pages = num_pages
        self.reserved_pages += num_pages

    def pages_to_finish(self, req: Req, computed_len: int) -> int:
        """Pages the request still needs, from computed_len tokens in the pool to its longest possible length.

        The last token a request samples is never fed back, so its KV is never written: at most
        len(input_ids) + max_new_tokens - 1 positions are stored, and `lookahead` more written by its last step.
        """
        max_stored = len(req.input_ids) + req.sampling_params.max_new_tokens - 1 + self.lookahead
        return pages_for(max_stored, self.page_size) - pages_for(computed_len, self.page_size)

    def pages_to_fork(self, fork: Req) -> int:
        """Pages a sample of n > 1 needs of its own: its prompt's whole pages are its parent's, shared."""
        return self.pages_to_finish(fork, len(fork.input_ids) // self.page_size * self.page_size)

    def fork(self, parent: Req, forks: Sequence[Req]) -> None:
        """Give each fork its parent's prompt, once the parent's last prefill step is launched and cached: the
        prompt's whole pages shared (those in the prefix cache under the parent's lock, as a prefix hit is; the
        parent's own ones with one more owner each, `PageAllocator.share`), a copy of its partial last page (which
        each sample's own tokens fill), and a copy of its state (every GDN layer's conv and recurrent state). Issued
        after the parent's forward, before any step that advances the parent's slot."""
        prompt_len = len(parent.input_ids)
        handle = parent.cache_handle
        whole = prompt_len // self.page_size * self.page_size
        row = self.table_manager.read(parent.slot, 0, prompt_len)
        own_pages = self.allocator.locations_to_pages(row[handle.cached_len : whole].cpu())
        for fork in forks:
            self.lock(handle)
            self.unlock(fork.cache_handle)
            fork.cache_handle = handle
            self.table_manager.write(fork.slot, 0, row[:whole])
            self.allocator.share(own_pages)
            if whole < prompt_len:
                locations = self.allocator.pages_to_locations(self._allocate_pages(1))
                self.kv_pool.copy_locations(row[whole:], locations[: prompt_len - whole].to(row.device))
                self.table_manager.write(fork.slot, whole, locations)
                fork.reserved_pages -= 1
                self.reserved_pages -= 1
            fork.kv_allocated_len = prompt_len
        if self.state_pool is not None:
            self.state_pool.copy(parent.slot, [fork.slot for fork in forks])

    def allocate(self, reqs: Sequence[Req], extend_lens: Sequence[int]) -> None:
        """Give the positions that this step writes (computed_len .. computed_len + extend_len - 1) KV locations.

        Pages are allocated whole and recorded in the table whole, so the tokens that follow in the same page
        already have their locations. Unlocked cache entries are evicted when the free list runs short. A request
        that already has locations for those positions (a step that raised before it was booked) gets no more.
        """
        page_size = self.page_size
        ends = [req.computed_len + extend_len for req, extend_len in zip(reqs, extend_lens)]
        # (slot, first position, positions) of each request whose step reaches into pages it does not have yet.
        writes = []
        for req, end in zip(reqs, ends):
            first_page, last_page = pages_for(req.kv_allocated_len, page_size), pages_for(end, page_size)
            if last_page > first_page:
                writes.append((req.slot, first_page * page_size, (last_page - first_page) * page_size))
        if writes:
            # One allocation and one table write for the whole batch, pages handed out in request order.
            pages = self._allocate_pages(sum(count for *_, count in writes) // page_size)
            self.table_manager.write_many(writes, self.allocator.pages_to_locations(pages))
        for req, end in zip(reqs, ends):
            new_pages = max(pages_for(end, page_size) - pages_for(req.kv_allocated_len, page_size), 0)
            req.reserved_pages -= new_pages
            self.reserved_pages -= new_pages
            req.kv_allocated_len = max(req.kv_allocated_len, end)

    def cache_req(self, req: Req, stored: int) -> None:
        """Hand the request's KV positions [0, stored) over to the prefix cache, and their state with them: the slot's
        state must be the state after exactly those tokens when the copy is issued.

        Row positions (old = the handle's length, new = the inserted page-aligned length):
          [0, old)            already the tree's, locked by this request since admission (or the last insert);
          [old, prefix_len)   the tree learned these tokens from another request meanwhile: ours are duplicates,
                              freed, and the row is pointed at the tree's copy;
          [prefix_len, new)   newly inserted: the tree owns these pages from now on, locked by this request;
          [new, ...)          a partial last page the tree cannot hold (or everything, with the cache off), and
                              pages allocated ahead: still the request's own, until `release_req`.
        The request's row, lock and handle agree again before the state is offered to the cache, so that an exception
        there leaves the request releasable.
        """
        slot = req.slot
        old_handle = req.cache_handle
        row = self.table_manager.read(slot, 0, stored)
        fed = (req.input_ids + req.output_ids)[:stored]
        result = self.prefix_cache.insert_prefix(fed, row)
        duplicates = slice(old_handle.cached_len, result.prefix_len)
        self.allocator.free_locations(row[duplicates])
        self.table_manager.write(slot, old_handle.cached_len, result.locations[duplicates])
        # Lock the new path before unlocking the old one, so the shared part is never evictable in between.
        self.lock(result.handle)
        self.unlock(old_handle)
        req.cache_handle = result.handle
        # The slot's state is the state after exactly the tokens fed: a chunk boundary, the end of the prompt, or
        # (finished) everything but the last sampled token, the prefix of a multi-turn chat's next turn.
        self.prefix_cache.save_state(fed, slot)

    def release_req(self, req: Req) -> None:
        """Give back what the request holds and the tree does not: its lock on the tree and its own pages.

        Nothing is inserted: after `cache_req` this finishes a request; without it, it aborts one, and nothing it
        computed enters the prefix cache. Its own pages start at its handle (the tree holds only whole pages, so
        that is a page boundary) and end with the last page allocated for it.
        """
        handle = req.cache_handle
        own_end = pages_for(req.kv_allocated_len, self.page_size) * self.page_size
        self.allocator.free_locations(self.table_manager.read(req.slot, handle.cached_len, own_end))
        self.unlock(handle)
        req.cache_handle = None
        req.kv_allocated_len = 0
        self.reserved_pages -= req.reserved_pages
        req.reserved_pages = 0

    def _allocate_pages(self, num_pages: int) -> torch.Tensor:
        shortfall = num_pages - self.allocator.num_free_pages
        if shortfall > 0:
            self.allocator.free_locations(self.prefix_cache.evict(shortfall * self.page_size))
        return self.allocator.allocate(num_pages)
