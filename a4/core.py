"""The engine's vocabulary: SamplingParams, Req, Batch, ForwardBatch and Output (names as in mini-sglang / SGLang).

A `Req` is one request as the scheduler sees it; a `Batch` is the requests the scheduler runs in one step; a
`ForwardBatch` is what the model sees in that step, built once per step: flat tensors (all requests' new tokens in
one row, no padding), the pools the layers read and write, and the attention backend's metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from a4.kvcache.kv_pool import KVPool
    from a4.layers.attention import AttentionBackend
    from a4.kvcache.state_pool import StatePool


FinishReason = Literal["eos", "length", "error", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request is continued, checked on construction (a bad value is an error naming its field)."""

    max_new_tokens: int = 16
    # temperature 0 means greedy (argmax), the mode every check against transformers uses. A positive temperature
    # too small for its scaled logits to stay finite is the limit T -> 0 of sampling, greedy (see sampling.py).
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no nucleus cut
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_new_tokens", self.max_new_tokens, low=1)
        _check_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 is greedy), got {self.temperature!r}")
        _check_int("top_k", self.top_k, low=0)
        _check_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            # torch.Generator.manual_seed takes seeds in [0, 2**64), but negative ones wrap around: a seed beyond
            # int64 is more likely a mistake than a choice.
            _check_int("seed", self.seed, low=0, high=2**63 - 1)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}")


def _check_int(name: str, value: object, *, low: int, high: int | None = None) -> None:
    # bool is an int in Python, but True tokens or True top_k are always a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an integer, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"SamplingParams.{name} must be {bounds}, got {value}")


def _check_real(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"SamplingParams.{name} must be a number, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be finite, got {value!r}")


@dataclass
class Req:
    """One request. Positions [0, computed_len) are in the pools (from the prefix cache or earlier chunks and steps)."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    # The request's slot: its row of the request-slot table (req_to_token) and of the state pool; None until admitted.
    slot: int | None = None
    # Tokens already fed and held: their KV is in the KV pool and the state (hybrid models) is after them. ("Cached"
    # is kept for the prefix cache: `prefix_hit_len` of these came from it, reported as Output.cached_tokens.)
    computed_len: int = 0
    # Positions [0, kv_allocated_len) have KV locations in the request's row, on whole pages. A step allocates before
    # its forward, so this runs ahead of computed_len until the step is booked: what an aborted request gives back.
    kv_allocated_len: int = 0
    # Prompt tokens that came from the prefix cache (reported in Output.cached_tokens).
    prefix_hit_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    cache_handle: object | None = None
    finished: bool = False
    # Why it finished: "eos", "length", "error" (then `error` says what is wrong) or "abort" (an exception stopped
    # the step or the call that ran it, or the caller aborted it: `error` says which); None while it runs.
    finish_reason: FinishReason | None = None
    error: str | None = None

    @property
    def admitted(self) -> bool:
        return self.slot is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def device_len(self) -> int:
        """Tokens whose KV (or state) the engine will hold once the next forward has run."""
        return len(self.all_ids)

    @property
    def extend_len(self) -> int:
        """Tokens still to be fed to the model before the next one can be sampled."""
        return self.device_len - self.computed_len


@dataclass
class Batch:
    """The requests of one scheduler step. A step is all prefill or all decode, never mixed (as in mini-sglang)."""

    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    # Tokens each request feeds this step; smaller than Req.extend_len for a chunk of a chunked prefill.
    extend_lens: list[int]
    # Whether each request samples a token at the end of this step (False for a chunk that is not the last).
    sample: list[bool]


@dataclass
class ForwardBatch:
    """The per-step context: everything one forward pass needs, built once per step (`ForwardBatch.build`).

    T = new tokens in the step, B = requests. Tensors live on the model's device; layers read them and never rebuild
    them (as nano-vllm's `Context`, and SGLang's ForwardBatch with its attention backend's metadata). Host-side lists
    (`extend_lens`, `prefix_lens`) serve the prefill paths, whose Python loops over requests cost little next to their
    matrix products; a decode step reads only tensors, so it can be captured in a CUDA graph.
    """

    # "decode": every request feeds one token after a non-empty prefix (one definition, decided in `build`); anything
    # else is "prefill" (whole prompts, chunks of prompts, or one last prompt token after a prefix-cache hit).
    phase: Literal["prefill", "decode"]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its own request
    slots: torch.Tensor  # [B] int64, each request's slot: its row of req_to_token and of the state pool
    extend_lens: list[int]  # [B] new tokens per request; they sum to T
    prefix_lens: list[int]  # [B] tokens of each request already in the pools before this step
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens: each request's length after this step
    cu_seqlens: torch.Tensor  # [B+1] int64, request i's new tokens are rows cu_seqlens[i] .. cu_seqlens[i+1]-1
    # The longest seq_len, or a bound on it (a CUDA-graph batch uses the context limit): the width of the
    # attention's key block in a decode step.
    max_seq_len: int
    out_cache_loc: torch.Tensor  # [T] int64, KV pool location written by each new token
    sample_indices: torch.Tensor  # [S] int64, rows of the T tokens whose logits are needed
    req_to_token: torch.Tensor  # [slots, max_context] int64, the request-slot table
    kv_pool: KVPool | None
    state_pool: StatePool | None = None
    attn_backend: AttentionBackend | None = None
    # What attn_backend.prepare computed for this step (request tables, masks), shared by every attention layer.
    attn_metadata: object = None
    # A decode step over static buffers (a4/engine/graph_runner.py), maybe being captured in a CUDA graph: layers
    # read only its tensors (the host lists would be frozen into the graph) and update states by slot, in place.
    graph_safe: bool = False
    # The verify pass of speculative decoding (a4/speculative): the Gated DeltaNet layers leave the pool as it is
    # and keep the state after every position here, until the engine commits the accepted length.
    verify: VerifyStates | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @classmethod
    def build(
        cls,
        *,
        input_ids: list[int] | torch.Tensor,
        slots: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        sample_indices: list[int],
        req_to_token: torch.Tensor,
        kv_pool: KVPool | None,
        state_pool: StatePool | None = None,
        attn_backend: AttentionBackend | None = None,
    ) -> ForwardBatch:
        """The context of one step: request i feeds extend_lens[i] tokens at positions prefix_lens[i] onwards, in
        slot slots[i], whose row of req_to_token already holds the locations of those positions."""
        if attn_backend is None:
            # Imported here: a4.layers imports this module.
            from a4.layers.attention import TorchAttnBackend

            attn_backend = TorchAttnBackend()
        device = req_to_token.device

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        # Built on the host and copied once: one small arange per request would be a launch per request on a GPU.
        positions = tensor([pos for p, n in zip(prefix_lens, extend_lens) for pos in range(p, p + n)])
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
        slots_t = tensor(slots)
        decode = all(n == 1 for n in extend_lens) and all(p > 0 for p in prefix_lens)
        fb = cls(
            phase="decode" if decode else "prefill",
            input_ids=torch.as_tensor(input_ids, dtype=torch.int64).to(device),
            positions=positions,
            slots=slots_t,
            extend_lens=list(extend_lens),
            prefix_lens=list(prefix_lens),
            seq_lens=tensor(seq_lens),
            cu_seqlens=tensor([0, *extend_lens]).cumsum(0),
            max_seq_len=max(seq_lens),
            out_cache_loc=req_to_token[slots_t.repeat_interleave(tensor(extend_lens)), positions],
            sample_indices=tensor(sample_indices),
            req_to_token=req_to_token,
            kv_pool=kv_pool,
            state_pool=state_pool,
            attn_backend=attn_backend,
        )
        attn_backend.prepare(fb)
        return fb


@dataclass
class VerifyStates:
    """The states a verify pass keeps (notebook 11): request i feeds its last token and its drafts, at most
    `num_tokens` = k + 1 tokens, and every Gated DeltaNet layer records its states after each of them.

    A KV cache rolls back by forgetting positions; a state cannot be cut, so the pass keeps them all and the engine
    copies the one after the last accepted token into the request's slot (`commit_verified_states_`).
    """

    num_tokens: int  # L: tokens of the longest verify row (k + 1)
    # [B, L] int64: the flat row of the step that holds request i's token j; T (one past the last row) where request
    # i feeds fewer than j + 1 tokens. Layers compute those padded positions on a zero row and nobody commits them.
    grid_rows: torch.Tensor
    conv: dict[int, torch.Tensor] = field(default_factory=dict)  # pool layer -> [B, L, conv_dim, K-1]
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)  # pool layer -> [B, L, Hv, dk, dv]

    @classmethod
    def for_lengths(cls, extend_lens: list[int], device: torch.device) -> VerifyStates:
        num_tokens, padding_row = max(extend_lens), sum(extend_lens)
        rows, start = [], 0
        for n in extend_lens:
            rows.append([start + j if j < n else padding_row for j in range(num_tokens)])
            start += n
        return cls(num_tokens, torch.tensor(rows, dtype=torch.int64, device=device))


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    # Prompt tokens served from the prefix cache instead of being prefilled.
    cached_tokens: int
    finish_reason: FinishReason
    error: str | None = None
