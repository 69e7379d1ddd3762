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

Without weight files (`load_format="dummy"`, vLLM's name) `draw_weights` fills the model from config.json alone: each
tensor drawn at random on the device from the tensor plan of a4.checkpoints, the plan's names going through the same
key map and the same checks as a checkpoint's keys. It is for models whose checkpoint would not fit on the disk (a
benchmark of Qwen3.5-35B-A3B's shapes); on the CPU it gives the weights `make_checkpoint` would write.
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

from a4.checkpoints import arch_of, draw_tensor, tensor_plan
from a4.models.config import read_json

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
    """What load_weights did: checkpoint keys loaded and skipped, their size on disk and the files read. Or what
    draw_weights did (`random_seed` set): the plan's keys drawn and skipped, their size in a checkpoint, no files."""

    loaded_keys: list[str] = field(default_factory=list)
    skipped_keys: list[str] = field(default_factory=list)
    loaded_bytes: int = 0
    skipped_bytes: int = 0
    files: list[str] = field(default_factory=list)
    random_seed: int | None = None

    def summary(self) -> str:
        skipped = f"skipped {len(self.skipped_keys)} ({self.skipped_bytes / 2**20:.1f} MiB)"
        if self.random_seed is not None:
            return (
                f"drew {len(self.loaded_keys)} random tensors ({self.loaded_bytes / 2**20:.1f} MiB in a checkpoint) "
                f"with seed {self.random_seed}, read no file; {skipped}"
            )
        return (
            f"loaded {len(self.loaded_keys)} tensors ({self.loaded_bytes / 2**20:.1f} MiB) from "
            f"{len(self.files)} file(s); {skipped}"
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


def tensors_to_fill(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`loadable_tensors(model)`, each of which must already be in `dtype`: the loaders cast every tensor to its
    parameter's dtype as they copy it in, so a model built in another dtype would silently stay in that one."""
    tensors = loadable_tensors(model)
    wrong = [f"{name} is {tensor.dtype}" for name, tensor in tensors.items() if tensor.dtype != dtype]
    if wrong:
        raise ValueError(
            f"loading in {dtype} needs a model built in {dtype} (e.g. under torch.set_default_dtype): "
            + ", ".join(wrong[:3]) + (f" and {len(wrong) - 3} more" if len(wrong) > 3 else "")
        )
    return tensors


def tied_aliases(model: nn.Module) -> set[str]:
    """Second names of shared parameters (e.g. lm_head.weight when tied): a checkpoint may carry them; not needed."""
    return {name for name, _ in model.named_parameters(remove_duplicate=False)} - dict(model.named_parameters()).keys()


class _Fit:
    """Checkpoint keys against a model's tensors, one key at a time (from the files' headers or from a tensor plan):
    every problem collected, to be raised together by `check`, and the report counted."""

    def __init__(
        self,
        model: nn.Module,
        targets: dict[str, torch.Tensor],
        key_map: Callable[[str], str | None],
        report: LoadReport,
    ) -> None:
        self.model, self.targets, self.key_map, self.report = model, targets, key_map, report
        self.aliases = tied_aliases(model)
        self.problems: list[str] = []
        self.source_of: dict[str, str] = {}  # model tensor name -> the checkpoint key that fills it

    def match(self, key: str, shape: tuple[int, ...], nbytes: int) -> str | None:
        """The model tensor `key` fills; None if the key map skips it (counted as skipped) or it fits none (a
        problem). The caller counts a match it keeps with `take`."""
        name = self.key_map(key)
        if name is None or name in self.aliases:
            self.report.skipped_keys.append(key)
            self.report.skipped_bytes += nbytes
            return None
        target = self.targets.get(name)
        if target is None:
            self.problems.append(f"unexpected: {key} {shape}" + (f" (mapped to {name})" if name != key else ""))
            return None
        if name in self.source_of:
            self.problems.append(f"loaded twice: {name} from both {self.source_of[name]} and {key}")
            return None
        self.source_of[name] = key
        if shape != tuple(target.shape):
            model_shape = tuple(target.shape)
            self.problems.append(f"wrong shape: {key} is {shape} in the checkpoint, {model_shape} in the model")
            return None
        return name

    def take(self, key: str, nbytes: int) -> None:
        self.report.loaded_keys.append(key)
        self.report.loaded_bytes += nbytes

    def check(self, source: str) -> None:
        """Raise WeightLoadError listing every problem, each model tensor that no key fills included."""
        problems = self.problems + [
            f"missing: {name} {tuple(t.shape)}" for name, t in self.targets.items() if name not in self.source_of
        ]
        if problems:
            listing = "".join(f"\n  {problem}" for problem in problems)
            raise WeightLoadError(
                f"{source} does not fit {type(self.model).__name__} ({len(problems)} problems):{listing}"
            )


# file -> [(checkpoint key, model tensor name)] of the tensors to read from it
Reads = dict[Path, list[tuple[str, str]]]


def plan_reads(
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    files: dict[Path, list[str]],
    key_map: Callable[[str], str | None],
) -> tuple[Reads, LoadReport]:
    """Check every checkpoint header against the model's tensors; raise WeightLoadError listing all problems."""
    report = LoadReport(files=[path.name for path in files])
    fit = _Fit(model, targets, key_map, report)
    reads: Reads = defaultdict(list)
    for path, keys in files.items():
        with open_safetensors(path) as f:
            stored = set(f.keys())
            for key in keys:
                if key not in stored:
                    fit.problems.append(f"not in file: {key} ({INDEX_FILE} maps it to {path.name}, which lacks it)")
                    continue
                meta = f.get_slice(key)  # the header only: the data stays on disk
                shape, dtype = tuple(meta.get_shape()), meta.get_dtype()
                nbytes = prod(shape) * _DTYPE_BYTES.get(dtype, 0)
                name = fit.match(key, shape, nbytes)
                if name is None:
                    continue
                if dtype not in FLOAT_DTYPES:
                    fit.problems.append(f"wrong dtype: {key} is {dtype} in {path.name}; weights must be floating point")
                    continue
                reads[path].append((key, name))
                fit.take(key, nbytes)
    fit.check("checkpoint")
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
    """Copy a checkpoint's tensors into `model`'s parameters, built in `dtype` on `device`, casting as they are copied.

    Raises WeightLoadError, before reading any tensor, if the checkpoint does not fit the model; and after reading
    them all, listing every tensor with NaN or infinite values (in `dtype`: a finite value too large for it counts).
    """
    targets = tensors_to_fill(model, dtype)
    reads, report = plan_reads(model, targets, checkpoint_files(model_dir), key_map)
    device = torch.device(device)
    non_finite: list[str] = []
    with tqdm(total=len(report.loaded_keys), desc="loading weights", unit="tensor", disable=not progress) as bar:
        for path, pairs in reads.items():
            # safetensors places each tensor straight on the device (no host copy for a GPU).
            with open_safetensors(path, device=str(device)) as f, torch.no_grad():
                for key, name in pairs:
                    target = targets[name]
                    # copy_ casts to the parameter's dtype as it copies: a bfloat16 checkpoint loaded in float32
                    # never holds a float32 copy beside the parameter (for the 0.8B's embedding, 1 GB at the peak).
                    target.copy_(f.get_tensor(key))
                    # Checked in `dtype`, where a value too large for it is inf. A NaN or inf makes the sum non-finite
                    # (so can finite values whose sum overflows: the count decides), and a sum allocates nothing of
                    # the parameter's size, where isfinite() does (it computes abs(x)).
                    if not bool(target.sum().isfinite()) and (bad := int((~target.isfinite()).sum())):
                        non_finite.append(
                            f"non-finite: {key} has {bad} NaN or infinite value(s) of {target.numel()} ({path.name})"
                        )
                    bar.update()
    if non_finite:
        listing = "".join(f"\n  {problem}" for problem in non_finite)
        raise WeightLoadError(f"checkpoint {model_dir} has weights that are not finite numbers:{listing}")
    return report


def draw_weights(
    model: nn.Module,
    model_dir: str | Path,
    *,
    key_map: Callable[[str], str | None] = identity,
    device: torch.device | str,
    dtype: torch.dtype,
    progress: bool = True,
    seed: int = 0,
) -> LoadReport:
    """load_weights without weight files: fill `model` with random tensors from the tensor plan of the architecture
    config.json names (a4.checkpoints), drawn on `device`, and return what was drawn.

    Each tensor is drawn as the checkpoint writer draws it (`draw_tensor`: its own generator seeded by (seed, name),
    float32 rounded to the checkpoints' bfloat16), so on the CPU the model holds the weights of
    `make_checkpoint(..., seed=seed, verify=False)` in `dtype`. The plan's names go through `key_map` and the checks
    of load_weights before anything is drawn: a tensor of the model that no plan entry fills is a WeightLoadError
    naming it. One tensor at a time: peak memory is the model and one tensor's draw.
    """
    config = read_json(Path(model_dir) / "config.json")
    arch = arch_of(config["architectures"][0])
    targets = tensors_to_fill(model, dtype)
    report = LoadReport(random_seed=seed)
    fit = _Fit(model, targets, key_map, report)
    draws = []
    for spec in tensor_plan(arch, config):
        name = fit.match(spec.name, spec.shape, spec.nbytes)
        if name is not None:
            draws.append((spec, name))
            fit.take(spec.name, spec.nbytes)
    fit.check(f"the {arch} tensor plan of a4.checkpoints (load_format='dummy')")
    bar = tqdm(total=len(draws), desc="drawing random weights", unit="tensor", disable=not progress)
    with bar, torch.no_grad():
        for spec, name in draws:
            # copy_ casts to the parameter's dtype: no second full-size copy of the draw.
            targets[name].copy_(draw_tensor(spec, seed, device))
            bar.update()
    return report


# How load_model fills a model, by `load_format`: the checkpoint's safetensors files, or random weights drawn on the
# device from config.json alone ("dummy", as vLLM names it).
WEIGHT_LOADERS: dict[str, Callable[..., LoadReport]] = {"safetensors": load_weights, "dummy": draw_weights}
LOAD_FORMATS = tuple(WEIGHT_LOADERS)


def weight_loader(load_format: str) -> Callable[..., LoadReport]:
    """load_weights or draw_weights, by `load_format`; a ValueError naming any other value."""
    if not isinstance(load_format, str) or load_format not in WEIGHT_LOADERS:
        raise ValueError(f"unknown load_format {load_format!r} (expected one of {LOAD_FORMATS})")
    return WEIGHT_LOADERS[load_format]
