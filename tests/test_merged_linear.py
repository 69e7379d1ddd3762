"""Merged projections (a4/layers/merged_linear.py): the same values as the separate linear layers, and the engine
with them = transformers' greedy generation token by token.

The engine merges them by default only where a4's Triton kernels run; `merge_projections=True` merges them on the CPU
too, so that these tests run the students' forward over merged projections here (tests/test_gpu.py does on CUDA).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from a4 import LLM, SamplingParams
from a4.course.checks._harness import random_tokens
from a4.layers.merged_linear import MergedLinearPart, merge_projections
from a4.models.registry import load_model
from a4.reference import hf_greedy


class TwoProjections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(8, 5, bias=False)
        self.up_proj = nn.Linear(8, 3, bias=False)


def test_each_part_returns_its_own_linear_output():
    torch.manual_seed(0)
    module = TwoProjections()
    gate, up = module.gate_proj.weight.clone(), module.up_proj.weight.clone()
    x, other = torch.randn(4, 8), torch.randn(2, 8)
    assert merge_projections(module) == 1
    assert isinstance(module.gate_proj, MergedLinearPart) and torch.equal(module.up_proj.weight, up)
    # Interleaved calls with two inputs, and one part called twice: each call is its own input's product.
    for tensor, weight in ((x, gate), (other, up), (x, up), (x, up), (other, gate)):
        proj = module.gate_proj if weight is gate else module.up_proj
        torch.testing.assert_close(proj(tensor), tensor @ weight.T, rtol=1e-6, atol=1e-6)
    # The group's product is not kept once every part has read it.
    module.gate_proj(x), module.up_proj(x)
    assert module.merged_gate_proj._input is None


def test_unmergeable_groups_are_left_alone():
    module = TwoProjections()
    module.up_proj = nn.Linear(8, 3, bias=True)
    assert merge_projections(module) == 0
    assert type(module.gate_proj) is nn.Linear


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_merged_model_has_the_unmerged_parameters(arch, request):
    checkpoint = request.getfixturevalue(f"tiny_{arch}")
    _, plain, _ = load_model(checkpoint, dtype=torch.float32, device="cpu", progress=False)
    _, merged, _ = load_model(checkpoint, dtype=torch.float32, device="cpu", progress=False, merge_projections=True)
    groups = sum(isinstance(m, MergedLinearPart) for m in merged.modules())
    assert groups > 0
    # Same bytes: each merged weight is its group's weights, concatenated.
    assert sum(p.numel() for p in merged.parameters()) == sum(p.numel() for p in plain.parameters())
    for name, module in plain.named_modules():
        if isinstance(module, nn.Linear) and isinstance(merged.get_submodule(name), MergedLinearPart):
            assert torch.equal(merged.get_submodule(name).weight, module.weight), name


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5", "qwen3_5_moe"])
def test_engine_with_merged_projections_is_transformers_greedy(arch, request):
    checkpoint = request.getfixturevalue(f"tiny_{arch}")
    prompts = [random_tokens(n, seed=n) for n in (1, 9, 70)]
    llm = LLM(checkpoint, merge_projections=True, max_prefill_tokens=32, max_running_requests=3)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [output.token_ids for output in outputs] == hf_greedy(checkpoint, prompts, 8)


def test_speculative_engine_with_merged_projections_is_transformers_greedy(tiny_qwen3_5):
    prompts = [random_tokens(n, seed=n) for n in (5, 33)]
    llm = LLM(tiny_qwen3_5, merge_projections=True, speculative_tokens=2, cuda_graphs=True)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=8))
    assert [output.token_ids for output in outputs] == hf_greedy(tiny_qwen3_5, prompts, 8)
