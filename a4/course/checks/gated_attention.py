"""Checks of notebook 03: Qwen3.5's gated full attention against transformers' modules and cache.

Two ground truths, both transformers:
- its own modules on random inputs: `Qwen3_5RMSNorm`, its partial RoPE (`Qwen3_5TextRotaryEmbedding`'s cos/sin through
  `apply_rotary_pos_emb`) and `Qwen3_5Attention` with random weights and a `DynamicCache` per request, in shapes the
  notebook does not show (6 query heads over 2 KV heads, head_dim 48, half of it rotated);
- the tiny Qwen3.5 checkpoint run by transformers (`a4.reference.hf_prefill_capture` / `hf_decode_capture`): each
  full-attention layer's input, output and cached keys and values, which a4's layer must reproduce from the same
  input with the same weights.

a4's side is built without the earlier notebooks' exercises: its ModelConfig comes from transformers' config object
(`a4_config`) and its weights are copied from transformers' modules, so these checks fail only when notebook 03's
own code does. The hand-made ForwardBatches come from `a4.course.checks._model_runner`; how close is close enough
from `a4.course.checks._harness`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

# a4.reference also quiets transformers' advice to install the GDN kernels that would change the reference.
import a4.reference  # noqa: F401
from a4.checkpoints import tiny_checkpoint
from a4.course.checks import conclude
from a4.course.checks._harness import (
    ATTENTION_ROUNDINGS,
    attention_reduction_length,
    compare,
    compare_dtype,
    dtype_name,
    randn,
    rms_normalised,
    tolerance,
)
from a4.course.checks._model_runner import PAGE_SIZE, SlotTable, kv_pool_for
from a4.course.checks.config import transformers_fields
from a4.dtypes import DTYPES
from a4.kvcache.kv_pool import KVPool
from a4.layers.rope import RotaryEmbedding
from a4.models.config import FULL_ATTENTION, LINEAR_ATTENTION, ModelConfig


# ------------------------------------------------------------------------------------------------ configs, batches


def a4_config(text_config: Any) -> ModelConfig:
    """a4's ModelConfig of a transformers Qwen3.5 text config, read by transformers (not by notebook 01's parser)."""
    from transformers import Qwen3_5Config

    raw = Qwen3_5Config(text_config=text_config.to_dict(), architectures=["Qwen3_5ForConditionalGeneration"])
    return ModelConfig(**transformers_fields(raw.to_dict()))


def attention_text_config(layer_types: list[str] | None = None, partial_rotary_factor: float = 0.5):
    """transformers' text config of the checks' own shape: 6 query heads over 2 KV heads (3 per group), head_dim 48 of
    which 24 rotate (`partial_rotary_factor`), hidden 40; one full-attention layer unless `layer_types` says
    otherwise. Attention "sdpa": the kernel a4's paged attention calls, so that bfloat16 rounds alike."""
    from transformers import Qwen3_5TextConfig

    layer_types = layer_types or [FULL_ATTENTION]
    config = Qwen3_5TextConfig(
        vocab_size=64,
        hidden_size=40,
        intermediate_size=64,
        num_hidden_layers=len(layer_types),
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=48,
        layer_types=layer_types,
        rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor
        },
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    return config


# ----------------------------------------------------------------------------------------- the norm and the RoPE


def check_zero_centred_norm(norm_class: type) -> None:
    """`norm_class(dim, eps)` against transformers' Qwen3_5RMSNorm: starts at zero, then random weights, two dtypes."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

    problems = []
    likely = None
    for dim, eps in ((24, 1e-6), (40, 1e-5)):
        if not torch.equal(norm_class(dim, eps).weight.detach(), torch.zeros(dim)):
            problems.append(f"dim {dim}: a new norm's weight must be zeros (zero-centred: scale 1 + w)")
        for dtype_name, dtype in DTYPES.items():
            reference = Qwen3_5RMSNorm(dim, eps=eps)
            with torch.no_grad():
                reference.weight.copy_(0.5 * randn(dim, seed=dim))
            ours = norm_class(dim, eps)
            ours.load_state_dict(reference.state_dict())
            reference.to(dtype)
            ours.to(dtype)
            x = 4 * randn(9, 3, dim, seed=dim + 1, dtype=dtype)
            with torch.no_grad():
                label = f"dim {dim}, eps {eps:g}, {dtype_name}"
                # One sum over the dim; one rounding of the result.
                output, allowed = ours(x), tolerance(dtype, dim)
                found = compare_dtype(label, output, reference(x), allowed, elementwise=True)
                # The usual mistake: Qwen3's RMSNorm (scale w) instead of the zero-centred one (scale 1 + w).
                if found and not compare("", output, rms_normalised(x, eps) * reference.weight.float(), allowed):
                    likely = "the output equals x̂ · w: missing the 1 + w of the zero-centred norm?"
                problems += found
    conclude(
        problems, "the zero-centred RMSNorm matches transformers' Qwen3_5RMSNorm in float32 and bfloat16", likely
    )



def transformers_cos_sin(text_config: Any, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """transformers' cos and sin [T, rotary_dim] for text positions (the three M-RoPE rows equal: 1-D RoPE)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    cos, sin = Qwen3_5TextRotaryEmbedding(text_config)(torch.zeros(1, dtype=dtype), positions[None])
    return cos[0], sin[0]


def check_partial_rope(apply_partial_rope) -> None:
    """`apply_partial_rope(x, cos, sin)` against transformers' apply_rotary_pos_emb, for rotary factors 0.25, 0.5
    and 1 of a 48-dim head, at positions up to 3000, in float32 and bfloat16."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb

    positions = torch.tensor([0, 1, 2, 7, 100, 3000])
    problems = []
    likely = None
    for factor in (0.25, 0.5, 1.0):
        text = Qwen3_5TextConfig(
            hidden_size=40, num_attention_heads=6, num_key_value_heads=2, head_dim=48,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor},
        )  # fmt: skip
        rotary_dim = int(48 * factor)
        for dtype_name, dtype in DTYPES.items():
            label = f"rotary_dim {rotary_dim} of head_dim 48, {dtype_name}"
            cos, sin = transformers_cos_sin(text, positions, dtype)
            q = randn(len(positions), 6, 48, seed=1, dtype=dtype)
            k = randn(len(positions), 2, 48, seed=2, dtype=dtype)
            expected_q, expected_k = apply_rotary_pos_emb(
                q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None]
            )
            for name, x, expected in (("q", q, expected_q), ("k", k, expected_k)):
                ours = apply_partial_rope(x, cos, sin)
                expected_x = expected[0].transpose(0, 1)
                # x * cos + rotate_half(x) * sin: a sum of two terms, one rounding.
                problems += compare_dtype(f"{label}, {name}", ours, expected_x, tolerance(dtype, 2), elementwise=True)
                if ours.shape != x.shape:
                    continue
                # The dims past rotary_dim pass through, untouched: equal, bit for bit.
                if not torch.equal(ours[..., rotary_dim:], x[..., rotary_dim:]):
                    problems.append(f"{label}, {name}: dims {rotary_dim}..47 changed; they must pass through as is")
                    likely = likely or (
                        f"the pass-through dims changed: only the first rotary_dim dims of each head rotate (here "
                        f"{rotary_dim} of 48), the others are copied as they are"
                    )
                # The usual mistake: rotate_half over the whole head, which pairs dim i with i + head_dim/2 instead
                # of i + rotary_dim/2. (With the whole head rotating the two are the same.)
                elif rotary_dim < 48 and not compare(
                    "", ours[..., :rotary_dim], _paired_across_head(x, cos, sin), tolerance(dtype, 2)
                ):
                    likely = likely or (
                        f"the rotated dims pair dim i with dim i + 24 (half the head); RoPE pairs dim i with "
                        f"i + {rotary_dim // 2} (half of the rotary_dim {rotary_dim}): take rotate_half of the "
                        f"first rotary_dim dims only"
                    )
    conclude(problems, "partial RoPE matches transformers for 3 rotary fractions in float32 and bfloat16", likely)


def _paired_across_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary dims as a RoPE computes them that takes rotate_half over the whole head: x * cos + the first
    rotary_dim dims of (-x[half:], x[:half]) * sin, half = head_dim / 2. cos, sin: [T, rotary_dim]; x: [T, H, D]."""
    rotary_dim, half = cos.shape[-1], x.shape[-1] // 2
    rotated_whole = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x[..., :rotary_dim] * cos[:, None] + rotated_whole[..., :rotary_dim] * sin[:, None]


# ------------------------------------------------------------------------- one layer with random weights, batched


class AttentionPair:
    """transformers' Qwen3_5Attention with random weights (one DynamicCache per request) and a4's layer with the same
    weights, whose requests keep their KV in a paged KVPool at pool layer 1 (the layer must write where it is told)."""

    POOL_LAYER = 1
    MAX_CONTEXT = 256

    def __init__(self, attention_class: type, dtype: torch.dtype, partial_rotary_factor: float = 0.5) -> None:
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

        self.text_config = attention_text_config(partial_rotary_factor=partial_rotary_factor)
        config = a4_config(self.text_config)
        self.config = config
        torch.manual_seed(0)
        self.reference = Qwen3_5Attention(self.text_config, layer_idx=0)
        with torch.no_grad():  # the norms start at zero: randomise them so that they matter
            self.reference.q_norm.weight.copy_(0.5 * randn(config.head_dim, seed=1))
            self.reference.k_norm.weight.copy_(0.5 * randn(config.head_dim, seed=2))
        self.ours = attention_class(config, pool_layer=self.POOL_LAYER)
        self.ours.load_state_dict(self.reference.state_dict())  # the checkpoint's parameter names
        self.reference.to(dtype)
        self.ours.to(dtype)
        self.dtype = dtype
        self.hidden_size = config.hidden_size
        self.rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, self.MAX_CONTEXT)
        num_pages = 4 * self.MAX_CONTEXT // PAGE_SIZE
        self.pool = KVPool(2, num_pages, PAGE_SIZE, config.num_key_value_heads, config.head_dim, dtype, "cpu")
        self.table = SlotTable(self.pool.num_locations)
        self.caches: dict[int, Any] = {}

    def step(self, new_tokens: dict[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random hidden states for new_tokens[slot] tokens of each slot: (a4's output, transformers' output)."""
        from transformers import DynamicCache

        hiddens = [randn(n, self.hidden_size, seed=seed + slot, dtype=self.dtype) for slot, n in new_tokens.items()]
        fb = self.table.step(new_tokens, self.pool)
        expected = []
        with torch.no_grad():
            cos, sin = self.rope(fb.positions, self.dtype)
            ours = self.ours(torch.cat(hiddens), cos, sin, fb)
            for slot, prefix_len, hidden in zip(new_tokens, fb.prefix_lens, hiddens):
                if prefix_len == 0:
                    self.caches[slot] = DynamicCache(config=self.text_config)
                expected.append(self._reference(hidden, prefix_len, self.caches[slot]))
        return ours, torch.cat(expected)

    def step_problems(self, what: str, new_tokens: dict[int, int], seed: int) -> list[str]:
        """One `step`: a4's outputs against transformers'."""
        return compare_dtype(what, *self.step(new_tokens, seed), self.output_tolerance())

    def output_tolerance(self) -> float:
        """For the layer's outputs: the sums over the longest context so far."""
        return tolerance(
            self.dtype, attention_reduction_length(self.config, max(self.table.lens)), roundings=ATTENTION_ROUNDINGS
        )

    def _reference(self, hidden: torch.Tensor, prefix_len: int, cache: Any) -> torch.Tensor:
        n = hidden.shape[0]
        positions = torch.arange(prefix_len, prefix_len + n)
        cos, sin = transformers_cos_sin(self.text_config, positions, self.dtype)
        # Causal over the cached prefix and the new tokens: the query at position p sees keys 0..p.
        mask = torch.arange(prefix_len + n)[None, :] <= positions[:, None]
        return self.reference(hidden[None], (cos[None], sin[None]), mask[None, None], cache=cache)[0][0]

    def kv_problems(self, label: str) -> list[str]:
        """The keys and values in the pool of every request, against transformers' cache."""
        k_buf, v_buf = self.pool.get_kv(self.POOL_LAYER)
        problems = []
        for slot, cache in self.caches.items():
            locations = self.table.locations(slot)
            keys, values = (x[0].transpose(0, 1) for x in (cache.layers[0].keys, cache.layers[0].values))
            ours = (k_buf[locations], v_buf[locations])
            problems += kv_problems(f"{label}, slot {slot}", self.config, *ours, keys, values)
        return problems


def key_tolerance(config: ModelConfig, dtype: torch.dtype) -> float:
    """Keys went through k_proj (a sum over hidden), k_norm (over head_dim) and RoPE (two terms), each rounded."""
    return tolerance(dtype, config.hidden_size + config.head_dim + 2, roundings=3)


def kv_problems(
    label: str,
    config: ModelConfig,
    keys: torch.Tensor,
    values: torch.Tensor,
    want_keys: torch.Tensor,
    want_values: torch.Tensor,
) -> list[str]:
    """Keys and values from a KV pool against transformers' cache (values: v_proj alone)."""
    problems = compare_dtype(f"{label}, keys", keys, want_keys, key_tolerance(config, want_keys.dtype))
    value_tolerance = tolerance(want_values.dtype, config.hidden_size)
    return problems + compare_dtype(f"{label}, values", values, want_values, value_tolerance)


# The batched scenario: three requests in slots 3, 0 and 1, prefilled together (one of them a single token), the
# third prefilled in two chunks, then three decode steps of all three.
FIRST_PREFILL = {3: 30, 0: 1, 1: 17}
SECOND_CHUNK = {1: 13}
DECODE_STEPS = 3


def run_batched_pair(
    attention_class: type, dtype: torch.dtype, partial_rotary_factor: float = 0.5
) -> dict[str, list[str]]:
    """The batched scenario on a random-weight layer: problems of each phase ("prefill", "decode", "kv")."""
    pair = AttentionPair(attention_class, dtype, partial_rotary_factor)
    rotary_dim = pair.config.rotary_dim
    label = f"random layer (6 heads over 2 KV heads, head_dim 48, {rotary_dim} rotated), {dtype_name(dtype)}"
    problems = {"prefill": [], "decode": [], "kv": []}
    problems["prefill"] += pair.step_problems(f"{label}, prefill of 3 requests", FIRST_PREFILL, seed=1)
    problems["prefill"] += pair.step_problems(f"{label}, second prefill chunk", SECOND_CHUNK, seed=2)
    for i in range(DECODE_STEPS):
        decode = {slot: 1 for slot in FIRST_PREFILL}
        problems["decode"] += pair.step_problems(f"{label}, decode step {i + 1} of 3 requests", decode, seed=10 * i)
    problems["kv"] += pair.kv_problems(label)
    return problems


# ---------------------------------------------------------------------- the tiny checkpoint, layer by layer


PROMPT = [17, 801, 5, 333, 92, 640, 28, 1001, 77, 250, 418, 9, 560, 31, 702, 144, 66, 990, 12, 387, 45]


@dataclass
class TinyRun:
    """Every full-attention layer of the tiny checkpoint run by a4 on transformers' inputs: a prefill of PROMPT and
    one decode step, all layers sharing one KV pool as in the engine."""

    config: ModelConfig
    full_layers: tuple[int, ...]
    prefill: dict[int, tuple[torch.Tensor, torch.Tensor]]  # model layer -> (a4's output, transformers' output)
    decode: dict[int, tuple[torch.Tensor, torch.Tensor]]
    expected_kv: dict[int, tuple[torch.Tensor, torch.Tensor]]  # model layer -> transformers' cached keys, values
    pool: KVPool
    locations: torch.Tensor  # the request's KV locations, in token order


@functools.lru_cache(maxsize=2)
def _tiny_captures(dtype: torch.dtype):
    """transformers' prefill and decode captures of the tiny checkpoint (the reference: computed once per dtype)."""
    from a4.reference import hf_decode_capture, hf_prefill_capture

    checkpoint = tiny_checkpoint("qwen3_5")
    return hf_prefill_capture(checkpoint, PROMPT, dtype), hf_decode_capture(checkpoint, PROMPT, dtype=dtype)


def run_tiny_checkpoint(attention_class: type, dtype: torch.dtype) -> TinyRun:
    from a4.models.qwen3_5 import pool_layer_of
    from a4.reference import cached_hf_model

    hf = cached_hf_model(tiny_checkpoint("qwen3_5"), dtype)
    config = a4_config(hf.config.get_text_config())
    prefill, decode = _tiny_captures(dtype)
    pool = kv_pool_for(config, num_slots=2, max_context=64, dtype=dtype)
    table = SlotTable(pool.num_locations, num_slots=2, max_context=64)
    slot = 1
    prefill_fb = table.step({slot: len(PROMPT)}, pool)
    decode_fb = table.step({slot: 1}, pool)
    rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, 64)
    pool_layers = pool_layer_of(config)
    layers = {}
    for layer in config.full_attention_layers:
        layers[layer] = attention_class(config, pool_layer=pool_layers[layer]).to(dtype)
        layers[layer].load_state_dict(hf.model.language_model.layers[layer].self_attn.state_dict())
    run = TinyRun(config, config.full_attention_layers, {}, {}, {}, pool, table.locations(slot))
    # Layer after layer within a step, as the model runs them: a layer that wrote into another's pool layer during
    # the prefill would find the wrong keys there in the decode step.
    with torch.no_grad():
        for fb, capture, results in ((prefill_fb, prefill, run.prefill), (decode_fb, decode, run.decode)):
            cos, sin = rope(fb.positions, dtype)
            for layer, ours in layers.items():
                captured = capture.layers[layer]
                results[layer] = (ours(captured.mixer_input, cos, sin, fb), captured.mixer_output)
    for layer in layers:
        captured = decode.layers[layer]
        run.expected_kv[layer] = (captured.keys.transpose(0, 1), captured.values.transpose(0, 1))
    return run


def _layer_output_problems(runs: list[TinyRun], phase: str) -> list[str]:
    problems = []
    for run in runs:
        # transformers' captures come from "eager" attention, which rounds the softmax weights to the model dtype
        # before they multiply V; a4's SDPA keeps them in float32: one rounding more.
        reduction_length = attention_reduction_length(run.config, len(PROMPT) + 1)
        for layer, (ours, expected) in getattr(run, phase).items():
            label = f"tiny checkpoint, model layer {layer}, {dtype_name(expected.dtype)}, {phase}"
            allowed = tolerance(expected.dtype, reduction_length, roundings=ATTENTION_ROUNDINGS + 1)
            problems += compare_dtype(label, ours, expected, allowed)
    return problems


def check_prefill(attention_class: type) -> None:
    """Prefill: each full-attention layer of the tiny checkpoint on transformers' inputs, and a random layer of
    another shape over a batch of three requests (one prefilled in two chunks), in float32 and bfloat16."""
    runs = [run_tiny_checkpoint(attention_class, dtype) for dtype in DTYPES.values()]
    problems = _layer_output_problems(runs, "prefill")
    for dtype in DTYPES.values():
        problems += run_batched_pair(attention_class, dtype)["prefill"]
    conclude(problems, "prefill outputs match transformers (tiny checkpoint and a batched random layer, 2 dtypes)")


def check_decode(attention_class: type) -> None:
    """Decode after a prefill: the same layers and batch as the prefill check, one token per request per step."""
    runs = [run_tiny_checkpoint(attention_class, dtype) for dtype in DTYPES.values()]
    problems = _layer_output_problems(runs, "decode")
    for dtype in DTYPES.values():
        problems += run_batched_pair(attention_class, dtype)["decode"]
    conclude(problems, "decode outputs match transformers (tiny checkpoint and a batched random layer, 2 dtypes)")


def check_kv_pool_keys(attention_class: type) -> None:
    """What the layers write into the KV pool, after the prefill and a decode step, against transformers' cache:
    keys after k_norm and partial RoPE, values as projected."""
    problems = []
    for dtype in DTYPES.values():
        run = run_tiny_checkpoint(attention_class, dtype)
        # The j-th full-attention layer of the model is pool layer j.
        for rank, layer in enumerate(run.full_layers):
            k_buf, v_buf = run.pool.get_kv(rank)
            keys, values = run.expected_kv[layer]
            label = f"tiny checkpoint, model layer {layer}, {dtype_name(dtype)}"
            problems += kv_problems(label, run.config, k_buf[run.locations], v_buf[run.locations], keys, values)
        problems += run_batched_pair(attention_class, dtype)["kv"]
    conclude(problems, "the keys and values in the pool equal transformers' cache (after k_norm and RoPE)")


# ------------------------------------------------------------------------------- one pool for the whole model


# Layer patterns besides the tiny checkpoint's: the 0.8B model's (6 full-attention layers of 24) and one that starts
# with full attention.
LAYER_PATTERNS = {
    "0.8B pattern (3 GDN, 1 full) x 6": ([LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]) * 6,
    "full attention first": [FULL_ATTENTION, LINEAR_ATTENTION, FULL_ATTENTION, FULL_ATTENTION, LINEAR_ATTENTION],
}


def check_kv_pool_layers(attention_class: type) -> None:
    """A KV pool with one layer per full-attention layer, shared by all of them: each model layer's keys land in its
    own pool layer (its rank among the full-attention layers, counted from transformers' config) and nowhere else."""
    problems = []
    run = run_tiny_checkpoint(attention_class, torch.float32)
    problems += _pool_layout_problems(
        "tiny checkpoint", run.config, run.pool, run.full_layers, run.locations, run.expected_kv
    )
    for label, layer_types in LAYER_PATTERNS.items():
        problems += _pattern_problems(attention_class, label, layer_types)
    conclude(problems, f"one KV pool layer per full-attention layer, for {1 + len(LAYER_PATTERNS)} layer patterns")


def _pool_layout_problems(
    label: str,
    config: ModelConfig,
    pool: KVPool,
    full_layers: tuple[int, ...],
    locations: torch.Tensor,
    expected_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
) -> list[str]:
    def holds(rank: int, model_layer: int, which: int) -> bool:
        """Pool layer `rank` holds model layer `model_layer`'s keys (which=0) or values (which=1)."""
        ours, expected = pool.get_kv(rank)[which][locations], expected_kv[model_layer][which]
        allowed = key_tolerance(config, expected.dtype) if which == 0 else tolerance(expected.dtype, config.hidden_size)
        return not compare("", ours, expected, allowed)

    ranks = range(len(full_layers))
    # Keys go through k_norm and RoPE before the pool, values do not: when no pool layer holds any layer's keys but
    # the values are where they belong, the mapping is right and the keys were wrong before they were written.
    if not any(holds(rank, layer, 0) for rank in ranks for layer in full_layers):
        if all(holds(rank, layer, 1) for rank, layer in enumerate(full_layers)):
            return [
                f"{label}: no pool layer holds any layer's keys, yet every pool layer holds its layer's values: the "
                f"keys are wrong before they reach the pool (k_norm or RoPE?): fix the checks kv-pool-keys, "
                f"zero-centred-rmsnorm and partial-rope first"
            ]
    problems = []
    others = torch.ones(pool.num_locations, dtype=torch.bool)
    others[locations] = False
    for rank, layer in enumerate(full_layers):
        if not holds(rank, layer, 0):
            holder = [other for other in full_layers if holds(rank, other, 0)]
            found = f"model layer {holder[0]}'s keys" if holder else "no layer's keys"
            problems.append(
                f"{label}: pool layer {rank} should hold the keys of model layer {layer} (full-attention layer "
                f"{rank}); it holds {found}"
            )
        if pool.get_kv(rank)[0][others].any():
            problems.append(f"{label}: pool layer {rank} has values at locations the request does not own")
    return problems


def _pattern_problems(attention_class: type, label: str, layer_types: list[str]) -> list[str]:
    """Random-weight full-attention layers of one layer pattern, sharing one pool; transformers' shared cache (one
    entry per model layer) is the reference for where each layer's keys belong."""
    from transformers import DynamicCache
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Attention

    from a4.models.qwen3_5 import pool_layer_of

    text_config = attention_text_config(layer_types)
    config = a4_config(text_config)
    pool = kv_pool_for(config, num_slots=1, max_context=32, dtype=torch.float32)
    table = SlotTable(pool.num_locations, num_slots=1, max_context=32)
    num_tokens = 7
    fb = table.step({0: num_tokens}, pool)
    cache = DynamicCache(config=text_config)
    rope = RotaryEmbedding(config.rotary_dim, config.rope_theta, 32)
    cos, sin = rope(fb.positions, torch.float32)
    hf_cos, hf_sin = transformers_cos_sin(text_config, fb.positions, torch.float32)
    mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool).tril()[None, None]
    pool_layers = pool_layer_of(config)
    expected_kv = {}
    for layer in config.full_attention_layers:
        torch.manual_seed(layer)
        reference = Qwen3_5Attention(text_config, layer_idx=layer)
        ours = attention_class(config, pool_layer=pool_layers[layer])
        ours.load_state_dict(reference.state_dict())
        hidden = randn(num_tokens, config.hidden_size, seed=layer)
        with torch.no_grad():
            ours(hidden, cos, sin, fb)
            reference(hidden[None], (hf_cos[None], hf_sin[None]), mask, cache=cache)
        expected_kv[layer] = tuple(x[0].transpose(0, 1) for x in (cache.layers[layer].keys, cache.layers[layer].values))
    return _pool_layout_problems(label, config, pool, config.full_attention_layers, table.locations(0), expected_kv)
