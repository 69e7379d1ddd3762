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

Nothing loads silently wrong: a file that is not a complete safetensors file (an interrupted download), a broken
index, a key the index puts in a file that lacks it, a weight stored as integers or booleans (cast to float it would
load, and the model would emit token 0 for ever) and a NaN or infinite weight are all WeightLoadErrors that name the
file and the tensor.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm.auto import tqdm

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors' dtype names -> bytes per element, to count a tensor's bytes without reading it (for the report only).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_DTYPE_BYTES |= {"F8_E4M3": 1, "F8_E5M2": 1}
# The dtypes a weight may be stored in: floating point. Integers and booleans would cast to float without a word.
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})


class WeightLoadError(ValueError):
    """A checkpoint that cannot fill the model: unreadable files, missing, unexpected, mis-shaped or bad tensors."""


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


@contextmanager
def open_safetensors(path: Path, device: str = "cpu") -> Iterator[Any]:
    """safe_open(path), with a file it cannot read reported as a WeightLoadError naming the file.

    safe_open checks the header against the file's size, so an empty or truncated file fails here, before any
    tensor is read.
    """
    try:
        handle = safe_open(path, framework="pt", device=device)
    except FileNotFoundError:
        raise WeightLoadError(f"{path}: no such file") from None
    except SafetensorError as e:
        raise WeightLoadError(
            f"{path}: not a complete safetensors file ({e}); an empty or cut-short file is usually an incomplete "
            "download: fetch it again"
        ) from None
    with handle as f:
        yield f


def read_index(index_path: Path) -> dict[str, str]:
    """The weight_map of model.safetensors.index.json: checkpoint key -> file name; a WeightLoadError if malformed."""
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise WeightLoadError(f"{index_path}: not valid JSON ({e})") from None
    if not isinstance(index, dict):
        raise WeightLoadError(f"{index_path}: expected a JSON object, got {type(index).__name__}")
    if "weight_map" not in index:
        raise WeightLoadError(f"{index_path}: has no 'weight_map' (which file holds each tensor)")
    weight_map = index["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) for file in weight_map.values()):
        raise WeightLoadError(f"{index_path}: 'weight_map' must map each tensor name to a file name")
    return weight_map


def checkpoint_files(model_dir: str | Path) -> dict[Path, list[str]]:
    """Each safetensors file of a checkpoint and the keys it holds (from the index, or the single file's header)."""
    model_dir = Path(model_dir)
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        files: dict[Path, list[str]] = defaultdict(list)
        for key, file in read_index(index_path).items():
            files[model_dir / file].append(key)
        for path in files:
            if not path.is_file():
                raise WeightLoadError(f"{path}: no such file ({INDEX_FILE} lists it)")
        return dict(files)
    single = model_dir / SINGLE_FILE
    if single.exists():
        with open_safetensors(single) as f:
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
        with open_safetensors(path) as f:
            stored = set(f.keys())
            for key in keys:
                if key not in stored:
                    problems.append(f"not in file: {key} ({INDEX_FILE} maps it to {path.name}, which lacks it)")
                    continue
                meta = f.get_slice(key)  # the header only: the data stays on disk
                shape, dtype = tuple(meta.get_shape()), meta.get_dtype()
                nbytes = prod(shape) * _DTYPE_BYTES.get(dtype, 0)
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
                elif dtype not in FLOAT_DTYPES:
                    problems.append(f"wrong dtype: {key} is {dtype} in {path.name}; weights must be floating point")
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

    Raises WeightLoadError, before reading any tensor, if the checkpoint does not fit the model; and after reading
    them all, listing every tensor with NaN or infinite values (in `dtype`: a finite value too large for it counts).
    """
    targets = loadable_tensors(model)
    reads, report = plan_reads(model, targets, checkpoint_files(model_dir), key_map)
    device = torch.device(device)
    non_finite: list[str] = []
    with tqdm(total=len(report.loaded_keys), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path, pairs in reads.items():
            # safetensors places each tensor straight on the device (no host copy for a GPU).
            with open_safetensors(path, device=str(device)) as f, torch.no_grad():
                for key, name in pairs:
                    tensor = f.get_tensor(key).to(dtype)
                    bad = int((~tensor.isfinite()).sum())
                    if bad:
                        non_finite.append(
                            f"non-finite: {key} has {bad} NaN or infinite value(s) of {tensor.numel()} ({path.name})"
                        )
                    targets[name].copy_(tensor)
                    bar.update()
    if non_finite:
        listing = "".join(f"\n  {problem}" for problem in non_finite)
        raise WeightLoadError(f"checkpoint {model_dir} has weights that are not finite numbers:{listing}")
    return report
