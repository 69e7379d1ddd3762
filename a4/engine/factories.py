"""What an engine builds for its model and settings, each chosen in one place (as mini-sglang's `create_kvcache_pool`
and `create_prefix_cache`): the pools, the prefix cache, the attention backend.

The only model-kind question is whether a model keeps a state per request (`state_pool_class`): Qwen3 keeps none,
Qwen3.5's Gated DeltaNet layers keep theirs in a StatePool. A third kind of model (another recurrent mixer, say) adds
its pool class there, not a branch at every site that builds something.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from a4.kernels import triton_kernels_run_on
from a4.kvcache.kv_pool import KVPool
from a4.kvcache.radix_cache import BasePrefixCache, NoPrefixCache, RadixCache
from a4.layers.attention import AttentionBackend, TorchAttnBackend, TritonAttnBackend
from a4.models.config import ModelConfig

if TYPE_CHECKING:
    from a4.engine.engine import EngineConfig
    from a4.kvcache.state_pool import StatePool


def state_pool_class(model_config: ModelConfig) -> type[StatePool] | None:
    """The pool of per-request states the model needs, or None for a model whose layers all keep KV."""
    if not model_config.is_hybrid:
        return None
    # Imported only for hybrid models: the StatePool is an exercise (notebook 05), and serving Qwen3 must not depend
    # on it.
    from a4.kvcache.state_pool import StatePool

    return StatePool


def state_bytes_per_slot(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one request slot's state (0 for a model without per-request state), for the memory plan."""
    pool_class = state_pool_class(model_config)
    return 0 if pool_class is None else pool_class.bytes_per_slot(model_config, dtype)


def create_state_pool(
    model_config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device
) -> StatePool | None:
    pool_class = state_pool_class(model_config)
    return None if pool_class is None else pool_class(model_config, num_slots, dtype, device)


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


def check_mtp_drafts(model_config: ModelConfig) -> None:
    """Raise ValueError unless the model's checkpoint carries an MTP module a4 can draft with (dense Qwen3.5)."""
    if not model_config.is_hybrid:
        raise ValueError(
            f"speculative_tokens needs a draft: {model_config.architecture} checkpoints have no MTP module (only "
            "Qwen3.5's do); give the Engine a drafter (a4.speculative.drafter) or set speculative_tokens=0"
        )
    if model_config.is_moe:
        raise ValueError(
            "speculative_tokens with a Qwen3.5-MoE checkpoint: a4 does not load its MTP module (its layer stores the "
            "experts one by one); set speculative_tokens=0"
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


def create_attention_backend(device: torch.device) -> AttentionBackend:
    """Triton's paged decode kernel where CUDA and Triton are present (a4/kernels), torch's SDPA elsewhere."""
    if triton_kernels_run_on(device):
        return TritonAttnBackend()
    return TorchAttnBackend()
