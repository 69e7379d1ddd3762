"""How close is close enough: the one closeness rule of the notebooks' checks and of the unit tests, and their inputs.

a4 and its reference compute the same values, but rarely in the same order: another CPU (or another
ATEN_CPU_CAPABILITY) runs kernels of another vector width, another thread count splits sums differently, a fused
kernel adds what a loop adds one by one, the chunked delta rule regroups the recurrence. Each order rounds
differently, so the comparisons allow a difference that follows from the dtype and from how many terms were summed
(`tolerance`), never a constant that happens to hold on one machine.

Where the two sides do the same operations on the same values (a copy, a cast, an elementwise formula in the same
order, the same kernel on the same shapes) the checks and tests ask for equality instead, and say why.
"""

from __future__ import annotations

import torch

from a4.course.checks import CheckFailed
from a4.dtypes import DTYPES
from a4.models.config import LINEAR_ATTENTION, ModelConfig

# On CPU, PyTorch sums in float32 for float32 and for bfloat16 inputs alike (matrix products, norms, softmax, SDPA).
ACCUMULATION_EPS = torch.finfo(torch.float32).eps
# bfloat16 results of the same formula computed in a slightly different order differ in about one value in 10^4;
# rounding to bfloat16 at a different step (before a multiplication transformers does in float32) changes many more.
MAX_BF16_ROUNDING_SHARE = 0.01


def tolerance(dtype: torch.dtype, reduction_length: int, roundings: int = 1) -> float:
    """The largest difference allowed between two computations of the same values, as a fraction of the largest
    magnitude of the reference (what `compare` measures).

    reduction_length: how many terms were summed on the way to each value, added up over the chain of sums (a layer:
    its projections, norms and attention; a recurrence: its tokens times the key dim). A sum of n float32 terms,
    in whatever order, is within about n * eps/2 of the exact sum, relative to the size of its terms (Higham,
    "Accuracy and Stability of Numerical Algorithms", section 4.2); two orders, within n * eps. The reference's
    largest magnitude stands for the size of the terms.

    roundings: how many times the values were rounded to `dtype` on the way (a bfloat16 layer rounds each
    projection's output, say) at a step where the two sides' float32 values may differ: each time, the two may
    land on neighbouring values, which differ by at most eps(dtype) of the largest one.
    """
    return reduction_length * ACCUMULATION_EPS + roundings * torch.finfo(dtype).eps


# bfloat16 roundings on the way through each kind of layer (see `tolerance`). Full attention: the projections,
# q_norm and k_norm, RoPE, the attention, its gate, o_proj. Gated DeltaNet: the projections, the conv, the
# recurrence's output, the gated norm (twice), out_proj. MLP: gate_up, the activation, down, and for MoE the
# routing weights and the weighted sum of the experts.
ATTENTION_ROUNDINGS = 6
GDN_ROUNDINGS = 6
MLP_ROUNDINGS = 5


def attention_reduction_length(config: ModelConfig, context: int) -> int:
    """The sums on the way through a full-attention layer: the projections (hidden), q_norm or k_norm and the scores
    (head_dim each), the softmax and the weighted values (the context), o_proj (every head's output)."""
    return config.hidden_size + 2 * config.head_dim + context + config.num_attention_heads * config.head_dim


def gdn_reduction_length(config: ModelConfig, context: int) -> int:
    """The sums on the way through a Gated DeltaNet layer: the projections (hidden), the conv (its kernel), the l2
    norms (dk), the recurrence (every token of the context adds into the state, each through a dk-long product),
    the gated norm (dv), out_proj (every value head's output)."""
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    out_proj = config.linear_num_value_heads * dv
    return config.hidden_size + config.linear_conv_kernel_dim + dk + context * dk + dv + out_proj


def mlp_reduction_length(config: ModelConfig) -> int:
    """The sums on the way through the MLP: gate_up (hidden), down (the intermediate size), and for MoE the top-k
    experts' weighted sum, the router's softmax over the experts and the shared expert (another hidden + its
    intermediate size)."""
    if not config.num_experts:
        return config.hidden_size + config.intermediate_size
    return (
        config.hidden_size + config.moe_intermediate_size + config.num_experts_per_tok + config.num_experts
        + config.hidden_size + config.shared_expert_intermediate_size
    )  # fmt: skip


def model_reduction_length(config: ModelConfig, context: int) -> int:
    """The sums from the embeddings to the logits of a model, for `context` tokens: every layer's two norms, its
    mixer and its MLP (an error made in one layer reaches the logits through the residual stream), the final norm
    and lm_head."""
    norms = 2 * config.hidden_size
    layers = sum(
        norms
        + mlp_reduction_length(config)
        + (gdn_reduction_length if kind == LINEAR_ATTENTION else attention_reduction_length)(config, context)
        for kind in config.layer_types
    )
    return layers + 2 * config.hidden_size


def shape_problems(what: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> list[str]:
    if tuple(tensor.shape) == tuple(shape):
        return []
    return [f"{what}: shape {tuple(tensor.shape)}, expected {tuple(shape)}"]


def compare(what: str, ours: torch.Tensor, expected: torch.Tensor, allowed: float) -> list[str]:
    """[] when `ours` has the reference's shape and max |ours - expected| <= allowed x max |expected| (`allowed`
    from `tolerance`), else one problem. The error is measured against the largest value, not value by value: a
    value near zero is the difference of larger terms, and carries their rounding errors, not its own."""
    if wrong_shape := shape_problems(what, ours, expected.shape):
        return wrong_shape
    scale = expected.double().abs().max().item()
    error = (ours.double() - expected.double()).abs().max().item()
    if not error <= allowed * scale:  # also catches NaN
        return [f"{what}: max error {error:.3g} against values up to {scale:.3g} (allowed: {allowed:.3g} of that)"]
    return []


def compare_dtype(
    what: str, ours: torch.Tensor, expected: torch.Tensor, allowed: float, elementwise: bool = False
) -> list[str]:
    """compare(), and `ours` in the reference's dtype.

    elementwise: the result of a formula applied value by value (a norm, a rotation, a conv), where in bfloat16 the
    share of values rounded differently from the reference's also shows whether the casts happen at the same steps.
    """
    problems = compare(what, ours, expected, allowed)
    if ours.dtype != expected.dtype:
        problems.append(f"{what}: dtype {ours.dtype}, expected {expected.dtype} (the input's)")
    elif elementwise and not problems and expected.dtype == torch.bfloat16:
        share = (ours != expected).float().mean().item()
        if share > MAX_BF16_ROUNDING_SHARE:
            problems.append(
                f"{what}: {share:.1%} of the bfloat16 values differ from transformers' (a different order of casts "
                f"rounds differently; allowed: {MAX_BF16_ROUNDING_SHARE:.0%})"
            )
    return problems


def assert_close(ours: torch.Tensor, expected: torch.Tensor, allowed: float, what: str = "output") -> None:
    """compare() for the unit tests: raises CheckFailed (an AssertionError) with the problem."""
    if problems := compare(what, ours, expected, allowed):
        raise CheckFailed(problems[0])


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, d in DTYPES.items() if d == dtype)


def rms_normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x̂ = x / sqrt(mean(x²) + eps) over the last dim, in float32: what a norm's usual mistakes are tested with."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Standard normal values of a fixed seed (drawn in float32, then cast)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def random_tokens(n: int, seed: int, vocab: int = 1024) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
