"""The student handout for the tests: building one, solving it, and running the commands its documents mention.

The documents are the handout's README and book intro (from handout/) and the notebooks' text. A command is a line
of a fenced `bash` block or inline code that starts with `make `, `python -m ` or `.venv/bin/`. Each runs in the
handout as documented, in this test's environment: `make` is pointed at this Python (and never installs), `python`
is this Python with the handout first on the path. To keep the tests fast, grading covers notebook 01 and the
benchmarks run `--quick`; a server is only asked for its version (JupyterLab) or its usage (`python -m a4 serve`).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat

from a4._overlay import REPO_ROOT
from a4.checkpoints import cache_root
from a4.course.exercises import solution_files, student_path_of
from a4.course.release import HANDOUT_DIR, release

DOCUMENTS = ("README.md", "book/intro.md")
FENCE = re.compile(r"^```(?:bash|sh|shell|console)\n(?P<body>.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(?P<command>(?:make |python -m |\.venv/bin/)[^`]*)`")
GRADED_NOTEBOOK = "01"
# Make variables that only concern installing: with the install step skipped they change nothing.
INSTALL_VARIABLES = ("TORCH",)


def commands_in(text: str) -> set[str]:
    found = set()
    for block in FENCE.finditer(text):
        for line in block["body"].splitlines():
            if command := re.sub(r"\s+#.*$", "", line).strip():
                found.add(command)
    return found | {match["command"].strip() for match in INLINE.finditer(FENCE.sub("", text))}


def documented_commands(repo: Path = REPO_ROOT) -> list[str]:
    """Every command the handout's documents mention, as written."""
    found = set()
    for document in DOCUMENTS:
        found |= commands_in((repo / HANDOUT_DIR / document).read_text())
    for path in sorted((repo / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                found |= commands_in(cell.source)
    return sorted(found)


# How the test runs a documented command: its words, "python" standing for this Python.
Run = tuple[str, ...]


def as_run(command: str) -> Run:
    """The documented command in this environment (the module docstring says how it differs)."""
    words = shlex.split(command)
    if words[0] == "make":
        variables = [w for w in words[1:] if "=" in w and w.split("=", 1)[0] not in INSTALL_VARIABLES]
        targets = [w for w in words[1:] if "=" not in w]
        if "grade" in targets and not any(v.startswith("GRADE_ARGS=") for v in variables):
            variables.append(f"GRADE_ARGS=--notebook {GRADED_NOTEBOOK}")
        if "bench" in targets:
            variables.append("BENCH_ARGS=--quick")
        return ("make", *targets, *sorted(variables))
    if words[0] in ("python", ".venv/bin/python"):
        words = ["python", *words[1:]]
        if words[1:4] == ["-m", "a4.course", "grade"] and "--notebook" not in words:
            words += ["--notebook", GRADED_NOTEBOOK]
        if words[1:4] == ["-m", "a4", "bench"]:
            words += ["--quick"]
        if words[1:4] == ["-m", "a4", "serve"]:
            words = [*words[:4], "--help"]  # a server runs until stopped: it is asked for its usage
        return tuple(words)
    if words[0] == ".venv/bin/jupyter":
        return (words[0], words[1], "--version")
    raise ValueError(f"the handout test does not know how to run {command!r}")


def runs(repo: Path = REPO_ROOT) -> list[Run]:
    """The distinct runs of the documented commands (`make TORCH= demo` is `make demo` here)."""
    return sorted({as_run(command) for command in documented_commands(repo)})


def environment(handout: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("A4_SOLUTIONS", "PYTEST_ADDOPTS", "MAKEFLAGS")}
    # The handout builds no checkpoint of its own: it shares the repository's cache (keys are content hashes).
    shared = {"PYTHONPATH": str(handout), "A4_CACHE_DIR": str(cache_root().parent), "OMP_NUM_THREADS": "1"}
    return {**env, **shared, **extra}


def argv_of(run: Run) -> list[str]:
    venv = Path(sys.prefix)
    if run[0] == "make":
        # -o: the install step is taken as done, whatever the dates; it must never run against this environment.
        return ["make", "-o", str(venv / ".installed"), f"VENV={venv}", f"PY={sys.executable}", *run[1:]]
    if run[0] == "python":
        return [sys.executable, *run[1:]]
    return [str(venv / "bin" / Path(run[0]).name), *run[1:]]


def run_in(handout: Path, run: Run, **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv_of(run), cwd=handout, env=environment(handout, **extra_env), capture_output=True, text=True
    )


def make_handout(parent: Path) -> Path:
    out = parent / "a4-handout"
    release(REPO_ROOT, out)
    return out


def solve(handout: Path) -> None:
    """Copy the reference solutions over the student files."""
    for path in solution_files(REPO_ROOT):
        shutil.copy(REPO_ROOT / path, handout / student_path_of(path))
