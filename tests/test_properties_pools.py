"""Property tests (hypothesis, stateful) of the pools a request draws from: KV pages, request slots, GDN states.

Random sequences of allocate / free (and write / read, save / restore / clear) run against naive models kept here:
a set of free pages, a stack of free slots and a list per table row, a dict of expected state values per slot.
After every step the invariants the modules document must hold: a page or slot is never handed out twice, what is
freed is what comes back, counts are conserved, and a bad free is refused without changing anything.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, precondition, rule

from a4.checkpoints import preset_config
from a4.kvcache.allocator import OutOfPagesError, PageAllocator
from a4.kvcache.state_pool import StateCheckpoint, StatePool
from a4.models.config import parse_config
from a4.scheduler.table import TableManager

# Bounded for `make test`: each example runs up to stateful_step_count steps.
MACHINE_SETTINGS = settings(max_examples=40, stateful_step_count=25)


class PageAllocatorMachine(RuleBasedStateMachine):
    """The allocator against a set of free pages; the test holds what it allocated, in groups."""

    groups = Bundle("groups")

    @initialize(num_pages=st.integers(1, 12), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_pages, page_size):
        self.allocator = PageAllocator(num_pages, page_size)
        self.free = set(range(num_pages))
        self.held: set[int] = set()

    @rule(target=groups, count=st.integers(0, 6))
    def allocate(self, count):
        if count > len(self.free):
            with pytest.raises(OutOfPagesError):
                self.allocator.allocate(count)
            return []
        pages = self.allocator.allocate(count).tolist()
        assert len(set(pages)) == count and set(pages) <= self.free, f"handed out {pages}, free {self.free}"
        self.free -= set(pages)
        self.held |= set(pages)
        return pages

    @rule(pages=consumes(groups), data=st.data())
    def free_some(self, pages, data):
        """Free a group (or part of it, in any order) as pages or as their locations."""
        some = data.draw(st.permutations(pages)).copy()[: data.draw(st.integers(0, len(pages)))]
        if data.draw(st.booleans()):
            self.allocator.free(torch.tensor(some, dtype=torch.int64))
        else:
            locations = self.allocator.pages_to_locations(torch.tensor(some, dtype=torch.int64))
            assert sorted(self.allocator.locations_to_pages(locations).tolist()) == sorted(some)
            self.allocator.free_locations(locations)
        self.free |= set(some)
        self.held -= set(some)

    @rule(data=st.data())
    def bad_free_changes_nothing(self, data):
        """A free page (freed twice), a page outside the pool, or a held page listed twice: refused, no change."""
        candidates = [[page] for page in self.free] + [[-1], [self.allocator.num_pages]]
        candidates += [[page, page] for page in self.held]
        bad = data.draw(st.sampled_from(candidates))
        held = data.draw(st.lists(st.sampled_from(sorted(self.held)), unique=True)) if self.held else []
        pages = data.draw(st.permutations(held + bad))
        before = self.allocator.num_free_pages
        with pytest.raises((RuntimeError, ValueError)):
            self.allocator.free(torch.tensor(pages, dtype=torch.int64))
        assert self.allocator.num_free_pages == before

    @invariant()
    def counts_are_conserved(self):
        assert self.allocator.num_free_pages == len(self.free)
        assert len(self.free) + len(self.held) == self.allocator.num_pages

    def teardown(self):
        # Everything the pool still lists as free comes out exactly once, and nothing else.
        if hasattr(self, "allocator"):
            rest = self.allocator.allocate(self.allocator.num_free_pages).tolist()
            assert sorted(rest) == sorted(self.free)


class TableManagerMachine(RuleBasedStateMachine):
    """Request slots against a stack of free slots (row 0 first, the last freed reused first), rows against lists."""

    @initialize(slots=st.integers(1, 5), context=st.integers(1, 8))
    def setup(self, slots, context):
        self.table = TableManager(slots, context, "cpu")
        self.free = list(range(slots - 1, -1, -1))
        self.rows = {slot: [0] * context for slot in range(slots)}

    @rule()
    def allocate(self):
        if not self.free:
            with pytest.raises(RuntimeError, match="no free request slot"):
                self.table.allocate()
            return
        assert self.table.allocate() == self.free.pop()

    @precondition(lambda self: len(self.free) < self.table.max_running_requests)
    @rule(data=st.data())
    def free_one(self, data):
        slot = data.draw(st.sampled_from(sorted(set(range(self.table.max_running_requests)) - set(self.free))))
        self.table.free(slot)
        self.free.append(slot)

    @rule(slot=st.integers(-2, 6))
    def bad_free_changes_nothing(self, slot):
        if 0 <= slot < self.table.max_running_requests and slot not in self.free:
            return  # a slot in use: freeing it is legal
        with pytest.raises(RuntimeError, match="not in use"):
            self.table.free(slot)

    @rule(data=st.data())
    def write_and_read(self, data):
        slot = data.draw(st.integers(0, self.table.max_running_requests - 1))
        start = data.draw(st.integers(0, self.table.max_context_len))
        values = data.draw(st.lists(st.integers(0, 10**6), max_size=self.table.max_context_len - start))
        self.table.write(slot, start, torch.tensor(values, dtype=torch.int64))
        self.rows[slot][start : start + len(values)] = values
        end = data.draw(st.integers(start, self.table.max_context_len))
        assert self.table.read(slot, start, end).tolist() == self.rows[slot][start:end]

    @invariant()
    def counts_are_conserved(self):
        assert self.table.available_size == len(self.free)
        for slot, row in self.rows.items():
            assert self.table.read(slot, 0, self.table.max_context_len).tolist() == row


TINY_QWEN3_5 = parse_config(preset_config("qwen3_5", "tiny"))


class StatePoolMachine(RuleBasedStateMachine):
    """The StatePool against the values expected in each slot; checkpoints against the values they were saved with.

    Values are written through the accessors the model uses (`conv_state(k)`, `recurrent_state(k)`, views).
    """

    checkpoints = Bundle("checkpoints")

    @initialize(num_slots=st.integers(1, 3), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
    def setup(self, num_slots, dtype):
        self.pool = StatePool(TINY_QWEN3_5, num_slots, dtype, "cpu")
        self.expected = [self._slot(slot) for slot in range(num_slots)]  # zeros
        self.next_value = 1

    def _slot(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        layers = range(self.pool.num_layers)
        return (
            torch.stack([self.pool.conv_state(k)[slot] for k in layers]).clone(),
            torch.stack([self.pool.recurrent_state(k)[slot] for k in layers]).clone(),
        )

    def _slots(self):
        return st.integers(0, self.pool.num_slots - 1)

    @rule(data=st.data())
    def write(self, data):
        """The model updates one layer's state of a slot in place."""
        slot, layer = data.draw(self._slots()), data.draw(st.integers(0, self.pool.num_layers - 1))
        # Small integers: exact in bfloat16, and each write distinct from the others.
        value, self.next_value = self.next_value % 200 + 1, self.next_value + 1
        self.pool.conv_state(layer)[slot] = value
        self.pool.recurrent_state(layer)[slot] = -value
        self.expected[slot][0][layer] = value
        self.expected[slot][1][layer] = -value

    @rule(target=checkpoints, data=st.data())
    def save(self, data):
        slot = data.draw(self._slots())
        saved = self.pool.save(slot)
        assert isinstance(saved, StateCheckpoint)
        return saved, tuple(t.clone() for t in self.expected[slot])

    @rule(saved=checkpoints, data=st.data())
    def restore(self, saved, data):
        checkpoint, values = saved
        slot = data.draw(self._slots())
        self.pool.restore(checkpoint, slot)
        self.expected[slot] = tuple(t.clone() for t in values)

    @rule(data=st.data())
    def clear(self, data):
        slots = data.draw(st.lists(self._slots(), unique=True, max_size=self.pool.num_slots))
        self.pool.clear(slots)
        for slot in slots:
            self.expected[slot] = tuple(torch.zeros_like(t) for t in self.expected[slot])

    @rule(slot=st.integers(-2, 5))
    def bad_slot_is_refused(self, slot):
        if 0 <= slot < self.pool.num_slots:
            return
        with pytest.raises(IndexError, match="slot"):
            self.pool.save(slot)

    @invariant()
    def slots_hold_what_was_written(self):
        if not hasattr(self, "pool"):
            return
        for slot, (conv, recurrent) in enumerate(self.expected):
            got_conv, got_recurrent = self._slot(slot)
            assert torch.equal(got_conv, conv) and torch.equal(got_recurrent, recurrent), f"slot {slot}"

    @rule(saved=checkpoints)
    def checkpoint_is_unchanged(self, saved):
        """A checkpoint is a copy: later writes to the slot it came from, or restores from it, leave it as saved."""
        checkpoint, (conv, recurrent) = saved
        assert torch.equal(checkpoint.conv, conv) and torch.equal(checkpoint.recurrent, recurrent)


TestPageAllocator = PageAllocatorMachine.TestCase
TestPageAllocator.settings = MACHINE_SETTINGS
TestTableManager = TableManagerMachine.TestCase
TestTableManager.settings = MACHINE_SETTINGS
TestStatePool = StatePoolMachine.TestCase
TestStatePool.settings = MACHINE_SETTINGS


# ------------------------------------------------------------------- shrunk counterexamples, kept as regular tests


def test_a_page_outside_the_pool_is_refused():
    """Found by PageAllocatorMachine: free([-1]) freed page -1, and the next allocate handed it out (a negative
    location writes some other request's KV)."""
    allocator = PageAllocator(1, 1)
    allocator.allocate(1)
    for outside in (-1, 1):
        with pytest.raises(ValueError, match="not in the pool"):
            allocator.free(torch.tensor([outside]))
    assert allocator.num_free_pages == 0


def test_a_refused_free_frees_nothing():
    """Found by PageAllocatorMachine: free([p, p]) freed p, then raised, leaving p free under its owner."""
    allocator = PageAllocator(2, 1)
    pages = allocator.allocate(2)
    for bad in ([pages[0], pages[0]], [pages[1], pages[1]]):
        with pytest.raises(RuntimeError, match="freed twice"):
            allocator.free(torch.tensor(bad))
        assert allocator.num_free_pages == 0
    allocator.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(pages)  # pages[1] would be freed before pages[0] is found free
    assert allocator.num_free_pages == 1
