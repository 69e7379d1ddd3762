"""The floor of a step: what the hardware needs at the least to run it, measured on the machine that runs it.

- Decode is memory-bound: a step reads every weight once, and each running request's state and KV; its floor is
  those bytes over the memory bandwidth (a large device-to-device copy, read plus written bytes per second).
- Prefill is compute-bound: a step multiplies every token by every weight outside the embedding (2 FLOP per weight
  per token); its floor is those FLOP over the machine's matrix-multiply rate (one GEMM, timed).

A step's fraction of its floor is floor time / measured time: 1.0 means the hardware ran flat out. Underscored: not
a benchmark of its own (see `_timing`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from a4.bench._timing import device_seconds
from a4.models.config import ModelConfig

EMBEDDING_PARAMETERS = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ModelBytes:
    """What a decode step reads and a prefill computes, for one model in one dtype."""

    weight_bytes: int  # every parameter once (a tied lm_head is the embedding: one parameter)
    non_embedding_params: int  # what each prompt token is multiplied by (the logits are of one token only)
    state_bytes_per_request: int  # a hybrid model's GDN states of one request (0 without GDN layers)
    kv_bytes_per_token: int  # K and V of one token in every full-attention layer

    @staticmethod
    def of(model: torch.nn.Module, config: ModelConfig, dtype: torch.dtype) -> ModelBytes:
        # Imported here: the engine's modules need the exercises only when called.
        from a4.engine.factories import state_pool_class
        from a4.engine.memory_plan import MemoryLedger

        pool_class = state_pool_class(config)
        params = dict(model.named_parameters())  # tied parameters come once
        return ModelBytes(
            weight_bytes=sum(p.nbytes for p in params.values()),
            non_embedding_params=sum(
                p.numel() for name, p in params.items() if not any(e in name for e in EMBEDDING_PARAMETERS)
            ),
            state_bytes_per_request=pool_class.bytes_per_slot(config, dtype) if pool_class else 0,
            kv_bytes_per_token=MemoryLedger.from_config(config, dtype).kv_bytes_per_token,
        )

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one decode step reads at least: the weights, and each request's state and the KV of its context."""
        return self.weight_bytes + batch * (self.state_bytes_per_request + self.kv_bytes_per_token * context)

    def prefill_flop(self, tokens: int) -> float:
        """FLOP of a prefill's weight GEMMs (attention's own work, which grows with the square of the prompt, aside)."""
        return 2 * self.non_embedding_params * tokens


def copy_bytes_per_second(num_bytes: int, device: torch.device, repeats: int) -> float:
    """Memory bandwidth: bytes read plus bytes written per second by a copy of num_bytes into another buffer."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).random_(256)
    dst = torch.empty_like(src)
    return 2 * num_bytes / device_seconds(lambda: dst.copy_(src), device, repeats, inner=4)


def gemm_flop_per_second(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device, repeats: int) -> float:
    """Matrix-multiply rate: FLOP per second of [m, k] @ [k, n] in dtype."""
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(m, k, generator=gen, device=device).to(dtype)
    b = torch.randn(k, n, generator=gen, device=device).to(dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return 2 * m * k * n / device_seconds(lambda: torch.matmul(a, b, out=out), device, repeats, inner=4)
