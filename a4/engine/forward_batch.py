"""The one place a step's ForwardBatch is made: from host lists for an eager step, from static buffers for the
static-buffer runner (a4/engine/graph_runner.py), whose steps a CUDA graph may capture, and on a tensor-parallel
worker from what rank 0 sent (a4/distributed/protocol.py's `StepInputs`).

The model runner builds every step's context here, and so do the drafter, the course's hand-stepped checks and the
benches, through `build_forward_batch`. The mode is given by the caller, from the scheduler's batch: it is never
guessed from the lengths (a one-token prompt tail after a prefix hit is an EXTEND step, not a decode step).

A MIXED step (prompts' tokens, then one token for each decoding request) is one context for the layers, which work
row by row, and two for its backend (`MixedBackend`): an EXTEND over the prompts and a DECODE over the decodes, so
that its decodes take the decode path, one batched attention call and the Gated DeltaNet step by slot, as vLLM's
backends split a batch into its prefills and its decodes. As length-1 sequences of the prompts' path they would cost
what a prompt's tokens cost: an attention call each, and on the CPU a 64-token chunk each in notebook 04's chunked
rule (on 2 CPU cores a mixed step of one 256-token prompt and 64 decodes took 1.95x its prefill and decode steps
apart that way, 0.94x as it runs now).
"""

from __future__ import annotations

import torch

from dataclasses import replace

from a4.core import AttentionBackend, ForwardBatch, ForwardMode, GDNStates, to_device
from a4.distributed.protocol import StepInputs, step_tensors


def build_forward_batch(
    mode: ForwardMode,
    *,
    input_ids: list[int] | torch.Tensor,
    slots: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
    sample_indices: list[int],
    req_to_token: torch.Tensor,
    kv_pool: object | None,
    state_pool: GDNStates | None = None,
    attn_backend: AttentionBackend | None = None,
    state_slots: torch.Tensor | None = None,
    num_decodes: int = 0,
) -> ForwardBatch:
    """The context of an eager step: request i feeds extend_lens[i] tokens at positions prefix_lens[i] onwards, in
    slot slots[i], whose row of req_to_token already holds the locations of those positions. `attn_backend`
    defaults to torch's attention with, for a hybrid model (a state pool given), notebook 04's GDN functions.
    `state_slots` (on the device): the state rows, where they are not the slots (ForwardBatch.state_slots).
    `num_decodes`: a MIXED step's decoding requests, the last ones."""
    if not mode.is_extend() and len(set(extend_lens)) > 1:
        raise ValueError(f"a {mode.name} step feeds every request the same number of tokens, got {extend_lens}")
    if mode is ForwardMode.DECODE and (extend_lens[0] != 1 or min(prefix_lens) == 0):
        raise ValueError(f"a DECODE step feeds one token after a prefix, got {extend_lens} after {prefix_lens}")
    if (mode is ForwardMode.MIXED) != (num_decodes > 0) or not 0 <= num_decodes < len(slots):
        raise ValueError(f"a MIXED step, and only one, has prompts and then 1 to n decodes: {mode.name} step of "
                         f"{len(slots)} requests with num_decodes={num_decodes}")  # fmt: skip
    if num_decodes and (set(extend_lens[-num_decodes:]) != {1} or min(prefix_lens[-num_decodes:]) == 0):
        raise ValueError(f"a MIXED step's last {num_decodes} requests decode: one token each after a prefix, got "
                         f"{extend_lens} after {prefix_lens}")  # fmt: skip
    if attn_backend is None:
        attn_backend = default_backend(state_pool)
    device = req_to_token.device

    def tensor(values: list[int]) -> torch.Tensor:
        return to_device(values, device)

    # Built on the host and copied once: one small arange per request would be a launch per request on a GPU.
    positions = tensor([pos for p, n in zip(prefix_lens, extend_lens) for pos in range(p, p + n)])
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    slots_t = tensor(slots)
    fb = ForwardBatch(
        mode=mode,
        input_ids=input_ids if isinstance(input_ids, torch.Tensor) and input_ids.device == device
        else to_device(input_ids, device),
        positions=positions,
        slots=slots_t,
        seq_lens=tensor(seq_lens),
        cu_seqlens=tensor([0, *extend_lens]).cumsum(0),
        max_seq_len=max(seq_lens),
        out_cache_loc=req_to_token[slots_t.repeat_interleave(tensor(extend_lens)), positions],
        sample_indices=tensor(sample_indices),
        req_to_token=req_to_token,
        kv_pool=kv_pool,
        state_pool=state_pool,
        attn_backend=attn_backend,
        extend_lens=list(extend_lens),
        prefix_lens=list(prefix_lens),
        state_slots=state_slots,
        num_decodes=num_decodes,
    )
    return prepared(fb)


def static_forward_batch(
    mode: ForwardMode,
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    max_seq_len: int,
    req_to_token: torch.Tensor,
    kv_pool: object,
    state_pool: GDNStates | None,
    attn_backend: AttentionBackend,
    state_slots: torch.Tensor,
) -> ForwardBatch:
    """The context of a DECODE or TARGET_VERIFY step over static buffers: every request feeds L = T / B tokens
    (input_ids, positions [T], request after request; slots and state_slots [B]). Everything is computed on the
    device from the buffers, and no host list exists to be frozen into a graph; keys are read up to the bound `max_seq_len`."""
    batch_size, num_tokens = slots.shape[0], input_ids.shape[0]
    per_request = num_tokens // batch_size
    last_positions = positions.view(batch_size, per_request)[:, -1]
    fb = ForwardBatch(
        mode=mode,
        input_ids=input_ids,
        positions=positions,
        slots=slots,
        seq_lens=last_positions + 1,
        cu_seqlens=torch.arange(batch_size + 1, device=slots.device) * per_request,
        max_seq_len=max_seq_len,
        out_cache_loc=req_to_token[slots.repeat_interleave(per_request), positions],
        sample_indices=torch.arange(num_tokens, device=slots.device),
        req_to_token=req_to_token,
        kv_pool=kv_pool,
        state_pool=state_pool,
        attn_backend=attn_backend,
        state_slots=state_slots,
    )
    attn_backend.prepare(fb)
    return fb


def static_extend_batch(
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot: torch.Tensor,
    num_tokens: torch.Tensor,
    padding_slot: int,
    req_to_token: torch.Tensor,
    kv_pool: object,
    state_pool: GDNStates | None,
    attn_backend: AttentionBackend,
) -> ForwardBatch:
    """The context of a static EXTEND step: the first prefill (no prefix) of one request, in slot `slot` [1], padded
    to its bucket of T = input_ids.shape[0] tokens, of which the first `num_tokens` [1] are the request's
    (positions [T] = 0 .. T-1). The host lists are the bucket's constants (one request of T tokens after none), so
    a graph may record them; what the request changes lives on the device:
    - the padding rows come after the request's tokens, so causal attention and the causal conv never carry them
      into the request's rows; their keys and values go to the padding slot's first location;
    - the Gated DeltaNet backends leave them out of the states (`num_token_non_padded`);
    - the row sampled is the request's last token."""
    num_padded = input_ids.shape[0]
    padding_location = req_to_token[padding_slot, 0]
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND,
        input_ids=input_ids,
        positions=positions,
        slots=slot,
        seq_lens=torch.full_like(slot, num_padded),
        cu_seqlens=torch.arange(2, device=slot.device) * num_padded,  # kernels: no host copy inside a capture
        max_seq_len=num_padded,
        out_cache_loc=torch.where(positions < num_tokens, req_to_token[slot, positions], padding_location),
        sample_indices=num_tokens - 1,
        req_to_token=req_to_token,
        kv_pool=kv_pool,
        state_pool=state_pool,
        attn_backend=attn_backend,
        extend_lens=[num_padded],
        prefix_lens=[0],
        num_token_non_padded=num_tokens,
    )
    attn_backend.prepare(fb)
    return fb


def rank_forward_batch(
    step: StepInputs,
    *,
    req_to_token: torch.Tensor,
    kv_pool,
    state_pool: GDNStates | None,
    attn_backend: AttentionBackend,
) -> ForwardBatch:
    """A tensor-parallel worker's context of rank 0's step, over the worker's own table, pools and backend: the
    table rows the step reads are written into the worker's table first (slots and KV locations are rank 0's on
    every rank, a4/engine/tp_driver.py)."""
    device = req_to_token.device
    req_to_token[step.fb.slots.to(device), : step.table_rows.shape[1]] = step.table_rows.to(device)
    fb = replace(
        step.fb,
        req_to_token=req_to_token,
        kv_pool=kv_pool,
        state_pool=state_pool,
        attn_backend=attn_backend,
        **step_tensors(step.fb, device),
    )
    return prepared(fb)


def prepared(fb: ForwardBatch) -> ForwardBatch:
    """fb with its backend's metadata prepared; a MIXED step's backend becomes a `MixedBackend` over it."""
    if fb.mode is ForwardMode.MIXED:
        fb.attn_backend = MixedBackend(fb)
    else:
        fb.attn_backend.prepare(fb)
    return fb


class MixedBackend:
    """A MIXED step's backend: each layer's call runs on the prompts' rows as an EXTEND step and on the decodes'
    rows as a DECODE step, through the step's own backend, each part with a context of its own (`mixed_parts`,
    prepared once per step), and the two outputs come back in the step's row order."""

    def __init__(self, fb: ForwardBatch) -> None:
        self.backend = fb.attn_backend
        self.prefill, self.decode = mixed_parts(fb)
        self.backend.prepare(self.prefill)
        self.backend.prepare(self.decode)
        self.split = self.prefill.input_ids.shape[0]

    def prepare(self, fb: ForwardBatch) -> None:
        """Nothing: the parts were prepared when the step was built."""

    def forward(self, q, k, v, fb: ForwardBatch, pool_layer: int, scale: float) -> torch.Tensor:
        # The step's keys and values are already in the pool (paged_attention writes them first), where the
        # decode part reads its own.
        return self._in_parts(lambda part, rows: self.backend.forward(q[rows], k[rows], v[rows], part, pool_layer,
                                                                      scale))  # fmt: skip

    def conv(self, x: torch.Tensor, weight: torch.Tensor, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        return self._in_parts(lambda part, rows: self.backend.conv(x[rows], weight, gdn_layer, part))

    def delta_rule(self, q, k, v, a, b, A_log, dt_bias, gdn_layer: int, fb: ForwardBatch) -> torch.Tensor:
        return self._in_parts(lambda part, rows: self.backend.delta_rule(q[rows], k[rows], v[rows], a[rows], b[rows],
                                                                         A_log, dt_bias, gdn_layer, part))  # fmt: skip

    def _in_parts(self, run) -> torch.Tensor:
        prompts = run(self.prefill, slice(None, self.split))
        decodes = run(self.decode, slice(self.split, None))
        # A GPU backend's decode rule gives its o in the model dtype already, the prompts' rule in float32.
        return torch.cat([prompts, decodes.to(prompts.dtype)])


def mixed_parts(fb: ForwardBatch) -> tuple[ForwardBatch, ForwardBatch]:
    """A MIXED step's two contexts: an EXTEND over its prompts, a DECODE over its last `num_decodes` requests, views
    of the step's own tensors (the parts are never given to the model, and sample nothing)."""
    num_prompts = fb.batch_size - fb.num_decodes
    split = sum(fb.extend_lens[:num_prompts])

    def part(mode: ForwardMode, reqs: slice, rows: slice, cu_seqlens: torch.Tensor) -> ForwardBatch:
        seq_lens = [p + n for p, n in zip(fb.prefix_lens[reqs], fb.extend_lens[reqs])]
        return replace(fb, mode=mode, input_ids=fb.input_ids[rows], positions=fb.positions[rows],
                       slots=fb.slots[reqs], seq_lens=fb.seq_lens[reqs], cu_seqlens=cu_seqlens,
                       max_seq_len=max(seq_lens), out_cache_loc=fb.out_cache_loc[rows],
                       sample_indices=fb.sample_indices[:0], extend_lens=fb.extend_lens[reqs],
                       prefix_lens=fb.prefix_lens[reqs], state_slots=fb.state_slots[reqs], num_decodes=0)  # fmt: skip

    prompts, decodes = slice(None, num_prompts), slice(num_prompts, None)
    return (part(ForwardMode.EXTEND, prompts, slice(None, split), fb.cu_seqlens[: num_prompts + 1]),
            part(ForwardMode.DECODE, decodes, slice(split, None), fb.cu_seqlens[num_prompts:] - split))  # fmt: skip


def default_backend(state_pool: GDNStates | None) -> AttentionBackend:
    """torch's attention and, with a state pool (a hybrid model), notebook 04's GDN functions: the eager CPU path."""
    # Imported here: the layers import a4.core, and the GDN backend needs notebook 04's exercise module.
    from a4.layers.attention import TorchAttnBackend

    if state_pool is None:
        return TorchAttnBackend()
    from a4.layers.gdn_backend import HybridAttnBackend, TorchGDNBackend

    return HybridAttnBackend(TorchAttnBackend(), TorchGDNBackend())
