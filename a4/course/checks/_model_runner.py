"""Stepping a4's layers and models by hand, as an engine would, before any scheduler exists.

`SlotTable` builds the ForwardBatch of each step: request slots in a `req_to_token` table whose KV locations are
handed out in random order. `ModelRunner` drives a whole a4 model with it: a KV pool for the full-attention layers
(`kv_pool_for`) and, for a hybrid model, zero-initialised Gated DeltaNet states (`ZeroStates`; the real StatePool is
notebook 05's); `a4_model` loads a checkpoint's model once per process. Shared by the checks of notebooks 03 and 04
and by the model tests. Nothing here imports an exercise module: the all-attention model must run on the untouched
skeleton.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from a4.core import ForwardBatch, ForwardMode
from a4.course.checks import CheckFailed
from a4.engine.forward_batch import build_forward_batch
from a4.kvcache.kv_pool import KVPool
from a4.models.config import ModelConfig
from a4.models.registry import load_model

PAGE_SIZE = 4


class SlotTable:
    """Request slots for hand-built ForwardBatches, as an engine would fill them: a `req_to_token` table whose KV
    locations are handed out in random order (no request's locations are contiguous), and each slot's length."""

    def __init__(self, num_locations: int, num_slots: int = 4, max_context: int = 256, seed: int = 0) -> None:
        self.free = torch.randperm(num_locations, generator=torch.Generator().manual_seed(seed)).tolist()
        self.req_to_token = torch.zeros(num_slots, max_context, dtype=torch.long)
        self.lens = [0] * num_slots

    def step(
        self,
        new_tokens: dict[int, int | list[int]],
        kv_pool: KVPool | None,
        state_pool: object | None = None,
        sample_indices: list[int] | None = None,
    ) -> ForwardBatch:
        """The ForwardBatch of one step: new_tokens[slot] is a count (layer checks) or token ids (model checks).

        Each slot's request continues where it stopped (its prefix is what the slot holds so far). Its mode is
        chosen as a scheduler would: a step in which every request feeds one token after a prefix is a DECODE step,
        any other step an EXTEND (prefill) step.
        """
        slots = list(new_tokens)
        tokens = {s: list(range(n)) if isinstance(n, int) else list(n) for s, n in new_tokens.items()}
        prefix_lens = [self.lens[slot] for slot in slots]
        extend_lens = [len(tokens[slot]) for slot in slots]
        for slot, prefix_len, extend_len in zip(slots, prefix_lens, extend_lens):
            locations = [self.free.pop() for _ in range(extend_len)]
            self.req_to_token[slot, prefix_len : prefix_len + extend_len] = torch.tensor(locations, dtype=torch.long)
            self.lens[slot] += extend_len
        decode = all(n == 1 for n in extend_lens) and all(p > 0 for p in prefix_lens)
        return build_forward_batch(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND,
            input_ids=[t for slot in slots for t in tokens[slot]],
            slots=slots,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            sample_indices=sample_indices or [],
            req_to_token=self.req_to_token,
            kv_pool=kv_pool,
            state_pool=state_pool,
        )

    def locations(self, slot: int) -> torch.Tensor:
        """The KV locations of every token the slot's request holds, in order."""
        return self.req_to_token[slot, : self.lens[slot]]


def kv_pool_for(config: ModelConfig, num_slots: int, max_context: int, dtype: torch.dtype) -> KVPool:
    """The KV pool an engine allocates for a hybrid model: one layer per full-attention layer, none for GDN."""
    num_pages = num_slots * max_context // PAGE_SIZE
    return KVPool(
        len(config.full_attention_layers), num_pages, PAGE_SIZE, config.num_key_value_heads, config.head_dim,
        dtype, "cpu",
    )  # fmt: skip


def state_tensors(config: ModelConfig, num_slots: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One GDN layer's conv state [slots, conv_dim, K-1] (model dtype) and recurrent state [slots, Hv, dk, dv]
    (float32), zero, as a state pool holds them (the StatePool itself is notebook 05's)."""
    conv = torch.zeros(num_slots, config.conv_dim, config.linear_conv_kernel_dim - 1, dtype=dtype)
    recurrent = torch.zeros(
        num_slots, config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    )
    return conv, recurrent


class ZeroStates:
    """Stand-in for notebook 05's state pool: what `a4.core.GDNStates` asks for, zero-initialised."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype) -> None:
        layers = [state_tensors(config, num_slots, dtype) for _ in config.linear_attention_layers]
        self.conv = [conv for conv, _ in layers]
        self.recurrent = [recurrent for _, recurrent in layers]

    def conv_state(self, gdn_layer: int) -> torch.Tensor:
        return self.conv[gdn_layer]

    def recurrent_state(self, gdn_layer: int) -> torch.Tensor:
        return self.recurrent[gdn_layer]

    def clear(self, slots: list[int]) -> None:
        for conv, recurrent in zip(self.conv, self.recurrent):
            conv[slots], recurrent[slots] = 0, 0


@functools.cache
def a4_model(checkpoint: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """a4's model of the checkpoint on the CPU, loaded once per process (callers must not modify it)."""
    return load_model(checkpoint, dtype=dtype, device="cpu", progress=False)[1]


class ModelRunner:
    """a4's model driven one step at a time for requests in slots, as an engine would: a KV pool for the
    full-attention layers, a ZeroStates for the GDN layers (none for a model without any), KV locations handed out in
    random order."""

    def __init__(self, model: torch.nn.Module, num_slots: int = 2, max_context: int = 64, seed: int = 0) -> None:
        config = model.config
        dtype = model.lm_head.weight.dtype
        self.model = model
        self.pool = kv_pool_for(config, num_slots, max_context, dtype)
        self.states = ZeroStates(config, num_slots, dtype) if config.linear_attention_layers else None
        self.table = SlotTable(self.pool.num_locations, num_slots, max_context, seed)

    def forward(
        self, new_tokens: dict[int, list[int]], sample: dict[int, bool] | None = None
    ) -> dict[int, torch.Tensor]:
        """Feed new_tokens[slot] to each slot's request: float32 logits [n, vocab] of every new token of each sampled
        slot (`sample[slot]`; default: every slot). A request continues where its slot stopped."""
        sampled = [slot for slot in new_tokens if sample is None or sample[slot]]
        sample_indices, row = [], 0
        for slot, tokens in new_tokens.items():
            if slot in sampled:
                sample_indices += range(row, row + len(tokens))
            row += len(tokens)
        if self.states is not None:
            # As the engine does when it gives a request its slot: a request that starts here starts from zeros.
            self.states.clear([slot for slot in new_tokens if self.table.lens[slot] == 0])
        fb = self.table.step(new_tokens, self.pool, self.states, sample_indices)
        with torch.no_grad():
            logits = self.model(fb)
        expected = (len(sample_indices), self.model.config.vocab_size)
        if logits.dtype != torch.float32 or tuple(logits.shape) != expected:
            raise CheckFailed(
                f"the model returned {logits.dtype} logits of shape {tuple(logits.shape)}: expected float32 logits "
                f"of shape {expected}, one row per sampled token"
            )
        return dict(zip(sampled, logits.split([len(new_tokens[slot]) for slot in sampled])))

    def release(self, slot: int) -> None:
        """End the slot's request. Its table row and states stay as they are, as an engine leaves them (the next
        request in the slot finds them cleared when it starts)."""
        self.table.lens[slot] = 0
