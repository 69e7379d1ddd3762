"""Causal attention over the paged KV pool: write this step's keys and values, then attend.

A ForwardBatch packs the new tokens of every request into one row (T tokens, no padding). Request i brings tokens
at positions prefix_lens[i] .. seq_lens[i]-1; its earlier tokens (a cached prefix, earlier chunks, earlier decode
steps) are already in the pool. All its keys, old and new, are found at `req_to_token[slots[i], :seq_lens[i]]`.

Layers call `paged_attention`; the arithmetic is the step's attention backend's (`ForwardBatch.attn_backend`, chosen
by a4.engine.factories; the protocol is a4.core's), whose `prepare` builds what every layer of the step shares
(request tables, masks) once. torch's backend attends request by request in an EXTEND step; a DECODE or TARGET_VERIFY
step treats every new token as a row of its own, which sees its request's keys up to its own position: one batched
call, graph-safe. `TorchAttnBackend` (the CPU's) is torch's `scaled_dot_product_attention` (SDPA): a fused kernel
that never materialises the full score matrix and keeps the softmax in float32 even for bfloat16 inputs. It is also
what transformers' default "sdpa" path calls, so the numerics match the reference (prefill in bfloat16 on CPU: bit for
bit; decode, which folds GQA into the rows of queries, to rounding: one bfloat16 ulp in a few elements). On CUDA,
`TritonAttnBackend` runs a4's kernels instead.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from a4.core import ForwardBatch, ForwardMode


def _cpu_flash_attention_runs() -> bool:
    """False where torch's CPU flash kernel fails: on a CPU with AMX whose kernels ATEN_CPU_CAPABILITY limited to a
    lesser vector ISA (as when emulating another CPU, e.g. ATEN_CPU_CAPABILITY=avx2). In bfloat16 the kernel then
    still packs its blocks for AMX, which the lesser kernels cannot do: "pack_vnni2 is only supported when avx512 is
    supported". A real CPU without AVX-512 has no AMX, and the kernel does not pack there."""
    return not (torch.cpu._is_amx_tile_supported() and torch.backends.cpu.get_cpu_capability() != "AVX512")


# Every SDPA backend but cuDNN's: cuDNN builds a new execution plan for each new key length, milliseconds of CPU
# time per call, and every decode step has a new length (an H200, Qwen3-0.6B, batch 8: 78 ms per decode step with
# cuDNN, 45 ms without). On CPU this changes nothing, but where the flash kernel fails (see above) the math kernel
# serves instead.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
if not _cpu_flash_attention_runs():
    SDPA_BACKENDS.remove(SDPBackend.FLASH_ATTENTION)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, pool_layer: int, scale: float
) -> torch.Tensor:
    """Attention of the step's T new tokens over their requests' keys, in the input dtype.

    q [T, nH, D]; k, v [T, nKV, D] (after RoPE); returns [T, nH, D]. The new k, v are first written into
    `fb.kv_pool` layer `pool_layer` at `fb.out_cache_loc`. A query at position p sees its request's keys 0..p.
    GQA: query head h reads kv head h // (nH / nKV), as transformers' `repeat_kv`. The arithmetic is the step's
    attention backend's (`fb.attn_backend`).
    """
    fb.kv_pool.set_kv(pool_layer, fb.out_cache_loc, k, v)
    return fb.attn_backend.forward(q, k, v, fb, pool_layer, scale)


@dataclass
class DecodeMetadata:
    # [B, max_seq_len]: each request's key locations, padded with location 0 where `valid` is False.
    locs: torch.Tensor
    valid: torch.Tensor  # [B, max_seq_len] bool: keys 0..seq_len-1 of each request


@dataclass
class ExtendMetadata:
    # Per request: its key locations [seq_len] and its causal mask [extend_len, seq_len] (True = may attend); both
    # None for a request without a prefix, whose keys are all this step's own (see `_extend_attention`).
    locs: list[torch.Tensor | None]
    masks: list[torch.Tensor | None]


class TorchAttnBackend:
    """torch's SDPA over keys gathered from the pool (CPU and GPU): a decode step batches every request into one
    padded call, a prefill runs one call per request. Shapes come only from the context's tensors and
    `max_seq_len`, so a decode step with a fixed `max_seq_len` is graph-safe."""

    def prepare(self, fb: ForwardBatch) -> None:
        if fb.mode is not ForwardMode.EXTEND:
            # Each token is a row: its request's slot, and keys up to its own position. In a decode step that is each
            # request's whole length; in a verify step, token j of a request sees its prefix and tokens 0..j.
            row_slots, row_lens = token_rows(fb)
            # The rows' entries of the table, gathered on the device: indexing with python ints of the slots would
            # need them on the host (a device sync).
            tables = fb.req_to_token[row_slots, : fb.max_seq_len]
            key_pos = torch.arange(fb.max_seq_len, device=fb.slots.device)
            valid = key_pos[None, :] < row_lens[:, None]
            # Table entries past a row's length may be stale: point them at location 0 to stay in bounds.
            fb.attn_metadata = DecodeMetadata(locs=torch.where(valid, tables, 0), valid=valid)
            return
        locs, masks = [], []
        if any(fb.prefix_lens):  # else nothing below reads them: two launches a step saved
            tables = fb.req_to_token[fb.slots, : fb.max_seq_len]
            key_pos = torch.arange(fb.max_seq_len, device=fb.slots.device)
        for i, (prefix_len, extend_len) in enumerate(zip(fb.prefix_lens, fb.extend_lens)):
            if prefix_len == 0:
                locs.append(None)
                masks.append(None)
                continue
            seq_len = prefix_len + extend_len
            locs.append(tables[i, :seq_len])
            # The query at position p sees keys 0..p. (SDPA's own `is_causal` would align the diagonal to the
            # top-left corner, which is right only without a prefix.)
            query_pos = torch.arange(prefix_len, seq_len, device=key_pos.device)
            masks.append(key_pos[None, :seq_len] <= query_pos[:, None])
        fb.attn_metadata = ExtendMetadata(locs=locs, masks=masks)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, pool_layer: int, scale: float
    ) -> torch.Tensor:
        k_buf, v_buf = fb.kv_pool.get_kv(pool_layer)
        if fb.mode is ForwardMode.EXTEND:
            return _extend_attention(q, k, v, k_buf, v_buf, fb, scale)
        return _decode_attention(q, k_buf, v_buf, fb.attn_metadata, scale)


class TritonAttnBackend:
    """On CUDA, a4's Triton kernels, which read each request's keys in place through its row of req_to_token and its
    lengths on the device: no gather of keys per layer, nothing prepared per request.
    - Decode through the paged kernel (a4/kernels/paged_attention.py), whose work follows the real lengths, not the
      graph's bound. A verify step's tokens are rows of that kernel too (`token_rows`).
    - Prefill (EXTEND) through the extend kernel (a4/kernels/extend_attention.py): every request of the step in one
      launch, a cached prefix read from the pool, where SDPA took a call per request and, after a prefix, a mask and
      the request's keys gathered and repeated per query head."""

    def prepare(self, fb: ForwardBatch) -> None:
        # EXTEND: the grid's bound, the most new tokens of a request (a host list, the bucket's in a captured prefill).
        fb.attn_metadata = max(fb.extend_lens) if fb.mode is ForwardMode.EXTEND else token_rows(fb)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch, pool_layer: int, scale: float
    ) -> torch.Tensor:
        # Imported here: Triton exists only where CUDA does.
        from a4.kernels.extend_attention import extend_attention
        from a4.kernels.paged_attention import default_num_splits, paged_decode_attention

        k_buf, v_buf = fb.kv_pool.get_kv(pool_layer)
        if fb.mode is ForwardMode.EXTEND:
            return extend_attention(q, k, v, k_buf, v_buf, fb.req_to_token, fb.slots, fb.seq_lens, fb.cu_seqlens,
                                    fb.attn_metadata, scale)  # fmt: skip
        row_slots, row_lens = fb.attn_metadata
        # The context's splits from the number of requests, not of rows: a verify step's L rows per request are then
        # split as the decode steps of those tokens split them, and compute what those steps compute.
        num_splits = default_num_splits(fb.batch_size, k_buf.shape[1], fb.req_to_token.shape[1], q.shape[-1], q.device)
        return paged_decode_attention(q, k_buf, v_buf, fb.req_to_token, row_slots, row_lens, scale, num_splits)


def token_rows(fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """DECODE / TARGET_VERIFY: each new token's slot [T] and the number of keys it sees [T] (its position + 1).

    Every request feeds the same number of tokens, so the repeat count is a shape, not a value: no host sync."""
    return fb.slots.repeat_interleave(fb.tokens_per_request), fb.positions + 1


def gather(buf: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """buf[locs] for a pool buffer [num_locations, nKV, D] and locations of any shape.

    index_select copies whole rows; on CPU it is several times faster than advanced indexing's generic kernel.
    """
    return buf.index_select(0, locs.flatten()).unflatten(0, locs.shape)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA of q [B, nH, n, D] over k, v [B, nKV, L, D] with a boolean mask (True = may attend), or, with mask None,
    causally with n = L (query i sees keys 0..i).

    Causal: SDPA's own `is_causal` and grouped heads (`enable_gqa`), which the flash kernel takes as they are: on an
    H200, a 2,048-token prompt of Qwen3.5-0.8B's attention shapes took 0.11 ms against 0.31 ms masked, K and V
    repeated (on the CPU the two give the same bits). With a mask, GQA by repeating each kv head for its nH / nKV
    query heads (transformers' `repeat_kv`): on GPU the fused kernel that accepts a mask (memory-efficient) does not
    accept grouped heads, and torch would fall back to the unfused math kernel.
    """
    with sdpa_kernel(SDPA_BACKENDS):
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _extend_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    fb: ForwardBatch,
    scale: float,
) -> torch.Tensor:
    """Prefill (or a chunk of one): one SDPA call per request.

    Requests have very different lengths here, and each call is a large matrix product, so a python loop costs
    little next to the arithmetic while padding to the longest request could cost a lot. A request without a prefix
    attends causally over this step's own k and v (the same values as the pool's copy), gathering nothing.
    """
    meta: ExtendMetadata = fb.attn_metadata
    outputs = []
    start = 0
    for locs, mask, extend_len in zip(meta.locs, meta.masks, fb.extend_lens):
        rows = slice(start, start + extend_len)
        start += extend_len
        # SDPA wants [batch, heads, tokens, D]: a batch of one. (Without the batch dim, CPU falls back to the
        # unfused math kernel, whose bfloat16 results differ from transformers'.)
        q_i = q[rows].transpose(0, 1)[None]  # [1, nH, extend_len, D]
        if locs is None:
            k_i, v_i = k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None]  # [1, nKV, extend_len, D]
        else:
            k_i = gather(k_buf, locs).transpose(0, 1)[None]  # [1, nKV, seq_len, D]
            v_i = gather(v_buf, locs).transpose(0, 1)[None]
        outputs.append(sdpa(q_i, k_i, v_i, mask, scale)[0].transpose(0, 1))
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: DecodeMetadata, scale: float
) -> torch.Tensor:
    """A few new tokens per request: many tiny attentions, where a per-request python loop would cost more than the
    arithmetic. So every row's keys (a row per new token, `token_rows`) are gathered into one padded
    [rows, max_seq_len] block for a single SDPA call; keys past the row's own position are masked out.
    """
    k = gather(k_buf, meta.locs).transpose(1, 2)  # [B, nKV, max_seq_len, D]
    v = gather(v_buf, meta.locs).transpose(1, 2)
    # GQA without copying K and V: with one query per head, the nH / nKV query heads that share a KV head become
    # that head's rows of queries (query head h reads KV head h // group, as repeat_kv). Repeating K and V instead
    # copies the whole context again in every layer: on CPU, 0.8B shapes at 4k tokens, 15x slower.
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_rows = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=meta.valid[:, None, None, :], scale=scale)
    return o.reshape(batch, num_heads, head_dim)
