"""KVPool: the paged key/value memory of the attention layers.

Every attention layer owns one K and one V buffer of `num_pages * page_size` token slots ("locations"). Page p holds
locations p * page_size ... p * page_size + page_size - 1. A token's KV is written once, at the location the scheduler
gave it (`ForwardBatch.out_cache_loc`), and read back through the request-slot table `req_to_token`.

The pool only stores. Which pages are free is the allocator's business; which tokens a request owns is the table's.
It holds only the layers that keep a KV cache: for a hybrid model (Qwen3.5) those are the full-attention layers, and
the model maps its own layer index to the pool's.
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value <= 0:
                raise ValueError(f"KVPool: {name} must be positive, got {value}")
        self._num_pages = num_pages
        self._page_size = page_size
        # One allocation for everything, as in mini-sglang: [K/V, layer, location, kv head, head dim]. Each layer's K
        # and V are contiguous views of it, so a location is a row that one index_put writes.
        self._buffer = torch.zeros(
            (2, num_layers, num_pages * page_size, num_kv_heads, head_dim), dtype=dtype, device=device
        )

    @property
    def num_layers(self) -> int:
        return self._buffer.shape[1]

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def num_locations(self) -> int:
        return self._num_pages * self._page_size

    @property
    def num_kv_heads(self) -> int:
        return self._buffer.shape[3]

    @property
    def head_dim(self) -> int:
        return self._buffer.shape[4]

    @property
    def dtype(self) -> torch.dtype:
        return self._buffer.dtype

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies across all layers, K and V together."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self._buffer.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_locations

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the keys and values of T tokens, k and v [T, num_kv_heads, head_dim], at locations loc [T]."""
        k_buf, v_buf = self.get_kv(layer)
        k_buf.index_copy_(0, loc, k.to(k_buf.dtype))
        v_buf.index_copy_(0, loc, v.to(v_buf.dtype))

    def copy_locations(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys and values of every layer at locations src [T] to locations dst [T] (a sample of n > 1
        taking its own copy of the prompt's partial last page)."""
        self._buffer[:, :, dst] = self._buffer[:, :, src]

    def get_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V buffers, each [num_locations, num_kv_heads, head_dim] (views: writes go to the pool)."""
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"KVPool has {self.num_layers} layers; layer {layer} does not exist")
        return self._buffer[0, layer], self._buffer[1, layer]
