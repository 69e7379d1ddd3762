"""Triton kernels for the router and routed experts of a mixture-of-experts layer (Qwen3.5-35B-A3B), no host sync.

Why kernels of our own: the students' `FusedExperts` (notebook 09) runs each active expert as its own pair of
matrix products, and learns which experts are active, and how many tokens each has, on the host
(`group_by_expert`'s `.tolist()`). A CUDA graph cannot record a step that asks the host, and on a GPU the loop costs
two launches per active expert and layer (at batch 32 of 35B-A3B, ~150 experts x 40 layers). Here the whole
layer's experts are two launches, whatever the routing:
- the token-expert pairs are sorted by expert on the device (`expert_runs`; counts by `scatter_add_`, not
  `torch.bincount`, which reads its largest value on the host), giving each active expert a run of pairs;
- `_expert_matmul_kernel`, launched twice: one program per (run, block of BLOCK_N output features) multiplies the
  run's tokens by its expert's gate and up rows and writes silu(gate) * up for each pair; then the same over
  down_proj, each pair's row scaled by its routing weight;
- the k rows of each token are summed (float32) and cast to x's dtype.
There are min(T * k, E) runs whatever the routing (those past the active experts are empty), so every grid and
buffer size follows from the shapes alone and a step captures; and a decode step of one token launches programs for
its 8 experts, not for all 256. Where the pairs are few next to the experts (`pairs_as_runs`), each pair is a run
of its own and nothing is sorted: the sort's ~20 small kernels per layer cost a decode step more than the rare
expert that two pairs share costs read twice (on an H200, 35B-A3B's batch-1 step ran 2,591 kernels with the sort).
Each program reads its expert's weight block once per BLOCK_M of its pairs: at decode sizes (a few pairs per expert)
the active experts' weights are read once, the floor of the step. After vLLM's and SGLang's `fused_moe`, which sort
the pairs the same way (theirs pads each expert's run to the block size; here a program walks its run instead).

The arithmetic is the module's, in float32 accumulators: gate and up, silu(gate) * up rounded to x's dtype (the
down projection's input, as in the module), the down projection times the routing weight, then the sum over the k
experts. The module sums into x's dtype expert after expert; here the sum is in float32 and rounded once, so
bfloat16 results agree to bfloat16 rounding and float32 ones to float32 rounding.

The router is one launch too (`fused_route`, `_route_kernel`): the students' `route` is a softmax, a top-k, a sum and a
division with their casts, ~7 launches per layer for a few hundred bytes of work.

`use_fused_experts(model)` (a4/layers/fused.py) routes a model's `FusedExperts` modules through `fused_experts` and its
`SparseMoeBlock`s' routers through `fused_route` (the engine does it where a4's Triton kernels run,
`a4.models.registry.fuse_for_device`); each module keeps its weights and only its forward changes, as with the fused
norms.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Pairs a program multiplies at once (the rows of its tl.dot, whose smallest is 16), by the mean run per expert.
SMALL_BLOCK_M, LARGE_BLOCK_M = 16, 64
# Output features per program: small, so that a decode step's few active experts still spread over the GPU's SMs.
GATE_UP_BLOCK_N, DOWN_BLOCK_N, BLOCK_K = 16, 32, 128


@triton.jit
def _run_bounds(run, run_experts_ptr, run_starts_ptr, run_counts_ptr, PAIR_RUNS: tl.constexpr):
    """(expert, index of its first pair, pair count) of run `run`. Runs past the last active expert have count 0:
    their programs skip the loop and write nothing. With PAIR_RUNS, run r is pair r alone (run_experts_ptr then
    holds each pair's expert): nothing was sorted."""
    # One return after the branch: Triton compiles a function with a single return statement.
    if PAIR_RUNS:
        start = run
        count = 1
    else:
        start = tl.load(run_starts_ptr + run)
        count = tl.load(run_counts_ptr + run)
    return tl.load(run_experts_ptr + run), start, count


@triton.jit
def _run_pairs(pairs_ptr, start, m, in_m, PAIR_RUNS: tl.constexpr):
    """The pair ids at positions start + m of the sorted pairs (m masked by in_m)."""
    if PAIR_RUNS:
        pairs = start + m
    else:
        pairs = tl.load(pairs_ptr + start + m, mask=in_m, other=0)
    return pairs


@triton.jit
def _expert_matmul_kernel(
    x_ptr, w_ptr, pairs_ptr, run_experts_ptr, run_starts_ptr, run_counts_ptr, pair_weights_ptr, y_ptr,
    pairs_per_row, out_features, in_features,
    stride_x, stride_we, stride_wn, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    PAIR_RUNS: tl.constexpr, GATE_UP: tl.constexpr,
):  # fmt: skip
    """Program (run, block of BLOCK_N output features): y[pair] for each pair of the run, from x row
    pair // pairs_per_row and the run's expert's rows of W. GATE_UP: W is gate_up_proj (its rows [0, I) the gate,
    [I, 2I) the up projection; out_features = I) and y = silu(gate) * up; otherwise W is down_proj and y is the
    product times the pair's routing weight."""
    run = tl.program_id(0)
    expert, start, count = _run_bounds(run, run_experts_ptr, run_starts_ptr, run_counts_ptr, PAIR_RUNS)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = n < out_features
    w_expert = w_ptr + expert.to(tl.int64) * stride_we
    for m0 in range(0, count, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        in_m = m < count
        pairs = _run_pairs(pairs_ptr, start, m, in_m, PAIR_RUNS)
        rows = pairs // pairs_per_row
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if GATE_UP:
            up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            in_k = k < in_features
            x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=in_m[:, None] & in_k[None, :], other=0.0)
            w_mask = in_n[:, None] & in_k[None, :]
            w = tl.load(w_expert + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
            if GATE_UP:
                w_up = tl.load(w_expert + (n + out_features)[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
                up = tl.dot(x, tl.trans(w_up), up, input_precision=PRECISION)
        if GATE_UP:
            y = acc * tl.sigmoid(acc) * up
        else:
            y = acc * tl.load(pair_weights_ptr + pairs, mask=in_m, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptr + pairs[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=in_m[:, None] & in_n[None, :])  # fmt: skip


@triton.jit
def _route_kernel(
    logits_ptr, weights_ptr, experts_ptr,
    num_experts, stride_logits,
    TOP_K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Program t: token t's softmax over the experts in float32, its TOP_K most probable experts (most probable
    first) and their probabilities, renormalised to sum to one when NORMALIZE."""
    token = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_logits + e, mask=e < num_experts, other=float("-inf"))
    logits = logits.to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    # The padding past the E experts is never chosen, not even over an expert whose probability underflowed to 0.
    probs = tl.where(e < num_experts, probs / tl.sum(probs, axis=0), -1.0)
    slot = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.int64)
    chosen_probs = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # top-k as k rounds of argmax, each taking its expert out of the running.
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, axis=0)
        chosen = tl.where(slot == j, best, chosen)
        chosen_probs = tl.where(slot == j, tl.max(probs, axis=0), chosen_probs)
        probs = tl.where(e == best, -1.0, probs)
    if NORMALIZE:
        chosen_probs = chosen_probs / tl.sum(chosen_probs, axis=0)
    in_k = slot < TOP_K
    tl.store(weights_ptr + token * TOP_K + slot, chosen_probs.to(weights_ptr.dtype.element_ty), mask=in_k)
    tl.store(experts_ptr + token * TOP_K + slot, chosen, mask=in_k)


class ExpertRuns(NamedTuple):
    """The token-expert pairs sorted by expert, as runs: run r is expert `experts[r]`'s `counts[r]` pairs from
    `pairs[starts[r]]` on. There are min(T * k, E) runs, a bound known from the shapes; the runs past the active
    experts have count 0. All int32, on the device."""

    pairs: torch.Tensor  # [T * k] pair ids (pair p: token p // k, its (p % k)-th choice), sorted by expert
    experts: torch.Tensor  # [runs] the active experts in increasing order, then zeros
    starts: torch.Tensor  # [runs]
    counts: torch.Tensor  # [runs]


def expert_runs(expert_ids: torch.Tensor, num_experts: int) -> ExpertRuns:
    """What `group_by_expert` (notebook 09) computes, kept on the device: its lists of active experts and their
    counts become tensors padded to a size that the shapes fix, so that a CUDA graph can record it."""
    flat = expert_ids.reshape(-1)
    num_runs = min(flat.numel(), num_experts)
    pairs = torch.sort(flat, stable=True).indices
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = counts.cumsum(0) - counts
    # Expert e is the run numbered by the active experts before it; the inactive ones go to a spare slot, cut off.
    active = counts > 0
    run = torch.where(active, active.cumsum(0) - 1, num_runs)

    def by_run(values: torch.Tensor) -> torch.Tensor:
        runs = torch.zeros(num_runs + 1, dtype=torch.int64, device=flat.device).scatter_(0, run, values)
        return runs[:num_runs].to(torch.int32)

    experts = torch.arange(num_experts, device=flat.device)
    return ExpertRuns(pairs.to(torch.int32), by_run(experts), by_run(starts), by_run(counts * active))


def pairs_as_runs(num_pairs: int, num_experts: int) -> bool:
    """Whether each pair should run alone, unsorted: when the pairs are few next to the experts (at most E / 4:
    35B-A3B's decode up to batch 8), two pairs rarely share an expert, so skipping the sort (~20 small kernels per
    layer, a decode step's launches being its cost) saves more than the few expert blocks read twice cost."""
    return 4 * num_pairs <= num_experts


def fused_experts(
    x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """`FusedExperts.forward` in two kernel launches: x [T, H], gate_up_proj [E, 2I, H], down_proj [E, H, I],
    expert_ids and weights [T, k] (a `Routing`) -> [T, H] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, intermediate = down_proj.shape[0], down_proj.shape[2]
    top_k = expert_ids.shape[-1]
    if gate_up_proj.shape != (num_experts, 2 * intermediate, hidden) or down_proj.shape[1] != hidden:
        raise ValueError(
            f"fused_experts: gate_up_proj {tuple(gate_up_proj.shape)} and down_proj {tuple(down_proj.shape)} do not "
            f"fit x {tuple(x.shape)} ([E, 2I, H] and [E, H, I])"
        )
    x = x.contiguous()
    num_pairs = num_tokens * top_k
    pair_runs = pairs_as_runs(num_pairs, num_experts)
    if pair_runs:
        pairs = experts = starts = counts = expert_ids.reshape(-1)  # run p is pair p: only its expert is read
    else:
        pairs, experts, starts, counts = expert_runs(expert_ids, num_experts)
    grid_runs = experts.numel()
    block_m = SMALL_BLOCK_M if num_pairs <= SMALL_BLOCK_M * num_experts else LARGE_BLOCK_M
    # tl.dot takes float32 operands as TF32 unless told otherwise: float32 must stay float32.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(num_pairs, intermediate, dtype=x.dtype, device=x.device)
    y = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    pair_weights = weights.reshape(-1)
    # h = silu(gate) * up of each pair, from its token's row of x; then y = down(h) * weight, from the pair's h row.
    for inputs, weight, outputs, pairs_per_row, block_n, gate_up in (
        (x, gate_up_proj, h, top_k, GATE_UP_BLOCK_N, True),
        (h, down_proj, y, 1, DOWN_BLOCK_N, False),
    ):
        out_features, in_features = outputs.shape[1], inputs.shape[1]
        _expert_matmul_kernel[(grid_runs, triton.cdiv(out_features, block_n))](
            inputs, weight, pairs, experts, starts, counts, pair_weights, outputs,
            pairs_per_row, out_features, in_features,
            inputs.stride(0), weight.stride(0), weight.stride(1), outputs.stride(0),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, PRECISION=precision, PAIR_RUNS=pair_runs,
            GATE_UP=gate_up,
        )  # fmt: skip
    return y.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)


def fused_route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The students' `route` (notebook 09) in one launch: router_logits [T, E] -> (weights [T, k] in the logits'
    dtype, expert ids [T, k] int64), the most probable first; softmax and renormalisation in float32."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"fused_route: top_k {top_k} must be in 1..{num_experts}, the number of experts")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        _route_kernel[(num_tokens,)](
            logits, weights, experts,
            num_experts, logits.stride(0),
            TOP_K=top_k, NORMALIZE=normalize, BLOCK_E=triton.next_power_of_2(num_experts),
            BLOCK_K=triton.next_power_of_2(top_k),
        )  # fmt: skip
    return weights, experts
