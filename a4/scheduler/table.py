"""TableManager: the request slots, rows of the `req_to_token` table.

A running request owns one row (its `slot`). Entry [row, pos] is the KV pool location of the request's token at
position pos, so attention finds all of a request's keys by reading its row. Rows are handed out when a request is
admitted and returned when it finishes, then reused by the next request: the number of rows bounds how many
requests run at once (`max_running_requests`).

The table lives on the model's device because attention reads it in every layer; which rows are free is host
bookkeeping. On a GPU the host keeps its own copy of the table (int32, written with it), which the prefix cache
reads: reading the device's would wait for the step in flight (overlap scheduling). It costs 4 bytes per slot and
position of host memory (0.5 GiB for 512 slots of 262,144 tokens). A hybrid model keeps its per-request state (StatePool) at the same row index, as SGLang's
HybridReqToTokenPool does, so a slot here is a slot there too.
"""

from __future__ import annotations

import torch

from a4.core import to_device


class TableManager:
    def __init__(self, max_running_requests: int, max_context_len: int, device: torch.device | str) -> None:
        if max_running_requests <= 0 or max_context_len <= 0:
            raise ValueError(
                "TableManager needs max_running_requests > 0 and max_context_len > 0, "
                f"got {max_running_requests} and {max_context_len}"
            )
        self.req_to_token = torch.zeros((max_running_requests, max_context_len), dtype=torch.int64, device=device)
        on_host = self.req_to_token.device.type == "cpu"
        self._host_table = None if on_host else torch.zeros(self.req_to_token.shape, dtype=torch.int32)
        # Popped from the end: row 0 first, and a freed row is the next one reused.
        self._free_slots = list(range(max_running_requests - 1, -1, -1))

    @property
    def max_running_requests(self) -> int:
        return self.req_to_token.shape[0]

    @property
    def max_context_len(self) -> int:
        return self.req_to_token.shape[1]

    @property
    def available_size(self) -> int:
        """Free request slots."""
        return len(self._free_slots)

    def allocate(self) -> int:
        if not self._free_slots:
            raise RuntimeError("no free request slot: check available_size before allocating")
        return self._free_slots.pop()

    def free(self, slot: int) -> None:
        if slot in self._free_slots or not 0 <= slot < self.max_running_requests:
            raise RuntimeError(f"request slot {slot} is not in use")
        self._free_slots.append(slot)

    def write(self, slot: int, start: int, locations: torch.Tensor) -> None:
        """Record that positions start .. start + len(locations) - 1 of the request live at `locations`."""
        self.req_to_token[slot, start : start + len(locations)] = to_device(locations, self.req_to_token.device)
        if self._host_table is not None:
            self._host_table[slot, start : start + len(locations)] = locations

    def write_many(self, writes: list[tuple[int, int, int]], locations: torch.Tensor) -> None:
        """Several `write`s as one indexed copy to the device: write (slot, start, count) records the next `count`
        of `locations` at positions start .. start + count - 1 of that slot. A decode step gives every request of
        its batch a location this way: one copy per request was most of an H200's step at batch 32."""
        rows = [slot for slot, _, count in writes for _ in range(count)]
        positions = [start + i for _, start, count in writes for i in range(count)]
        host = torch.stack((torch.tensor(rows, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), locations))
        packed = to_device(host, self.req_to_token.device)
        self.req_to_token[packed[0], packed[1]] = packed[2]
        if self._host_table is not None:
            self._host_table[host[0], host[1]] = host[2].int()

    def read(self, slot: int, start: int, end: int) -> torch.Tensor:
        """Host copy of the locations of positions start .. end - 1."""
        if self._host_table is not None:
            return self._host_table[slot, start:end].long()
        return self.req_to_token[slot, start:end].clone()
