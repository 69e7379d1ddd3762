"""GPU prefill of a Gated DeltaNet layer over a varlen batch, through flash-linear-attention (fla).

The prefill of a GDN layer is two scans over each request's tokens, both started from the state in the request's
pool row and ending in the state that the backend (a4.layers.gdn_backend) writes back there: the causal depthwise
conv (state: the last K-1 inputs) and the chunked gated delta rule (state: S [Hv, dk, dv] float32). a4's torch
versions (notebook 04) loop over requests and chunk groups in Python, which is fine on a CPU and launch-bound on a
GPU. fla 0.6 has both as Triton kernels over a flattened varlen batch (`cu_seqlens`, flash-attention's convention,
a4's too), with per-sequence initial and final states:
- `fla.ops.gated_delta_rule.chunk_gated_delta_rule`: the WY/UT chunked form of notebook 04 (chunks of 64), one
  launch per stage for the whole batch; l2-norm of q and k in the kernel (x * rsqrt(sum(x^2) + 1e-6), the layer's),
  scale dk^-0.5, grouped value heads (value head h reads key head h // (Hv / Hk), as a4), states float32;
- `fla.modules.convolution.causal_conv1d` (activation silu): its states are [N, D, K] of which the last K-1
  columns are the stored inputs, so the pool's [D, K-1] rows get a zero column in front going in and lose it coming
  out (small copies: the conv state is K-1 tokens).
We use them rather than kernels of our own: the chunked rule is the hard kernel of the model (a triangular solve
per chunk, tensor-core products, a sequential pass over chunk states), fla's is the one transformers and SGLang run
for Qwen3.5 and is tested upstream, and the course's teaching value is in notebook 04's torch version of the same
algorithm, not in re-deriving a tuned Triton implementation. The decode step, a few lines of arithmetic per state
element, is where an a4 kernel pays for itself (`a4.kernels.gdn_decode`).

fla is an optional GPU extra (`a4[gpu]`) and never installed in the CPU test environment (transformers would switch
its reference GDN path to it): it is imported lazily, and `fla_available()` says whether it can be used.
Precision: fla runs the rule in its inputs' dtype with float32 states and accumulation, so bfloat16 models get
bfloat16-level agreement. fla syncs with the host to plan the chunks of a varlen batch, not for a batch of one
sequence: the prefill of one request is what the engine captures in CUDA graphs (a4/engine/graph_runner.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def fla_available() -> bool:
    """Whether flash-linear-attention's kernels can be imported (the package, Triton and a GPU build of torch)."""
    try:
        import fla.modules.convolution  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing package or one that fails to load (no Triton, no GPU) alike
        return False
    return True


def _varlen(cu_seqlens: torch.Tensor) -> torch.Tensor | None:
    """cu_seqlens for fla, or None for a batch of one sequence: fla's varlen path plans its chunks on the host in
    every call (about 1 ms of CPU per layer on an H200's host, more than the kernels), its batch path does not."""
    return None if len(cu_seqlens) == 2 else cu_seqlens


def causal_conv1d_prefill(
    x: torch.Tensor, weight: torch.Tensor, initial: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv + silu over a varlen batch, each sequence from its own conv state.

    x [T, D] (model dtype, sequence i's tokens cu_seqlens[i] .. cu_seqlens[i+1]-1); weight [D, 1, K]; initial
    [N, D, K-1], each sequence's last K-1 inputs before x (zeros for a request that starts here); cu_seqlens [N+1]
    int64 on the device. Returns (y [T, D] in x's dtype, final [N, D, K-1]: each sequence's last K-1 inputs, with
    its old state in front when the sequence is shorter than K-1), as `a4.layers.deltanet.causal_conv1d_prefill`.
    """
    from fla.modules.convolution import causal_conv1d

    y, final = causal_conv1d(
        x[None],
        weight[:, 0, :],
        initial_state=F.pad(initial, (1, 0)),  # fla's state has K columns; the first is never read
        output_final_state=True,
        activation="silu",
        cu_seqlens=_varlen(cu_seqlens),
    )
    return y[0], final[:, :, 1:].to(initial.dtype)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    initial: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a varlen batch (prefill), each sequence from its own state.

    q, k [T, Hk, dk] and v [T, Hv, dv]: the conv output split, NOT yet l2-normalised or scaled (model dtype); a, b
    [T, Hv]: in_proj_a / in_proj_b outputs; A_log, dt_bias [Hv]; initial [N, Hv, dk, dv] float32; cu_seqlens [N+1]
    int64 on the device. Returns (o [T, Hv, dv] in q's dtype, final [N, Hv, dk, dv] float32). Same arithmetic as
    the prefill of `GatedDeltaNet.forward` (beta = sigmoid(b) in b's dtype; g = -exp(A_log) * softplus(a + dt_bias)
    in float32, by fla's kernel that also sums it over each chunk: in torch it was six launches per layer).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    o, final = fla_chunk_gated_delta_rule(
        q[None],
        k[None],
        v[None],
        g=a[None],
        beta=b.sigmoid()[None],
        scale=q.shape[-1] ** -0.5,
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=_varlen(cu_seqlens),
    )
    return o[0], final.to(initial.dtype)
