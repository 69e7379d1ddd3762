"""PageAllocator: which pages of the KV pool are free.

The KV pool is cut into pages of `page_size` consecutive locations; page p holds locations p * page_size ...
p * page_size + page_size - 1. Memory is handed out a whole page at a time, so a request's tokens fill its pages in
order and the prefix cache can share pages between requests. The allocator only counts: it never touches the pool.

A page can be held by several owners at once (`share`): the n samples of one prompt hold its pages together, each
freeing them once; a page returns to the free list when its last owner frees it.

The bookkeeping stays on the host (a python list) whatever the device: it is a handful of integers per step, and
keeping it off the accelerator means no device round trip to decide whether a request fits.
"""

from __future__ import annotations

import torch


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free: the scheduler should have evicted or waited first."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"PageAllocator needs num_pages > 0 and page_size > 0, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # Popped from the end: the most recently freed page is reused first.
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        # Owners of each page (0: free). Catches a page freed more often than it was held, which would later hand the
        # same memory to two requests.
        self._owners = [0] * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def allocate(self, num_pages: int) -> torch.Tensor:
        """Page ids [num_pages] (int64, on the host) taken from the free list."""
        if num_pages > len(self._free_pages):
            raise OutOfPagesError(f"asked for {num_pages} pages, only {len(self._free_pages)} are free")
        pages = [self._free_pages.pop() for _ in range(num_pages)]
        for page in pages:
            self._owners[page] = 1
        return torch.tensor(pages, dtype=torch.int64)

    def free(self, pages: torch.Tensor) -> None:
        """Give pages back. A page outside the pool, already free or listed twice is refused, and then none is freed:
        checked first, so that a refused call leaves the free list as it was."""
        pages = pages.tolist()
        outside = [page for page in pages if not 0 <= page < self.num_pages]
        if outside:
            # A negative id would otherwise index from the end and free some other request's page.
            raise ValueError(f"pages {outside} are not in the pool of {self.num_pages} pages")
        listed = set()
        for page in pages:
            if self._owners[page] == 0 or page in listed:
                raise RuntimeError(f"page {page} freed twice")
            listed.add(page)
        for page in pages:
            self._owners[page] -= 1
            if self._owners[page] == 0:
                self._free_pages.append(page)

    def share(self, pages: torch.Tensor) -> None:
        """One more owner for each of these pages, all in use: each owner frees them once."""
        pages = pages.tolist()
        if any(not 0 <= page < self.num_pages or self._owners[page] == 0 for page in pages):
            raise RuntimeError(f"only pages in use can be shared, got {pages}")
        for page in pages:
            self._owners[page] += 1

    def pages_to_locations(self, pages: torch.Tensor) -> torch.Tensor:
        """All locations of the given pages, page after page: [len(pages) * page_size]."""
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=pages.device)
        return (pages[:, None] * self.page_size + offsets).flatten()

    def locations_to_pages(self, locations: torch.Tensor) -> torch.Tensor:
        """The distinct pages that the given locations lie on."""
        return torch.unique(locations // self.page_size)

    def free_locations(self, locations: torch.Tensor) -> None:
        """Free the pages under `locations`: every location of each such page must be unused afterwards."""
        if len(locations):
            self.free(self.locations_to_pages(locations.cpu()))
