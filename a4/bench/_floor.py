"""The floor of a step: what the hardware needs at the least to run it, measured on the machine that runs it.

- Decode is memory-bound: a step reads every weight once and each running request's KV, and reads each request's
  GDN state and writes it back (the rule updates it in place); its floor is those bytes over the memory bandwidth
  (a large device-to-device copy, read plus written bytes per second). Of a mixture of experts' routed experts a
  step reads only those its tokens chose: with routing spread evenly over the E experts (as random weights route),
  a batch of B tokens choosing k each touches E * (1 - (1 - k / E)^B) of them. Of an input embedding that is not
  also the lm_head (untied) it reads one row per token, a few KB: not counted.
- Prefill is compute-bound: a step multiplies every token by every weight outside the embedding (2 FLOP per weight
  per token), of a mixture of experts' routed experts by its k of E; its floor is those FLOP over the machine's
  matrix-multiply rate (one GEMM, timed). Unless reading the weights takes longer: a prompt of a few hundred tokens
  touches nearly every routed expert of a mixture of experts (the 35B-A3B's 64 GB), while its FLOP are those of the
  k experts per token. The floor is then the weights it reads at the bandwidth (`weights_read`), the longer of the
  two (the roofline's).

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
    # The input embedding's bytes where the lm_head has weights of its own (0 where tied: the lm_head reads it all).
    untied_embedding_bytes: int = 0

    @staticmethod
    def from_dict(fields: dict) -> ModelBytes:
        """From a report's dict holding these fields among others (runs before the last field had it: 0)."""
        return ModelBytes(**{name: fields[name] for name in ModelBytes.__dataclass_fields__ if name in fields})

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
            # named_parameters() gives a tied lm_head once, under the embedding's name: both names means untied.
            untied_embedding_bytes=sum(p.nbytes for name, p in params.items() if "embed_tokens" in name)
            if any("lm_head" in name for name in params)
            else 0,
        )

    def unused_expert_params(self, tokens: int) -> float:
        """The routed experts' parameters that `tokens` tokens leave unread, expected: each token takes k of the E
        experts of a layer, so with routing spread evenly an expert escapes all of them with (1 - k / E)^tokens."""
        if not self.num_experts:
            return 0.0
        return self.routed_expert_params * (1 - self.experts_per_token / self.num_experts) ** tokens

    def decode_bytes(self, batch: int, context: float) -> float:
        """Bytes one decode step moves at least: the weights it reads (`weights_read`), each request's state read and
        written back, and the KV of its context read."""
        per_request = 2 * self.state_bytes_per_request + self.kv_bytes_per_token * context
        return self.weights_read(batch) + batch * per_request

    def weights_read(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: all but an untied embedding (a row a token) and the routed
        experts none of its tokens chose."""
        unused = self.untied_embedding_bytes + self.unused_expert_params(tokens) * self.bytes_per_param
        return self.weight_bytes - unused

    def prefill_floor_seconds(self, tokens: int, flop_per_s: float, bytes_per_s: float) -> float:
        """A prefill's floor: its weight GEMMs at the GEMM rate or the weights it reads at the bandwidth, the longer."""
        return max(self.prefill_flop(tokens) / flop_per_s, self.weights_read(tokens) / bytes_per_s)

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
