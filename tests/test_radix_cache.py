"""RadixCache against a brute-force reference: every prefix of every inserted sequence in a dict, first writer wins."""

from __future__ import annotations

import random

import pytest
import torch

from a4.kvcache.radix_cache import NoPrefixCache, RadixCache


class NaivePrefixCache:
    """What the tree must answer, without a tree: a dict from each stored page-aligned prefix to its last page's
    locations (memory is shared a whole page at a time, so a page belongs to the first sequence that stored it)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.page_locations: dict[tuple[int, ...], list[int]] = {}

    def stored_prefix_len(self, ids: list[int]) -> int:
        """Longest page-aligned k such that ids[:k] is stored."""
        k = len(ids) - len(ids) % self.page_size
        while k > 0 and tuple(ids[:k]) not in self.page_locations:
            k -= self.page_size
        return k

    def locations(self, ids: list[int], k: int) -> list[int]:
        page_ends = range(self.page_size, k + 1, self.page_size)
        return [loc for end in page_ends for loc in self.page_locations[tuple(ids[:end])]]

    def insert(self, ids: list[int], locations: list[int]) -> int:
        already = self.stored_prefix_len(ids)
        for end in range(self.page_size, len(ids) + 1, self.page_size):
            self.page_locations.setdefault(tuple(ids[:end]), locations[end - self.page_size : end])
        return already

    @property
    def num_tokens(self) -> int:
        return len(self.page_locations) * self.page_size


def insert_random(rng: random.Random, cache: RadixCache, naive: NaivePrefixCache, next_location: int,
                  min_len: int) -> tuple[list[int], int]:
    """A random sequence inserted into both caches at fresh locations from next_location; returns it and the next
    free location. A 3-letter alphabet makes long shared prefixes, splits and divergences inside edges common."""
    ids = [rng.randrange(3) for _ in range(rng.randrange(min_len, 16))]
    locations = list(range(next_location, next_location + len(ids)))
    cache.insert_prefix(ids, torch.tensor(locations))
    naive.insert(ids, locations)
    return ids, next_location + len(ids)


def tree_tokens(cache: RadixCache) -> int:
    total, stack = 0, [cache.root]
    while stack:
        node = stack.pop()
        total += len(node)
        stack.extend(node.children.values())
    return total


@pytest.mark.parametrize("page_size", [1, 2, 4])
def test_match_and_insert_agree_with_brute_force(page_size):
    rng = random.Random(page_size)
    cache, naive = RadixCache(page_size), NaivePrefixCache(page_size)
    next_location = 0
    for _ in range(300):
        # A 3-letter alphabet makes long shared prefixes, splits and divergences inside edges common.
        ids = [rng.randrange(3) for _ in range(rng.randrange(0, 24))]
        if rng.random() < 0.5:
            locations = list(range(next_location, next_location + len(ids)))
            next_location += len(ids)
            result = cache.insert_prefix(ids, torch.tensor(locations, dtype=torch.int64))
            expected_prefix = naive.insert(ids, locations)
            assert result.prefix_len == expected_prefix
            aligned = len(ids) - len(ids) % page_size
            assert result.handle.cached_len == aligned
            assert result.locations.tolist() == naive.locations(ids, aligned)
        else:
            match = cache.match_prefix(ids)
            k = naive.stored_prefix_len(ids)
            assert match.handle.cached_len == k
            assert match.locations.tolist() == naive.locations(ids, k)
        assert cache.evictable_size == tree_tokens(cache) == naive.num_tokens
        assert cache.protected_size == 0


def test_match_splits_an_edge_and_lock_protects_only_the_matched_part():
    cache = RadixCache()
    cache.insert_prefix([1, 2, 3, 4], torch.tensor([10, 11, 12, 13]))
    match = cache.match_prefix([1, 2, 9])
    assert match.handle.cached_len == 2 and match.locations.tolist() == [10, 11]
    assert sorted(len(n) for n in cache.root.children[1].children.values()) == [2]  # [1, 2] -> [3, 4]
    cache.lock(match.handle)
    assert (cache.protected_size, cache.evictable_size) == (2, 2)
    # Only the unlocked tail can go.
    assert sorted(cache.evict(2).tolist()) == [12, 13]
    assert cache.evictable_size == 0
    with pytest.raises(ValueError, match="only 0 are unlocked"):
        cache.evict(1)
    assert cache.match_prefix([1, 2, 3, 4]).locations.tolist() == [10, 11]
    cache.unlock(match.handle)
    assert (cache.protected_size, cache.evictable_size) == (0, 2)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.unlock(match.handle)


def test_lock_counts_references_up_to_the_root():
    cache = RadixCache()
    cache.insert_prefix([1, 2], torch.tensor([0, 1]))
    deep = cache.insert_prefix([1, 2, 3, 4], torch.tensor([0, 1, 2, 3])).handle
    shallow = cache.match_prefix([1, 2, 7]).handle
    cache.lock(deep)
    cache.lock(shallow)
    cache.unlock(deep)
    # [1, 2] is still held by `shallow`; [3, 4] is free again.
    assert (cache.protected_size, cache.evictable_size) == (2, 2)
    assert cache.evict(1).tolist() == [2, 3]
    cache.unlock(shallow)
    assert cache.evict(2).tolist() == [0, 1]
    assert tree_tokens(cache) == 0


def test_evict_least_recently_used_leaf_first_then_parents():
    cache = RadixCache()
    cache.insert_prefix([5, 1], torch.tensor([0, 1]))
    cache.insert_prefix([5, 1, 2], torch.tensor([0, 1, 2]))
    cache.insert_prefix([5, 1, 3], torch.tensor([0, 1, 3]))
    cache.insert_prefix([6], torch.tensor([4]))
    cache.match_prefix([5, 1, 2])  # touches [5, 1] and [2]; [3] and [6] are older
    assert cache.evict(1).tolist() == [3]
    assert cache.evict(1).tolist() == [4]
    assert cache.evict(1).tolist() == [2]
    # [5, 1] became a leaf once both children were gone.
    assert cache.evict(2).tolist() == [0, 1]
    assert cache.evictable_size == 0


def test_evict_keeps_locked_paths_intact_under_random_traffic():
    rng = random.Random(7)
    cache, naive = RadixCache(2), NaivePrefixCache(2)
    locked = []
    next_location = 0
    for _ in range(200):
        ids, next_location = insert_random(rng, cache, naive, next_location, min_len=2)
        if rng.random() < 0.3:
            match = cache.match_prefix(ids)
            cache.lock(match.handle)
            locked.append((ids[: match.handle.cached_len], match.locations.tolist(), match.handle))
        if rng.random() < 0.3 and cache.evictable_size:
            before = tree_tokens(cache)
            want = rng.randrange(1, cache.evictable_size + 1)
            evicted = cache.evict(want)
            assert len(evicted) >= want and tree_tokens(cache) == before - len(evicted)
            assert len(evicted) % 2 == 0
        if rng.random() < 0.2 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked)))[2])
        for ids_locked, locations_locked, _ in locked:
            match = cache.match_prefix(ids_locked)
            assert match.locations.tolist() == locations_locked
        assert cache.evictable_size + cache.protected_size == tree_tokens(cache)


@pytest.mark.parametrize("page_size", [1, 2])
def test_subclass_interface_agrees_with_brute_force(page_size):
    """What a subclass builds on (HybridRadixCache): match_node, a node's path and on_evict, called once for each
    node that evict removes, which can then never match again."""
    evicted_nodes = []

    class Recording(RadixCache):
        def on_evict(self, node):
            evicted_nodes.append((node.path_token_ids(), node.value.tolist()))

    rng = random.Random(page_size)
    cache, naive = Recording(page_size), NaivePrefixCache(page_size)
    next_location = 0
    for _ in range(60):
        _, next_location = insert_random(rng, cache, naive, next_location, min_len=0)
        probe = [rng.randrange(3) for _ in range(rng.randrange(0, 16))]
        node, matched_len = cache.match_node(probe)
        assert matched_len == cache.align_down(matched_len) == naive.stored_prefix_len(probe)
        assert node.path_token_ids() == probe[:matched_len]
        assert node.path_locations().tolist() == naive.locations(probe, matched_len)

    evicted = cache.evict(cache.evictable_size // 2).tolist()
    assert sorted(location for _, locations in evicted_nodes for location in locations) == sorted(evicted)
    for ids, locations in evicted_nodes:
        assert locations == naive.locations(ids, len(ids))[len(ids) - len(locations) :]
        assert cache.match_prefix(ids).handle.cached_len < len(ids)


def test_page_aligned_insert_and_match():
    cache = RadixCache(page_size=4)
    result = cache.insert_prefix(list(range(10)), torch.arange(100, 110))
    assert result.handle.cached_len == 8 and result.prefix_len == 0
    assert cache.evictable_size == 8
    assert cache.match_prefix(list(range(7))).handle.cached_len == 4
    assert cache.match_prefix(list(range(9))).handle.cached_len == 8
    # Differs inside the second page: only the first page matches.
    assert cache.match_prefix([0, 1, 2, 3, 4, 99, 6, 7]).locations.tolist() == [100, 101, 102, 103]
    assert cache.match_prefix([0, 1, 2]).handle.cached_len == 0


def test_no_prefix_cache_keeps_nothing():
    cache = NoPrefixCache(page_size=1)
    result = cache.insert_prefix([1, 2, 3], torch.tensor([0, 1, 2]))
    assert result.prefix_len == 0 and result.handle.cached_len == 0
    assert cache.match_prefix([1, 2, 3]).handle.cached_len == 0
    assert cache.evictable_size == cache.protected_size == 0
    with pytest.raises(ValueError, match="disabled"):
        cache.evict(1)
