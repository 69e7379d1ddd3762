"""Running a checkout's notebooks under nbval and reading back one result per cell.

Every run is a pytest subprocess: `--nbval-lax --nbval-current-env` (the kernel is this Python; stored outputs are
never compared, the notebooks store none), the cells named and their time bounded by `a4.course.nbval_plugin`,
notebooks spread over workers a whole file at a time (`-n N --dist loadfile`: the cells of one notebook share one
kernel). The kernel inherits the environment: `A4_SOLUTIONS` chooses the reference solutions or the student's code,
`PYTHONPATH` makes `import a4` load the checkout being run, and an `IPYTHONDIR` whose kernel config turns colours
off keeps tracebacks readable. A run given a budget is killed, with every process it started, if it outlives the
budget by more than BACKSTOP_S (the plugin's own limits should have ended it); the cells it had finished count.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import nbformat

from a4.course.exercises import MESSAGE_RE, not_written_yet
from a4.course.nbval_plugin import CHECK_TAG, NOT_RUN, TIMEOUT, check_ids_of

NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
# verify-notebooks' limit per cell: generous, since there a cell that runs long is the course's bug, not a student's.
CELL_TIMEOUT_S = 600
BACKSTOP_S = 120
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
        if self.exercise_not_implemented:
            return not_written_yet(self.evalue)
        first_line = self.evalue.strip().splitlines()[0] if self.evalue.strip() else ""
        if self.ename in (TIMEOUT, NOT_RUN):
            return first_line
        return f"{self.ename}: {first_line}" if first_line else self.ename

    @property
    def exercise_not_implemented(self) -> bool:
        """The cell failed because it reached an exercise that still raises its NotImplementedError."""
        return self.ename == "NotImplementedError" and MESSAGE_RE.fullmatch(self.evalue) is not None


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


def check_cells(notebook: nbformat.NotebookNode) -> dict[str, str]:
    """A notebook's check cells: check id -> source, in order."""
    return {
        ids[0]: cell.source
        for cell in notebook.cells
        if cell.cell_type == "code" and CHECK_TAG in cell.metadata.get("tags", []) and (ids := check_ids_of(cell))
    }


# A markdown heading line ("## 2. Decode is launch-bound"), and a fence line, between which "#" starts no heading.
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>\S.*?)[ \t#]*$")
FENCE = re.compile(r"^[ \t]*(```|~~~)")


def _last_heading(markdown: str) -> str | None:
    """The title of a markdown cell's last heading; None if it has none."""
    heading, fenced = None, False
    for line in markdown.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and (match := HEADING.match(line)):
            heading = match["title"]
    return heading


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def cell_places(notebook: nbformat.NotebookNode) -> dict[int, str]:
    """Where each code cell is, as a reader finds it, by its number as nbval counts them (code cells from 0, what
    CellResult.cell holds): 'under "2. Decode is launch-bound"', the nearest markdown heading above it, with
    ', its 2nd code cell' when several code cells share that heading."""
    headings: list[str | None] = []  # the heading above each code cell, in order
    heading = None
    for cell in notebook.cells:
        if cell.cell_type == "markdown":
            heading = _last_heading(cell.source) or heading
        elif cell.cell_type == "code":
            headings.append(heading)
    total, seen, places = Counter(headings), Counter(), {}
    for number, heading in enumerate(headings):
        seen[heading] += 1
        place = f'under "{heading}"' if heading else "above the first heading"
        places[number] = place if total[heading] == 1 else f"{place}, its {_ordinal(seen[heading])} code cell"
    return places


def _ipython_dir(parent: Path) -> Path:
    profile = parent / "ipython" / "profile_default"
    profile.mkdir(parents=True)
    (profile / "ipython_kernel_config.py").write_text('c.InteractiveShell.colors = "nocolor"\n')
    return parent / "ipython"


def run_notebooks(
    notebooks: list[Path],
    repo: Path,
    solutions: bool,
    workers: int = 2,
    timeout: float = CELL_TIMEOUT_S,
    budget: float | None = None,
    notebook_budget: float | None = None,
    env: dict[str, str] | None = None,
) -> list[CellResult]:
    """Run notebooks of the checkout `repo` and return the result of every cell that ran.

    solutions: True sets A4_SOLUTIONS=1, False removes it. timeout: seconds per cell. budget, notebook_budget:
    seconds for the run and for each notebook, after which no cell starts. env: variables to set for the run.
    """
    if not notebooks:
        return []
    with tempfile.TemporaryDirectory(prefix="a4-notebooks-") as tmp:
        results_path = Path(tmp) / "results.jsonl"
        env = {**os.environ, **(env or {})}
        env.pop("A4_SOLUTIONS", None)
        if solutions:
            env["A4_SOLUTIONS"] = "1"
        env["PYTHONPATH"] = os.pathsep.join([str(repo), *filter(None, [env.get("PYTHONPATH")])])
        env["IPYTHONDIR"] = str(_ipython_dir(Path(tmp)))
        command = [
            sys.executable, "-m", "pytest",
            "-p", "a4.course.nbval_plugin", "-p", "no:cacheprovider",
            "--nbval-lax", "--nbval-current-env", f"--nbval-cell-timeout={timeout:g}",
            f"--a4-results={results_path}", f"--rootdir={repo}", "-q", "--tb=no", "--no-header",
        ]  # fmt: skip
        if budget is not None:
            command.append(f"--a4-budget={budget:g}")
        if notebook_budget is not None:
            command.append(f"--a4-notebook-budget={notebook_budget:g}")
        if workers > 1 and len(notebooks) > 1:
            command += ["-n", str(min(workers, len(notebooks))), "--dist", "loadfile"]
            # One kernel per worker: several OpenMP threads per kernel would oversubscribe the cores, and tiny-model
            # forwards then run many times slower.
            env.setdefault("OMP_NUM_THREADS", "1")
        command += [str(path) for path in notebooks]
        deadline = None if budget is None else budget + timeout + BACKSTOP_S
        returncode, output = _run_killable(command, repo, env, deadline)
        killed = returncode is None
        if not killed and (returncode not in RAN or not results_path.exists()):
            raise NotebookRunError(f"pytest exited with {returncode}:\n{output}")
        text = results_path.read_text() if results_path.exists() else ""
        lines = text.splitlines() if text.endswith("\n") or not killed else text.splitlines()[:-1]
        records = [json.loads(line) for line in lines]
    results = [CellResult(**record) for record in records]
    return sorted(results, key=lambda r: (r.notebook, r.cell))


def _run_killable(command: list[str], cwd: Path, env: dict[str, str], deadline: float | None) -> tuple[int | None, str]:
    """Run command in its own process group; kill the whole group after `deadline` seconds (returncode None)."""
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = process.communicate(timeout=deadline)
        return process.returncode, output
    except BaseException as e:  # the deadline, or the user's Ctrl-C: the pytest workers and kernels go too
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return None, output
