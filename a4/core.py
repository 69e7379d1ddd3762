"""The engine's vocabulary: SamplingParams, Req, Batch, ForwardBatch and Output (names as in mini-sglang / SGLang).

A `Req` is one request as the scheduler sees it; a `Batch` is the requests the scheduler runs in one step; a
`ForwardBatch` is what the model sees in that step: flat tensors (all requests' new tokens in one row, no padding)
plus the pools the layers read and write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from a4.kvcache.kv_pool import KVPool
    from a4.kvcache.state_pool import StatePool


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    # temperature 0 means greedy (argmax), the mode every check against transformers uses.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False


@dataclass
class Req:
    """One request. Positions [0, cached_len) are in the KV pool (from the prefix cache or earlier chunks)."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    # Row of the request-slot table (req_to_token) and of the state pool; -1 until admitted.
    table_idx: int = -1
    cached_len: int = 0
    # Prompt tokens that came from the prefix cache (reported in Output.cached_tokens).
    prefix_hit_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    cache_handle: object | None = None
    finished: bool = False
    # Why it finished: "eos", "length" or "error" (then `error` says what is wrong); None while it runs.
    finish_reason: Literal["eos", "length", "error"] | None = None
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
    finish_reason: Literal["eos", "length", "error"]
    error: str | None = None
