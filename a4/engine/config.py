"""EngineConfig: the engine's settings, checked on construction (`LLM(model_dir, **options)` takes its fields)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from a4.dtypes import resolve_dtype
from a4.models.registry import usable_device
from a4.models.weights import weight_loader

# How the prefix cache serves a hybrid model: "checkpoint" (hits only where a copy of the state was saved, notebook
# 07) or "refuse" (no hits at all: always correct, never faster).
HYBRID_PREFIX_POLICIES = ("checkpoint", "refuse")


@dataclass(frozen=True)
class EngineConfig:
    """The engine's settings, checked on construction (a bad value is a ValueError naming it)."""

    model_dir: str | Path
    dtype: str | torch.dtype = "float32"
    device: str | torch.device = "cpu"
    max_running_requests: int = 8
    max_prefill_tokens: int = 512
    page_size: int = 1
    enable_prefix_cache: bool = True
    memory_budget_bytes: int | None = None
    # Hybrid models: the largest share of the budget (of what the state checkpoints leave) that request slots, with
    # their states, may take, the rest going to KV pages (`plan_hybrid_memory`, notebook 06); None:
    # `max_running_requests` slots first (`plan_memory`).
    state_fraction: float | None = None
    # Hybrid models: how the prefix cache reuses prefixes (HYBRID_PREFIX_POLICIES), and under "checkpoint" how many
    # state checkpoints it keeps at most (least recently used evicted first; their bytes come out of the budget).
    hybrid_prefix_policy: str = "checkpoint"
    max_state_checkpoints: int = 16
    # Decode steps, and the first prefill of a request on its own, as CUDA graphs (graph_runner.py). None: on where
    # CUDA is. False on CUDA: the same static-buffer runner, not captured. True on the CPU: that runner too (nothing
    # to capture), the GPU's path run eagerly.
    cuda_graphs: bool | None = None
    # The projections that read one input (GDN's four, attention's q / k / v, the MLP's gate and up) as one GEMM each
    # (a4/layers/merged_linear.py); the layers' forward is unchanged. None: on where a4's Triton kernels run (CUDA).
    merge_projections: bool | None = None
    # Speculative decoding (a4/speculative, notebook 11): drafts per decode step, verified in one forward; 0: off.
    # Qwen3.5 drafts with its checkpoint's MTP module unless the Engine is given another drafter. Greedy only.
    speculative_tokens: int = 0
    # Tensor parallelism (a4/distributed): the model split over this many processes, one per GPU (or all on the
    # CPU), rank 0 this one; each rank's memory plan is its share's. 1: no split.
    tensor_parallel_size: int = 1
    # Where the weights come from (a4.models.weights.LOAD_FORMATS): "safetensors", the checkpoint's files; "dummy",
    # random weights drawn on the device from config.json alone (a4.checkpoints' tensor plan; the MTP module's too),
    # for benchmarks of models whose checkpoint the disk cannot hold. model_dir then needs no weight files.
    load_format: str = "safetensors"
    # Overlap scheduling (engine.py): the host schedules step n + 1 and books step n - 1 while the device runs step n.
    # None: on where the device runs asynchronously to the host (CUDA), off on the CPU, where nothing would overlap;
    # True on the CPU runs the same path synchronously (CI tests it). Not with speculative decoding, whose steps are
    # booked before the next is scheduled.
    overlap_schedule: bool | None = None
    # Mixed steps (scheduler.py): a step with prefill work also carries every running request's next token, under
    # the same max_prefill_tokens budget, so that prompts no longer stop the decodes (SGLang's --enable-mixed-chunk,
    # vLLM V1's chunked prefill). Not with speculative decoding, whose decode steps are verify passes.
    enable_mixed_chunk: bool = False

    def __post_init__(self) -> None:
        if not Path(self.model_dir).is_dir():
            raise ValueError(f"model_dir {str(self.model_dir)!r} is not a directory")
        resolve_dtype(self.dtype)
        usable_device(self.device)
        weight_loader(self.load_format)
        for name in ("max_running_requests", "max_prefill_tokens", "page_size"):
            value = getattr(self, name)
            if not _is_int(value) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.memory_budget_bytes is not None and (
            not _is_int(self.memory_budget_bytes) or self.memory_budget_bytes <= 0
        ):
            raise ValueError(
                f"memory_budget_bytes must be a positive integer or None, got {self.memory_budget_bytes!r}"
            )
        if not isinstance(self.enable_prefix_cache, bool):
            raise ValueError(f"enable_prefix_cache must be True or False, got {self.enable_prefix_cache!r}")
        if self.state_fraction is not None and (
            isinstance(self.state_fraction, bool)
            or not isinstance(self.state_fraction, (int, float))
            or not 0 < self.state_fraction < 1
        ):
            raise ValueError(f"state_fraction must be a number in (0, 1) or None, got {self.state_fraction!r}")
        if self.hybrid_prefix_policy not in HYBRID_PREFIX_POLICIES:
            raise ValueError(
                f"unknown hybrid_prefix_policy {self.hybrid_prefix_policy!r} (expected one of {HYBRID_PREFIX_POLICIES})"
            )
        checkpoints = self.max_state_checkpoints
        if not _is_int(checkpoints) or checkpoints < 0:
            raise ValueError(f"max_state_checkpoints must be a non-negative integer, got {checkpoints!r}")
        if not _is_int(self.speculative_tokens) or self.speculative_tokens < 0:
            raise ValueError(f"speculative_tokens must be a non-negative integer, got {self.speculative_tokens!r}")
        if self.speculative_tokens and self.state_fraction is not None:
            raise ValueError(
                "state_fraction cannot be combined with speculative_tokens: notebook 06's plan_hybrid_memory does not "
                "count the verify states and the draft's KV; leave state_fraction=None (slots first)"
            )
        for name in ("cuda_graphs", "merge_projections", "overlap_schedule"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be True, False or None, got {value!r}")
        if not isinstance(self.enable_mixed_chunk, bool):
            raise ValueError(f"enable_mixed_chunk must be True or False, got {self.enable_mixed_chunk!r}")
        for name in ("overlap_schedule", "enable_mixed_chunk"):
            if self.speculative_tokens and getattr(self, name):
                raise ValueError(
                    f"{name}=True cannot be combined with speculative_tokens={self.speculative_tokens}: a verify step is "
                    f"booked before the next step is scheduled, and its decode steps cannot mix; leave {name} unset"
                )
        self._check_tensor_parallel()

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not _is_int(size) or size <= 0:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {size!r}")
        if size == 1:
            return
        device = self.torch_device
        if device.type not in ("cpu", "cuda") or device.index not in (None, 0):
            raise ValueError(
                f"tensor_parallel_size {size} runs on the CPU or on GPUs 0..{size - 1}: device must be 'cpu' or "
                f"'cuda', got {str(self.device)!r}"
            )
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(
                f"tensor_parallel_size {size} needs {size} GPUs, this machine has {torch.cuda.device_count()}"
            )
        if self.cuda_graphs and device.type == "cuda":
            # A captured step would replay its collectives without the broadcast that starts the workers' step.
            raise ValueError(
                f"cuda_graphs=True cannot be combined with tensor_parallel_size {size} on CUDA: decode steps run over "
                "the static buffers uncaptured; leave cuda_graphs=None or False"
            )

    @property
    def overlap(self) -> bool:
        """Whether the engine overlaps scheduling with the device's work (`overlap_schedule` resolved)."""
        if self.overlap_schedule is not None:
            return self.overlap_schedule
        return self.torch_device.type == "cuda" and not self.speculative_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


def _is_int(value: object) -> bool:
    # bool is an int in Python, but `page_size=True` is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)
