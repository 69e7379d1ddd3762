"""GraphRunner: steps over static buffers, captured as one CUDA graph per mode and bucket: decode and verify steps
by batch size, the first prefill of one request by its number of tokens.

A decode step of a small model is launch-bound: on an H200 a4's eager batch-1 step of Qwen3.5-0.8B launches about
2,000 kernels whose GPU time is a fraction of the step's wall time (`python -m a4 bench gpu`). A CUDA graph records
the kernels of one step once and replays them with a single launch. Replay repeats the recorded work exactly, so
what a captured step reads must sit at fixed addresses with fixed shapes, and nothing in it may consult the host:
- the inputs (token ids, positions, slots, state rows) are copied into static buffers before each replay (a decode
  step's token ids from the device, where the last step sampled them);
- a batch is padded up to its bucket size (1, 2, 4, 8, 16, 32, 48, 64, ...); padded requests feed token 0 at
  positions 0.. of a padding slot whose KV locations and state no request owns, so their writes land nowhere that
  matters;
- attention reads keys up to a fixed bound (`ForwardBatch.max_seq_len` = the context limit) masked by the device's
  `seq_lens`, or through a kernel that reads `seq_lens` itself;
- the Gated DeltaNet layers read and update their state-pool rows by slot index in place (the runner's backend,
  a4.layers.gdn_backend), with no Python loop over requests.
A TARGET_VERIFY step (speculative decoding) is the same with L = k + 1 tokens per request: its graphs are recorded
beside the decode ones, so that a verify pass costs one replay too.

A prefill is launch-bound too: on an H200 the 0.8B's 2,048-token prefill runs ~12 ms of kernels in 45-80 ms of wall
time, most of it Python launching ~1,000 kernels. So an EXTEND step of one request with no prefix (a prompt, or its
first chunk) is captured as well, by token bucket (16, 32, 64, ... up to max_prefill_tokens or 4,096), padded at the
end (`static_extend_batch` in forward_batch.py): a causal layer cannot carry the padding into the tokens before it, the
padding's keys go to the padding slot's location, the Gated DeltaNet backends keep it out of the states, and the row
sampled is the prompt's last. Batches of several prompts, later chunks and prefills after a prefix hit stay eager
(their lengths would need a graph per combination); so do a speculative engine's prefills, whose drafter reads the
hidden states of every row.

Everything that changes the pools between steps (clearing a reused slot, restoring a prefix-cache checkpoint) is
issued on the same CUDA stream before the replay, so it is ordered before the forward that reads it.

The same runner runs without capture (on the CPU, or `cuda_graphs=False`): the same buffers, padding and kernels,
called eagerly, which is how CI tests everything above except the capture itself. The ForwardBatch of a step is
built by a4/engine/forward_batch.py's `static_forward_batch`. After mini-sglang's `engine/graph.py` and SGLang's
`CudaGraphRunner`.

A mixture of experts captures too: on CUDA its routed experts run as a4's kernels (a4/kernels/moe.py), which sort
the tokens by expert on the device, where the students' `group_by_expert` (notebook 09) reads the sizes on the host.
"""

from __future__ import annotations

import torch
from torch import nn

from a4.core import AttentionBackend, ForwardMode, GDNStates, to_device
from a4.engine.forward_batch import static_extend_batch, static_forward_batch


# The longest prefill captured. Past it a prefill's kernels outlast its launches: on an H200 the 0.8B's 8,192-token
# prefill ran 66 ms captured against 68 eager, and each bucket costs capture time at start-up and graph memory.
MAX_CAPTURED_PREFILL = 4096


def token_buckets(max_tokens: int) -> list[int]:
    """The prefill lengths captured: powers of two from 16 below max_tokens, then max_tokens (the longest prefill
    step, a whole chunk). A prompt pads to the first bucket that holds it: past 16 tokens, to less than double."""
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


def batch_buckets(max_batch: int) -> list[int]:
    """The batch sizes captured: powers of two up to 32, then steps of 16 (finer where large batches would waste
    most on padding), up to the first size >= max_batch."""
    sizes, size = [], 1
    while True:
        sizes.append(size)
        if size >= max_batch:
            return sizes
        size = size * 2 if size < 32 else size + 16


class GraphRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        tokens_per_request: dict[ForwardMode, int],
        max_batch: int,
        max_seq_len: int,
        req_to_token: torch.Tensor,
        kv_pool: object,
        state_pool: GDNStates | None,
        backend: AttentionBackend,
        padding_slot: int,
        capture: bool,
        max_extend_tokens: int = 0,
    ) -> None:
        """`tokens_per_request`: the decode modes this runner serves and each one's tokens per request (DECODE: 1,
        TARGET_VERIFY: k + 1). `padding_slot`: a row of req_to_token (and of the state pool) that no request is ever
        given; its first positions must map to KV locations no request owns. `capture`: record CUDA graphs.
        `max_extend_tokens`: the longest first prefill of one request that this runner serves (0: none)."""
        device = req_to_token.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.tokens_per_request = dict(tokens_per_request)
        self.buckets = batch_buckets(max_batch)
        self.padding_slot = padding_slot
        size, tokens = self.buckets[-1], max(self.tokens_per_request.values())
        # The static inputs, copied into before each step and read by every replay: token ids and positions (L per
        # request), slots and state rows (ForwardBatch.state_slots), in one buffer.
        self._inputs = torch.zeros(2 * size * tokens + 2 * size, dtype=torch.int64, device=device)
        # A prefill's: its slot, its number of tokens, then its token ids padded to the bucket (positions 0, 1, ...).
        max_extend_tokens = min(max_extend_tokens, MAX_CAPTURED_PREFILL)
        self.extend_buckets = token_buckets(max_extend_tokens) if max_extend_tokens else []
        self._extend_inputs = torch.zeros(2 + max_extend_tokens, dtype=torch.int64, device=device)
        self._extend_positions = torch.arange(max_extend_tokens, device=device)
        self._req_to_token, self._kv_pool, self._state_pool = req_to_token, kv_pool, state_pool
        self._backend, self._max_seq_len = backend, max_seq_len
        self.graphs: dict[tuple[ForwardMode, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[ForwardMode, int], tuple[torch.Tensor, torch.Tensor]] = {}
        if capture:
            with torch.inference_mode():
                self._capture()

    def _buffers(self, mode: ForwardMode, batch_size: int) -> tuple[torch.Tensor, ...]:
        """Views of the input buffer for `batch_size` requests: input_ids and positions [B * L], slots and state rows
        [B]."""
        num_tokens = batch_size * self.tokens_per_request[mode]
        return self._inputs[: 2 * num_tokens + 2 * batch_size].split([num_tokens, num_tokens, batch_size, batch_size])

    def _forward(self, mode: ForwardMode, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One step over the buffers (the work a graph records). DECODE or TARGET_VERIFY: the first `size` requests,
        the final hidden states [B * L, hidden] of every row and their float32 logits. EXTEND: the prefill in the
        buffers padded to `size` tokens, the final hidden state [1, hidden] of its last token and its logits."""
        # What every step reads and writes, whatever its mode.
        pools = dict(req_to_token=self._req_to_token, kv_pool=self._kv_pool, state_pool=self._state_pool,
                     attn_backend=self._backend)  # fmt: skip
        if mode is ForwardMode.EXTEND:
            slot, num_tokens, input_ids = self._extend_inputs[:1], self._extend_inputs[1:2], self._extend_inputs[2:]
            fb = static_extend_batch(input_ids=input_ids[:size], positions=self._extend_positions[:size], slot=slot,
                                     num_tokens=num_tokens, padding_slot=self.padding_slot, **pools)  # fmt: skip
        else:
            input_ids, positions, slots, state_slots = self._buffers(mode, batch_size=size)
            fb = static_forward_batch(mode, input_ids=input_ids, positions=positions, slots=slots,
                                      state_slots=state_slots, max_seq_len=self._max_seq_len, **pools)  # fmt: skip
        return self.model(fb, with_hidden=True)

    def _capture(self) -> None:
        # Warm-up and capture write into the padding slot only. A prefill is the padding slot's, of one token (its
        # first location; the padding rows go to that location too).
        self._extend_inputs[:2] = torch.tensor([self.padding_slot, 1])
        # One memory pool for all graphs: only one replays at a time, so their intermediates can share memory. The
        # largest first: the smaller ones then fit in what it left.
        pool = None
        steps = [(ForwardMode.EXTEND, n) for n in reversed(self.extend_buckets)]
        steps += [(mode, batch_size) for mode in self.tokens_per_request for batch_size in reversed(self.buckets)]
        for step in steps:
            if step[0] is not ForwardMode.EXTEND:
                # The requests of a decode or verify step point at the padding slot (each bucket's slots are a
                # view of its own offset in the buffer).
                for slots in self._buffers(*step)[2:]:
                    slots.fill_(self.padding_slot)
            # Warm-up on a side stream first (lazy initialisation in cuBLAS and Triton's autotuning must not be
            # recorded), as torch.cuda.graphs recommends.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._forward(*step)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[step] = self._forward(*step)
            pool = graph.pool()
            self.graphs[step] = graph

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def forward(
        self,
        mode: ForwardMode,
        input_ids: torch.Tensor,
        positions: list[int],
        slots: list[int],
        state_slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Final hidden states [B * L, hidden] and float32 logits [B * L, vocab] of one step: request i feeds
        input_ids[i * L : (i + 1) * L] (on the device, or the host) at positions[...] in slots[i], its state in
        state_slots[i] (on the device; default: slots[i])."""
        batch_size, per_request = len(slots), self.tokens_per_request[mode]
        bucket = next(size for size in self.buckets if size >= batch_size)
        # The padded rows are written too: an earlier, larger step may have left a request's values there.
        padding = bucket - batch_size
        padded_slots = [*slots, *[self.padding_slot] * padding]
        ids, *_, state_slots_buffer = self._buffers(mode, bucket)
        # Positions, slots and state rows follow the ids in the buffer: one copy from the host.
        host = to_device([*positions, *list(range(per_request)) * padding, *padded_slots, *padded_slots], ids.device)
        self._inputs[ids.shape[0] : ids.shape[0] + host.shape[0]].copy_(host)
        # The padded rows keep whatever valid ids an earlier step left: their outputs are never read.
        ids[: batch_size * per_request].copy_(to_device(input_ids, ids.device))
        if state_slots is not None:
            state_slots_buffer[:batch_size].copy_(state_slots)
        if (mode, bucket) in self.graphs:
            self.graphs[mode, bucket].replay()
            hidden, logits = self.outputs[mode, bucket]
        else:
            hidden, logits = self._forward(mode, bucket)
        rows = batch_size * per_request
        return hidden[:rows], logits[:rows]

    def takes_prefill(self, prefix_lens: list[int], extend_lens: list[int]) -> bool:
        """Whether an EXTEND step is this runner's: one request's first prefill, of at most max_extend_tokens."""
        if not self.extend_buckets or len(extend_lens) != 1:
            return False
        return prefix_lens[0] == 0 and extend_lens[0] <= self.extend_buckets[-1]

    def prefill(self, input_ids: list[int], slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden state [1, hidden] and float32 logits [1, vocab] of the last of `input_ids`, the first
        prefill of the request in `slot`, which the table already maps to its KV locations."""
        num_tokens = len(input_ids)
        bucket = next(size for size in self.extend_buckets if size >= num_tokens)
        # The padding's ids are written too (any id would do; these are the same in every run).
        host = to_device([slot, num_tokens, *input_ids, *[0] * (bucket - num_tokens)], self._extend_inputs.device)
        self._extend_inputs[: host.shape[0]].copy_(host)
        if (ForwardMode.EXTEND, bucket) in self.graphs:
            self.graphs[ForwardMode.EXTEND, bucket].replay()
            return self.outputs[ForwardMode.EXTEND, bucket]
        return self._forward(ForwardMode.EXTEND, bucket)
