"""Merged projections: the linear layers of a module that read the same input, run as one GEMM.

Why: a decode step multiplies a few token rows by every weight matrix, and a GEMM with so few rows is bound by the
launch and by how well it spreads a small matrix over the GPU, not by the bytes it reads. An H200 decode step of
Qwen3.5-0.8B (batch 1) spent 90 GEMM launches on the Gated DeltaNet and attention input projections, the 32 KB
`in_proj_a` / `in_proj_b` as long as the 12 MB `in_proj_qkv`; one GEMM over their concatenated weights reads the
same bytes in one launch, at a better rate (vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`).

The layers call their projections one by one (the students' `GatedDeltaNet.forward` calls `self.in_proj_qkv(hidden)`,
then `self.in_proj_z(hidden)`, ...), and that forward is what the engine runs. So `merge_projections(model)` leaves
the forward alone and changes the projections under it: each group's weights are concatenated, once, into a
`MergedLinear`, and each projection is replaced by a `MergedLinearPart` that returns its own columns of the merged
product. The first part called with an input computes the product for the whole group; the others, called with the
same tensor, take their slices (views, no copy). A part called with another tensor, or twice with one, computes the
product anew: always correct, only slower. Tested against the unmerged layers (tests/test_merged_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Projections that read the same input, by their checkpoint names: Gated DeltaNet's input projections, attention's
# q / k / v, the gated MLP's gate and up (the dense MLP, the MoE's shared expert, the MTP module's MLP).
PROJECTION_GROUPS = (
    ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
)


class MergedLinear(nn.Module):
    """The concatenated weight of a group of bias-free linear layers, and the last product computed with it."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([linear.weight for linear in linears]), requires_grad=False)
        self.split_sizes = [linear.out_features for linear in linears]
        # How the product is computed: F.linear, or a4's small-batch kernel on CUDA (a4/layers/fused.py: use_gemv).
        self.matmul = F.linear
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._unread: set[int] = set()

    def output(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """Part `part`'s columns of x @ weight.T, from the product of the group's first call with x."""
        if x is not self._input or part not in self._unread:
            self._input = x
            self._outputs = self.matmul(x, self.weight).split(self.split_sizes, dim=-1)
            self._unread = set(range(len(self.split_sizes)))
        self._unread.discard(part)
        out = self._outputs[part]
        if not self._unread:
            # Every part has its slice: hold no activations between steps.
            self._input, self._outputs = None, ()
        return out


class MergedLinearPart(nn.Module):
    """One projection of a merged group, in its place: `part(x)` = the original `linear(x)`."""

    def __init__(self, merged: MergedLinear, part: int, in_features: int, out_features: int) -> None:
        super().__init__()
        # Not a child module: the merged weight belongs to the parent once, not to every part.
        self.__dict__["merged"] = merged
        self.part, self.in_features, self.out_features = part, in_features, out_features

    @property
    def weight(self) -> torch.Tensor:
        """This projection's rows of the merged weight (a view), for code that reads `proj.weight`."""
        start = sum(self.merged.split_sizes[: self.part])
        return self.merged.weight[start : start + self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.merged.output(x, self.part)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.part} of a merged GEMM"


def _mergeable(module: nn.Module, names: tuple[str, ...]) -> list[nn.Linear] | None:
    linears = [getattr(module, name, None) for name in names]
    if not all(type(linear) is nn.Linear and linear.bias is None for linear in linears):
        return None
    first = linears[0].weight
    same = all(
        linear.in_features == linears[0].in_features
        and linear.weight.dtype == first.dtype
        and linear.weight.device == first.device
        for linear in linears
    )
    return linears if same else None


def merge_projections(model: nn.Module) -> int:
    """Merge every group of PROJECTION_GROUPS found in `model`'s modules; returns how many groups were merged.

    The merged weight is registered on the group's module as `merged_<first name>`; the original weights are
    released (the merged one is their copy)."""
    merged_groups = 0
    for module in list(model.modules()):
        for names in PROJECTION_GROUPS:
            linears = _mergeable(module, names)
            if linears is None:
                continue
            merged = MergedLinear(linears)
            module.add_module(f"merged_{names[0]}", merged)
            for part, (name, linear) in enumerate(zip(names, linears)):
                setattr(module, name, MergedLinearPart(merged, part, linear.in_features, linear.out_features))
            merged_groups += 1
    return merged_groups
