"""Where the decode kernels' tiles come from: a sweep of the GEMV's tiles (a4/kernels/gemv.py, `TILES`) and of the GDN
conv's programs (a4/kernels/gdn_decode.py, `CONV_BLOCK_D`), for solutions/REPORT.md §5. Its figures of an H100 are
`gemv_sweep` and `conv_sweep` in solutions/report/h100_decode_kernels.json, and `choose_tiles` of them is TILES.

Not a part of `python -m a4 bench gpu`: a one-off probe, run from the repository root on a machine with a GPU:

    A4_SOLUTIONS=1 PYTHONPATH=. python solutions/report/kernel_sweep.py OUT_DIR

- The GEMV: every decode shape of the 0.8B and the 35B-A3B (the bias-free linear layers and merged projections that
  `use_gemv` routes, read off the models built on the meta device), at 1 and 4 rows, through cuBLAS, the kernel at
  TILE, the kernel at each of 71 tiles, and a split-K variant defined here (partial sums per K range into a float32
  buffer, then a second kernel adds them in order: more programs for the narrow outputs, at the price of a launch).
- The conv: `conv_update_by_slot_` over every GDN layer's own pool at batch 1 / 32 / 128 for eight (channels, warps)
  pairs, each checked against the first for the same bits.

Every time is the GPU's alone, µs per call, within a CUDA graph that calls the kernel once per copy of its weight (or
once per layer's pool), so that each call reads its operands from HBM as a decode step's layers do (the H100's and
H200's L2 would otherwise hold a small weight between calls). Writes OUT_DIR/gemv_sweep.json and conv_sweep.json.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import nn

import a4.kernels.gdn_decode as gdn_decode
from a4.checkpoints import make_checkpoint
from a4.kernels.gemv import TILE, gemv
from a4.layers.merged_linear import MergedLinear, merge_projections
from a4.models.config import load_model_config
from a4.models.registry import model_class

DTYPE = torch.bfloat16
HBM_BYTES_PER_S = 4.8e12  # the H200's; the floor column is the weight's bytes at this rate
ROTATE_BYTES = 512 << 20  # weight copies per shape: enough to leave nothing of the last call in L2
GEMV_TILES = [
    (rows_of_w, block_k, warps, stages)
    for rows_of_w, block_k, (warps, stages) in itertools.product(
        (1, 2, 4, 8, 16), (256, 512, 1024, 2048), ((4, 3), (8, 3), (4, 2), (2, 3))
    )
    if rows_of_w * block_k <= 16384 and not (rows_of_w * block_k >= 8192 and warps == 2)
]
# (splits, BLOCK_N, BLOCK_K, warps, stages)
SPLIT_K = [(s, *tile) for s in (2, 4, 8) for tile in ((4, 512, 4, 3), (8, 256, 4, 3), (2, 1024, 4, 3), (4, 256, 2, 2))]
CONV_VARIANTS = [(256, 1), (128, 1), (256, 2), (512, 2), (512, 4), (1024, 4), (1024, 8), (2048, 8)]


def decode_shapes() -> dict[tuple[int, int], list[str]]:
    """(out_features, in_features) of every projection `use_gemv` routes: the presets that have it, how often."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for arch, preset in (("qwen3_5", "0.8b"), ("qwen3_5_moe", "35b-a3b")):
        config = load_model_config(make_checkpoint(None, arch, preset=preset, weights=False))
        with torch.device("meta"):
            model = model_class(config.architecture)(config)
        merge_projections(model)
        counts = Counter(
            tuple(module.weight.shape)
            for module in model.modules()
            if (type(module) is nn.Linear and module.bias is None) or isinstance(module, MergedLinear)
        )
        for shape, count in counts.items():
            shapes.setdefault(shape, []).append(f"{preset} x{count}")
    return shapes


@triton.jit
def _split_k_partial_kernel(x_ptr, w_ptr, partial_ptr, out_features, in_features, k_per_split, stride_x, stride_w,
                            ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    # Program (block of outputs, split): every row's dot products over the split's K range, each tile of W read once
    # for all rows, into partial[split, row, n].
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    r = tl.arange(0, ROWS)
    in_n = n < out_features
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for start in range(0, k_per_split, BLOCK_K):
        offset = start + tl.arange(0, BLOCK_K)
        k = split * k_per_split + offset
        in_k = (k < in_features) & (offset < k_per_split)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=in_n[:, None] & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + r[:, None] * stride_x + k[None, :], mask=in_k[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    tl.store(partial_ptr + (split * ROWS + r[:, None]) * out_features + n[None, :], acc, mask=in_n[None, :])


@triton.jit
def _split_k_sum_kernel(partial_ptr, y_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(partial_ptr + s * total + i, mask=mask, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=mask)


def split_k_gemv(x, weight, splits, block_n, block_k, warps, stages):
    rows, in_features = x.shape  # 1 or 4: a power of two, as tl.arange needs
    out_features = weight.shape[0]
    partial = torch.empty(splits, rows, out_features, dtype=torch.float32, device=x.device)
    y = torch.empty(rows, out_features, dtype=x.dtype, device=x.device)
    k_per_split = triton.cdiv(triton.cdiv(in_features, splits), block_k) * block_k
    _split_k_partial_kernel[(triton.cdiv(out_features, block_n), splits)](
        x, weight, partial, out_features, in_features, k_per_split, x.stride(0), weight.stride(0),
        ROWS=rows, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _split_k_sum_kernel[(triton.cdiv(rows * out_features, 1024),)](partial, y, rows * out_features, SPLITS=splits,
                                                                     BLOCK=1024)  # fmt: skip
    return y


def graph_us(calls) -> float:
    """Median µs per call of `calls` (a list of no-argument functions) captured in one CUDA graph, replayed 3 times."""
    for call in calls[:2]:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def sweep_gemv() -> list[dict]:
    results = []
    for (out_features, in_features), where in sorted(decode_shapes().items(), key=lambda item: item[0][0] * item[0][1]):
        nbytes = out_features * in_features * 2
        weights = [torch.randn(out_features, in_features, dtype=DTYPE, device="cuda")
                   for _ in range(max(4, min(64, ROTATE_BYTES // nbytes)))]  # fmt: skip
        for rows in (1, 4):
            x = torch.randn(rows, in_features, dtype=DTYPE, device="cuda")
            reference = x.double() @ weights[0].double().T

            def timed(product):
                return graph_us([lambda w=w: product(x, w) for w in weights])

            row = {"n": out_features, "k": in_features, "rows": rows, "where": where,
                   "floor_us": nbytes / HBM_BYTES_PER_S * 1e6, "cublas_us": timed(F.linear),
                   "current_us": timed(gemv), "tiles": {}}  # fmt: skip
            for tile in GEMV_TILES:
                row["tiles"]["x".join(map(str, tile))] = timed(lambda x, w, tile=tile: gemv(x, w, tile))
            best = min(row["tiles"], key=row["tiles"].get)
            row["best_us"], row["best_tile"] = row["tiles"][best], [int(v) for v in best.split("x")]
            row["best_err"] = (gemv(x, weights[0], tuple(row["best_tile"])).double() - reference).abs().max().item()
            split_times = {cfg: timed(lambda x, w, cfg=cfg: split_k_gemv(x, w, *cfg)) for cfg in SPLIT_K}
            best_split = min(split_times, key=split_times.get)
            row["split_us"], row["split_cfg"] = split_times[best_split], list(best_split)
            results.append(row)
            print(f"{out_features:>6} x {in_features:<5} {rows} row(s): floor {row['floor_us']:7.2f}  cuBLAS "
                  f"{row['cublas_us']:7.2f}  TILE {row['current_us']:7.2f}  best {row['best_us']:7.2f} {best}  "
                  f"split-K {row['split_us']:7.2f}  ({', '.join(where)})", flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    return results


def sweep_conv() -> list[dict]:
    results = []
    for dim, layers, preset in ((6144, 18, "0.8b"), (8192, 30, "35b-a3b")):
        for batch in (1, 32, 128):
            first = None
            for variant in CONV_VARIANTS:
                gdn_decode.CONV_BLOCK_D, gdn_decode.CONV_WARPS = variant
                generator = torch.Generator(device="cuda").manual_seed(0)
                pools = [torch.randn(256, dim, 3, dtype=DTYPE, device="cuda", generator=generator)
                         for _ in range(layers)]  # fmt: skip
                weights = [torch.randn(dim, 1, 4, dtype=DTYPE, device="cuda", generator=generator)
                           for _ in range(layers)]  # fmt: skip
                x = torch.randn(batch, dim, dtype=DTYPE, device="cuda", generator=generator)
                slots = torch.randperm(256, device="cuda", generator=generator)[:batch]
                outputs = [gdn_decode.conv_update_by_slot_(x, w, pool, slots) for pool, w in zip(pools, weights)]
                bits = [*outputs, *pools]  # one step from the same start: every variant must leave the same
                if first is None:
                    first = bits
                same = all(torch.equal(a, b) for a, b in zip(bits, first))
                us = graph_us([lambda p=p, w=w: gdn_decode.conv_update_by_slot_(x, w, p, slots)
                               for p, w in zip(pools, weights)])  # fmt: skip
                results.append({"preset": preset, "dim": dim, "batch": batch, "variant": list(variant), "us": us,
                                "same_bits": same})  # fmt: skip
                print(f"conv {preset} b{batch} {variant}: {us:.2f} us{'' if same else ' (other bits!)'}", flush=True)
    return results


def choose_tiles(results: list[dict]) -> dict[tuple[int, int], tuple[int, ...]]:
    """gemv.TILES from a GEMV sweep: per shape, the tile with the least time at 1 row plus a quarter of its time at 4
    (decode at batch 1 first, then a k = 3 verify step), where that beats TILE's by 3% or more."""
    by_shape: dict[tuple[int, int], dict[int, dict[str, float]]] = {}
    for row in results:
        by_shape.setdefault((row["n"], row["k"]), {})[row["rows"]] = row["tiles"]
    current = "x".join(map(str, TILE))
    chosen = {}
    for shape, times in by_shape.items():
        score = {tile: times[1][tile] + times[4][tile] / 4 for tile in times[1]}
        best = min(score, key=score.get)
        if score[best] <= 0.97 * score[current]:
            chosen[shape] = tuple(int(v) for v in best.split("x"))
    return chosen


def main(out_dir: str) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conv_default = gdn_decode.CONV_BLOCK_D, gdn_decode.CONV_WARPS
    try:
        (out / "conv_sweep.json").write_text(json.dumps(sweep_conv(), indent=1) + "\n")
    finally:
        gdn_decode.CONV_BLOCK_D, gdn_decode.CONV_WARPS = conv_default
    results = sweep_gemv()
    (out / "gemv_sweep.json").write_text(json.dumps({"tile_now": TILE, "results": results}, indent=1) + "\n")
    print("TILES:", choose_tiles(results))


if __name__ == "__main__":
    main(sys.argv[1])
