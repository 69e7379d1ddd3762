"""Checks of notebook 02: a4 loading a multimodal Qwen3.5 checkpoint, against transformers loading the same files.

The ground truth for the values is transformers' `Qwen3_5ForConditionalGeneration.from_pretrained` on the same
directory: every tensor a4 holds must be bitwise equal to the one transformers holds for the same checkpoint key.
The ground truth for what to skip is the checkpoint's own layout: its keys grouped by prefix (`key_group`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from a4.course.checks import CheckFailed, conclude, error_problems
from a4.models.registry import load_model
from a4.models.weights import WeightLoadError, checkpoint_files

LANGUAGE_MODEL, VISION, MTP, LM_HEAD, OTHER = "language model", "vision encoder", "MTP", "lm_head", "other"
SKIPPED_GROUPS = (VISION, MTP)


def key_group(key: str) -> str:
    """Which part of a Qwen3.5 checkpoint a key belongs to, by its prefix."""
    if key.startswith("model.language_model."):
        return LANGUAGE_MODEL
    if key.startswith("model.visual."):
        return VISION
    if key.startswith("mtp."):
        return MTP
    return LM_HEAD if key == "lm_head.weight" else OTHER


def transformers_name(a4_name: str) -> str:
    """The name transformers' Qwen3_5ForConditionalGeneration gives the parameter a4 calls `a4_name`.

    a4 names its text model like a text-only checkpoint (`model.layers...`); transformers nests it in
    `model.language_model`. lm_head is top-level in both.
    """
    return a4_name if a4_name == "lm_head.weight" else "model.language_model." + a4_name.removeprefix("model.")


def _load(model_dir: Path):
    """(a4 model, LoadReport), float32 on CPU, through the registry and so through your key map."""
    _, model, report = load_model(model_dir, dtype=torch.float32, device="cpu", progress=False)
    return model, report


def _load_or_fail(model_dir: Path, label: str):
    """_load, with a WeightLoadError turned into a failed check (its message lists every problem)."""
    try:
        return _load(model_dir)
    except WeightLoadError as e:
        raise CheckFailed(f"{label}: the checkpoint did not load through your key map: {e}") from None


def check_weight_loading(model_dir: str | Path, label: str | None = None) -> None:
    """Every parameter of a4's model equals transformers' parameter loaded from the same directory."""
    from a4.reference import load_hf_model

    model_dir = Path(model_dir)
    label = label or model_dir.name
    model, report = _load_or_fail(model_dir, label)
    hf_params = dict(load_hf_model(model_dir, "float32").named_parameters(remove_duplicate=False))
    problems = []
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, param in params.items():
        hf_key = transformers_name(name)
        if hf_key not in hf_params:
            problems.append(f"{name}: transformers has no parameter {hf_key}")
        # Both copy the same stored tensor (float32 holds every bfloat16 value): equal, bit for bit.
        elif not torch.equal(param, hf_params[hf_key]):
            problems.append(f"{name}: differs from transformers' {hf_key} (filled from the wrong checkpoint key?)")
    conclude(
        problems,
        f"{label}: all {len(params)} parameters equal transformers' ({len(report.loaded_keys)} tensors read)",
    )


def check_weight_skipped(model_dir: str | Path, label: str | None = None) -> None:
    """The keys skipped are exactly the vision encoder's and the MTP module's; every other key is loaded."""
    model_dir = Path(model_dir)
    label = label or model_dir.name
    _, report = _load_or_fail(model_dir, label)
    keys = [key for keys in checkpoint_files(model_dir).values() for key in keys]
    should_skip = {key for key in keys if key_group(key) in SKIPPED_GROUPS}
    skipped = set(report.skipped_keys)
    problems = [f"{key}: loaded, but it belongs to the {key_group(key)}" for key in sorted(should_skip - skipped)]
    problems += [f"{key}: skipped, but it belongs to the {key_group(key)}" for key in sorted(skipped - should_skip)]
    conclude(problems, f"{label}: skipped exactly the {len(should_skip)} vision and MTP tensors")


def _all_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            tensors |= {key: f.get_tensor(key) for key in f.keys()}
    return tensors


def broken_checkpoints() -> dict[str, tuple[Callable[[dict[str, torch.Tensor]], None], str]]:
    """Edits that break a checkpoint, each with the tensor name its error must mention."""
    missing = "model.language_model.layers.1.linear_attn.A_log"
    misshaped = "model.language_model.layers.3.self_attn.q_proj.weight"
    extra_inside = "model.language_model.layers.0.mlp.bias_proj.weight"
    extra_outside = "model.audio_tower.proj.weight"

    def drop(tensors):
        del tensors[missing]

    def halve(tensors):
        tensors[misshaped] = tensors[misshaped][: tensors[misshaped].shape[0] // 2]

    def add(key):
        return lambda tensors: tensors.update({key: torch.zeros(17, 8, dtype=torch.bfloat16)})

    return {
        # Named by a4's parameter name or by the checkpoint key: either contains this.
        f"missing {missing}": (drop, "layers.1.linear_attn.A_log"),
        f"{misshaped} with half its rows": (halve, misshaped),
        f"extra {extra_inside} (no such parameter)": (add(extra_inside), extra_inside),
        f"extra {extra_outside} (a group a4 does not know)": (add(extra_outside), extra_outside),
    }


def check_weight_errors(model_dir: str | Path) -> None:
    """A missing, a mis-shaped and two unexpected tensors: each load must raise a WeightLoadError naming it."""
    model_dir = Path(model_dir)
    original = _all_tensors(model_dir)
    cases = broken_checkpoints()
    problems = []
    with tempfile.TemporaryDirectory(prefix="a4-broken-") as tmp:
        for i, (label, (edit, mentions)) in enumerate(cases.items()):
            broken = Path(tmp) / f"case{i}"
            broken.mkdir()
            for name in ("config.json", "generation_config.json"):
                (broken / name).write_bytes((model_dir / name).read_bytes())
            tensors = dict(original)
            edit(tensors)
            save_file(tensors, broken / "model.safetensors")
            problems += error_problems(
                label, lambda: _load(broken), WeightLoadError, mentions, accepted="loaded without an error"
            )
    conclude(problems, f"{len(cases)} broken checkpoints each raise a WeightLoadError naming the tensor")
