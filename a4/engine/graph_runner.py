"""DecodeGraphRunner: decode steps over static buffers, captured as one CUDA graph per batch-size bucket.

A decode step of a small model is launch-bound: on an H200 a4's eager batch-1 step of Qwen3.5-0.8B launches about
2,000 kernels whose GPU time is a fraction of the step's wall time (`python -m a4 bench gpu`). A CUDA graph records
the kernels of one step once and replays them with a single launch. Replay repeats the recorded work exactly, so
what a captured step reads must sit at fixed addresses with fixed shapes, and nothing in it may consult the host:
- the inputs (token ids, positions, slots) are copied into static buffers before each replay;
- a batch is padded up to its bucket size (1, 2, 4, 8, 16, 32, 48, 64, ...); padded rows feed token 0 at position 0 of
  a padding slot whose one KV location and state no request owns, so their writes land nowhere that matters;
- attention reads keys up to a fixed bound (`ForwardBatch.max_seq_len` = the context limit) masked by the device's
  `seq_lens`, or through a kernel that reads `seq_lens` itself;
- the Gated DeltaNet layers read and update their state-pool rows by slot index in place (`ForwardBatch.graph_safe`,
  a4.layers.gdn_backend), with no Python loop over requests.
Everything that changes the pools between steps (clearing a reused slot, restoring a prefix-cache checkpoint) is
issued on the same CUDA stream before the replay, so it is ordered before the forward that reads it.

The same runner runs without capture (on the CPU, or `cuda_graphs=False`): the same buffers, padding and kernels,
called eagerly, which is how CI tests everything above except the capture itself. After mini-sglang's
`engine/graph.py` and SGLang's `CudaGraphRunner`.
"""

from __future__ import annotations

import torch
from torch import nn

from a4.core import ForwardBatch
from a4.kvcache.kv_pool import KVPool
from a4.layers.attention import AttentionBackend


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: powers of two up to 32, then steps of 16 (finer where large batches would waste
    most on padding), up to the first size >= max_batch."""
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= max_batch:
            return sizes
        size = size * 2 if size < 32 else size + 16


class DecodeGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch: int,
        max_seq_len: int,
        req_to_token: torch.Tensor,
        kv_pool: KVPool,
        state_pool: object | None,
        attn_backend: AttentionBackend,
        padding_slot: int,
        capture: bool,
    ) -> None:
        """`padding_slot`: a row of req_to_token (and of the state pool) that no request is ever given; its position
        0 must map to a KV location no request owns. `capture`: record CUDA graphs (CUDA only)."""
        device = req_to_token.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.buckets = batch_buckets(max_batch)
        self.padding_slot = padding_slot
        size = self.buckets[-1]
        # The static inputs, copied into before each step and read by every replay: token ids, positions and slots,
        # three rows of one buffer so that a step needs one host-to-device copy.
        self._inputs = torch.zeros(3, size, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.slots = self._inputs
        self.slots.fill_(padding_slot)
        self._req_to_token, self._kv_pool, self._state_pool = req_to_token, kv_pool, state_pool
        self._attn_backend, self._max_seq_len = attn_backend, max_seq_len
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            with torch.inference_mode():
                self._capture()

    def _forward(self, batch_size: int) -> torch.Tensor:
        """One decode step of the first `batch_size` rows of the buffers: the work a graph records."""
        slots, positions = self.slots[:batch_size], self.positions[:batch_size]
        fb = ForwardBatch(
            phase="decode",
            input_ids=self.input_ids[:batch_size],
            positions=positions,
            slots=slots,
            # Host lists are per-step facts a graph would freeze: a graph-safe step has none to read.
            extend_lens=[1] * batch_size,
            prefix_lens=[],
            seq_lens=positions + 1,
            cu_seqlens=torch.arange(batch_size + 1, device=slots.device),
            max_seq_len=self._max_seq_len,
            out_cache_loc=self._req_to_token[slots, positions],
            sample_indices=torch.arange(batch_size, device=slots.device),
            req_to_token=self._req_to_token,
            kv_pool=self._kv_pool,
            state_pool=self._state_pool,
            attn_backend=self._attn_backend,
            graph_safe=True,
        )
        self._attn_backend.prepare(fb)
        return self.model(fb)

    def _capture(self) -> None:
        # One memory pool for all graphs: only one replays at a time, so their intermediates can share memory.
        pool = None
        for batch_size in reversed(self.buckets):
            # Warm-up on a side stream first (lazy initialisation in cuBLAS and Triton's autotuning must not be
            # recorded), as torch.cuda.graphs recommends.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(batch_size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch_size] = self._forward(batch_size)
            pool = graph.pool()
            self.graphs[batch_size] = graph

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def forward(self, input_ids: list[int], slots: list[int], positions: list[int]) -> torch.Tensor:
        """Logits [B, vocab] (float32) of one decode step: request i feeds input_ids[i] at positions[i] in slots[i]."""
        batch_size = len(input_ids)
        bucket = next(size for size in self.buckets if size >= batch_size)
        # The padded rows are written too: an earlier, larger step may have left a request's values there.
        padding = bucket - batch_size
        host = torch.tensor(
            [[*input_ids, *[0] * padding], [*positions, *[0] * padding], [*slots, *[self.padding_slot] * padding]],
            dtype=torch.int64,
        )
        self._inputs[:, :bucket].copy_(host)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            logits = self.outputs[bucket]
        else:
            logits = self._forward(bucket)
        return logits[:batch_size]
