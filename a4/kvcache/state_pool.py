# GENERATED from solutions/a4/kvcache/state_pool.py by `python -m a4.course sync`.
# Students: edit this file. Course maintainers: edit solutions/a4/kvcache/state_pool.py instead
# and run `python -m a4.course sync`.
"""Exercises (notebook 05): the StatePool, where the Gated DeltaNet layers keep each request's state.

A full-attention layer stores K and V for every token (the KV pool). A Gated DeltaNet (GDN) layer folds everything a
request has seen into a state of fixed size: the last K-1 inputs of its causal conv, and one dk x dv matrix per value
head. The StatePool holds that state for every request slot, beside the KV pool and indexed by the same slot as the
request's row of `req_to_token` (`Req.slot`, `ForwardBatch.slots`), like SGLang's MambaPool inside its
HybridReqToTokenPool. One buffer per kind of state, layer first, as KVPool keeps one buffer for all its layers:

    conv states       [num_gdn_layers, num_slots, conv_dim, K-1]   model dtype
    recurrent states  [num_gdn_layers, num_slots, Hv, dk, dv]       float32 (the checkpoints' mamba_ssm_dtype)

The model asks for the k-th GDN layer's part (`conv_state(k)`, `recurrent_state(k)`: the `GDNStates` protocol of
a4.models.qwen3_5) and reads and updates rows of it in place. A request's state needs no other bookkeeping: chunked
prefill carries it from chunk to chunk because the request keeps its slot, and decode updates it where it is.

Unlike KV, a state cannot be cut at a position or shared page by page: it describes everything up to the last token
fed, and only as a whole. So the only operations on it are whole-slot ones: `clear`, and `save` (a copy,
`StateCheckpoint`) and `restore`, which a prefix cache of a hybrid model stores and hands back.

Slots are reused: a request admitted into the slot of a finished one finds that request's state there. So when the
scheduler gives a request its slot it either restores the prefix cache's checkpoint there (notebook 07) or calls
`clear_new_requests`, which zeroes the slot of a request that starts from nothing (like SGLang's MambaPool, which
zeroes a slot when it hands it out). That is the only place a slot is cleared: the layers trust what it holds.

Speculative decoding (notebook 11) adds verify buffers (`allocate_verify_states`): the state after each of a verify
pass's L positions, per slot, which the layers' backends fill and `commit_verified` copies back at the accepted
length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from a4.core import Req
from a4.model_config import ModelConfig

# The recurrent state is a long running sum of decayed updates: the checkpoints ask for float32
# (mamba_ssm_dtype), whatever the model dtype, and transformers keeps it in float32 too.
RECURRENT_DTYPE = torch.float32


@dataclass(frozen=True)
class StateCheckpoint:
    """A copy of one slot's whole state: every GDN layer's conv and recurrent state, as they were when saved.

    Independent of the pool: later writes to the slot do not change it, and it can be restored into any slot.
    """

    conv: torch.Tensor  # [num_gdn_layers, conv_dim, K-1], model dtype
    recurrent: torch.Tensor  # [num_gdn_layers, Hv, dk, dv], float32

    @property
    def nbytes(self) -> int:
        """Memory the checkpoint holds (equal to StatePool.bytes_per_slot of its model and dtype)."""
        return self.conv.nbytes + self.recurrent.nbytes


class StatePool:
    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: torch.device | str,
        verify: ModuleType | None = None,
    ) -> None:
        """Zero-filled conv and recurrent states for `num_slots` request slots of every GDN layer of `config`.

        Creates exactly two tensors, both on `device` (see the module docstring for the layout):
            self._conv       [num_gdn_layers, num_slots, conv_dim, linear_conv_kernel_dim - 1], dtype `dtype`
            self._recurrent  [num_gdn_layers, num_slots, linear_num_value_heads, linear_key_head_dim,
                              linear_value_head_dim], dtype RECURRENT_DTYPE (float32)
        num_gdn_layers = len(config.linear_attention_layers); config.conv_dim gives conv_dim. Layer first, so that
        each layer's part is one contiguous block (`conv_state(k)` is `self._conv[k]`, a view).

        `verify` (not part of the exercise): notebook 11's module, a4.speculative.verify, whose
        `commit_verified_states_` `commit_verified` runs; handed in by whoever builds the pool (a4/engine/factories.py),
        as the pools sit below the speculative package. None: a pool that never commits a verify pass.
        """
        self.verify = verify
        if not config.is_hybrid:
            raise ValueError(f"{config.architecture} has no Gated DeltaNet layers: it needs no StatePool")
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"StatePool: num_slots must be a positive integer, got {num_slots!r}")
        raise NotImplementedError("Exercise state-pool-alloc: the zero-filled conv and recurrent states of every GDN layer (notebooks/05_state_pool.ipynb)")

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        """Bytes of one slot's state over all GDN layers, for a model run in `dtype`, without allocating anything.

        Per GDN layer: the conv state, conv_dim x (K-1) values in `dtype`, plus the recurrent state,
        Hv x dk x dv values in float32. The memory plan charges this to every request slot.
        """
        raise NotImplementedError("Exercise state-bytes-per-slot: the state bytes of one request slot, from the config alone (notebooks/05_state_pool.ipynb)")

    @property
    def num_layers(self) -> int:
        """GDN layers (the pool's layer k is the model's k-th GDN layer)."""
        return self._conv.shape[0]

    @property
    def num_slots(self) -> int:
        return self._conv.shape[1]

    @property
    def device(self) -> torch.device:
        return self._conv.device

    @property
    def total_bytes(self) -> int:
        return self._conv.nbytes + self._recurrent.nbytes

    def conv_state(self, gdn_layer: int) -> torch.Tensor:
        """The k-th GDN layer's conv states, [num_slots, conv_dim, K-1] (a view: writes go to the pool)."""
        return self._conv[self._layer(gdn_layer)]

    def recurrent_state(self, gdn_layer: int) -> torch.Tensor:
        """The k-th GDN layer's recurrent states, [num_slots, Hv, dk, dv] float32 (a view: writes go to the pool)."""
        return self._recurrent[self._layer(gdn_layer)]

    def clear(self, slots: Sequence[int]) -> None:
        """Zero the whole state (every GDN layer, both kinds) of the given slots; other slots are not touched."""
        self._check_slots(slots)
        index = torch.as_tensor(list(slots), dtype=torch.int64, device=self.device)
        self._conv[:, index] = 0
        self._recurrent[:, index] = 0

    def clear_new_requests(self, reqs: Sequence[Req]) -> None:
        """Zero the slot of every request in `reqs` that starts from nothing; leave every other slot as it is.

        The scheduler calls it when it gives requests their slots, before their first step runs. A slot is reused:
        the request admitted into it finds the previous request's conv and recurrent states there, and must not
        continue from another conversation's memory. A request starts from nothing when nothing of it is in the pools yet,
        `req.computed_len == 0`: clear its slot, `req.slot` (`clear` zeroes whole slots). Every other request
        continues from what its slot holds, which must not change: the next chunk of a chunked prefill, a decode
        step, or a prefix-cache hit whose saved state the radix cache has just restored into the slot (notebook 07).
        """
        raise NotImplementedError("Exercise state-reset: zero the slots of the requests that start from nothing (notebooks/05_state_pool.ipynb)")

    def save(self, slot: int) -> StateCheckpoint:
        """A copy of the slot's whole state: every GDN layer's conv and recurrent state (see StateCheckpoint).

        The copy stays on the pool's device and keeps the pool's dtypes; the slot itself is not changed.
        """
        self._check_slots([slot])
        raise NotImplementedError("Exercise state-save: copy one slot's whole state out of the pool (notebooks/05_state_pool.ipynb)")

    def restore(self, checkpoint: StateCheckpoint, slot: int) -> None:
        """Overwrite the slot's whole state with a checkpoint's (the checkpoint is not changed, and can be reused).

        After it, the slot holds exactly the state `save` copied: a request continuing from this slot computes what
        the saved request would have computed next.
        """
        self._check_slots([slot])
        self._check_compatible(checkpoint)
        raise NotImplementedError("Exercise state-restore: copy a checkpoint into a slot (notebooks/05_state_pool.ipynb)")

    def copy(self, src_slot: int, dst_slots: Sequence[int]) -> None:
        """Copy one slot's whole state (every GDN layer, both kinds) into other slots: the n samples of one prompt
        each continue from the state after it (Scheduler's fork). One copy per destination slot."""
        self._check_slots([src_slot, *dst_slots])
        index = torch.as_tensor(list(dst_slots), dtype=torch.int64, device=self.device)
        self._conv[:, index] = self._conv[:, src_slot : src_slot + 1]
        self._recurrent[:, index] = self._recurrent[:, src_slot : src_slot + 1]

    def allocate_verify_states(self, num_tokens: int) -> None:
        """Buffers for the states a verify pass of `num_tokens` positions keeps, for every slot (speculative
        decoding: the memory plan counts them, `MemoryLedger.verify_bytes_per_slot`)."""
        self._verify_conv = self._conv.new_zeros(self.num_layers, self.num_slots, num_tokens, *self._conv.shape[2:])
        self._verify_recurrent = self._recurrent.new_zeros(
            self.num_layers, self.num_slots, num_tokens, *self._recurrent.shape[2:]
        )

    def verify_conv_states(self, gdn_layer: int) -> torch.Tensor:
        """The k-th GDN layer's conv state after each verify position, [num_slots, L, conv_dim, K-1] (a view)."""
        return self._verify_conv[self._layer(gdn_layer)]

    def verify_recurrent_states(self, gdn_layer: int) -> torch.Tensor:
        """The k-th GDN layer's recurrent state after each verify position, [num_slots, L, Hv, dk, dv] (a view)."""
        return self._verify_recurrent[self._layer(gdn_layer)]

    def commit_verified(self, slots: torch.Tensor, kept_lens: torch.Tensor) -> None:
        """After a verify pass: each request's slot gets, in every GDN layer, its state after the last verify token
        it keeps (kept_lens[i] of them), with notebook 11's `commit_verified_states_`.

        One call for all layers: a (layer, slot) pair is a row of the pool's buffers with the layer dim folded into
        the slot dim, so the function sees num_layers x B requests (a call per layer would be ~6 launches and a host
        sync per GDN layer on a GPU, outside the captured verify step)."""
        if self.verify is None:
            raise RuntimeError("commit_verified: this StatePool was built without verify= (a4.speculative.verify)")
        if kept_lens.shape != slots.shape or slots.dim() != 1:
            raise ValueError(
                f"commit_verified: slots and kept_lens must be two [B] tensors; got {tuple(slots.shape)} and "
                f"{tuple(kept_lens.shape)}"
            )
        # The (layer, slot) rows, layer-major as the buffers are, and their lengths: a few ints, built on the host
        # and moved in one copy (on a GPU these launches sit between two verify steps' graphs).
        rows = (torch.arange(self.num_layers)[:, None] * self.num_slots + slots.cpu()[None, :]).flatten()
        rows, kept_lens = torch.stack([rows, kept_lens.cpu().repeat(self.num_layers)]).to(self.device).unbind()
        self.verify.commit_verified_states_(
            self._conv.flatten(0, 1),
            self._recurrent.flatten(0, 1),
            self._verify_conv.flatten(0, 1).index_select(0, rows),
            self._verify_recurrent.flatten(0, 1).index_select(0, rows),
            rows,
            kept_lens,
        )

    def _layer(self, gdn_layer: int) -> int:
        if not 0 <= gdn_layer < self.num_layers:
            raise IndexError(f"StatePool has {self.num_layers} GDN layers; GDN layer {gdn_layer} does not exist")
        return gdn_layer

    def _check_slots(self, slots: Sequence[int]) -> None:
        bad = [slot for slot in slots if not 0 <= slot < self.num_slots]
        if bad:
            raise IndexError(f"StatePool has {self.num_slots} slots; slot(s) {bad} do not exist")

    def _check_compatible(self, checkpoint: StateCheckpoint) -> None:
        """A checkpoint of another model or dtype would be copied in silently (or broadcast): refuse it."""
        for name, saved, pool in (
            ("conv", checkpoint.conv, self._conv[:, 0]),
            ("recurrent", checkpoint.recurrent, self._recurrent[:, 0]),
        ):
            if saved.shape != pool.shape or saved.dtype != pool.dtype:
                raise ValueError(
                    f"StateCheckpoint {name} state is {tuple(saved.shape)} {saved.dtype}, but this pool's slots hold "
                    f"{tuple(pool.shape)} {pool.dtype}: it was saved from another model or dtype"
                )
