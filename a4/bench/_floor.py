"""The floor of a step: what the hardware needs at the least to run it, measured on the machine that runs it.

- Decode is memory-bound: a step reads every weight once and each running request's KV, and reads each request's
  GDN state and writes it back (the rule updates it in place); its floor is those bytes over the memory bandwidth
  (a large device-to-device copy, read plus written bytes per second). Of a mixture of experts' routed experts a
  step reads only those its tokens chose: with routing spread evenly over the E experts (as random weights route),
  a batch of B tokens choosing k each touches E * (1 - (1 - k / E)^B) of them.
- Prefill is compute-bound: a step multiplies every token by every weight outside the embedding (2 FLOP per weight
  per token), of a mixture of experts' routed experts by its k of E; its floor is those FLOP over the machine's
  matrix-multiply rate (one GEMM, timed).

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
    # A mixture of experts: the routed experts' parameters (every layer's), experts per layer and the number each
    # token chooses; all 0 for a dense model. And the bytes of one parameter, which the weights are stored in.
    routed_expert_params: int
    num_experts: int
    experts_per_token: int
    bytes_per_param: int

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
            routed_expert_params=sum(p.numel() for name, p in params.items() if ".experts." in name),
            num_experts=config.num_experts if config.is_moe else 0,
            experts_per_token=config.num_experts_per_tok if config.is_moe else 0,
            bytes_per_param=dtype.itemsize,
        )

    def unused_expert_params(self, tokens: int) -> float:
        """The routed experts' parameters that `tokens` tokens leave unread, expected: each token takes k of the E
        experts of a layer, so with routing spread evenly an expert escapes all of them with (1 - k / E)^tokens."""
        if not self.num_experts:
            return 0.0
        return self.routed_expert_params * (1 - self.experts_per_token / self.num_experts) ** tokens

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one decode step moves at least: the weights (of the routed experts, the share a batch of this many
        tokens chooses), each request's state read and written back, and the KV of its context read."""
        weights = self.weight_bytes - self.unused_expert_params(batch) * self.bytes_per_param
        return weights + batch * (2 * self.state_bytes_per_request + self.kv_bytes_per_token * context)

    def prefill_flop(self, tokens: int) -> float:
        """FLOP of a prefill's weight GEMMs (attention's own work, which grows with the square of the prompt, aside);
        each token goes through k of a layer's E routed experts."""
        unused_share = 1 - self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return 2 * (self.non_embedding_params - self.routed_expert_params * unused_share) * tokens


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
