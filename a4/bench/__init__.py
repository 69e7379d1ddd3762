"""Benchmarks, one module each: `python -m a4 bench <name> [--quick] [--out DIR]` calls `a4.bench.<name>.main`.

A benchmark module defines `main(quick: bool, out_dir: pathlib.Path) -> None`: it measures, writes its figures and
tables under out_dir and prints a short summary. `--quick` is a smaller run for CI and notebooks. The dispatcher
lists every module in this package, so adding a file here is all it takes to add a benchmark. A benchmark that cannot
run on this machine (`bench gpu` without CUDA) raises `Unavailable`; a module may name its own `DEFAULT_OUT_DIR`.
"""

import json
from collections.abc import Callable
from pathlib import Path

from a4._overlay import overlay

overlay(__name__, __path__)


class Unavailable(Exception):
    """This benchmark cannot run on this machine; the message says what it needs."""


def write_report(
    out_dir: str | Path, stem: str, report: dict, plot: Callable[[dict, Path], None], plotted: dict | None = None
) -> None:
    """`report` as out_dir/<stem>.json and `plot(plotted or report, path)` as out_dir/<stem>.png."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(report if plotted is None else plotted, out_dir / f"{stem}.png")
    print(f"wrote {out_dir / stem}.json and .png")
