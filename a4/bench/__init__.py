"""Benchmarks, one module each: `python -m a4 bench <name> [--quick] [--out DIR]` calls `a4.bench.<name>.main`.

A benchmark module defines `main(quick: bool, out_dir: pathlib.Path) -> None`: it measures, writes its figures and
tables under out_dir and prints a short summary. `--quick` is a smaller run for CI and notebooks. The dispatcher
lists every module in this package, so adding a file here is all it takes to add a benchmark. A benchmark that cannot
run on this machine (`bench gpu` without CUDA) raises `Unavailable`; a module may name its own `DEFAULT_OUT_DIR`.
"""

from a4._overlay import overlay

overlay(__name__, __path__)


class Unavailable(Exception):
    """This benchmark cannot run on this machine; the message says what it needs."""
