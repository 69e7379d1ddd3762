"""What an engine builds for its model and settings, each chosen in one place (as mini-sglang's `create_kvcache_pool`
and `create_prefix_cache`): the memory ledger and plan, the pools, the prefix cache, the backends.

The only model-kind question is whether a model keeps a state per request (`state_pool_class`): Qwen3 keeps none,
Qwen3.5's Gated DeltaNet layers keep theirs in a StatePool. A third kind of model (another recurrent mixer, say) adds
its pool class there, not a branch at every site that builds something.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import dataclasses
import functools

import torch

from a4.core import AttentionBackend
from a4.engine.memory_plan import MemoryLedger, MemoryPlan, plan_engine_memory
from a4.kernels import triton_kernels_run_on
from a4.kvcache.kv_pool import KVPool
from a4.kvcache.radix_cache import BasePrefixCache, NoPrefixCache, RadixCache
from a4.layers.attention import TorchAttnBackend, TritonAttnBackend
from a4.models.config import ModelConfig

if TYPE_CHECKING:
    from a4.engine.config import EngineConfig
    from a4.kvcache.state_pool import StatePool


def state_pool_class(model_config: ModelConfig) -> type[StatePool] | None:
    """The pool of per-request states the model needs, or None for a model whose layers all keep KV."""
    if not model_config.is_hybrid:
        return None
    # Imported only for hybrid models: the StatePool is an exercise (notebook 05), and serving Qwen3 must not depend
    # on it.
    from a4.kvcache.state_pool import StatePool

    return StatePool


def create_memory_plan(
    config: EngineConfig, model_config: ModelConfig, draft_kv_layers: int = 0
) -> tuple[MemoryLedger, MemoryPlan]:
    """The model's ledger and the engine's memory plan (a4/engine/memory_plan.py).

    A hybrid model's ledger is notebook 06's `hybrid_ledger` (KV of the full-attention layers, the state of every
    slot), plus speculative decoding's draft KV and verify states; its budget is split slots first, or with
    `state_fraction` by notebook 06's `plan_hybrid_memory`; its description says from how many tokens a request
    costs less than in the same model with every layer attention (notebook 06's `break_even_tokens`)."""
    dtype, hybrid = config.torch_dtype, state_pool_class(model_config) is not None
    if config.state_fraction is not None and not hybrid:
        raise ValueError(
            f"state_fraction {config.state_fraction} applies to hybrid models only: "
            f"{model_config.architecture} keeps no state per request"
        )
    split = None
    if hybrid:
        # Imported only for hybrid models: notebook 06's exercises, which serving Qwen3 must not need.
        from a4.engine.hybrid_memory import break_even_tokens, hybrid_ledger, plan_hybrid_memory

        ledger = hybrid_ledger(model_config, dtype)
        # Asked when the plan is described, not to make it: serving does not need it.
        break_even = functools.partial(break_even_tokens, ledger, MemoryLedger.all_attention(model_config, dtype))
        if config.state_fraction is not None:
            split = functools.partial(plan_hybrid_memory, state_fraction=config.state_fraction)
    else:
        ledger, break_even = MemoryLedger.from_config(model_config, dtype), None
    if config.speculative_tokens:
        ledger = ledger.with_speculation(model_config, dtype, draft_kv_layers, config.speculative_tokens + 1)
    checkpoints = config.max_state_checkpoints if keeps_state_checkpoints(config, model_config) else 0
    plan = plan_engine_memory(config, model_config, ledger, num_checkpoints=checkpoints, split=split)
    return ledger, dataclasses.replace(plan, break_even=break_even)


def create_state_pool(
    model_config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
) -> StatePool | None:
    """A hybrid model's state pool, given notebook 11's verify functions for the commit of a speculative step."""
    pool_class = state_pool_class(model_config)
    if pool_class is None:
        return None
    import a4.speculative.verify as verify

    return pool_class(model_config, num_slots, dtype, device, verify=verify)


def create_kv_pool(
    model_config: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device,
    draft_kv_layers: int = 0,
) -> KVPool:
    """KV pages for the full-attention layers only (GDN layers keep no KV), then a draft model's attention layers
    (speculative decoding's MTP module), which share the main model's pages and locations."""
    return KVPool(
        num_layers=len(model_config.full_attention_layers) + draft_kv_layers,
        num_pages=num_pages,
        page_size=page_size,
        num_kv_heads=model_config.num_key_value_heads,
        head_dim=model_config.head_dim,
        dtype=dtype,
        device=device,
    )


def keeps_state_checkpoints(config: EngineConfig, model_config: ModelConfig) -> bool:
    """Whether the prefix cache saves copies of request states: a stateful model's, under "checkpoint"."""
    return (
        config.enable_prefix_cache
        and state_pool_class(model_config) is not None
        and config.hybrid_prefix_policy == "checkpoint"
    )


def create_prefix_cache(
    config: EngineConfig, model_config: ModelConfig, state_pool: StatePool | None
) -> BasePrefixCache:
    """The radix cache. A stateful model's prefix hit must also restore the state after exactly the hit's tokens: under
    "checkpoint" it hits only where a state copy is kept (notebook 07); under "refuse" it never hits."""
    if keeps_state_checkpoints(config, model_config):
        # Imported here: the hybrid radix cache is an exercise (notebook 07), and serving Qwen3 must not depend on it.
        from a4.kvcache.hybrid_radix_cache import HybridRadixCache

        return HybridRadixCache(config.page_size, state_pool, config.max_state_checkpoints)
    if config.enable_prefix_cache and state_pool is None:
        return RadixCache(config.page_size)
    return NoPrefixCache(config.page_size)


def create_backends(
    model_config: ModelConfig, device: torch.device, dtype: torch.dtype
) -> tuple[AttentionBackend, AttentionBackend]:
    """The backends of eager steps and of the static-buffer runner's steps (a4/layers/attention.py, gdn_backend.py).

    Attention: a4's Triton paged decode where CUDA and Triton are present, torch's SDPA elsewhere. Gated DeltaNet
    (hybrid models): on CUDA the Triton / flash-linear-attention backend for both; on the CPU the students'
    functions, notebook 04's for eager steps and notebook 10's by-slot step for the static runner."""
    on_gpu = triton_kernels_run_on(device)
    attention = TritonAttnBackend() if on_gpu else TorchAttnBackend()
    if state_pool_class(model_config) is None:
        return attention, attention
    # Imported only for hybrid models: the GDN backends are made of exercises (notebooks 04, 10, 11).
    import a4.speculative.verify as verify
    from a4.layers.gdn_backend import BySlotGDNBackend, HybridAttnBackend, TorchGDNBackend, TritonGDNBackend

    if on_gpu:
        backend = HybridAttnBackend(attention, TritonGDNBackend(dtype))
        return backend, backend
    eager, static = TorchGDNBackend(verify=verify), BySlotGDNBackend(verify=verify)
    return HybridAttnBackend(attention, eager), HybridAttnBackend(attention, static)
