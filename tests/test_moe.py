"""Qwen3.5-MoE: the sparse MoE block against transformers' modules, its efficiency, and the model served by the engine.

References: transformers' Qwen3_5MoeSparseMoeBlock / router / experts on random weights (a4.course.checks.moe), the
layer captures and greedy tokens of transformers' Qwen3_5MoeForConditionalGeneration on the tiny MoE checkpoint
(a4.reference), and naive groupings and expert loops written here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from a4 import LLM, SamplingParams
from a4.__main__ import demo_prompts, main
from a4.course.checks import CheckFailed
from a4.course.checks import moe as checks
from a4.course.checks._harness import assert_close, mlp_reduction_length, tolerance
from a4.course.checks.state_pool import bfloat16_agreement
from a4.layers import moe
from a4.layers.moe import FusedExperts, Routing, SparseMoeBlock, group_by_expert
from a4.models.config import load_model_config
from a4.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration
from a4.models.qwen3_5_weights import checkpoint_key_map
from a4.models.registry import load_model, model_class
from a4.models.weights import checkpoint_files
from a4.reference import hf_greedy, hf_prefill_capture

BF16_MIN_AGREEING_FRACTION = 0.5


# --------------------------------------------------------------------------------------------------- the MoE block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("shape", checks.LAYER_SHAPES, ids=str)
def test_layer_matches_transformers(shape, dtype):
    assert checks.layer_problems(shape, dtype) == []


def no_renormalisation(router_logits, top_k, normalize):
    weights, experts = torch.softmax(router_logits, dim=-1, dtype=torch.float32).topk(top_k, dim=-1)
    return Routing(weights.to(router_logits.dtype), experts)


def softmax_in_model_dtype(router_logits, top_k, normalize):
    weights, experts = torch.softmax(router_logits, dim=-1).topk(top_k, dim=-1)
    return Routing(weights / weights.sum(dim=-1, keepdim=True), experts)


def up_rows_taken_as_gate(self, x, expert_ids, weights):
    out = torch.zeros_like(x)
    for token, (experts, token_weights) in enumerate(zip(expert_ids.tolist(), weights)):
        for expert, weight in zip(experts, token_weights):
            up, gate = F.linear(x[token], self.gate_up_proj[expert]).chunk(2)
            out[token] += weight * F.linear(F.silu(gate) * up, self.down_proj[expert])
    return out


def shared_expert_without_its_gate(self, x):
    routing = moe.route(self.gate(x), self.top_k, self.norm_topk_prob)
    return self.experts(x, routing.experts, routing.weights) + self.shared_expert(x)


MISTAKES = [
    (moe, "route", no_renormalisation),
    (moe, "route", softmax_in_model_dtype),
    (FusedExperts, "forward", up_rows_taken_as_gate),
    (SparseMoeBlock, "forward", shared_expert_without_its_gate),
]


@pytest.mark.parametrize("owner,name,mistake", MISTAKES, ids=[mistake.__name__ for _, _, mistake in MISTAKES])
def test_layer_check_catches_mistakes(monkeypatch, owner, name, mistake):
    monkeypatch.setattr(owner, name, mistake)
    with pytest.raises(CheckFailed):
        checks.check_moe_layer()


def naive_groups(expert_ids: torch.Tensor) -> dict[int, list[int]]:
    """expert -> its pair ids (p = token * k + choice), by walking the pairs in order."""
    groups: dict[int, list[int]] = {}
    for pair, expert in enumerate(expert_ids.flatten().tolist()):
        groups.setdefault(expert, []).append(pair)
    return dict(sorted(groups.items()))


@pytest.mark.parametrize("tokens,top_k,num_experts", [(1, 2, 8), (13, 3, 16), (50, 8, 256), (6, 4, 4)])
def test_group_by_expert_sorts_pairs_by_expert(tokens, top_k, num_experts):
    expert_ids = checks.distinct_routing(tokens, top_k, list(range(num_experts)), seed=tokens)
    groups = group_by_expert(expert_ids, num_experts)
    want = naive_groups(expert_ids)
    assert groups.experts == list(want)
    assert groups.counts == [len(pairs) for pairs in want.values()]
    assert [chunk.tolist() for chunk in groups.pairs.split(groups.counts)] == list(want.values())


@pytest.mark.parametrize(
    "tokens,top_k,experts", [(1, 2, [5, 9]), (3, 2, [3, 17, 40, 41, 62]), (40, 2, list(range(64)))]
)
def test_one_gate_up_and_one_down_product_per_active_expert(tokens, top_k, experts):
    routing = checks.distinct_routing(tokens, top_k, experts)
    recorder = checks.record_experts(FusedExperts, 64, routing, hidden=32, intermediate=16)
    assert recorder.matmuls == 2 * len(set(routing.flatten().tolist()))


def test_efficiency_check_passes_grouped_experts():
    assert checks.efficiency_problems(FusedExperts) == []


class EveryExpertLoop(FusedExperts):
    """Correct, but visits all E experts: the loop transformers avoids with its `expert_hit` list."""

    def forward(self, x, expert_ids, weights):
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            tokens, choice = torch.where(expert_ids == expert)
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            out.index_add_(0, tokens, y * weights[tokens, choice, None])
        return out


class PerTokenWeights(FusedExperts):
    """Correct, but copies the weights of every token's experts: [T, k, 2I, H] and [T, k, H, I]."""

    def forward(self, x, expert_ids, weights):
        gate_up = torch.einsum("th,tkoh->tko", x, self.gate_up_proj[expert_ids])
        gate, up = gate_up.chunk(2, dim=-1)
        y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, self.down_proj[expert_ids])
        return (y * weights[..., None]).sum(dim=1)


@pytest.mark.parametrize("inefficient", [EveryExpertLoop, PerTokenWeights])
def test_efficiency_check_rejects_correct_but_wasteful_experts(inefficient):
    # Both give the right numbers: the check rejects them for their work alone.
    torch.manual_seed(0)
    experts = FusedExperts(16, 32, 8)
    torch.nn.init.normal_(experts.gate_up_proj)
    torch.nn.init.normal_(experts.down_proj)
    wasteful = inefficient(16, 32, 8)
    wasteful.load_state_dict(experts.state_dict())
    x, routing = torch.randn(7, 32), checks.distinct_routing(7, 3, list(range(16)))
    weights = torch.rand(7, 3)
    with torch.no_grad():
        # The same sums in other orders (einsum over copied weights): hidden, intermediate and the 3 choices.
        assert_close(wasteful(x, routing, weights), experts(x, routing, weights), tolerance(torch.float32, 32 + 8 + 3))
    assert checks.efficiency_problems(inefficient) != []


# ------------------------------------------------------------------------------------------ the model and weights


def test_registry_maps_the_architecture_to_the_moe_model():
    assert model_class("Qwen3_5MoeForConditionalGeneration") is Qwen3_5MoeForConditionalGeneration


def test_weights_equal_transformers_and_skip_vision_and_mtp(tiny_qwen3_5_moe):
    checks.check_moe_weights(tiny_qwen3_5_moe)


def test_mtp_experts_are_skipped_whatever_their_layout(tiny_qwen3_5_moe):
    keys = [key for keys in checkpoint_files(tiny_qwen3_5_moe).values() for key in keys]
    per_expert_mtp = [key for key in keys if key.startswith("mtp.") and ".mlp.experts." in key]
    fused_main = [key for key in keys if key.startswith("model.language_model.") and ".mlp.experts." in key]
    # The tiny checkpoint stores them as the real one does: one by one in the MTP layer, fused in the main layers.
    assert per_expert_mtp and all(key.split(".mlp.experts.")[1][0].isdigit() for key in per_expert_mtp)
    assert fused_main and all(key.endswith((".gate_up_proj", ".down_proj")) for key in fused_main)
    fused_mtp = [key.replace("model.language_model.", "mtp.") for key in fused_main]
    assert all(checkpoint_key_map(key) is None for key in per_expert_mtp + fused_mtp)


@pytest.fixture(scope="module")
def moe_model(tiny_qwen3_5_moe):
    return load_model(tiny_qwen3_5_moe, dtype=torch.float32, device="cpu", progress=False)[1]


def test_every_layer_has_a_sparse_moe_block(moe_model):
    assert all(isinstance(layer.mlp, SparseMoeBlock) for layer in moe_model.model.layers)


def test_moe_mlps_equal_transformers_on_the_checkpoint(moe_model, tiny_qwen3_5_moe):
    # Each layer's MLP fed transformers' own MLP input, during a prefill of 70 tokens: real weights, real routing.
    capture = hf_prefill_capture(tiny_qwen3_5_moe, list(range(3, 73)))
    config = moe_model.config
    with torch.no_grad():
        for i, (layer, captured) in enumerate(zip(moe_model.model.layers, capture.layers, strict=True)):
            router_logits = layer.mlp.gate(captured.mlp_input)
            assert_close(router_logits, captured.router_logits, tolerance(torch.float32, config.hidden_size),
                         f"layer {i}: router logits")  # fmt: skip
            mlp_tolerance = tolerance(torch.float32, mlp_reduction_length(config))
            assert_close(layer.mlp(captured.mlp_input), captured.mlp_output, mlp_tolerance, f"layer {i}: MoE MLP")


# ---------------------------------------------------------------------------------------------------- the engine


def test_decode_single(tiny_qwen3_5_moe):
    checks.check_decode_single(tiny_qwen3_5_moe)


def test_decode_varlen_in_one_batch(tiny_qwen3_5_moe):
    checks.check_decode_varlen(tiny_qwen3_5_moe)


def test_decode_chunked(tiny_qwen3_5_moe):
    checks.check_decode_chunked(tiny_qwen3_5_moe)


def test_bfloat16_agreement(tiny_qwen3_5_moe):
    agreeing, total, identical, requests = bfloat16_agreement(tiny_qwen3_5_moe)
    print(f"\nbfloat16: {agreeing} of {total} tokens agree before the first difference; "
          f"{identical} of {requests} requests identical")
    assert agreeing >= BF16_MIN_AGREEING_FRACTION * total


def test_prefix_cache_hits_and_tokens_equal_transformers(tiny_qwen3_5_moe):
    # The demo's prompts: six share a 24-token prefix, one repeats another. The cache keeps states for the MoE model
    # exactly as for the dense one (the experts hold no per-request memory).
    config = load_model_config(tiny_qwen3_5_moe)
    prompts = demo_prompts(config.vocab_size, config.eos_token_ids)
    llm = LLM(tiny_qwen3_5_moe, max_prefill_tokens=16, max_running_requests=4)
    outputs = llm.generate(prompts, SamplingParams(max_new_tokens=6))
    assert [out.token_ids for out in outputs] == hf_greedy(tiny_qwen3_5_moe, prompts, 6)
    assert llm.stats.cached_tokens > 0 and sum(out.cached_tokens > 0 for out in outputs) >= 3


def test_demo_matches_transformers(capsys):
    assert main(["demo", "--arch", "qwen3_5_moe"]) == 0
    assert "all 8 requests match transformers token for token" in capsys.readouterr().out
