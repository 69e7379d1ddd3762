"""Prefill attention: a4's extend kernel against torch's SDPA per request, side by side: a probe of REPORT.md §5.

Not a part of `python -m a4 bench gpu`: run from the repository root on a machine with a GPU,

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/extend_attention_probe.py

At Qwen3.5-0.8B's attention shapes (8 query heads, 2 KV heads, head_dim 256, bf16) it times one EXTEND step's
attention of one layer both ways, on the same keys: `extend_attention` (a4/kernels/extend_attention.py, the CUDA
backend's) and `_extend_attention` (the CPU backend's: SDPA per request, with gathered, repeated and masked keys
after a prefix). The steps: one prompt of 512 and of 2,048 tokens, eight prompts of 256, a 2,048-token chunk after a
2,048-token prefix, and four requests mixing prompts and chunks. The lone prompts run at the committed tile and at
three others. Each line gives both times (CUDA events, mean of 20 calls after a warm-up), their ratio, the kernel's
rate and the largest difference between the two outputs. It prints; nothing is written.
"""

import torch

from a4.core import ForwardBatch, ForwardMode
from a4.kernels.extend_attention import extend_attention
from a4.layers.attention import TorchAttnBackend, _extend_attention

DEVICE = "cuda"
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 256
TILES = (None, (128, 64, 8, 2), (64, 64, 8, 2), (32, 32, 4, 2))  # None: the committed one


def milliseconds(run, calls: int = 20) -> float:
    run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def compare(prefix_lens: list[int], extend_lens: list[int], tile=None) -> None:
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    num_tokens, width = sum(extend_lens), max(seq_lens)
    # Each request's keys at scattered locations of the pool, its new tokens' among them (paged_attention writes
    # them before it attends).
    table = torch.randperm(len(seq_lens) * width, device=DEVICE).view(len(seq_lens), width)
    k_buf = torch.randn(len(seq_lens) * width, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    v_buf = torch.randn_like(k_buf)
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.bfloat16)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(prefix_lens, extend_lens)]).to(DEVICE)
    slots = torch.arange(len(seq_lens), device=DEVICE)
    locations = table[slots.repeat_interleave(torch.tensor(extend_lens, device=DEVICE)), positions]
    k, v = k_buf[locations], v_buf[locations]

    class Pool:
        def get_kv(self, layer):
            return k_buf, v_buf

    cu_seqlens = torch.tensor([0, *extend_lens], device=DEVICE).cumsum(0)
    fb = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=positions, positions=positions, slots=slots,
        seq_lens=torch.tensor(seq_lens, device=DEVICE), cu_seqlens=cu_seqlens, max_seq_len=width,
        out_cache_loc=locations, sample_indices=positions[:1], req_to_token=table, kv_pool=Pool(),
        extend_lens=extend_lens, prefix_lens=prefix_lens,
    )  # fmt: skip
    TorchAttnBackend().prepare(fb)
    scale = HEAD_DIM**-0.5

    def sdpa():
        return _extend_attention(q, k, v, k_buf, v_buf, fb, scale)

    def ours():
        return extend_attention(q, k, v, k_buf, v_buf, table, slots, fb.seq_lens, fb.cu_seqlens, max(extend_lens),
                                scale, tile)  # fmt: skip

    difference = (sdpa().float() - ours().float()).abs().max().item()
    sdpa_ms, ours_ms = milliseconds(sdpa), milliseconds(ours)
    flops = sum(4 * NUM_HEADS * HEAD_DIM * n * (p + (n + 1) / 2) for p, n in zip(prefix_lens, extend_lens))
    print(f"prefixes {prefix_lens} new {extend_lens} tile {tile or 'committed'}: SDPA {sdpa_ms * 1e3:.1f} us, "
          f"extend {ours_ms * 1e3:.1f} us ({ours_ms / sdpa_ms:.2f}x, {flops / ours_ms / 1e9:.0f} TFLOP/s), "
          f"largest difference {difference:.3g}", flush=True)  # fmt: skip


for tile in TILES:
    compare([0], [512], tile)
    compare([0], [2048], tile)
compare([0] * 8, [256] * 8)
compare([2048], [2048])
compare([0, 1000, 0, 300], [700, 24, 1024, 333])
