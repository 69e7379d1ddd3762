"""A Triton kernel for the greedy sampler's two reads of the logits in one: each row's argmax and whether the row is
finite (the sampler's `_rows_finite`, which decides that a request gets an error instead of a token).

Why a kernel of our own: torch reads the float32 logits twice for this, once for `aminmax` (the finiteness) and once
for `argmax`, two launches outside the captured decode step. At batch 128 the 0.8B's logits are 127 MB, and each
pass took 0.051 ms of a 3.55 ms step on an H200 (solutions/REPORT.md §5); here one pass reads them once.

A row of 248,320 logits is too long for one program at batch 1 (one SM would read 1 MB), so each row is cut into
CHUNK-wide pieces: the first kernel gives each piece its maximum, the first index where it occurs and whether the
piece is finite; the second reduces a row's pieces in order. Ties go to the lower index, as torch's argmax gives the
first maximal value, so the tokens are exactly torch's on every finite row (on a row that is not finite the
sampler reports an error and the token is not used).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from a4.kernels.pdl import pdl_launch, wait_for_previous_kernel

# Logits per program of the first pass: 248,320 / 8,192 = 31 pieces a row (at batch 1, 31 programs).
CHUNK = 8192
# Pieces a program of the second pass reduces at once (a row longer than CHUNK * PIECES loops).
PIECES = 64


@triton.jit
def _chunk_argmax_kernel(
    logits_ptr, max_ptr, index_ptr, finite_ptr, vocab, stride_row, num_chunks, CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    in_row = cols < vocab
    x = tl.load(logits_ptr + row * stride_row + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    # |x| < inf is false for NaN and for either infinity (padding is -inf but is not counted).
    bad = tl.sum((in_row & ~(tl.abs(x) < float("inf"))).to(tl.int32), axis=0)
    best, where = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    out = row * num_chunks + chunk
    tl.store(max_ptr + out, best)
    tl.store(index_ptr + out, chunk * CHUNK + where)
    tl.store(finite_ptr + out, bad == 0)


@triton.jit
def _row_argmax_kernel(
    max_ptr, index_ptr, finite_ptr, tokens_ptr, row_finite_ptr, num_chunks, PIECES: tl.constexpr, PDL: tl.constexpr
):
    wait_for_previous_kernel(PDL)
    row = tl.program_id(0)
    best = tl.full((), float("-inf"), tl.float32)
    token = tl.zeros((), tl.int32)
    finite = tl.full((), 1, tl.int32)
    for start in range(0, num_chunks, PIECES):
        pieces = start + tl.arange(0, PIECES)
        in_row = pieces < num_chunks
        values = tl.load(max_ptr + row * num_chunks + pieces, mask=in_row, other=float("-inf"))
        piece_best, piece = tl.max(values, axis=0, return_indices=True, return_indices_tie_break_left=True)
        index = tl.load(index_ptr + row * num_chunks + start + piece)
        # Strictly greater: a tie keeps the earlier pieces, whose indices are lower. (A finite row's maximum is
        # above -inf, so its first pieces are always taken.)
        take = piece_best > best
        best = tl.where(take, piece_best, best)
        token = tl.where(take, index, token)
        pieces_finite = tl.load(finite_ptr + row * num_chunks + pieces, mask=in_row, other=1)
        finite = finite & tl.min(pieces_finite, axis=0).to(tl.int32)
    tl.store(tokens_ptr + row, token.to(tl.int64))
    tl.store(row_finite_ptr + row, finite != 0)


def argmax_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For logits [N, vocab]: (argmax [N] int64, whether each row is finite [N] bool), from one read of the logits.

    On a finite row the argmax is torch's (the first maximal value); on a row that is not, it is some index."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"argmax_and_finite: logits {tuple(logits.shape)} should be [N, vocab] with unit stride")
    rows, vocab = logits.shape
    num_chunks = triton.cdiv(vocab, CHUNK)
    maxima = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    indices = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    chunk_finite = torch.empty(rows, num_chunks, dtype=torch.int8, device=logits.device)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    finite = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows:
        _chunk_argmax_kernel[(rows, num_chunks)](
            logits, maxima, indices, chunk_finite, vocab, logits.stride(0), num_chunks, CHUNK=CHUNK, num_warps=8,
            **pdl_launch(logits.device, rows * num_chunks),
        )
        _row_argmax_kernel[(rows,)](
            maxima, indices, chunk_finite, tokens, finite, num_chunks, PIECES=PIECES, **pdl_launch(logits.device, rows)
        )
    return tokens, finite
