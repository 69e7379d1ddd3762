"""The engine's vocabulary: SamplingParams, Req, Batch, ForwardBatch and Output (names as in mini-sglang / SGLang).

A `Req` is one request as the scheduler sees it; a `Batch` is the requests the scheduler runs in one step; a
`ForwardBatch` is what the model sees in that step: flat tensors (all requests' new tokens in one row, no padding)
plus the pools the layers read and write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from a4.kvcache.kv_pool import KVPool
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
    """One request. Positions [0, cached_len) are in the KV pool (from the prefix cache or earlier chunks)."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    # Row of the request-slot table (req_to_token) and of the state pool; -1 until admitted.
    table_idx: int = -1
    cached_len: int = 0
    # Positions [0, kv_allocated_len) have KV locations in the request's row, on whole pages. A step allocates before
    # its forward, so this runs ahead of cached_len until the step is booked: what an aborted request gives back.
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
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def device_len(self) -> int:
        """Tokens whose KV (or state) the engine will hold once the next forward has run."""
        return len(self.all_ids)

    @property
    def extend_len(self) -> int:
        """Tokens still to be fed to the model before the next one can be sampled."""
        return self.device_len - self.cached_len


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
    """What one forward pass needs. T = total new tokens in the step, B = number of requests."""

    phase: Literal["prefill", "decode"]
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its own request
    req_slots: torch.Tensor  # [B] int64, each request's row in req_to_token and in the state pool
    extend_lens: list[int]  # [B] new tokens per request; they sum to T
    prefix_lens: list[int]  # [B] tokens of each request already in the pools before this step
    out_cache_loc: torch.Tensor  # [T] int64, KV pool location written by each new token
    sample_indices: torch.Tensor  # [S] int64, rows of the T tokens whose logits are needed
    req_to_token: torch.Tensor  # [max_running_requests, max_context] int64, the request-slot table
    kv_pool: KVPool
    state_pool: StatePool | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        """Each request's total length after this step (prefix + new tokens)."""
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    # Prompt tokens served from the prefix cache instead of being prefilled.
    cached_tokens: int
    finish_reason: FinishReason
    error: str | None = None
