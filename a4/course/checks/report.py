"""Checks of notebook 08, the report: the memory ledger behind its tables, and the decode cost of each kind of layer.

- The ledger: your `hybrid_ledger` for the models of the report, in bfloat16 and float32, against the arithmetic of
  notebook 06's checks on config.json's own fields (`memory.figures`), and the report's capacity figure (how many
  requests of a given length one H200 holds) computed here from those figures, not with a4's ledger.
- The decode slope: your GatedDeltaNet and GatedAttention layers, built at Qwen3.5-0.8B's shapes, decode one token
  at contexts from 256 to 16k tokens (the measurement of `a4.bench.decode_context`). A timing on a shared machine is
  noisy, so the check asks only for what no noise can fake: the attention layer's time grows with the context, and
  the GDN layer's slope is less than a fifth of the attention layer's. A measurement that misses is repeated
  before the check fails.

`bench_report` finds the full-size figures the notebook draws: the reader's own benchmark run, else the course's
reference run.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from a4._overlay import REPO_ROOT, SOLUTIONS_ROOT
from a4.bench.decode_context import layer_step_seconds, slope_ms_per_1k
from a4.checkpoints import preset_config
from a4.course.checks import conclude
from a4.course.checks.common import weight_bytes
from a4.course.checks.memory import figures
from a4.engine.memory_plan import MemoryLedger
from a4.layers.rope import RotaryEmbedding
from a4.models.config import ModelConfig, parse_config

# The models of the report: (arch, preset) by name.
REPORT_MODELS = {"0.8B": ("qwen3_5", "0.8b"), "35B-A3B": ("qwen3_5_moe", "35b-a3b")}
# One H200, NVIDIA's "141 GB": the total that torch.cuda.mem_get_info reported on one (139.8 GiB). An engine plans
# its pools with a share of it and keeps the rest for activations and the allocator (SGLang's
# --mem-fraction-static is about 0.9 on large GPUs).
H200_BYTES = 150_109_880_320
MEMORY_FRACTION = 0.9
REPORT_CONTEXTS = (4096, 32768)

# Contexts of the decode-slope check, and what it asks.
SLOPE_CONTEXTS = (256, 4096, 8192, 16384)
SLOPE_REPEATS = 5
MIN_SLOPE_RATIO = 5  # the attention layer's slope over the GDN layer's, at least
MIN_ATTENTION_GROWTH = 2  # the attention layer at the longest context over the shortest, at least
ATTEMPTS = 3


# Where `python -m a4 bench NAME --out bench-out` writes NAME.json, and where the course keeps its reference run's.
BENCH_OUT = REPO_ROOT / "bench-out"
REFERENCE_REPORTS = SOLUTIONS_ROOT / "report"


def bench_report(
    name: str, out_dir: Path = BENCH_OUT, reference_dir: Path = REFERENCE_REPORTS
) -> dict[str, Any] | None:
    """The JSON of the benchmark `name` (its command-line name, e.g. "decode-context"): your own run's in out_dir,
    else the course's reference run's (solutions/report/, in the instructor's repository and its book), else None.
    Says which one it found, or how to make it."""
    file_name = f"{name.replace('-', '_')}.json"
    command = f"python -m a4 bench {name} --out {out_dir.name}"
    for folder in (out_dir, reference_dir):
        path = folder / file_name
        if path.exists():
            if folder == reference_dir:
                print(f"The course's reference run: {_shown(path)}\nYour own: {command}")
            return json.loads(path.read_text())
    print(f"No {_shown(out_dir / file_name)} yet. For the full-size figure, run\n    {command}")
    return None


def _shown(path: Path) -> Path:
    """A path relative to the repository when it is inside it (as the notebooks' readers know it)."""
    return path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path


# ------------------------------------------------------------------------------------------------------ the ledger


def pool_budget(arch: str, preset: str, dtype: torch.dtype) -> int:
    """What one H200 leaves for request slots and KV once the weights are loaded (MEMORY_FRACTION of it planned)."""
    return int(H200_BYTES * MEMORY_FRACTION) - weight_bytes(arch, preset, dtype)


def check_ledger(hybrid_ledger: Callable[[ModelConfig, torch.dtype], MemoryLedger]) -> None:
    """Your ledger of the report's models, and the H200 capacities it gives, against config.json arithmetic."""
    problems = []
    for name, (arch, preset) in REPORT_MODELS.items():
        raw = preset_config(arch, preset)
        for dtype in (torch.bfloat16, torch.float32):
            label = f"{name} in {str(dtype).removeprefix('torch.')}"
            fig = figures(raw, dtype)
            ledger = hybrid_ledger(parse_config(raw), dtype)
            for field, want in (
                ("kv_bytes_per_token", fig.kv_bytes_per_token),
                ("state_bytes_per_slot", fig.state_bytes_per_slot),
                ("table_bytes_per_slot", fig.table_bytes_per_slot),
            ):
                got = getattr(ledger, field)
                if got != want:
                    problems.append(f"{label}: {field}: expected {want:,} B (from config.json), got {got:,}")
            budget = pool_budget(arch, preset, dtype)
            for context in REPORT_CONTEXTS:
                # Written out rather than ledger.bytes_per_request: the check does its own arithmetic.
                want = budget // (fig.slot_bytes + context * fig.kv_bytes_per_token)
                got = budget // ledger.bytes_per_request(context)
                if got != want:
                    problems.append(
                        f"{label}: an H200 holds {want:,} requests of {context:,} tokens by config.json, your ledger "
                        f"says {got:,}"
                    )
    conclude(
        problems,
        f"{', '.join(REPORT_MODELS)} in bfloat16 and float32: KV per token, state and table row per slot, and the "
        f"requests of {' and '.join(f'{n:,}' for n in REPORT_CONTEXTS)} tokens an H200 holds, match config.json",
    )


# ---------------------------------------------------------------------------------------------- the decode slope


def decode_layers(gdn_class: type, attention_class: type) -> tuple[ModelConfig, torch.nn.Module, torch.nn.Module]:
    """Your two layers at Qwen3.5-0.8B's shapes, float32, random weights (the attention layer's pool layer is 0)."""
    config = parse_config(preset_config("qwen3_5", "0.8b"))
    torch.manual_seed(0)
    return config, gdn_class(config).eval(), attention_class(config, 0).eval()


def check_decode_slope(gdn_class: type, attention_class: type) -> None:
    """A decode step of your GDN layer costs the same at any context; your attention layer's grows with it."""
    config, gdn, attention = decode_layers(gdn_class, attention_class)
    rotary_emb = RotaryEmbedding(config.rotary_dim, config.rope_theta, max(SLOPE_CONTEXTS) + 1)
    for _ in range(ATTEMPTS):
        times = layer_step_seconds(config, gdn, attention, rotary_emb, SLOPE_CONTEXTS, SLOPE_REPEATS)
        slopes = {name: slope_ms_per_1k(SLOPE_CONTEXTS, seconds) for name, seconds in times.items()}
        problems = _slope_problems(times, slopes)
        if not problems:
            break
    conclude(
        problems,
        f"from {SLOPE_CONTEXTS[0]:,} to {SLOPE_CONTEXTS[-1]:,} tokens of context the attention layer's decode step "
        f"grows by {slopes['attention layer']:.2f} ms per 1k tokens, the GDN layer's changes by "
        f"{slopes['GDN layer']:+.3f} ms per 1k tokens (flat: timing noise moves it either way)",
    )


def _slope_problems(times: dict[str, list[float]], slopes: dict[str, float]) -> list[str]:
    attention, gdn = times["attention layer"], times["GDN layer"]
    shortest, longest = f"{SLOPE_CONTEXTS[0]:,}", f"{SLOPE_CONTEXTS[-1]:,}"
    problems = []
    if attention[-1] < MIN_ATTENTION_GROWTH * attention[0]:
        problems.append(
            f"the attention layer's decode step at {longest} tokens of context ({attention[-1] * 1e3:.2f} ms) is not "
            f"{MIN_ATTENTION_GROWTH}x its step at {shortest} ({attention[0] * 1e3:.2f} ms): does it read every key?"
        )
    if abs(slopes["GDN layer"]) * MIN_SLOPE_RATIO > slopes["attention layer"]:
        problems.append(
            f"the GDN layer's decode step changes by {slopes['GDN layer']:+.3f} ms per 1k tokens of context, not under "
            f"a {MIN_SLOPE_RATIO}th of the attention layer's {slopes['attention layer']:.3f} (GDN: "
            f"{', '.join(f'{t * 1e3:.2f}' for t in gdn)} ms): does it read anything that grows with the context?"
        )
    return problems
