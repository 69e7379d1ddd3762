"""The prefix cache: KV of finished (and running) requests kept in a radix tree so later prompts can reuse it.

Each edge of the tree holds a run of token ids (`key`) and the KV pool locations of those tokens (`value`). A path
from the root spells a token sequence whose KV sits in the pool, so a new prompt that starts with that sequence skips
its prefill. The design follows mini-sglang's RadixCache:

- `match_prefix(ids)` walks down as far as `ids` agrees with the tree and returns a handle on the deepest node; when
  the match ends inside an edge, that edge is split in two so that the handle points at an exact node.
- `lock(handle)` / `unlock(handle)` count references on every node from the handle up to the root: a locked node is
  in use by a running request and can never be evicted.
- `insert_prefix(ids, locations)` adds the part of `ids` that the tree does not know yet as a new leaf, which from
  then on owns those locations.
- `evict(n)` frees at least n tokens, least recently used unlocked leaves first (a parent becomes a leaf in turn).

With page_size > 1 only whole pages are matched and inserted, because a page is the unit of memory: the tree can
only own, share and free whole pages. Children are then keyed by their first page of tokens instead of their first
token.

The tree lives on the host (token ids as python lists, locations as int64 host tensors), as in mini-sglang: its
work is comparisons and pointer chasing, which the accelerator cannot speed up.

`NoPrefixCache` has the same interface and caches nothing (`enable_prefix_cache=False`): the scheduler uses either
without knowing which. A hybrid model's cache (`HybridRadixCache`, notebook 07) subclasses RadixCache and also keeps
copies of request states on some nodes, through hooks that the others leave empty (`save_state`, `restore_state`,
`prefill_pause`). What a subclass may build on, as SGLang's hybrid radix caches build on theirs:

- `match_node(ids)`: the node where the KV match of `ids` ends, and its length (what `match_prefix` reports);
- `node.path_locations()` / `node.path_token_ids()`: the locations and token ids from the root down to a node;
- `align_down(length)`: a length rounded down to whole pages, the only lengths the tree holds;
- `on_evict(node)`: called for each node `evict` removes, so that what a subclass keeps on a node goes with it.

A node keeps its identity when an edge above it is split (the new node is the upper part), so what a subclass keeps
per node stays attached to the same token sequence.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

_EMPTY_LOCATIONS = torch.empty(0, dtype=torch.int64)


@dataclass(frozen=True)
class CacheHandle:
    """A matched or inserted prefix: its length, and the tree node where it ends (None when nothing is cached)."""

    cached_len: int
    node: RadixNode | None = None


class MatchResult(NamedTuple):
    handle: CacheHandle
    # KV pool locations of the matched tokens, [handle.cached_len]. Only safe to use once the handle is locked.
    locations: torch.Tensor


class InsertResult(NamedTuple):
    # Tokens at the start of the inserted sequence that the tree already held before this insert: the caller's own
    # copies of them are duplicates, to be freed.
    prefix_len: int
    handle: CacheHandle
    # The tree's locations of the inserted (page-aligned) sequence, [handle.cached_len].
    locations: torch.Tensor


class BasePrefixCache(ABC):
    """What the scheduler needs from a prefix cache. Sizes are in tokens."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult: ...

    @abstractmethod
    def insert_prefix(self, token_ids: Sequence[int], locations: torch.Tensor) -> InsertResult: ...

    @abstractmethod
    def lock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def unlock(self, handle: CacheHandle) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> torch.Tensor:
        """Free at least num_tokens cached tokens (whole leaves, so possibly more); returns their locations."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes: memory that `evict` can give back."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Tokens held by locked nodes: in use by running requests."""

    # A hybrid model's cache also keeps copies of request states (HybridRadixCache, notebook 07). KV alone needs none
    # of these hooks: the KV of a matched prefix is all an all-attention model needs to continue.
    def save_state(self, token_ids: Sequence[int], slot: int) -> None:
        """The request slot `slot` holds the state after exactly token_ids (just inserted): keep a copy for hits."""

    def restore_state(self, handle: CacheHandle, slot: int) -> None:
        """A request admitted with the match `handle` into `slot`: give the slot the state saved where it ends."""

    def prefill_pause(self, prompt_len: int) -> int:
        """Where a prompt's prefill should pause so that the state there can be saved; prompt_len: nowhere."""
        return prompt_len


class NoPrefixCache(BasePrefixCache):
    """The prefix cache switched off: nothing matches, nothing is kept."""

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        return MatchResult(CacheHandle(0), _EMPTY_LOCATIONS)

    def insert_prefix(self, token_ids: Sequence[int], locations: torch.Tensor) -> InsertResult:
        return InsertResult(0, CacheHandle(0), _EMPTY_LOCATIONS)

    def lock(self, handle: CacheHandle) -> None:
        pass

    def unlock(self, handle: CacheHandle) -> None:
        pass

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > 0:
            raise ValueError(f"cannot evict {num_tokens} tokens: the prefix cache is disabled and holds nothing")
        return _EMPTY_LOCATIONS

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0


class RadixNode:
    """One edge of the tree, stored at its lower end: `key` token ids and their KV `value` locations."""

    _ids = itertools.count()

    def __init__(self, key: list[int], value: torch.Tensor, parent: RadixNode | None, last_access: int) -> None:
        self.key = key
        self.value = value
        self.parent = parent
        self.children: dict[int | tuple[int, ...], RadixNode] = {}
        self.ref_count = 0
        self.last_access = last_access
        # Breaks LRU ties deterministically (heapq compares the next tuple field on equal times).
        self.id = next(RadixNode._ids)

    def __len__(self) -> int:
        return len(self.key)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_locations(self) -> torch.Tensor:
        """KV locations of the whole sequence from the root down to this node."""
        values = [node.value for node in self._path()]
        return torch.cat(values) if values else _EMPTY_LOCATIONS

    def path_token_ids(self) -> list[int]:
        """Token ids of the whole sequence from the root down to this node."""
        return [token for node in self._path() for token in node.key]

    def _path(self) -> list[RadixNode]:
        """The nodes from the root's child down to this one (empty for the root)."""
        path, node = [], self
        while not node.is_root:
            path.append(node)
            node = node.parent
        return path[::-1]


class RadixCache(BasePrefixCache):
    def __init__(self, page_size: int = 1) -> None:
        super().__init__(page_size)
        self.root = RadixNode([], _EMPTY_LOCATIONS, parent=None, last_access=0)
        # The root holds no tokens and must never be evicted: one permanent reference.
        self.root.ref_count = 1
        self._evictable_size = 0
        self._protected_size = 0
        # A logical clock for LRU: deterministic, unlike wall time.
        self._clock = itertools.count(1)

    @property
    def evictable_size(self) -> int:
        return self._evictable_size

    @property
    def protected_size(self) -> int:
        return self._protected_size

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        node, matched_len = self.match_node(token_ids)
        return MatchResult(CacheHandle(matched_len, node), node.path_locations())

    def insert_prefix(self, token_ids: Sequence[int], locations: torch.Tensor) -> InsertResult:
        if len(token_ids) != len(locations):
            raise ValueError(f"insert_prefix: {len(token_ids)} token ids but {len(locations)} locations")
        insert_len = self.align_down(len(token_ids))
        token_ids = list(token_ids[:insert_len])
        node, prefix_len = self.match_node(token_ids)
        if prefix_len < insert_len:
            leaf = RadixNode(
                token_ids[prefix_len:], locations[prefix_len:insert_len].cpu().clone(), node, next(self._clock)
            )
            node.children[self._child_key(leaf.key)] = leaf
            self._evictable_size += len(leaf)
            node = leaf
        return InsertResult(prefix_len, CacheHandle(insert_len, node), node.path_locations())

    def lock(self, handle: CacheHandle) -> None:
        node = handle.node
        while node is not None and not node.is_root:
            if node.ref_count == 0:
                self._evictable_size -= len(node)
                self._protected_size += len(node)
            node.ref_count += 1
            node = node.parent

    def unlock(self, handle: CacheHandle) -> None:
        node = handle.node
        while node is not None and not node.is_root:
            if node.ref_count <= 0:
                raise RuntimeError("unlock of a prefix that is not locked")
            node.ref_count -= 1
            if node.ref_count == 0:
                self._evictable_size += len(node)
                self._protected_size -= len(node)
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        if num_tokens > self._evictable_size:
            raise ValueError(f"cannot evict {num_tokens} tokens: only {self._evictable_size} are unlocked")
        heap = [(leaf.last_access, leaf.id, leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted: list[torch.Tensor] = [_EMPTY_LOCATIONS]
        evicted_len = 0
        while evicted_len < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            self._evictable_size -= len(leaf)
            evicted_len += len(leaf)
            evicted.append(leaf.value)
            self.on_evict(leaf)
            if parent.is_leaf and parent.ref_count == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return torch.cat(evicted)

    def on_evict(self, node: RadixNode) -> None:
        """Called by `evict` for each node it has just removed from the tree: a subclass drops what it keeps there
        (nothing can match the node again). RadixCache keeps nothing beside the KV."""

    def match_node(self, token_ids: Sequence[int]) -> tuple[RadixNode, int]:
        """The deepest node whose path is a prefix of token_ids, and that prefix's length (whole pages).

        When the match ends inside an edge, the edge is split there, so the returned node ends exactly at the match
        (the root, length 0, when nothing matches). The nodes on the way count as used for the LRU order of `evict`.
        """
        now = next(self._clock)
        node, matched_len = self.root, 0
        while len(token_ids) - matched_len >= self.page_size:
            rest = token_ids[matched_len:]
            child = node.children.get(self._child_key(rest))
            if child is None:
                break
            child.last_access = now
            # The child's first page equals rest's (it is the lookup key), so at least one page matches.
            common = self.align_down(_common_prefix_len(child.key, rest))
            matched_len += common
            if common < len(child):
                return self._split(child, common), matched_len
            node = child
        return node, matched_len

    def align_down(self, length: int) -> int:
        """length rounded down to whole pages: the tree matches, inserts and holds whole pages only."""
        return length - length % self.page_size

    def _split(self, node: RadixNode, at: int) -> RadixNode:
        """Cut node's edge after `at` tokens; returns the new upper node, which takes node's place in the tree."""
        parent = node.parent
        upper = RadixNode(node.key[:at], node.value[:at], parent, node.last_access)
        # Everyone that locked `node` also holds the path through `upper`.
        upper.ref_count = node.ref_count
        parent.children[self._child_key(upper.key)] = upper
        node.key, node.value, node.parent = node.key[at:], node.value[at:], upper
        upper.children[self._child_key(node.key)] = node
        return upper

    def _evictable_leaves(self) -> list[RadixNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.is_leaf and node.ref_count == 0:
                leaves.append(node)
            stack.extend(node.children.values())
        return leaves

    def _child_key(self, token_ids: Sequence[int]) -> int | tuple[int, ...]:
        return token_ids[0] if self.page_size == 1 else tuple(token_ids[: self.page_size])


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
