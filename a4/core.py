"""The engine's vocabulary: SamplingParams, Req, Batch, ForwardMode, ForwardBatch and Output (names as in
mini-sglang / SGLang), and the protocols the layers meet their memory through.

A `Req` is one request as the scheduler sees it; a `Batch` is the requests the scheduler runs in one step; a
`ForwardBatch` is what the model sees in that step, built once per step: its `ForwardMode`, flat tensors (all
requests' new tokens in one row, no padding), the pools the layers read and write, and the backend with its
metadata. This module is the bottom of the engine: it imports nothing else of a4.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    import xgrammar


FinishReason = Literal["eos", "length", "stop", "error", "abort"]


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
    # vLLM's logits processors (sampling.py's LogitsProcessors applies them, to the rows that ask): penalties on the
    # tokens already output (presence: once, frequency: per occurrence, both subtracted as OpenAI defines them) and
    # on every token of the prompt and the output (repetition, as in CTRL: positive logits divided, negative ones
    # multiplied); min_p drops the tokens less likely than min_p times the most likely one (sampled requests).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: none
    min_p: float = 0.0  # 0: no cut
    # No end-of-sequence nor stop token before this many output tokens (their logits are masked until then).
    min_tokens: int = 0
    # Tokens that finish the request as an end-of-sequence token does, with finish_reason "stop" (even with
    # ignore_eos, as in vLLM).
    stop_token_ids: tuple[int, ...] = ()
    # Added to the logits of these token ids before sampling (greedy too); OpenAI's range, [-100, 100].
    logit_bias: dict[int, float] | None = None
    # Samples of the same prompt: its prefill runs once and they share its KV (Engine.add_parallel_requests).
    n: int = 1
    # Log-probabilities (vLLM's names): each output token's, with the `logprobs` most likely tokens' at its step
    # (0: its own only), and each prompt token's, with the `prompt_logprobs` most likely; None: not computed.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured output: the grammar the output follows (a4/engine/grammar.py), compiled beforehand (the server
    # does it in a worker thread, where a bad schema is a 400); None: free text. The engine checks it on arrival.
    grammar: xgrammar.CompiledGrammar | None = None

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
        for name in ("presence_penalty", "frequency_penalty"):
            _check_real(name, getattr(self, name))
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"SamplingParams.{name} must be in [-2, 2], got {getattr(self, name)!r}")
        _check_real("repetition_penalty", self.repetition_penalty)
        if not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty must be > 0 (1: none), got {self.repetition_penalty!r}")
        _check_real("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p must be in [0, 1], got {self.min_p!r}")
        _check_int("min_tokens", self.min_tokens, low=0, high=self.max_new_tokens)
        if not isinstance(self.stop_token_ids, tuple):
            raise TypeError(f"SamplingParams.stop_token_ids must be a tuple of token ids, got {self.stop_token_ids!r}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, low=0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise TypeError(f"SamplingParams.logit_bias must be a dict {{token id: bias}}, got {self.logit_bias!r}")
            for token, bias in self.logit_bias.items():
                _check_int("logit_bias", token, low=0)
                _check_real("logit_bias", bias)
                if not -100 <= bias <= 100:
                    raise ValueError(f"SamplingParams.logit_bias of token {token} must be in [-100, 100], got {bias!r}")
        _check_int("n", self.n, low=1)

        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), low=0)
    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before it picks a token (LogitsProcessors)."""
        return bool(self.penalized or self.logit_bias or self.min_tokens)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)


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


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's log-probabilities under the model's own distribution (log-softmax of its float32 logits, before
    temperature, top-k or top-p: vLLM's default "raw" logprobs): the token there, and the k most likely tokens."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class Req:
    """One request. Positions [0, computed_len) are in the pools (from the prefix cache or earlier chunks and steps)."""

    uid: int
    input_ids: list[int]
    sampling_params: SamplingParams
    # The request's slot: its row of the request-slot table (req_to_token) and of the state pool; None until admitted.
    slot: int | None = None
    # Tokens fed to the model: their KV is in the KV pool and the state (hybrid models) is after them once the steps
    # launched so far have run. The scheduler advances it when it launches a step (a verify step: when it is booked,
    # by the tokens kept). ("Cached" is kept for the prefix cache: `prefix_hit_len` of these came from it.)
    computed_len: int = 0
    # Positions [0, kv_allocated_len) have KV locations in the request's row, on whole pages. A step allocates before
    # its forward, so this runs ahead of computed_len until the step is booked: what an aborted request gives back.
    kv_allocated_len: int = 0
    # Pages still promised to the request by the admission policy (scheduler/prefill.py): its worst case less what its
    # steps have allocated.
    reserved_pages: int = 0
    # Prompt tokens that came from the prefix cache (reported in Output.cached_tokens).
    prefix_hit_len: int = 0
    output_ids: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: one entry per output token, booked with it. With prompt_logprobs: one per prompt
    # token, the first None (nothing predicts it), filled as the prompt's chunks are booked.
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # Tokens sampled by launched steps that are not booked yet (in output_ids): with overlap scheduling, the step in
    # flight's; they are on the device (ModelRunner.last_tokens), where the next decode step reads them.
    tokens_in_flight: int = 0
    cache_handle: object | None = None
    finished: bool = False
    # Why it finished: "eos", "length", "stop" (its caller found a stop condition, Engine.finish_req), "error" (then
    # `error` says what is wrong) or "abort" (an exception stopped the step or the call that ran it, or the caller
    # aborted it: `error` says which); None while it runs.
    finish_reason: FinishReason | None = None
    error: str | None = None
    # n > 1 (Engine.add_parallel_requests): the other samples of this request's prompt, admitted with it, that fork
    # from it when its prefill is launched; empty once they have.
    forks: list[Req] = field(default_factory=list, repr=False)
    # The scheduler the request was submitted to (a request is submitted once, to one engine).
    owner: object | None = field(default=None, repr=False, compare=False)

    @property
    def admitted(self) -> bool:
        return self.slot is not None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    def ids_between(self, start: int, stop: int) -> list[int]:
        """all_ids[start:stop] (0 <= start <= stop), without copying the whole prompt and output into all_ids first:
        a step reads a few tokens of each request, whose context may be thousands long."""
        prompt_len = len(self.input_ids)
        from_output = self.output_ids[max(start - prompt_len, 0) : max(stop - prompt_len, 0)]
        return self.input_ids[start:stop] + from_output if start < prompt_len else from_output

    @property
    def device_len(self) -> int:
        """Tokens whose KV (or state) the engine will hold once the next forward has run."""
        return len(self.input_ids) + len(self.output_ids) + self.tokens_in_flight

    @property
    def num_sampled(self) -> int:
        """Output tokens sampled so far, booked or in flight."""
        return len(self.output_ids) + self.tokens_in_flight

    @property
    def extend_len(self) -> int:
        """Tokens still to be fed to the model before the next one can be sampled."""
        return self.device_len - self.computed_len


@dataclass
class Batch:
    """The requests of one scheduler step, and what kind of step it is (the scheduler decides, in one place):
    "prefill" (prompts and chunks of prompts), "decode" (every running request's next token), "verify" (a
    speculative engine's decode step: every running request's last token and its drafts), or "mixed"
    (`EngineConfig.enable_mixed_chunk`: prefill chunks, then every running request's next token, in one forward, as
    SGLang's mixed chunk and vLLM V1's chunked prefill)."""

    reqs: list[Req]
    phase: Literal["prefill", "decode", "verify", "mixed"]
    # Tokens each request feeds this step; smaller than Req.extend_len for a chunk of a chunked prefill.
    extend_lens: list[int]
    # Whether each request samples a token at the end of this step (False for a chunk that is not the last).
    sample: list[bool]
    # Tokens of each request in the pools before this step: where its new tokens start (set by the scheduler).
    prefix_lens: list[int] = field(default_factory=list)
    # n > 1: (row of a prompt that ends in this step, a sample forking from it). A fork feeds nothing: it samples its
    # first token from its prompt's logits, and is booked after the batch's requests.
    forks: list[tuple[int, Req]] = field(default_factory=list)

    @property
    def booked_reqs(self) -> list[Req]:
        """The requests this step books, in the order of its results: its own, then its forks."""
        return self.reqs + [fork for _, fork in self.forks]

    @property
    def booked_sample(self) -> list[bool]:
        return self.sample + [True] * len(self.forks)

    @property
    def decode_rows(self) -> list[bool]:
        """Per request, whether it feeds its last sampled token (and drafts) rather than prompt tokens: every
        request of a decode step, the requests after the prefill chunks of a mixed step."""
        return [prefix_len >= len(req.input_ids) for req, prefix_len in zip(self.reqs, self.prefix_lens)]


class ForwardMode(enum.Enum):
    """What kind of step a forward is, set once per step by the builder of its ForwardBatch (a4/engine/forward_batch.py)
    from the scheduler's batch; layers and backends branch on it and on nothing else (SGLang's ForwardMode)."""

    # Prefill: whole prompts, chunks of prompts, a prompt's tail after a prefix hit, a drafter catching up. Each
    # request feeds any number of tokens after any prefix (extend_lens and prefix_lens say how many).
    EXTEND = "extend"
    # One token per request after a non-empty prefix.
    DECODE = "decode"
    # Speculative decoding's verify pass: every request feeds the same number L of tokens, its last committed token
    # and L - 1 drafts. The Gated DeltaNet layers keep their states after each of the L tokens beside the pool.
    TARGET_VERIFY = "target_verify"
    # A mixed step (EngineConfig.enable_mixed_chunk): prompts' tokens, then one token for each of the last
    # `ForwardBatch.num_decodes` requests, in one forward. The layers run it whole (row by row); their backends see
    # its two parts, an EXTEND and a DECODE, each with the context of its own (a4/engine/forward_batch.py's
    # `MixedBackend`), as vLLM's attention and GDN backends split a batch into its prefills and its decodes.
    MIXED = "mixed"

    def is_extend(self) -> bool:
        """Whether the step feeds prompt tokens, in any number per request (SGLang's `is_extend`)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


class AttentionBackend(Protocol):
    """How attention layers reach the KV pool (as mini-sglang's `BaseAttnBackend`): `prepare` once per step, then
    `forward` in every attention layer, reading what `prepare` put in `fb.attn_metadata` (a4/layers/attention.py)."""

    def prepare(self, fb: ForwardBatch) -> None: ...

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, pool_layer: int, scale: float
    ) -> torch.Tensor: ...


class GDNStates(Protocol):
    """What the Gated DeltaNet layers need of `fb.state_pool` (notebook 05's StatePool): each GDN layer's state
    tensors, views whose writes go to the pool, and for speculative decoding the states a verify pass keeps."""

    def conv_state(self, gdn_layer: int) -> torch.Tensor: ...

    def recurrent_state(self, gdn_layer: int) -> torch.Tensor: ...


@dataclass
class ForwardBatch:
    """The per-step context: everything one forward pass needs, built once per step (a4/engine/forward_batch.py).

    T = new tokens in the step, B = requests. Tensors live on the model's device; layers read them and never rebuild
    them (as nano-vllm's `Context`, and SGLang's ForwardBatch with its attention backend's metadata). The host-side
    lists (`extend_lens`, `prefix_lens`) serve EXTEND steps, whose Python loops over requests cost little next to
    their matrix products; layers and backends read only tensors in DECODE and TARGET_VERIFY steps, so that those
    can be captured in a CUDA graph (a static decode or verify step has no host lists at all; a static EXTEND step's
    are constants of its bucket).
    """

    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, position of each token in its own request
    slots: torch.Tensor  # [B] int64, each request's slot: its row of req_to_token and of the state pool
    seq_lens: torch.Tensor  # [B] int64, prefix + new tokens: each request's length after this step
    cu_seqlens: torch.Tensor  # [B+1] int64, request i's new tokens are rows cu_seqlens[i] .. cu_seqlens[i+1]-1
    # The longest seq_len, or a bound on it (a CUDA-graph batch uses the context limit): the width of the
    # attention's key block in a decode or verify step.
    max_seq_len: int
    out_cache_loc: torch.Tensor  # [T] int64, KV pool location written by each new token
    sample_indices: torch.Tensor  # [S] int64, rows of the T tokens whose outputs are needed
    req_to_token: torch.Tensor  # [slots, max_context] int64, the request-slot table
    kv_pool: object | None  # a4.kvcache.kv_pool.KVPool: the full-attention layers' KV
    state_pool: GDNStates | None = None  # the Gated DeltaNet layers' states (hybrid models)
    # The step's backend (a4/layers): attention for every model, and the Gated DeltaNet primitives for a hybrid one.
    attn_backend: AttentionBackend | None = None
    # EXTEND steps: new tokens per request, and tokens of each request already in the pools before this step.
    extend_lens: list[int] | None = None
    prefix_lens: list[int] | None = None
    # A static EXTEND step (one request's first prefill padded to its bucket, a4/engine/graph_runner.py): [1] int64,
    # how many of the T rows are the request's tokens; the rows after them are padding, which no state may keep.
    # (SGLang's name.)
    num_token_non_padded: torch.Tensor | None = None
    # What the backends' `prepare` computed for this step, shared by every layer of its kind.
    attn_metadata: object = None
    gdn_metadata: object = None
    # [B] int64: the state-pool row each request's Gated DeltaNet layers read and update; `slots` unless set. Under
    # overlap scheduling a request whose EOS is booked only after this step was launched runs on a padding row here,
    # so that its state stays the state its prefix-cache checkpoint needs (a4/engine/model_runner.py).
    state_slots: torch.Tensor | None = None
    # MIXED steps: how many requests, the last ones, feed one decode token each after the prompts' tokens.
    num_decodes: int = 0

    def __post_init__(self) -> None:
        if self.state_slots is None:
            self.state_slots = self.slots

    @property
    def batch_size(self) -> int:
        return self.slots.shape[0]

    @property
    def tokens_per_request(self) -> int:
        """DECODE and TARGET_VERIFY: how many tokens each request feeds (1 for a decode step, L for a verify)."""
        return self.input_ids.shape[0] // self.slots.shape[0]


def to_device(values: list[int] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Integers (a list, or a tensor) as int64 on `device`, without waiting for the device: on a GPU through
    pinned memory and a non-blocking copy. torch's copy from ordinary host memory waits for every kernel already
    queued on the stream, which would stop overlap scheduling (engine.py) from running ahead of the device."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device, torch.int64)  # on a device already (decode ids gathered there)
    host = torch.as_tensor(values, dtype=torch.int64)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class Output:
    token_ids: list[int]
    # Prompt tokens served from the prefix cache instead of being prefilled.
    cached_tokens: int
    finish_reason: FinishReason
    error: str | None = None
    # Asked for in SamplingParams (logprobs, prompt_logprobs): as Req's, else None.
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
