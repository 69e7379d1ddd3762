"""From a checkpoint directory to a ready model: the architecture registry and `load_model`.

The registry maps the `architectures` string of config.json to "module:Class". Model modules are imported only when
asked for, so serving Qwen3 never imports the Qwen3.5 files (exercises that may not be written yet).
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from a4.dtypes import resolve_dtype
from a4.kernels import triton_kernels_run_on
from a4.models.config import ConfigError, ModelConfig, load_model_config
from a4.models.weights import LoadReport, identity, weight_loader

MODEL_REGISTRY: dict[str, str] = {
    "Qwen3ForCausalLM": "a4.models.qwen3:Qwen3ForCausalLM",
    "Qwen3_5ForConditionalGeneration": "a4.models.qwen3_5:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": "a4.models.qwen3_5_moe:Qwen3_5MoeForConditionalGeneration",
}

# A tensor-parallel rank's cut of a loaded model, in place: shard(model, config).
Shard = Callable[[nn.Module, ModelConfig], None]


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ConfigError(f"no model class for architecture {architecture!r} (known: {sorted(MODEL_REGISTRY)})")
    module_name, class_name = MODEL_REGISTRY[architecture].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def usable_device(device: torch.device | str) -> torch.device:
    """`device` as a torch.device that can hold the weights, or a ValueError naming it (before anything is loaded).

    "meta" holds shapes, not values; a device this machine or this PyTorch build lacks fails a one-element allocation.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"unknown device {device!r} ({e})") from None
    if resolved.type == "meta":
        raise ValueError(f"device {str(device)!r} holds tensor shapes but no values: it cannot hold weights")
    try:
        torch.empty(1, device=resolved)
    except Exception as e:  # noqa: BLE001 - each backend fails its own way (AssertionError, RuntimeError, ...)
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"device {str(device)!r} cannot hold tensors on this machine ({reason})") from None
    return resolved


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Create parameters directly in `dtype`: no float32 copy of a bfloat16 model, even for a moment."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def load_model(
    model_dir: str | Path,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    progress: bool = True,
    merge_projections: bool | None = None,
    shard: Shard | None = None,
    load_format: str = "safetensors",
) -> tuple[ModelConfig, nn.Module, LoadReport]:
    """Read config.json, build the registered model class on `device` in `dtype`, load its weights.

    A model class may define `checkpoint_key_map(key) -> str | None` (a staticmethod) to rename or skip checkpoint
    keys; without one, the keys are its parameter names. The model comes back in eval mode, without gradients, and
    with the fusions of `fuse_for_device`. `shard(model, config)`: a tensor-parallel rank keeps its share of the
    loaded weights (a4/distributed/sharding.py), before the fusions. `load_format`: "safetensors" reads the
    checkpoint's files; "dummy" reads none and draws random weights on `device` (a4.models.weights.draw_weights).
    """
    fill = weight_loader(load_format)
    device = usable_device(device)
    dtype = resolve_dtype(dtype)
    config = load_model_config(model_dir)
    cls = model_class(config.architecture)
    # The random initialisation is overwritten by the checkpoint (or the plan's draw); it costs a little time.
    with torch.device(device), default_dtype(dtype):
        model = cls(config)
    key_map: Callable[[str], str | None] = getattr(cls, "checkpoint_key_map", identity)
    report = fill(model, model_dir, key_map=key_map, device=device, dtype=dtype, progress=progress)
    model.eval().requires_grad_(False)
    if shard is not None:
        shard(model, config)
    fuse_for_device(model, device, merge_projections)
    return config, model, report


def fuse_for_device(model: nn.Module, device: torch.device, merge_projections: bool | None = None) -> None:
    """Where a4's Triton kernels run: every norm in one launch instead of ~10, the residual add before a norm in
    that launch (a4/kernels/rmsnorm.py), a decode step's launches being its cost, SwiGLU's silu-and-multiply and
    attention's output gate in one each (a4/kernels/activation.py), an attention layer's q/k norms, partial RoPE and
    KV write in one (a4/kernels/rope.py), the linear layers on a few rows as matrix-vector products
    (a4/kernels/gemv.py), and a mixture of experts' router and routed experts in three launches that never ask the
    host, so that its steps capture (a4/kernels/moe.py). `merge_projections`: the projections that read one input as
    one GEMM (a4/layers/merged_linear.py); None: where the Triton kernels run. None of them changes what a layer
    computes, only how."""
    if merge_projections is None:
        merge_projections = triton_kernels_run_on(device)
    if merge_projections:
        from a4.layers.merged_linear import merge_projections as merge

        merge(model)
    if triton_kernels_run_on(device):
        from a4.layers.fused import (
            use_fused_activation, use_fused_attention, use_fused_experts, use_fused_norms, use_gemv,
        )  # fmt: skip

        use_fused_norms(model)
        use_fused_activation(model)
        use_fused_attention(model)
        use_gemv(model)
        use_fused_experts(model)
