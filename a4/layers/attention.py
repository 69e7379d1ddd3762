"""Causal attention over the paged KV pool: write this step's keys and values, then attend.

A ForwardBatch packs the new tokens of every request into one row (T tokens, no padding). Request i brings tokens
at positions prefix_lens[i] .. seq_lens[i]-1; its earlier tokens (a cached prefix, earlier chunks, earlier decode
steps) are already in the pool. All its keys, old and new, are found at `req_to_token[req_slots[i], :seq_lens[i]]`.

The arithmetic is torch's `scaled_dot_product_attention` (SDPA): a fused kernel that never materialises the full
score matrix and keeps the softmax in float32 even for bfloat16 inputs. It is also what transformers' default "sdpa"
path calls, so the numerics match the reference (prefill in bfloat16 on CPU: bit for bit; decode, which folds
GQA into the rows of queries, to rounding: one bfloat16 ulp in a few elements).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from a4.core import ForwardBatch


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
    GQA: query head h reads kv head h // (nH / nKV), as transformers' `repeat_kv`.
    """
    fb.kv_pool.set_kv(pool_layer, fb.out_cache_loc, k, v)
    k_buf, v_buf = fb.kv_pool.get_kv(pool_layer)
    if all(n == 1 for n in fb.extend_lens):
        return _decode_attention(q, k_buf, v_buf, fb, scale)
    return _extend_attention(q, k_buf, v_buf, fb, scale)


def gather(buf: torch.Tensor, locs: torch.Tensor) -> torch.Tensor:
    """buf[locs] for a pool buffer [num_locations, nKV, D] and locations of any shape.

    index_select copies whole rows; on CPU it is several times faster than advanced indexing's generic kernel.
    """
    return buf.index_select(0, locs.flatten()).unflatten(0, locs.shape)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """SDPA of q [B, nH, n, D] over k, v [B, nKV, L, D] with a boolean mask (True = may attend).

    GQA by repeating each kv head for its nH / nKV query heads (transformers' `repeat_kv`) rather than SDPA's
    `enable_gqa`: on GPU the fused kernel that accepts a mask (memory-efficient) does not accept grouped heads, and
    torch would fall back to the unfused math kernel.
    """
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def _extend_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """Prefill (or a chunk of one): one SDPA call per request.

    Requests have very different lengths here, and each call is a large matrix product, so a python loop costs
    little next to the arithmetic while padding to the longest request could cost a lot.
    """
    # The requests' rows of the table, gathered on the device: indexing with python ints of req_slots would need
    # the slots on the host (a device sync in every layer).
    tables = fb.req_to_token[fb.req_slots, : max(fb.seq_lens)]
    out = torch.empty_like(q)
    start = 0
    for i, (prefix_len, extend_len) in enumerate(zip(fb.prefix_lens, fb.extend_lens)):
        seq_len = prefix_len + extend_len
        locs = tables[i, :seq_len]
        # SDPA wants [batch, heads, tokens, D]: a batch of one. (Without the batch dim, CPU falls back to the
        # unfused math kernel, whose bfloat16 results differ from transformers'.)
        q_i = q[start : start + extend_len].transpose(0, 1)[None]  # [1, nH, extend_len, D]
        k_i = gather(k_buf, locs).transpose(0, 1)[None]  # [1, nKV, seq_len, D]
        v_i = gather(v_buf, locs).transpose(0, 1)[None]
        # The query at position p sees keys 0..p. (SDPA's own `is_causal` would align the diagonal to the top-left
        # corner, which is right only without a prefix.)
        query_pos = fb.positions[start : start + extend_len]  # prefix_len .. seq_len-1
        mask = torch.arange(seq_len, device=q.device)[None, :] <= query_pos[:, None]  # [extend_len, seq_len]
        o_i = sdpa(q_i, k_i, v_i, mask, scale)
        out[start : start + extend_len] = o_i[0].transpose(0, 1)
        start += extend_len
    return out


def _decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, fb: ForwardBatch, scale: float
) -> torch.Tensor:
    """One new token per request: every decode step, and a prefill whose prompts were cached but their last token.

    A decode step is many tiny attentions, where a per-request python loop would cost more than the arithmetic. So
    every request's keys are gathered into one padded [B, max_len] block for a single SDPA call; the padding is
    masked out. The new token is the last of its request, so it sees all of its request's keys: no causal mask.
    """
    max_len = max(fb.seq_lens)
    # Each query is its request's last token (position seq_len-1): keys 0..position are real, the rest padding.
    valid = torch.arange(max_len, device=q.device)[None, :] <= fb.positions[:, None]  # [B, max_len]
    # Table entries past a request's length may be stale; point them at location 0 so the gather stays in bounds.
    locs = torch.where(valid, fb.req_to_token[fb.req_slots, :max_len], 0)
    k = gather(k_buf, locs).transpose(1, 2)  # [B, nKV, max_len, D]
    v = gather(v_buf, locs).transpose(1, 2)
    # GQA without copying K and V: with one query per head, the nH / nKV query heads that share a KV head become
    # that head's rows of queries (query head h reads KV head h // group, as repeat_kv). Repeating K and V instead
    # copies the whole context again in every layer: on CPU, 0.8B shapes at 4k tokens, 15x slower.
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    q_rows = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    with sdpa_kernel(SDPA_BACKENDS):
        o = F.scaled_dot_product_attention(q_rows, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    return o.reshape(batch, num_heads, head_dim)
