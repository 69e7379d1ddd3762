"""Weight loading: a4 loads exactly what transformers loads, and every kind of misfit is reported by name.

Broken checkpoints are copies of the tiny one rewritten with safetensors (one file, no index: that layout is
covered too).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import a4.models.weights as weights
from a4.models.config import ConfigError, load_model_config
from a4.models.qwen3 import Qwen3ForCausalLM
from a4.models.registry import default_dtype, load_model
from a4.models.weights import WeightLoadError, load_weights
from a4.reference import load_hf_model


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in set(index["weight_map"].values()):
        with safe_open(model_dir / file, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    return tensors


def rewritten(source: Path, target: Path, tensors: dict[str, torch.Tensor], **config_changes) -> Path:
    """A copy of `source` whose weights are `tensors`, in one model.safetensors."""
    target.mkdir()
    config = json.loads((source / "config.json").read_text()) | config_changes
    (target / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", target)
    save_file(tensors, target / "model.safetensors")
    return target


def fresh_model(model_dir: Path, dtype: torch.dtype = torch.float32) -> Qwen3ForCausalLM:
    with default_dtype(dtype):
        return Qwen3ForCausalLM(load_model_config(model_dir))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_parameters_equal_transformers(tiny_qwen3, dtype):
    config, model, report = load_model(tiny_qwen3, dtype=dtype, device="cpu", progress=False)
    reference = load_hf_model(tiny_qwen3, dtype).state_dict()
    ours = dict(model.named_parameters())
    assert sorted(ours) == sorted(key for key in reference if key != "lm_head.weight" or not config.tie_word_embeddings)
    for name, param in ours.items():
        assert param.dtype == getattr(torch, dtype) and not param.requires_grad
        assert torch.equal(param, reference[name]), name  # both copy the stored tensor: equal, bit for bit
    assert sorted(report.loaded_keys) == sorted(ours) and report.skipped_keys == []
    assert report.loaded_bytes == sum(t.numel() * t.element_size() for t in read_all(tiny_qwen3).values())
    assert not model.training


def test_missing_unexpected_and_misshaped_are_all_reported(tiny_qwen3, tmp_path):
    tensors = read_all(tiny_qwen3)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.bogus.weight"] = torch.zeros(3, 4)
    tensors["model.layers.2.self_attn.k_norm.weight"] = torch.ones(7)
    broken = rewritten(tiny_qwen3, tmp_path / "broken", tensors)
    model = fresh_model(broken)
    with pytest.raises(WeightLoadError) as err:
        load_weights(model, broken, device="cpu", dtype=torch.float32, progress=False)
    message = str(err.value)
    assert "missing: model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected: model.layers.0.self_attn.bogus.weight (3, 4)" in message
    head_dim = model.config.head_dim
    assert f"wrong shape: model.layers.2.self_attn.k_norm.weight is (7,) in the checkpoint, ({head_dim},)" in message
    assert message.count("\n") == 3  # one error, exactly these three problems


@pytest.mark.parametrize("problem", ["missing", "unexpected", "misshaped"])
def test_each_misfit_alone_raises(tiny_qwen3, tmp_path, problem):
    tensors = read_all(tiny_qwen3)
    key = "model.norm.weight"
    if problem == "missing":
        del tensors[key]
    elif problem == "unexpected":
        key = "model.extra.weight"
        tensors[key] = torch.zeros(2)
    else:
        tensors[key] = torch.ones(3)
    broken = rewritten(tiny_qwen3, tmp_path / problem, tensors)
    with pytest.raises(WeightLoadError, match=key.replace(".", r"\.")):
        load_weights(fresh_model(broken), broken, device="cpu", dtype=torch.float32, progress=False)


class GetTensorSpy:
    """Wraps safetensors' safe_open and records every tensor whose data is read."""

    def __init__(self) -> None:
        self.read: list[str] = []

    def __call__(self, *args, **kwargs):
        spy = self

        class Handle:
            def __init__(self) -> None:
                self.handle = safe_open(*args, **kwargs)

            def __enter__(self):
                self.handle.__enter__()
                return self

            def __exit__(self, *exc):
                return self.handle.__exit__(*exc)

            def get_tensor(self, key: str) -> torch.Tensor:
                spy.read.append(key)
                return self.handle.get_tensor(key)

            def __getattr__(self, name: str):
                return getattr(self.handle, name)

        return Handle()


def test_keys_mapped_to_none_are_skipped_without_being_read(tiny_qwen3, tmp_path, monkeypatch):
    tensors = read_all(tiny_qwen3)
    tensors["model.visual.patch_embed.weight"] = torch.randn(16, 8)
    with_vision = rewritten(tiny_qwen3, tmp_path / "with_vision", tensors)
    spy = GetTensorSpy()
    monkeypatch.setattr(weights, "safe_open", spy)

    def drop_vision(key: str) -> str | None:
        return None if key.startswith("model.visual.") else key

    model = fresh_model(with_vision)
    report = load_weights(model, with_vision, key_map=drop_vision, device="cpu", dtype=torch.float32, progress=False)
    assert report.skipped_keys == ["model.visual.patch_embed.weight"]
    assert report.skipped_bytes == 16 * 8 * 4
    assert "model.visual.patch_embed.weight" not in spy.read
    assert sorted(spy.read) == sorted(k for k in tensors if not k.startswith("model.visual."))
    assert torch.equal(model.model.norm.weight, tensors["model.norm.weight"].float())


def test_key_map_renames(tiny_qwen3, tmp_path):
    tensors = {f"language_model.{key}": t for key, t in read_all(tiny_qwen3).items()}
    prefixed = rewritten(tiny_qwen3, tmp_path / "prefixed", tensors)
    model = fresh_model(prefixed)
    report = load_weights(
        model, prefixed, key_map=lambda k: k.removeprefix("language_model."), device="cpu", dtype=torch.float32,
        progress=False,
    )
    assert len(report.loaded_keys) == len(tensors)
    assert torch.equal(model.lm_head.weight, tensors["language_model.lm_head.weight"].float())


@pytest.mark.parametrize("checkpoint_has_lm_head", [False, True])
def test_tied_embeddings(tiny_qwen3, tmp_path, checkpoint_has_lm_head):
    tensors = read_all(tiny_qwen3)
    del tensors["lm_head.weight"]
    if checkpoint_has_lm_head:  # some tied checkpoints still store the alias (a copy): skipped, not read twice
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    tied = rewritten(tiny_qwen3, tmp_path / "tied", tensors, tie_word_embeddings=True)
    config, model, report = load_model(tied, dtype="float32", device="cpu", progress=False)
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, load_hf_model(tied).lm_head.weight)
    assert report.skipped_keys == (["lm_head.weight"] if checkpoint_has_lm_head else [])


def test_no_checkpoint_files(tmp_path, tiny_qwen3):
    shutil.copy(tiny_qwen3 / "config.json", tmp_path)
    with pytest.raises(WeightLoadError, match="model.safetensors"):
        load_model(tmp_path, dtype="float32", device="cpu", progress=False)


def test_unknown_architecture_and_dtype(tiny_qwen3, tmp_path):
    other = rewritten(tiny_qwen3, tmp_path / "other", read_all(tiny_qwen3), architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_model(other, dtype="float32", device="cpu", progress=False)
    with pytest.raises(ValueError, match="float8"):
        load_model(tiny_qwen3, dtype="float8", device="cpu", progress=False)


def load_qwen3(model_dir: Path) -> None:
    load_weights(fresh_model(model_dir), model_dir, device="cpu", dtype=torch.float32, progress=False)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool])
def test_integer_or_bool_tensor_is_an_error_naming_it(tiny_qwen3, tmp_path, dtype):
    """A weight stored as integers would load (cast to float) and make the model emit token 0 for ever."""
    tensors = read_all(tiny_qwen3)
    key = "model.layers.1.self_attn.q_proj.weight"
    tensors[key] = torch.ones_like(tensors[key], dtype=dtype)
    broken = rewritten(tiny_qwen3, tmp_path / "integer", tensors)
    with pytest.raises(WeightLoadError, match=re.escape(f"wrong dtype: {key} is ") + r"\w+ in model\.safetensors"):
        load_qwen3(broken)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_an_error_naming_the_tensor(tiny_qwen3, tmp_path, value):
    tensors = read_all(tiny_qwen3)
    key = "model.layers.2.mlp.down_proj.weight"
    tensors[key] = tensors[key].clone()
    tensors[key][3, 5] = value
    tensors["model.norm.weight"] = tensors["model.norm.weight"].clone()
    tensors["model.norm.weight"][0] = value
    broken = rewritten(tiny_qwen3, tmp_path / "non_finite", tensors)
    with pytest.raises(WeightLoadError) as err:
        load_qwen3(broken)
    message = str(err.value)
    assert f"non-finite: {key} has 1 NaN or infinite value(s) of {tensors[key].numel()}" in message
    assert "non-finite: model.norm.weight has 1 NaN or infinite" in message


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_finite_weights_load(tiny_qwen3, tmp_path, dtype):
    """Finite values whose sum overflows are still finite: only NaN and inf are errors."""
    tensors = read_all(tiny_qwen3)
    key = "model.layers.2.mlp.down_proj.weight"
    tensors[key] = torch.full_like(tensors[key], 3e38)  # finite in bfloat16 and float32; two of them sum to inf
    model = fresh_model(tiny_qwen3, dtype)
    load_weights(model, rewritten(tiny_qwen3, tmp_path / "large", tensors), device="cpu", dtype=dtype,
                 progress=False)  # fmt: skip
    assert torch.equal(model.get_parameter(key), tensors[key].to(dtype))


def test_a_model_built_in_another_dtype_is_refused(tiny_qwen3):
    model = fresh_model(tiny_qwen3, torch.float32)
    with pytest.raises(ValueError, match=r"loading in torch.bfloat16 needs a model built in torch.bfloat16 .*: "
                                         r"model.embed_tokens.weight is torch.float32, .* and \d+ more$"):  # fmt: skip
        load_weights(model, tiny_qwen3, device="cpu", dtype=torch.bfloat16, progress=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loading_makes_no_full_size_copy_beside_the_parameter(tiny_qwen3, dtype):
    """Peak memory is the model plus the checkpoint tensor being read: casting to the model's dtype happens inside
    copy_, and the non-finite check makes no float copy (isfinite() would: abs(x); the 0.8B's embedding is 1 GB in
    float32)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class FloatOutputs(TorchDispatchMode):
        """Every floating-point tensor an op allocates (views and in-place ops allocate none)."""

        def __init__(self) -> None:
            super().__init__()
            self.created: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            aliases = func._schema.returns and func._schema.returns[0].alias_info is not None
            if not aliases and isinstance(out, torch.Tensor) and out.is_floating_point():
                self.created.append((str(func), out.numel()))
            return out

    model = fresh_model(tiny_qwen3, dtype)
    largest = max(p.numel() for p in model.parameters())
    assert model.model.embed_tokens.weight.numel() == largest
    with FloatOutputs() as ops:
        load_weights(model, tiny_qwen3, device="cpu", dtype=dtype, progress=False)
    assert [(op, n) for op, n in ops.created if n >= largest] == []


def sharded_copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("kept_bytes", [0, 5, 100, -1])
def test_truncated_or_empty_shard_names_the_file(tiny_qwen3, tmp_path, kept_bytes):
    broken = sharded_copy(tiny_qwen3, tmp_path / "truncated")
    shard = sorted(broken.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: kept_bytes % len(data)])
    with pytest.raises(WeightLoadError, match=rf"{shard.name}: not a complete safetensors file .*incomplete download"):
        load_model(broken, dtype="float32", device="cpu", progress=False)


def test_truncated_single_file_names_the_file(tiny_qwen3, tmp_path):
    single = rewritten(tiny_qwen3, tmp_path / "single", read_all(tiny_qwen3))
    path = single / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightLoadError, match=r"model\.safetensors: not a complete safetensors file"):
        load_model(single, dtype="float32", device="cpu", progress=False)


def edit_index(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors.index.json"
    path.write_text(edit(path.read_text()))


def with_weight_map(change):
    def edit(text: str) -> str:
        index = json.loads(text)
        change(index["weight_map"])
        return json.dumps(index)

    return edit


@pytest.mark.parametrize(
    "label, edit, message",
    [
        ("not JSON", lambda text: text[: len(text) // 2], "model.safetensors.index.json: not valid JSON"),
        ("a list", lambda text: "[]", "model.safetensors.index.json: expected a JSON object"),
        ("no weight_map", lambda text: json.dumps({"metadata": {}}), "has no 'weight_map'"),
        ("weight_map a list", lambda text: json.dumps({"weight_map": []}), "'weight_map' must map"),
        (
            "a key in the wrong shard",
            with_weight_map(lambda m: m.update({"model.norm.weight": sorted(set(m.values()))[0]})),
            r"not in file: model\.norm\.weight \(model\.safetensors\.index\.json maps it to model-00001-of-",
        ),
        (
            "a shard that does not exist",
            with_weight_map(lambda m: m.update({"model.norm.weight": "model-00003-of-00002.safetensors"})),
            r"model-00003-of-00002\.safetensors: no such file \(model\.safetensors\.index\.json lists it",
        ),
    ],
)
def test_broken_index_names_the_file_and_the_problem(tiny_qwen3, tmp_path, label, edit, message):
    broken = sharded_copy(tiny_qwen3, tmp_path / "index")
    edit_index(broken, edit)
    with pytest.raises(WeightLoadError, match=message):
        load_model(broken, dtype="float32", device="cpu", progress=False)


# No machine holds data on "meta" or has a hundred GPUs.
@pytest.mark.parametrize("device", ["meta", torch.device("meta"), "cuda:99"])
def test_device_that_cannot_hold_the_weights_is_rejected_before_loading(tiny_qwen3, device, monkeypatch):
    from a4 import LLM

    def no_read(*args, **kwargs):
        raise AssertionError("the checkpoint was opened for a device that cannot hold it")

    monkeypatch.setattr(weights, "safe_open", no_read)
    with pytest.raises(ValueError, match=r"device '(meta|cuda:99)'"):
        LLM(tiny_qwen3, device=device)
    with pytest.raises(ValueError, match=r"device '(meta|cuda:99)'"):
        load_model(tiny_qwen3, dtype="float32", device=device, progress=False)
