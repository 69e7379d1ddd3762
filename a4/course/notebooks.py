"""Running a checkout's notebooks under nbval and reading back one result per cell.

Every run is a pytest subprocess: `--nbval-lax --nbval-current-env` (the kernel is this Python; stored outputs are
never compared, the notebooks store none), the cells named by `a4.course.nbval_plugin`, notebooks spread over
workers a whole file at a time (`-n N --dist loadfile`: the cells of one notebook share one kernel). The kernel
inherits the environment: `A4_SOLUTIONS` chooses the reference solutions or the student's code, `PYTHONPATH` makes
`import a4` load the checkout being run, and an `IPYTHONDIR` whose kernel config turns colours off keeps
tracebacks readable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import nbformat

from a4.course.nbval_plugin import CHECK_TAG, check_ids_of

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
CELL_TIMEOUT_S = 600
# pytest exit codes that mean "the run happened" (0: all passed, 1: some cells failed).
RAN = (0, 1)


@dataclass(frozen=True)
class CellResult:
    notebook: str  # file name, e.g. "01_config.ipynb"
    cell: int  # code cell number, as nbval counts them
    check_id: str | None
    outcome: str  # "passed", "failed" or "skipped"
    ename: str  # the exception the cell raised, "" when it passed
    evalue: str
    traceback: str
    duration: float

    @property
    def name(self) -> str:
        return f"{self.notebook}::{self.check_id or f'Cell {self.cell}'}"

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"

    @property
    def error(self) -> str:
        """The first line of the failure, as a student would read it."""
        first_line = self.evalue.strip().splitlines()[0] if self.evalue.strip() else ""
        return f"{self.ename}: {first_line}" if first_line else self.ename

    @property
    def exercise_not_implemented(self) -> bool:
        """The cell failed because it reached an exercise that still raises its NotImplementedError."""
        return self.ename == "NotImplementedError" and self.evalue.startswith("Exercise ")


class NotebookRunError(RuntimeError):
    """pytest could not run the notebooks at all (a usage error, a collection error, an internal error)."""


def notebook_paths(repo: Path) -> list[Path]:
    return sorted((repo / "notebooks").glob(NOTEBOOK_GLOB))


def select(notebooks: list[Path], prefixes: list[str] | None) -> list[Path]:
    """The notebooks whose file name starts with one of `prefixes` ("01", "01_config"); all when None."""
    if not prefixes:
        return notebooks
    return [path for path in notebooks if any(path.name.startswith(prefix) for prefix in prefixes)]


def read_notebook(path: Path) -> nbformat.NotebookNode:
    return nbformat.read(path, as_version=4)


def check_cells(notebook: nbformat.NotebookNode) -> list[str]:
    """The check ids of a notebook's check cells, in order."""
    return [
        ids[0]
        for cell in notebook.cells
        if cell.cell_type == "code" and CHECK_TAG in cell.metadata.get("tags", []) and (ids := check_ids_of(cell))
    ]


def _ipython_dir(parent: Path) -> Path:
    profile = parent / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text('c.InteractiveShell.colors = "nocolor"\n')
    return parent / "ipython"


def run_notebooks(
    notebooks: list[Path],
    repo: Path,
    solutions: bool | None,
    workers: int = 2,
    junit: Path | None = None,
) -> list[CellResult]:
    """Run notebooks of the checkout `repo` and return every cell's result.

    solutions: True sets A4_SOLUTIONS=1, False removes it, None keeps the caller's environment.
    """
    if not notebooks:
        return []
    with tempfile.TemporaryDirectory(prefix="a4-notebooks-") as tmp:
        results_path = Path(tmp) / "results.jsonl"
        env = dict(os.environ)
        if solutions is True:
            env["A4_SOLUTIONS"] = "1"
        elif solutions is False:
            env.pop("A4_SOLUTIONS", None)
        env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])])
        env["IPYTHONDIR"] = str(_ipython_dir(Path(tmp)))
        command = [
            sys.executable, "-m", "pytest",
            "-p", "a4.course.nbval_plugin", "-p", "no:cacheprovider",
            "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={CELL_TIMEOUT_S}",
            f"--a4-results={results_path}", f"--rootdir={repo}", "-q", "--tb=no", "--no-header",
        ]  # fmt: skip
        if workers > 1 and len(notebooks) > 1:
            command += ["-n", str(min(workers, len(notebooks))), "--dist", "loadfile"]
            # One kernel per worker: several OpenMP threads per kernel would oversubscribe the cores, and tiny-model
            # forwards then run many times slower.
            env.setdefault("OMP_NUM_THREADS", "1")
        if junit is not None:
            command.append(f"--junitxml={junit}")
        command += [str(path) for path in notebooks]
        run = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
        if run.returncode not in RAN or not results_path.exists():
            raise NotebookRunError(f"pytest exited with {run.returncode}:\n{run.stdout}\n{run.stderr}")
        records = [json.loads(line) for line in results_path.read_text().splitlines()]
    results = [CellResult(**record) for record in records]
    return sorted(results, key=lambda r: (r.notebook, r.cell))
