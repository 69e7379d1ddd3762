"""Exercises (notebook 07): the radix cache of a hybrid model, KV in the tree and state checkpoints on some nodes.

For an all-attention model a prefix hit of any length L is correct: the KV of positions 0..L-1 is all a request
needs to continue at position L. A hybrid model (Qwen3.5) also needs each Gated DeltaNet layer's state after exactly
L tokens, and a state cannot be cut at a position (notebook 05): only a copy saved after exactly L tokens will do.
So, as SGLang's MambaRadixCache does, this cache keeps `StateCheckpoint`s (copies of a request slot's state) on some
nodes of the ordinary radix tree:

- `save_state(token_ids, slot)`: the slot holds the state after exactly `token_ids`; keep a copy on the node where
  `token_ids` ends (an edge is split if it ends inside one). The scheduler saves at every point where a request has
  just been fed and its KV handed to the tree: a chunk boundary of a chunked prefill, the end of its prompt, and its
  end (prompt + output tokens whose KV exists), the checkpoint a multi-turn chat's next turn hits.
- `match_prefix(token_ids)`: the longest cached prefix that ends EXACTLY at a checkpoint. KV may match deeper,
  but a longer hit would run the GDN layers from a state that was never saved there: the tokens after the
  checkpoint are recomputed instead.
- `restore_state(handle, slot)`: on a hit, copy the checkpoint into the request's own slot (copy-on-write: the
  request then updates its slot, never the stored checkpoint, which stays valid for every later hit).
- Checkpoints are evicted least recently used first once there are more than `max_checkpoints` (their memory is set
  aside in the memory plan). A node's KV may outlive its checkpoint, never the reverse: evicting a node's KV drops
  its checkpoint too.

With page_size > 1 the tree holds whole pages only, so a state can be saved only where the saved sequence ends on a
page boundary: elsewhere the KV of its last, partial page would not be in the tree to match. So that every prompt
leaves one such state, the scheduler pauses a prefill at the prompt's last page boundary (`prefill_pause`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from a4.kvcache.radix_cache import CacheHandle, MatchResult, RadixCache, RadixNode
from a4.kvcache.state_pool import StateCheckpoint, StatePool


class HybridRadixCache(RadixCache):
    """RadixCache whose nodes may also hold a StateCheckpoint; a hit must end exactly at one (module docstring)."""

    def __init__(self, page_size: int, state_pool: StatePool, max_checkpoints: int) -> None:
        if not isinstance(max_checkpoints, int) or max_checkpoints < 0:
            raise ValueError(f"max_checkpoints must be a non-negative integer, got {max_checkpoints!r}")
        super().__init__(page_size)
        self.state_pool = state_pool
        self.max_checkpoints = max_checkpoints
        # The checkpoint on each node that has one, least recently used first: an OrderedDict is an LRU list
        # (`move_to_end` on use, `popitem(last=False)` to evict). Nodes hash by identity.
        self._checkpoints: OrderedDict[RadixNode, StateCheckpoint] = OrderedDict()

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """The longest prefix of token_ids whose KV is in the tree AND that ends exactly at a saved checkpoint.

        `self.match_node(token_ids)` (RadixCache's, already written) returns the deepest node whose path is a prefix
        of token_ids, splitting an edge so that the node ends exactly where the KV match ends. The hit is that node if
        it holds a checkpoint, else its nearest ancestor that holds one (`self._checkpoints`), else nothing: the
        root, length 0, where every request starts from zero states.

        Returns MatchResult(CacheHandle(hit length, hit node), KV locations of the hit's tokens): the locations of
        the path from the root down to the hit node are `node.path_locations()`, and their number is the hit
        length. A hit counts as a use of its checkpoint for the LRU order (`self._checkpoints.move_to_end`).
        """
        # BEGIN SOLUTION hybrid-match 07_radix_cache: the longest cached prefix that ends exactly at a checkpoint
        node, _ = self.match_node(token_ids)
        while not node.is_root and node not in self._checkpoints:
            node = node.parent
        if not node.is_root:
            self._checkpoints.move_to_end(node)
        locations = node.path_locations()
        return MatchResult(CacheHandle(len(locations), node), locations)
        # END SOLUTION

    def save_state(self, token_ids: Sequence[int], slot: int) -> None:
        """Keep a copy of `slot`'s state, which is the state after exactly `token_ids`, on the node where they end.

        The KV of token_ids has just been inserted (CacheManager.cache_req); `self.match_node(token_ids)` finds the node
        where they end, splitting an edge if they end inside one, and how many of them the tree holds. When that is
        fewer than len(token_ids) (a partial last page with page_size > 1, which the tree cannot hold) save nothing:
        a checkpoint must sit exactly at the end of its sequence, or a hit would use a state of another length.
        Save nothing for an empty sequence either (the root's state is zero, not a checkpoint), nor when
        `max_checkpoints` is 0.

        Otherwise the node gets `self.state_pool.save(slot)` (a copy), unless it already holds a checkpoint, which
        is then kept (it is the state after the same tokens). Either way it becomes the most recently used one, and
        `_evict_checkpoints` brings the count back within `max_checkpoints`.
        """
        # BEGIN SOLUTION hybrid-save 07_radix_cache: save a copy of a slot's state on the node where its tokens end
        node, cached_len = self.match_node(token_ids)
        if cached_len != len(token_ids) or node.is_root or self.max_checkpoints == 0:
            return
        if node not in self._checkpoints:
            self._checkpoints[node] = self.state_pool.save(slot)
        self._checkpoints.move_to_end(node)
        self._evict_checkpoints()
        # END SOLUTION

    def restore_state(self, handle: CacheHandle, slot: int) -> None:
        """A request was admitted with `handle` (from match_prefix) into `slot`: give the slot the hit's state.

        A hit of length 0 has nothing to restore: the engine starts such a request from zero states. Otherwise copy
        the checkpoint on handle.node into the slot with `self.state_pool.restore`, which copies: the request goes on
        to update its slot in place, and the stored checkpoint must stay exactly as it was saved for later hits.
        """
        # BEGIN SOLUTION hybrid-restore 07_radix_cache: copy the hit checkpoint into the request slot
        if handle.cached_len > 0:
            self.state_pool.restore(self._checkpoints[handle.node], slot)
        # END SOLUTION

    def _evict_checkpoints(self) -> None:
        """Drop checkpoints, least recently used first, until at most `max_checkpoints` remain.

        Only the checkpoint goes: its node keeps its KV, which prefixes of other checkpoints may still need, and which
        the KV's own LRU eviction (`evict`) frees when memory runs short.
        """
        # BEGIN SOLUTION hybrid-evict-checkpoints 07_radix_cache: drop the least recently used checkpoints over budget
        while len(self._checkpoints) > self.max_checkpoints:
            self._checkpoints.popitem(last=False)
        # END SOLUTION

    def prefill_pause(self, prompt_len: int) -> int:
        """The prompt's last page boundary. A state can be saved only on a page boundary, and the prompt's own end
        rarely is one: pausing the prefill there leaves a state the next turn of a chat can resume from (vLLM's
        "align" mode cuts its chunks at block boundaries for the same reason). With page_size 1: no pause."""
        return self.align_down(prompt_len) or prompt_len

    def on_evict(self, node: RadixNode) -> None:
        """A node's checkpoint goes with its KV: it could never be hit again."""
        self._checkpoints.pop(node, None)

    @property
    def num_checkpoints(self) -> int:
        return len(self._checkpoints)

    def checkpoints(self) -> list[tuple[list[int], StateCheckpoint]]:
        """Every stored checkpoint with the token ids it is the state after, least recently used first."""
        return [(node.path_token_ids(), checkpoint) for node, checkpoint in self._checkpoints.items()]
