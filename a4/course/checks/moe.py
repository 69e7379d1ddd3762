"""Checks of notebook 09: the mixture-of-experts MLP of Qwen3.5-MoE, against transformers' own modules.

Ground truths:
- the layer: transformers' `Qwen3_5MoeSparseMoeBlock`, `Qwen3_5MoeTopKRouter` and `Qwen3_5MoeExperts` ("eager"
  experts: its plain PyTorch loop), given the same random weights and inputs. Qwen3.5-MoE's router always
  renormalises; for `norm_topk_prob=False` the reference is Qwen3-MoE's router, the same arithmetic with that flag;
- efficiency: what the experts' forward asks of torch, recorded by `TorchOpRecorder` (a TorchFunctionMode that sees
  every torch call): how many matrix products, how many calls in all, and the largest tensor made;
- the weights and the engine: the checks of notebooks 02 and 05, run on the tiny MoE checkpoint (transformers'
  parameters and greedy tokens).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from a4.course.checks import CheckFailed, conclude
from a4.course.checks._earlier import after_notebooks
from a4.course.checks._harness import MLP_ROUNDINGS, compare_dtype, dtype_name, mlp_reduction_length, tolerance
from a4.course.checks.state_pool import check_decode_chunked, check_decode_single, check_decode_varlen
from a4.course.checks.weights import check_weight_loading, check_weight_skipped
from a4.models.config import FULL_ATTENTION, ModelConfig

__all__ = [
    "check_decode_chunked",  # notebook 05's engine checks hold for the MoE model as they are
    "check_decode_single",
    "check_decode_varlen",
    "check_moe_efficiency",
    "check_moe_layer",
    "check_moe_weights",
]


# ---------------------------------------------------------------------------------------------------------- weights


@after_notebooks("01", "02")
def check_moe_weights(model_dir: str | Path, label: str = "tiny MoE checkpoint") -> None:
    """The MoE checkpoint through a4's loader: every parameter equal to transformers', vision and MTP skipped.

    Notebook 02's checks, on a checkpoint whose main layers store their experts fused and whose MTP layer stores
    them one by one.
    """
    check_weight_loading(model_dir, label)
    check_weight_skipped(model_dir, label)


# --------------------------------------------------------------------------------------------------------- the layer


@dataclasses.dataclass(frozen=True)
class MoeShape:
    """The shape of one MoE layer under test, and of the batch fed to it."""

    num_experts: int
    top_k: int
    hidden: int
    intermediate: int
    shared_intermediate: int
    tokens: int
    norm_topk_prob: bool = True

    def __str__(self) -> str:
        norm = "" if self.norm_topk_prob else ", norm_topk_prob=False"
        return f"E={self.num_experts} k={self.top_k} H={self.hidden} I={self.intermediate} T={self.tokens}{norm}"


# The tiny checkpoint's layer (a prefill and a decode step), other numbers of experts and of choices, and every
# expert chosen (k = E). The last shape is Qwen3-MoE's convention: top-k weights not renormalised.
LAYER_SHAPES = (
    MoeShape(8, 2, 64, 32, 32, tokens=40),
    MoeShape(8, 2, 64, 32, 32, tokens=1),
    MoeShape(16, 3, 48, 24, 40, tokens=37),
    MoeShape(64, 8, 32, 16, 16, tokens=5),
    MoeShape(4, 4, 32, 8, 24, tokens=9),
    MoeShape(16, 4, 48, 24, 40, tokens=23, norm_topk_prob=False),
)
# bfloat16 routing weights: float32 arithmetic cast once gives transformers' bits, bar a rare rounding tie; a softmax
# computed in bfloat16 changes about a third of them, each by about one unit in the last place.
MAX_BFLOAT16_WEIGHTS_CHANGED = 0.05


def a4_config(shape: MoeShape) -> ModelConfig:
    """A one-layer ModelConfig with this MoE shape (the attention fields only have to be valid)."""
    return ModelConfig(
        architecture="Qwen3_5MoeForConditionalGeneration",
        vocab_size=16,
        hidden_size=shape.hidden,
        intermediate_size=0,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rotary_dim=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        eos_token_ids=(),
        layer_types=(FULL_ATTENTION,),
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.intermediate,
        shared_expert_intermediate_size=shape.shared_intermediate,
        norm_topk_prob=shape.norm_topk_prob,
    )


def transformers_block(shape: MoeShape, seed: int = 0) -> nn.Module:
    """transformers' Qwen3_5MoeSparseMoeBlock of this shape, float32, with random weights of unit-scale outputs."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(
        hidden_size=shape.hidden,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        moe_intermediate_size=shape.intermediate,
        shared_expert_intermediate_size=shape.shared_intermediate,
    )
    config._experts_implementation = "eager"  # the plain PyTorch loop over the experts hit
    block = Qwen3_5MoeSparseMoeBlock(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            # N(0, 1/fan_in): each projection keeps unit scale; router logits of std ~1 spread the tokens.
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    return block


def qwen3_moe_router(shape: MoeShape, weight: torch.Tensor) -> nn.Module:
    """Qwen3-MoE's router (transformers), which renormalises only when norm_topk_prob, with the given weight."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(
        hidden_size=shape.hidden,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k,
        norm_topk_prob=shape.norm_topk_prob,
    )
    router = Qwen3MoeTopKRouter(config).to(weight.dtype)
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


def a4_block(shape: MoeShape, reference: nn.Module, dtype: torch.dtype) -> nn.Module:
    """a4's SparseMoeBlock with the reference block's weights, loaded by name (the checkpoint's names)."""
    from a4.layers.moe import SparseMoeBlock

    block = SparseMoeBlock(a4_config(shape))
    try:
        block.load_state_dict(reference.state_dict())
    except RuntimeError as e:
        raise CheckFailed(f"SparseMoeBlock's parameters do not match transformers' names and shapes: {e}") from None
    return block.to(dtype).eval()


def layer_problems(shape: MoeShape, dtype: torch.dtype) -> list[str]:
    """route, FusedExperts and SparseMoeBlock of one shape against transformers, on random weights and inputs.

    Tolerances (see `_harness.tolerance`): the routing weights sum over the experts (softmax) and the top k
    (renormalisation), rounded once; the experts over hidden, their intermediate size and the top k; the block over
    all of that, the router and the shared expert.
    """
    from a4.layers.moe import route

    label = f"{shape}, {dtype_name(dtype)}"
    config = a4_config(shape)
    weights_tolerance = tolerance(dtype, shape.num_experts + shape.top_k)
    experts_tolerance = tolerance(dtype, shape.hidden + shape.intermediate + shape.top_k, roundings=MLP_ROUNDINGS)
    block_tolerance = tolerance(dtype, mlp_reduction_length(config), roundings=MLP_ROUNDINGS)
    reference = transformers_block(shape).to(dtype)
    ours = a4_block(shape, reference, dtype)
    x = torch.randn(shape.tokens, shape.hidden, generator=torch.Generator().manual_seed(1)).to(dtype)
    problems = []
    with torch.no_grad():
        # The router: the same experts, in the same order, with the same weights.
        router = reference.gate if shape.norm_topk_prob else qwen3_moe_router(shape, reference.gate.weight)
        logits, want_weights, want_experts = router(x)
        routing = route(logits, shape.top_k, shape.norm_topk_prob)
        # The top k of the same logits: the same experts, exactly (random logits have no ties).
        if not torch.equal(routing.experts, want_experts):
            problems.append(f"{label}: route: the expert ids differ from transformers' top-{shape.top_k}")
        problems += compare_dtype(f"{label}: route's weights", routing.weights, want_weights, weights_tolerance)
        if dtype == torch.bfloat16 and routing.weights.shape == want_weights.shape:
            changed = float((routing.weights != want_weights).float().mean())
            if changed > MAX_BFLOAT16_WEIGHTS_CHANGED:
                problems.append(f"{label}: route: {changed:.0%} of the weights differ from transformers' bits "
                                "(compute the softmax and the renormalisation in float32, cast once at the end)")
        if shape.norm_topk_prob:
            # The routed experts alone, given transformers' routing; then the whole block.
            want = reference.experts(x, want_experts, want_weights)
            got = ours.experts(x, want_experts, want_weights)
            problems += compare_dtype(f"{label}: FusedExperts", got, want, experts_tolerance)
            problems += compare_dtype(f"{label}: SparseMoeBlock", ours(x), reference(x[None])[0], block_tolerance)
    return problems


def check_moe_layer(shapes: tuple[MoeShape, ...] = LAYER_SHAPES) -> None:
    """route, FusedExperts and SparseMoeBlock against transformers on random weights and inputs, in float32 and
    bfloat16; with the dtype checks, bfloat16 catches a weight or an output left in float32 and a softmax computed
    in bfloat16."""
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        problems += [p for shape in shapes for p in layer_problems(shape, dtype)]
    conclude(problems, f"router, experts and MoE block equal transformers' for {len(shapes)} shapes in both dtypes")


# ------------------------------------------------------------------------------------------------------- efficiency

# What a matrix product can be called through (F.linear, @, torch.matmul, Tensor.mm, einsum, grouped GEMMs, ...).
MATMUL_NAMES = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "einsum",
                "_grouped_mm", "grouped_mm"}


class TorchOpRecorder(TorchFunctionMode):
    """Records every torch call made inside `with recorder:`: its name, and the tensors it returns.

    `exclude` are tensors (the weights) whose storage does not count as new: indexing a weight makes a view, not a
    copy, and only copies are counted in `largest_new_tensor`.
    """

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.largest_new_tensor = 0
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        self.calls.append(getattr(func, "__name__", str(func)))
        for out in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() not in self._excluded:
                self.largest_new_tensor = max(self.largest_new_tensor, out.numel())
        return result

    @property
    def matmuls(self) -> int:
        return sum(name in MATMUL_NAMES for name in self.calls)


def record_experts(
    experts_class: type[nn.Module], num_experts: int, expert_ids: torch.Tensor, hidden: int, intermediate: int
) -> TorchOpRecorder:
    """Run experts_class(num_experts, hidden, intermediate) on this routing and random x; record its torch calls."""
    generator = torch.Generator().manual_seed(0)
    experts = experts_class(num_experts, hidden, intermediate)
    with torch.no_grad():
        for param in experts.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5)
    x = torch.randn(expert_ids.shape[0], hidden, generator=generator)
    weights = torch.rand(expert_ids.shape, generator=generator)
    recorder = TorchOpRecorder(exclude=tuple(experts.parameters()))
    with torch.no_grad(), recorder:
        experts(x, expert_ids, weights)
    return recorder


def distinct_routing(tokens: int, top_k: int, experts: list[int], seed: int = 0) -> torch.Tensor:
    """[tokens, top_k] expert ids: each row top_k distinct experts drawn from `experts`."""
    generator = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    return torch.stack([pool[torch.randperm(len(experts), generator=generator)[:top_k]] for _ in range(tokens)])


def efficiency_problems(experts_class: type[nn.Module], hidden: int = 64, intermediate: int = 48) -> list[str]:
    """Three properties of an experts module's forward that grouping by expert has, and that the usual shortcuts
    (a loop over all E experts, a copy of the weights per token) have not. experts_class(E, H, I) is built like
    a4's FusedExperts and called like it: (x, expert_ids, weights)."""
    problems = []
    one_expert = 2 * intermediate * hidden  # values in one expert's gate_up matrix
    # A decode-like batch: 3 tokens, 2 choices each, among 64 experts.
    routing = distinct_routing(3, 2, [3, 17, 40, 41, 62])
    active = len(set(routing.flatten().tolist()))
    few = record_experts(experts_class, 64, routing, hidden, intermediate)
    if few.matmuls > 2 * active:
        problems.append(
            f"3 tokens routed to {active} of 64 experts took {few.matmuls} matrix products; at most {2 * active} "
            "expected (one with gate_up_proj[e] and one with down_proj[e] per ACTIVE expert: do not loop over all E)"
        )
    # The same routing with 16 times as many experts, none of them used: the same calls, not more.
    many = record_experts(experts_class, 1024, routing, hidden, intermediate)
    if len(many.calls) != len(few.calls):
        problems.append(
            f"the same routing took {len(few.calls)} torch calls with E=64 and {len(many.calls)} with E=1024 (the "
            "extra experts unused): the work must not grow with the number of experts, only with those used"
        )
    # Many tokens among few experts: a per-token copy of expert weights would hold 48 expert matrices and more.
    crowded = record_experts(experts_class, 8, distinct_routing(24, 2, list(range(8))), hidden, intermediate)
    if crowded.largest_new_tensor > one_expert:
        problems.append(
            f"24 tokens x 2 choices made a tensor of {crowded.largest_new_tensor:,} values, more than one expert's "
            f"gate_up matrix ({one_expert:,}): never gather expert weights per token (gate_up_proj[expert_ids])"
        )
    return problems


def check_moe_efficiency() -> None:
    """FusedExperts runs each active expert once: 2 products per active expert, work independent of E, no copies."""
    from a4.layers.moe import FusedExperts

    conclude(
        efficiency_problems(FusedExperts),
        "two products per active expert, no work for unused experts, no per-token copies of expert weights",
    )
