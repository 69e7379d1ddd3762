"""Property tests (hypothesis, stateful) of the prefix caches: RadixCache, HybridRadixCache ("checkpoint") and
NoPrefixCache (what a hybrid model's "refuse" policy uses).

Random sequences of insert / match / lock / unlock / evict (and, for the hybrid cache, save_state / restore_state)
run against a naive model: a dict from every stored page-aligned prefix to the locations of its last page (first
writer wins), the prefixes that locks hold, and, for the hybrid cache, an LRU dict of the prefixes that have a state
checkpoint. The memory is a real PageAllocator (property-tested in test_properties_pools.py): the test allocates the
locations it inserts and frees what the tree gives back, so a location owned twice shows up as a double free.

Invariants checked after every step, as the modules document them: a match is the longest stored prefix (for the
hybrid cache: the longest that ends exactly at a checkpoint, and restoring it gives the state saved after exactly
those tokens); no location is owned twice; locked prefixes are never evicted and eviction takes leaves first;
evictable + protected = tokens in the tree, and free pages + the tree's pages = all pages.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from a4.checkpoints import preset_config
from a4.kvcache.allocator import PageAllocator
from a4.kvcache.hybrid_radix_cache import HybridRadixCache
from a4.kvcache.radix_cache import CacheHandle, NoPrefixCache, RadixCache
from a4.kvcache.state_pool import StatePool
from a4.models.config import parse_config

MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=30)
# A 3-token alphabet makes shared prefixes, edge splits and divergences inside edges common. Drawn as bytes: one
# draw per sequence instead of one per token, which is most of hypothesis's time here.
TOKEN_IDS = st.binary(max_size=12).map(lambda raw: [byte % 3 for byte in raw])
# Enough for every insert of a run (30 steps of at most 12 pages) without evicting.
NUM_PAGES = 400


class PrefixModel:
    """What the tree must hold, without a tree: each stored page-aligned prefix -> the locations of its last page."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pages: dict[tuple[int, ...], list[int]] = {}

    def stored_len(self, ids: list[int]) -> int:
        """The longest page-aligned k such that ids[:k] is stored."""
        k = len(ids) - len(ids) % self.page_size
        while k and tuple(ids[:k]) not in self.pages:
            k -= self.page_size
        return k

    def locations(self, ids: list[int], k: int) -> list[int]:
        return [loc for end in range(self.page_size, k + 1, self.page_size) for loc in self.pages[tuple(ids[:end])]]

    def insert(self, ids: list[int], locations: list[int]) -> None:
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            self.pages.setdefault(tuple(ids[:end]), locations[end - self.page_size : end])


def tree_nodes(cache: RadixCache):
    stack = list(cache.root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


class RadixCacheMachine(RuleBasedStateMachine):
    # Sequences inserted so far: later prompts continue them, as the turns of a chat do.
    sequences = Bundle("sequences")

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.start(RadixCache(page_size))

    def start(self, cache: RadixCache) -> None:
        self.cache, self.page_size = cache, cache.page_size
        self.model = PrefixModel(self.page_size)
        self.allocator = PageAllocator(NUM_PAGES, self.page_size)
        # (the prefix a lock holds, its handle), one entry per lock.
        self.locks: list[tuple[tuple[int, ...], CacheHandle]] = []

    def expected_hit(self, ids: list[int]) -> int:
        return self.model.stored_len(ids)

    def forget(self, prefix: tuple[int, ...]) -> None:
        """The model's bookkeeping when a prefix is evicted."""
        del self.model.pages[prefix]

    def locked(self, prefix: tuple[int, ...]) -> bool:
        return any(len(prefix) <= len(held) and held[: len(prefix)] == prefix for held, _ in self.locks)

    @rule(target=sequences, ids=TOKEN_IDS)
    def insert(self, ids):
        p = self.page_size
        locations = self.allocator.pages_to_locations(self.allocator.allocate(-(-len(ids) // p)))[: len(ids)]
        already, aligned = self.model.stored_len(ids), len(ids) - len(ids) % p
        result = self.cache.insert_prefix(ids, locations)
        assert (result.prefix_len, result.handle.cached_len) == (already, aligned)
        self.model.insert(ids[:aligned], locations[:aligned].tolist())
        assert result.locations.tolist() == self.model.locations(ids, aligned)
        # The caller's copies of what the tree held already, and its partial last page, stay the caller's: freed.
        self.allocator.free_locations(locations[:already])
        self.allocator.free_locations(locations[aligned:])
        return ids

    @rule(ids=TOKEN_IDS)
    def match(self, ids):
        self.check_match(ids)

    @rule(earlier=sequences, more=TOKEN_IDS)
    def match_a_continuation(self, earlier, more):
        self.check_match(earlier + more)

    def check_match(self, ids: list[int]) -> CacheHandle:
        want = self.expected_hit(ids)
        result = self.cache.match_prefix(ids)
        assert result.handle.cached_len == want, f"match of {ids}: {result.handle.cached_len}, expected {want}"
        assert result.locations.tolist() == self.model.locations(ids, want)
        return result.handle

    @rule(ids=TOKEN_IDS)
    def match_and_lock(self, ids):
        handle = self.check_match(ids)
        self.cache.lock(handle)
        self.locks.append((tuple(ids[: handle.cached_len]), handle))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        _, handle = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
        self.cache.unlock(handle)

    @rule(ids=TOKEN_IDS)
    def unlock_of_an_unlocked_prefix_is_refused(self, ids):
        handle = self.check_match(ids)
        prefix = tuple(ids[: handle.cached_len])
        if not prefix or self.locked(prefix):
            return  # the root, which unlock passes over, or a prefix a lock holds
        sizes = (self.cache.evictable_size, self.cache.protected_size)
        with pytest.raises(RuntimeError, match="not locked"):
            self.cache.unlock(handle)
        assert (self.cache.evictable_size, self.cache.protected_size) == sizes

    @rule(data=st.data())
    def evict(self, data):
        evictable = self.cache.evictable_size
        # Often everything: locked prefixes are the most recently used, so only a large eviction reaches them.
        num_tokens = data.draw(st.just(evictable) | st.integers(0, evictable + 2))
        if num_tokens > evictable:
            with pytest.raises(ValueError, match="unlocked"):
                self.cache.evict(num_tokens)
            return
        locations = self.cache.evict(num_tokens).tolist()
        assert len(locations) >= num_tokens
        gone = set(locations)
        removed = {prefix for prefix, page in self.model.pages.items() if gone & set(page)}
        # Whole pages, each once; never one a lock holds; leaves first (a prefix goes with all its extensions).
        assert sorted(loc for prefix in removed for loc in self.model.pages[prefix]) == sorted(locations)
        for prefix in removed:
            assert not self.locked(prefix), f"evicted {prefix}, which a running request holds"
            extensions = [other for other in self.model.pages if other[: len(prefix)] == prefix]
            assert set(extensions) <= removed, f"evicted {prefix} but kept an extension of it"
        for prefix in removed:
            self.forget(prefix)
        self.allocator.free_locations(torch.tensor(locations, dtype=torch.int64))

    @invariant()
    def sizes_and_pages_are_conserved(self):
        if not hasattr(self, "cache"):
            return
        p = self.page_size
        protected = [prefix for prefix in self.model.pages if self.locked(prefix)]
        assert self.cache.protected_size == p * len(protected)
        assert self.cache.evictable_size + self.cache.protected_size == p * len(self.model.pages)
        assert self.allocator.num_free_pages + len(self.model.pages) == NUM_PAGES
        # No location owned twice: the tree's locations are exactly the model's, each once.
        tree_locations = [loc for node in tree_nodes(self.cache) for loc in node.value.tolist()]
        assert sorted(tree_locations) == sorted(loc for page in self.model.pages.values() for loc in page)
        # A lock counts on every node up to the root: a parent holds at least the references of each child.
        for node in tree_nodes(self.cache):
            assert node.parent.is_root or node.parent.ref_count >= node.ref_count

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        # Unlocked, everything in the tree can be evicted, and the memory is whole again.
        for _, handle in self.locks:
            self.cache.unlock(handle)
        self.allocator.free_locations(self.cache.evict(self.cache.evictable_size))
        assert self.cache.evictable_size == self.cache.protected_size == 0
        assert self.allocator.num_free_pages == NUM_PAGES


TINY_QWEN3_5 = parse_config(preset_config("qwen3_5", "tiny"))
# Slot 0 is the request that saves states, slot 1 the one a hit is restored into.
SAVER, RESTORED = 0, 1


class HybridRadixCacheMachine(RadixCacheMachine):
    """The checkpoint policy: states saved after random sequences, hits only where one is kept, LRU over them.

    The state saved after a sequence is a code for that sequence, written into the saving slot; restoring a hit must
    give back the code of exactly the hit's tokens.
    """

    @initialize(page_size=st.sampled_from([1, 2, 4]), max_checkpoints=st.integers(0, 3))
    def setup(self, page_size, max_checkpoints):
        self.pool = StatePool(TINY_QWEN3_5, 2, torch.float32, "cpu")
        self.start(HybridRadixCache(page_size, self.pool, max_checkpoints))
        self.max_checkpoints = max_checkpoints
        # Prefixes with a checkpoint, least recently used first, and the code of each sequence seen.
        self.checkpoints: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.codes: dict[tuple[int, ...], int] = {}

    def code(self, ids) -> int:
        return self.codes.setdefault(tuple(ids), len(self.codes) + 1)

    def expected_hit(self, ids: list[int]) -> int:
        hits = [len(prefix) for prefix in self.checkpoints if prefix == tuple(ids[: len(prefix)])]
        # Sequences shorter than a page never get a checkpoint; a whole-sequence hit must still leave it in the tree.
        hit = max(hits, default=0)
        assert self.model.stored_len(ids) >= hit, "a checkpoint outlived its KV"
        if hit:
            self.checkpoints.move_to_end(tuple(ids[:hit]))
        return hit

    def forget(self, prefix: tuple[int, ...]) -> None:
        super().forget(prefix)
        self.checkpoints.pop(prefix, None)

    @rule(target=RadixCacheMachine.sequences, ids=TOKEN_IDS, insert_first=st.booleans())
    def save_state(self, ids, insert_first):
        """The scheduler inserts a request's KV, then saves its state; saving where the KV is not whole is a no-op."""
        if insert_first:
            self.insert(ids)
        self.pool.conv_state(0)[SAVER] = self.code(ids)
        self.cache.save_state(ids, SAVER)
        key = tuple(ids)
        if ids and self.max_checkpoints and self.model.stored_len(ids) == len(ids):
            self.checkpoints.setdefault(key, self.code(ids))
            self.checkpoints.move_to_end(key)
            while len(self.checkpoints) > self.max_checkpoints:
                self.checkpoints.popitem(last=False)
        return ids

    def check_match(self, ids: list[int]) -> CacheHandle:
        handle = super().check_match(ids)
        self.pool.conv_state(0)[RESTORED] = -1
        self.cache.restore_state(handle, RESTORED)
        restored = int(self.pool.conv_state(0)[RESTORED].flatten()[0])
        assert restored == (self.code(ids[: handle.cached_len]) if handle.cached_len else -1), (
            f"hit of {handle.cached_len} tokens restored the state of another sequence"
        )
        return handle

    @invariant()
    def checkpoints_are_the_models_in_lru_order(self):
        if not hasattr(self, "cache"):
            return
        stored = self.cache.checkpoints()
        assert [tuple(tokens) for tokens, _ in stored] == list(self.checkpoints)
        for tokens, checkpoint in stored:
            assert int(checkpoint.conv[0].flatten()[0]) == self.checkpoints[tuple(tokens)]
        assert self.cache.num_checkpoints <= self.max_checkpoints


TestRadixCache = RadixCacheMachine.TestCase
TestRadixCache.settings = MACHINE_SETTINGS
TestHybridRadixCache = HybridRadixCacheMachine.TestCase
TestHybridRadixCache.settings = MACHINE_SETTINGS


@settings(max_examples=50)
@given(
    page_size=st.sampled_from([1, 4]),
    ops=st.lists(st.tuples(st.sampled_from(["insert", "match", "evict"]), TOKEN_IDS), max_size=12),
)
def test_refuse_policy_keeps_nothing(page_size, ops):
    """A hybrid model under "refuse" gets NoPrefixCache: nothing is kept, nothing matches, nothing can be evicted."""
    cache = NoPrefixCache(page_size)
    for op, ids in ops:
        if op == "insert":
            result = cache.insert_prefix(ids, torch.arange(len(ids)))
            # Nothing taken over: the caller keeps (and frees) every location it inserted.
            assert (result.prefix_len, result.handle.cached_len, len(result.locations)) == (0, 0, 0)
        elif op == "match":
            result = cache.match_prefix(ids)
            cache.lock(result.handle)
            cache.unlock(result.handle)
            assert (result.handle.cached_len, len(result.locations)) == (0, 0)
            cache.restore_state(result.handle, 0)  # nothing saved, nothing restored
        else:
            assert len(cache.evict(0)) == 0
            if ids:
                with pytest.raises(ValueError, match="disabled"):
                    cache.evict(len(ids))
        cache.save_state(ids, 0)
        assert cache.evictable_size == cache.protected_size == 0
        assert cache.prefill_pause(len(ids)) == len(ids)
