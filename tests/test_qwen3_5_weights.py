"""Loading a multimodal Qwen3.5 checkpoint into a4's text-only model, against transformers' loading of it.

transformers' Qwen3_5ForConditionalGeneration loads the same directory; every tensor a4 loads must equal the one
transformers holds under the checkpoint's name. The vision encoder and the MTP module must be skipped, and never
read; a broken checkpoint (a tensor missing, one too many, one of the wrong shape) must fail naming the tensor.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import a4.models.weights
from a4.checkpoints import tiny_checkpoint
from a4.course.checks.weights import SKIPPED_GROUPS, check_weight_errors, key_group, transformers_name
from a4.models.registry import load_model
from a4.models.weights import WeightLoadError
from a4.reference import cached_hf_model


@pytest.fixture(scope="module", params=["tied", "untied"])
def checkpoint(request) -> Path:
    # The tiny preset ties its embeddings, as Qwen3.5-0.8B does; the untied one has lm_head.weight, as 9B does.
    if request.param == "tied":
        return tiny_checkpoint("qwen3_5")
    return tiny_checkpoint("qwen3_5", tie_word_embeddings=False)


@functools.cache
def loaded(checkpoint: Path):
    """(a4 model, LoadReport), float32 on CPU."""
    _, model, report = load_model(checkpoint, dtype=torch.float32, device="cpu", progress=False)
    return model, report


def checkpoint_keys(checkpoint: Path) -> set[str]:
    return set(json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"])


def test_loaded_parameters_equal_transformers(checkpoint):
    model, _ = loaded(checkpoint)
    hf_params = dict(cached_hf_model(checkpoint, "float32").named_parameters(remove_duplicate=False))
    ours = dict(model.named_parameters(remove_duplicate=False))
    # Every text-model parameter of transformers exists in a4, and nothing else does.
    hf_text = {name for name in hf_params if name.startswith("model.language_model.") or name == "lm_head.weight"}
    assert {transformers_name(name) for name in ours} == hf_text
    different = [name for name, param in ours.items() if not torch.equal(param, hf_params[transformers_name(name)])]
    assert not different, f"{len(different)} parameters differ from transformers', e.g. {different[:3]}"


def test_embeddings_tied_exactly_when_the_config_says(checkpoint):
    model, _ = loaded(checkpoint)
    hf = cached_hf_model(checkpoint, "float32")
    tied_in_hf = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied_in_hf
    assert ("lm_head.weight" in checkpoint_keys(checkpoint)) == (not tied_in_hf)


def test_skipped_keys_are_exactly_vision_and_mtp(checkpoint):
    _, report = loaded(checkpoint)
    keys = checkpoint_keys(checkpoint)
    expected_skipped = {key for key in keys if key_group(key) in SKIPPED_GROUPS}
    assert {key_group(key) for key in expected_skipped} == set(SKIPPED_GROUPS)
    assert set(report.skipped_keys) == expected_skipped
    assert set(report.loaded_keys) == keys - expected_skipped


def test_skipped_tensors_are_never_read(checkpoint, monkeypatch):
    read: list[str] = []

    class SpyingSlice:
        """A lazy tensor of safe_open: its header is free to look at, indexing it reads the data."""

        def __init__(self, lazy, key: str) -> None:
            self._lazy, self._key = lazy, key

        def __getitem__(self, index):
            read.append(self._key)
            return self._lazy[index]

        def __getattr__(self, name: str):
            return getattr(self._lazy, name)

    class SpyingFile:
        """safe_open's file object, recording the keys whose data is read."""

        def __init__(self, *args, **kwargs) -> None:
            self._file = safe_open(*args, **kwargs)

        def __enter__(self):
            self._file.__enter__()
            return self

        def __exit__(self, *exc):
            return self._file.__exit__(*exc)

        def get_tensor(self, key: str) -> torch.Tensor:
            read.append(key)
            return self._file.get_tensor(key)

        def get_slice(self, key: str) -> SpyingSlice:
            return SpyingSlice(self._file.get_slice(key), key)

        def __getattr__(self, name: str):
            return getattr(self._file, name)

    monkeypatch.setattr(a4.models.weights, "safe_open", SpyingFile)
    load_model(checkpoint, dtype=torch.float32, device="cpu", progress=False)
    keys = checkpoint_keys(checkpoint)
    assert set(read) == {key for key in keys if key_group(key) not in SKIPPED_GROUPS}


def test_broken_checkpoints_raise_naming_the_tensor():
    # A missing, a mis-shaped, and two unexpected tensors (one inside the language model, one in no known group).
    check_weight_errors(tiny_checkpoint("qwen3_5"))


def with_tensor(source: Path, target: Path, key: str, edit) -> Path:
    """A copy of the sharded checkpoint `source` whose tensor `key` is edit(tensor), rewritten in its own shard."""
    shutil.copytree(source, target)
    shard = target / json.loads((target / "model.safetensors.index.json").read_text())["weight_map"][key]
    with safe_open(shard, framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    tensors[key] = edit(tensors[key])
    save_file(tensors, shard, metadata={"format": "pt"})
    return target


def with_nan(tensor: torch.Tensor) -> torch.Tensor:
    tensor = tensor.clone()
    tensor.view(-1)[0] = float("nan")
    return tensor


A_LOG = "model.language_model.layers.0.linear_attn.A_log"


def test_integer_weight_is_named_by_its_checkpoint_key(tmp_path):
    broken = with_tensor(tiny_checkpoint("qwen3_5"), tmp_path / "int", A_LOG, lambda t: t.to(torch.int32))
    with pytest.raises(WeightLoadError, match=rf"wrong dtype: {re.escape(A_LOG)} is I32 in model-\d+-of-\d+"):
        load_model(broken, dtype=torch.float32, device="cpu", progress=False)


def test_non_finite_weight_is_named_and_a_skipped_one_is_never_read(tmp_path):
    source = tiny_checkpoint("qwen3_5")
    vision = next(key for key in checkpoint_keys(source) if key_group(key) == "vision encoder")
    # A NaN in the vision encoder, which a4 skips without reading it, changes nothing.
    skipped = with_tensor(source, tmp_path / "vision", vision, with_nan)
    load_model(skipped, dtype=torch.float32, device="cpu", progress=False)
    broken = with_tensor(source, tmp_path / "a_log", A_LOG, with_nan)
    with pytest.raises(WeightLoadError, match=rf"non-finite: {re.escape(A_LOG)} has 1 NaN or infinite value"):
        load_model(broken, dtype=torch.float32, device="cpu", progress=False)


def test_truncated_shard_is_named(tmp_path):
    broken = shutil.copytree(tiny_checkpoint("qwen3_5"), tmp_path / "truncated")
    shard = sorted(broken.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(WeightLoadError, match=rf"{shard.name}: not a complete safetensors file"):
        load_model(broken, dtype=torch.float32, device="cpu", progress=False)
