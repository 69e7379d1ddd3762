"""A Triton kernel for a linear layer on a few token rows (decode at small batch): y = x @ W.T, x [M <= 4, K].

Why a kernel of our own: with one to four rows, a linear layer is a matrix-vector product, bound by reading W once
from HBM. cuBLAS tiles it as a GEMM and, for the layers whose output is narrow, spreads it over too few thread
blocks: on an H200, Qwen3.5-0.8B's `down_proj` (3584 -> 1024, 7.3 MB) took 10.4 us at batch 1, 0.7 TB/s of a 4.8
TB/s memory, and the GDN `out_proj` and attention `o_proj` (2048 -> 1024) ran as slowly; together a fifth of the
decode step. Here each program owns BLOCK_N output features and streams their rows of W (BLOCK_N x BLOCK_K tiles,
pipelined over K), applying each tile to every token row of the call before the next is read: W is read once
whatever the row count (a batch-1 verify step's 97 projections of 4 rows took 1.15 ms of GPU time on the H200, 1.5x
the decode step's 0.76 ms at one row; 1.40 ms, 1.8x, when each row had programs of its own and found W in L2).

The tile (TILE) and the layers that take the kernel were chosen by timing the 0.8B model's decode projections inside
CUDA graphs on an H200, eight tiles side by side with cuBLAS (the GPU's time alone, bf16; solutions/REPORT.md §5):
- 4 rows of W per program in 1024-wide K steps, 4 warps, 3 stages, was the fastest of that round's few tiles for
  every shape and row count (the 8 x 512 tile of the first round was 10-40% slower); `tile=` runs another, for the
  tests and such timings. A later sweep of 71 tiles on an H100 (every decode shape of the 0.8B and the 35B-A3B, at 1
  and 4 rows, each call reading its weight from HBM inside a CUDA graph) found a tile per shape that beats it, by up
  to 2.2x at one row where the output is narrow: fewer rows of W per program (1 or 2) make more programs, which keep
  more loads in flight. Those tiles are TILES, below; with the tiles of its two narrow shapes alone (`down_proj`,
  `out_proj` and `o_proj`), the 0.8B's decode step at batch 1 went from 1.47 to 1.27 ms on that H100
  (solutions/REPORT.md §5);
- for a narrow output (out_features <= in_features: `down_proj`, `out_proj`, `o_proj`, 1024 features) the kernel
  beats cuBLAS by 1.4-3.8x at one row (3.3 us against 12.5 us for 2048 -> 1024); for a wide one (the merged input
  projections, 5,000-8,000 features) cuBLAS is as fast at one row and twice as fast at four. (Autotuning every
  shape instead compiled ~200 variants at graph capture: minutes of start-up.)

Every projection of at most MAX_ROWS rows takes the kernel, the wide ones too, for one more reason: the same row must
come out the same whatever rows share its call. A speculative verify step at batch 1 multiplies k + 1 rows where the
decode step multiplies one, and its rows must be what the decode steps would compute, or the verify rejects drafts
that plain decoding would have chosen. cuBLAS chooses its kernel (tile, split of K) by the row count, so on the H200
the 4 rows of a k = 3 verify came out otherwise than 4 one-row steps, and 7% of oracle drafts were accepted (random
weights leave the top logits so close that one bfloat16 rounding moves the argmax). Here each row has its own
accumulator and its own reduction of each tile (`_row_dot`): its dot products are the same instructions, over the
same K blocks in the same order, however many rows the call has, and a one-row call compiles to exactly the one-row
kernel. (A first version held the rows as one [MAX_ROWS, BLOCK_N] block of registers, reduced together: its one-row
step on the H200 was 0.57 ms slower than cuBLAS for the wide projections.)

The arithmetic is a dot product per output in float32, cast to x's dtype at the end, as cuBLAS computes a bfloat16 GEMM
(the sum is taken in another order). `use_gemv(model)` (a4/layers/fused.py) routes a model's bias-free linear layers
(and merged projections) through `linear`, which takes this kernel for at most MAX_ROWS rows on CUDA and F.linear
otherwise.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel

# Rows a call may have to take the kernel: decode at batch 1 to 4, a batch-1 verify step of up to 3 drafts. With
# more rows cuBLAS's GEMM tiles do better.
MAX_ROWS = 4  # the kernel's accumulators are named, one per row: raising it means adding some
# (BLOCK_N, BLOCK_K, num_warps, num_stages), measured as the module docstring says.
TILE = (4, 1024, 4, 3)
# A weight shape (out_features, in_features) whose own tile was measured faster than TILE (an H100, bf16, µs per call
# within CUDA graphs, gpu time alone): the least time at 1 row plus a quarter of that at 4 (decode at batch 1 first,
# then a k = 3 verify step). One tile per shape, whatever the row count: a row's bits depend on the tile, and must not
# on the rows sharing its call. Shapes of other models take TILE.
TILES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (1, 2048): (1, 2048, 8, 3),  # 2.3 -> 1.5 us at 1 row, 4.3 -> 2.7 at 4 (35B-A3B shared-expert gate)
    (256, 2048): (1, 2048, 4, 2),  # 5.5 -> 2.4 us at 1 row, 5.5 -> 4.0 at 4 (35B-A3B router)
    (1024, 2048): (1, 2048, 4, 3),  # 5.9 -> 3.6 us at 1 row, 6.6 -> 5.1 at 4
    (1024, 3584): (1, 2048, 4, 3),  # 10.2 -> 4.7 us at 1 row, 11.1 -> 7.9 at 4
    (2048, 512): (2, 512, 2, 3),  # 4.0 -> 2.8 us at 1 row, 4.3 -> 3.9 at 4
    (2048, 4096): (2, 2048, 4, 3),  # 11.4 -> 7.7 us at 1 row, 13.9 -> 11.9 at 4
    (5120, 1024): (2, 512, 2, 3),  # 6.0 -> 5.5 us at 1 row, 9.2 -> 8.5 at 4
    (7168, 1024): (4, 256, 2, 3),  # 7.2 -> 7.2 us at 1 row, 11.3 -> 9.4 at 4
    (8224, 1024): (2, 1024, 2, 3),  # 7.9 -> 7.6 us at 1 row, 12.4 -> 11.0 at 4
    (9216, 2048): (2, 2048, 4, 2),  # 17.5 -> 14.6 us at 1 row, 24.3 -> 20.4 at 4
    (12352, 2048): (2, 1024, 2, 3),  # 20.1 -> 18.7 us at 1 row, 30.3 -> 25.3 at 4
    (248320, 1024): (2, 1024, 2, 3),  # 165.4 -> 163.5 us at 1 row, 241.9 -> 180.3 at 4 (the 0.8B's lm_head)
    (248320, 2048): (2, 2048, 2, 3),  # 325.0 -> 323.3 us at 1 row, 445.7 -> 334.6 at 4
}


@triton.jit
def _row_dot(x_ptr, row, stride_x, k, in_k, w):
    """One row's share of one K block: the same instructions whichever row, and however many rows the call has."""
    x = tl.load(x_ptr + row * stride_x + k, mask=in_k, other=0.0)
    return tl.sum(x.to(tl.float32)[None, :] * w.to(tl.float32), axis=1)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, y_ptr,
    out_features, in_features,
    stride_x, stride_w, stride_y,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # One program per block of output features, for every row: each tile of W is read once and used ROWS times.
    # A row has its own accumulator (MAX_ROWS = 4 of them, named, as Triton has no arrays of tensors).
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < out_features
    # W's first tile is read before the wait for the kernel before: no kernel writes a weight, so under PDL the read
    # overlaps that kernel's end (a4/kernels/pdl.py). For the narrow projections, whose programs are one or two tiles
    # of W each and all resident at once, that is all or half of the weight read. x, which that kernel writes, is
    # read after the wait.
    k = tl.arange(0, BLOCK_K)
    in_k = k < in_features
    w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
    wait_for_previous_kernel(PDL)
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, in_features, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        in_k = k < in_features
        acc0 += _row_dot(x_ptr, 0, stride_x, k, in_k, w)
        if ROWS > 1:
            acc1 += _row_dot(x_ptr, 1, stride_x, k, in_k, w)
        if ROWS > 2:
            acc2 += _row_dot(x_ptr, 2, stride_x, k, in_k, w)
        if ROWS > 3:
            acc3 += _row_dot(x_ptr, 3, stride_x, k, in_k, w)
        # The next tile (none past the last: its mask is all false, and nothing is read).
        k += BLOCK_K
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=in_n[:, None] & (k < in_features)[None, :],
                    other=0.0)  # fmt: skip
    tl.store(y_ptr + n, acc0.to(y_ptr.dtype.element_ty), mask=in_n)
    if ROWS > 1:
        tl.store(y_ptr + stride_y + n, acc1.to(y_ptr.dtype.element_ty), mask=in_n)
    if ROWS > 2:
        tl.store(y_ptr + 2 * stride_y + n, acc2.to(y_ptr.dtype.element_ty), mask=in_n)
    if ROWS > 3:
        tl.store(y_ptr + 3 * stride_y + n, acc3.to(y_ptr.dtype.element_ty), mask=in_n)


def gemv(x: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows in all) times weight [N, K] transposed: [..., N] in x's dtype.

    `tile`: (BLOCK_N, BLOCK_K, num_warps, num_stages); None: the weight shape's in TILES, else TILE."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    num_rows, in_features = rows.shape
    out_features = weight.shape[0]
    if num_rows > MAX_ROWS or weight.shape[1] != in_features or weight.stride(1) != 1:
        raise ValueError(
            f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} (strides {weight.stride()}) do not fit "
            f"x [<= {MAX_ROWS} rows, K], weight [N, K] with unit stride along K"
        )
    y = torch.empty(num_rows, out_features, dtype=x.dtype, device=x.device)
    if num_rows:
        block_n, block_k, num_warps, num_stages = tile or TILES.get((out_features, in_features), TILE)
        _gemv_kernel[(triton.cdiv(out_features, block_n),)](
            rows, weight, y,
            out_features, in_features,
            rows.stride(0), weight.stride(0), y.stride(0),
            ROWS=num_rows, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps, num_stages=num_stages,
            **pdl_launch(x.device, triton.cdiv(out_features, block_n), decode_only=True),
        )  # fmt: skip
    return y.view(*x.shape[:-1], out_features)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias, through `gemv` for at most MAX_ROWS rows on CUDA."""
    few_rows = x.numel() <= MAX_ROWS * x.shape[-1]
    if x.is_cuda and few_rows and weight.stride(1) == 1:
        return gemv(x, weight)
    return F.linear(x, weight)
