"""Loading a safetensors checkpoint into a model, one tensor at a time.

A checkpoint is `model.safetensors` or shards listed in `model.safetensors.index.json`. Each file is opened with
safetensors' `safe_open`, which memory-maps it: a tensor is read from disk only when asked for, so peak memory stays
near the size of the model, not model + checkpoint.

Loading runs in two passes. The first reads only the files' headers (names, shapes, dtypes) and checks that the
checkpoint fits the model: every parameter present once, nothing unexpected, every shape right. Every problem is
collected and reported in ONE error, because a wrong key map usually breaks many keys at once. The second pass reads
the tensors and copies them in.

`key_map` renames a checkpoint key to the model's parameter name, or returns None for a tensor the model does not use
(for example the vision tower of a multimodal checkpoint); such a tensor is never read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' dtype names -> bytes per element, to count a tensor's bytes without reading it (for the report only).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1}


class WeightLoadError(ValueError):
    """A checkpoint that does not fit the model: missing, unexpected or mis-shaped tensors (all listed)."""


@dataclass
class LoadReport:
    """What load_weights did: checkpoint keys loaded and skipped, and their size on disk."""

    loaded_keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    loaded_bytes: int = 0
    skipped_bytes: int = 0
    files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"loaded {len(self.loaded_keys)} tensors ({self.loaded_bytes / 2**20:.1f} MiB) from "
            f"{len(self.files)} file(s); skipped {len(self.skipped_keys)} ({self.skipped_bytes / 2**20:.1f} MiB)"
        )


def identity(key: str) -> str:
    return key


def checkpoint_files(model_dir: str | Path) -> dict[Path, list[str]]:
    """Each safetensors file of a checkpoint and the keys it holds (from the index, or the single file's header)."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        with open(index_path) as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        files: dict[Path, list[str]] = defaultdict(list)
        for key, file in weight_map.items():
            files[model_dir / file].append(key)
        return dict(files)
    single = model_dir / SINGLE_FILE
    if single.exists():
        with safe_open(single, framework="pt") as f:
            return {single: list(f.keys())}
    raise WeightLoadError(f"{model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found (is this a checkpoint?)")


def loadable_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint must provide: parameters and persistent buffers, each shared tensor once.

    `named_parameters()` lists a tensor shared by two modules (tied embeddings: lm_head.weight IS
    model.embed_tokens.weight) under its first name only, so a checkpoint that omits the alias is complete.
    """
    tensors = dict(model.named_parameters())
    persistent = model.state_dict(keep_vars=True).keys()
    tensors |= {name: buf for name, buf in model.named_buffers() if name in persistent}
    return tensors


def tied_aliases(model: nn.Module) -> set[str]:
    """Second names of shared parameters (e.g. lm_head.weight when tied): a checkpoint may carry them; not needed."""
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()


# file -> [(checkpoint key, model tensor name)] of the tensors to read from it
Reads = dict[Path, list[tuple[str, str]]]


def plan_reads(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    files: dict[Path, list[str]],
    key_map: Callable[[str], str | None],
) -> tuple[Reads, LoadReport]:
    """Check every checkpoint header against the model's tensors; raise WeightLoadError listing all problems."""
    aliases = tied_aliases(model)
    report = LoadReport(files=[path.name for path in files])
    reads: Reads = defaultdict(list)
    problems: list[str] = []
    source_of: dict[str, str] = {}  # model tensor name -> the checkpoint key that fills it
    for path, keys in files.items():
        with safe_open(path, framework="pt") as f:
            for key in keys:
                meta = f.get_slice(key)  # the header only: the data stays on disk
                shape = tuple(meta.get_shape())
                nbytes = prod(shape) * _DTYPE_BYTES.get(meta.get_dtype(), 0)
                name = key_map(key)
                if name is None or name in aliases:
                    report.skipped_keys.append(key)
                    report.skipped_bytes += nbytes
                    continue
                target = targets.get(name)
                if target is None:
                    problems.append(f"unexpected: {key} {shape}" + (f" (mapped to {name})" if name != key else ""))
                    continue
                if name in source_of:
                    problems.append(f"loaded twice: {name} from both {source_of[name]} and {key}")
                    continue
                source_of[name] = key
                if shape != tuple(target.shape):
                    model_shape = tuple(target.shape)
                    problems.append(f"wrong shape: {key} is {shape} in the checkpoint, {model_shape} in the model")
                else:
                    reads[path].append((key, name))
                    report.loaded_keys.append(key)
                    report.loaded_bytes += nbytes
    problems += [f"missing: {name} {tuple(t.shape)}" for name, t in targets.items() if name not in source_of]
    if problems:
        listing = "".join(f"\n  {problem}" for problem in problems)
        raise WeightLoadError(f"checkpoint does not fit {type(model).__name__} ({len(problems)} problems):{listing}")
    return dict(reads), report


def load_weights(
    model: nn.Module,
    model_dir: str | Path,
    *,
    key_map: Callable[[str], str | None] = identity,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = True,
) -> LoadReport:
    """Copy a checkpoint's tensors into `model`'s parameters, cast to `dtype`, on `device`.

    Raises WeightLoadError, before reading any tensor, if the checkpoint does not fit the model.
    """
    targets = loadable_tensors(model)
    reads, report = plan_reads(model, targets, checkpoint_files(model_dir), key_map)
    device = torch.device(device)
    with tqdm(total=len(report.loaded_keys), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path, pairs in reads.items():
            # safetensors places each tensor straight on the device (no host copy for a GPU).
            with safe_open(path, framework="pt", device=str(device)) as f, torch.no_grad():
                for key, name in pairs:
                    targets[name].copy_(f.get_tensor(key).to(dtype))
                    bar.update()
    return report
