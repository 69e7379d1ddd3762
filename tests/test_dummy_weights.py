"""load_format="dummy": random weights drawn on the device from config.json alone, for a config-only directory.

The reference is the checkpoint writer: on the CPU the drawn model holds exactly `random_tensors`' tensors (the
ones make_checkpoint writes, seed 0, unverified), under the model's names, and runs as the written checkpoint does.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import a4.models.weights as weights
from a4 import LLM, SamplingParams
from a4.checkpoints import CheckpointError, make_checkpoint, random_tensors
from a4.engine.config import EngineConfig
from a4.layers.deltanet import GatedRMSNorm
from a4.layers.gated_attention import ZeroCenteredRMSNorm
from a4.layers.moe import FusedExperts
from a4.models.qwen3_5_mtp import experts_as_stored, load_mtp, mtp_key_map
from a4.models.registry import load_model, model_class
from a4.models.weights import WeightLoadError, loadable_tensors

ARCHS = ["qwen3", "qwen3_5", "qwen3_5_moe"]


def config_only(arch: str) -> object:
    return make_checkpoint(None, arch, weights=False)


def load_dummy(model_dir, dtype="float32") -> nn.Module:
    return load_model(model_dir, dtype=dtype, device="cpu", progress=False, load_format="dummy")[1]


def test_config_only_directory_holds_no_weights_and_draws_the_plan_distribution():
    model_dir = config_only("qwen3_5_moe")
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json", "generation_config.json"]
    config, model, report = load_model(model_dir, dtype="float32", device="cpu", progress=False, load_format="dummy")
    assert report.files == [] and report.random_seed == 0
    assert "read no file" in report.summary()
    assert all(t.isfinite().all() for t in loadable_tensors(model).values())
    checked = 0
    for name, module in model.named_modules():
        # Linear weights N(0, 1/in_features); the fused experts' last dimension is their input. Tensors of 2048
        # elements or more: the sample std is then within ~2% of the true one, and 10% is a real miss.
        if isinstance(module, nn.Linear):
            tensors = [(module.weight, module.in_features)]
        elif isinstance(module, FusedExperts):
            tensors = [(t, t.shape[-1]) for t in module.parameters()]
        else:
            continue
        for w, fan_in in tensors:
            if w.numel() >= 2048:
                assert w.std().item() * math.sqrt(fan_in) == pytest.approx(1.0, rel=0.1), name
                checked += 1
    assert checked >= 2 * config.num_hidden_layers
    for name, module in model.named_modules():
        # Zero-centred norms store w ~ N(0, 0.1²) (scale 1 + w), q/k norms N(1, 0.1²), GDN's plain norm N(1, 0.1²).
        if isinstance(module, ZeroCenteredRMSNorm):
            mean = 1.0 if name.endswith(("q_norm", "k_norm")) else 0.0
        elif isinstance(module, GatedRMSNorm):
            mean = 1.0
        else:
            continue
        assert module.weight.mean().item() == pytest.approx(mean, abs=0.1), name
    decay = [model.get_submodule(f"model.layers.{i}.linear_attn").A_log.exp() for i in config.linear_attention_layers]
    assert all(((0.049 <= a) & (a <= 0.81)).all() for a in decay)  # U(0.05, 0.8), log rounded to bfloat16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_drawn_tensors_are_the_checkpoint_writers_on_the_cpu(arch, dtype):
    model_dir = config_only(arch)
    model = load_dummy(model_dir, dtype)
    config = json.loads((model_dir / "config.json").read_text())
    key_map = getattr(model_class(config["architectures"][0]), "checkpoint_key_map", weights.identity)
    expected = {key_map(key): t for key, t in random_tensors(arch, config, seed=0).items()}
    targets = loadable_tensors(model)
    assert set(targets) <= set(expected)
    for name, tensor in targets.items():
        assert tensor.dtype == getattr(torch, dtype)
        assert torch.equal(tensor, expected[name].to(tensor.dtype)), name


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_mtp_module_is_drawn_from_the_plans_mtp_entries(arch):
    model_dir = config_only(arch)
    model = load_dummy(model_dir)
    mtp, report = load_mtp(model, model_dir, dtype=torch.float32, device="cpu", load_format="dummy")
    config = json.loads((model_dir / "config.json").read_text())
    expected = {mtp_key_map(key): t for key, t in random_tensors(arch, config, seed=0, prefix="mtp.").items()}
    # A MoE layer's experts are drawn one by one, as the checkpoint stores them, into the layer's fused tensors.
    with experts_as_stored(mtp):
        drawn = loadable_tensors(mtp)
    assert drawn.keys() == expected.keys() and report.random_seed == 0
    assert all(torch.equal(t, expected[name].float()) for name, t in drawn.items())


def test_moe_engine_drafts_with_its_drawn_mtp_module():
    prompts = [[5, 17, 300, 2], [900, 4, 4, 61, 7, 12]]
    params = SamplingParams(max_new_tokens=8)
    expected = [out.token_ids for out in LLM(config_only("qwen3_5_moe"), load_format="dummy").generate(prompts, params)]
    speculative = LLM(config_only("qwen3_5_moe"), load_format="dummy", speculative_tokens=2)
    assert [out.token_ids for out in speculative.generate(prompts, params)] == expected
    assert speculative.stats.draft_tokens > 0


def test_llm_on_drawn_weights_generates_what_the_written_checkpoint_generates(tmp_path):
    # Written here, not taken from the cache: torch.randn's CPU kernels round differently from one CPU capability to
    # another (CI runs these tests twice, the second time on PyTorch's portable kernels).
    written = make_checkpoint(tmp_path / "written", "qwen3_5", verify=False)  # seed 0's weights, as the dummy draw
    prompts = [[5, 17, 300, 2], [900, 4, 4, 61, 7, 12], [33]]
    params = SamplingParams(max_new_tokens=12)
    dummy = LLM(config_only("qwen3_5"), load_format="dummy")
    full = LLM(written)
    for name, t in dummy.engine.model.state_dict().items():
        assert torch.equal(t, full.engine.model.state_dict()[name]), name
    expected = [out.token_ids for out in full.generate(prompts, params)]
    assert all(len(ids) == 12 for ids in expected)
    assert [out.token_ids for out in dummy.generate(prompts, params)] == expected
    # The MTP drafter is drawn too: speculative decoding gives the same greedy tokens.
    speculative = LLM(config_only("qwen3_5"), load_format="dummy", speculative_tokens=2)
    assert [out.token_ids for out in speculative.generate(prompts, params)] == expected
    assert speculative.stats.draft_tokens > 0


def test_tensor_parallel_ranks_draw_their_weights_too():
    """Each worker draws the whole model, as it would load it, and keeps its share: the same tokens as one process
    (to the rounding of the split sums, as in tests/test_tensor_parallel.py), its MTP module drawn too."""
    prompts = [[5, 17, 300, 2], [900, 4, 4, 61, 7, 12]]
    params = SamplingParams(max_new_tokens=8)
    expected = [out.token_ids for out in LLM(config_only("qwen3_5"), load_format="dummy").generate(prompts, params)]
    with LLM(config_only("qwen3_5"), load_format="dummy", tensor_parallel_size=2, speculative_tokens=2) as split:
        assert [out.token_ids for out in split.generate(prompts, params)] == expected


def test_bad_load_format_is_a_value_error_naming_it():
    model_dir = config_only("qwen3")
    with pytest.raises(ValueError, match="'auto'.*'safetensors', 'dummy'"):
        EngineConfig(model_dir, load_format="auto")
    with pytest.raises(TypeError, match="load_formats"):
        LLM(model_dir, load_formats="dummy")
    with pytest.raises(ValueError, match="'bogus'"):
        load_model(model_dir, dtype="float32", device="cpu", progress=False, load_format="bogus")


def test_config_only_directory_without_dummy_still_needs_weight_files():
    model_dir = config_only("qwen3_5")
    with pytest.raises(WeightLoadError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_model(model_dir, dtype="float32", device="cpu", progress=False)
    with pytest.raises(WeightLoadError, match="is this a checkpoint"):
        LLM(model_dir)


def test_a_parameter_the_plan_does_not_draw_is_an_error_naming_it(monkeypatch):
    plan = weights.tensor_plan
    monkeypatch.setattr(weights, "tensor_plan", lambda arch, config: plan(arch, config)[:-1])  # no lm_head
    with pytest.raises(WeightLoadError, match=r"tensor plan .* does not fit[^\n]*\n  missing: lm_head.weight"):
        load_dummy(config_only("qwen3"))


def test_config_only_cache_entry_never_shadows_the_full_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("A4_CACHE_DIR", str(tmp_path))
    configs = make_checkpoint(None, "qwen3", weights=False)
    full = make_checkpoint(None, "qwen3", verify=False)
    assert configs != full and (full / "model.safetensors.index.json").exists()
    assert (configs / "config.json").read_text() == (full / "config.json").read_text()
    assert make_checkpoint(None, "qwen3", weights=False) == configs
    with pytest.raises(CheckpointError, match="seed 0"):
        make_checkpoint(None, "qwen3", weights=False, seed=1)
    with pytest.raises(CheckpointError, match="verify=True"):
        make_checkpoint(None, "qwen3", weights=False, verify=True)
