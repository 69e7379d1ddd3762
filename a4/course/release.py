"""release: the student handout, a copy of the repository that works on its own.

The files are those git would commit (tracked files plus untracked files that .gitignore does not exclude, so a
release made before the latest commit still holds the latest work), except:
- `solutions/`, and the tests that are the course's own: the handout's `tests/` are the student's (STUDENT_TESTS),
  run against their code by `make test`;
- the files under `handout/`, which replace the files at the same paths: the student's Makefile, README and book
  intro, whose commands all work without solutions/;
- `book/_config.yml` is the course's with notebook execution turned off: the student's book shows their notebooks
  as they saved them.
Notebooks are cleared of outputs. The student files in `a4/` are already the skeleton (`check` keeps them in sync),
so the handout's `a4` imports and runs Qwen3 without any solution.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import nbformat

from a4.course.exercises import SOLUTIONS_DIR

HANDOUT_DIR = "handout"
TESTS_DIR = "tests"
# The student's tests, run by `make test` in the handout: the tests of the exercises, end to end through the engine,
# and of the environment, with the modules they share. The other files of tests/ stay with the course: tests of its
# tooling (they need solutions/), of the engine the student is given, of its robustness.
STUDENT_TESTS = frozenset(
    {
        "conftest.py",
        "test_environment.py",
        "test_config.py",
        "test_qwen3_5_weights.py",
        "test_gated_attention.py",
        "test_deltanet.py",
        "test_state_pool.py",
        "test_hybrid_memory.py",
        "test_hybrid_radix_cache.py",
        "test_moe.py",
        "test_gdn_decode.py",
        "test_speculative_verify.py",
        "test_tensor_parallel_split.py",
        "test_qwen3_5_model.py",
        "test_engine_qwen3_5.py",
    }
)
BOOK_CONFIG = Path("book/_config.yml")
EXECUTE_NOTEBOOKS = re.compile(r"^(?P<key>\s*execute_notebooks:).*$", re.MULTILINE)


# solutions/ files that a handout needs as data, and where the handout keeps them (a4.course.checks.common reads both).
MEASURED_DATA = {Path("solutions/report/h200_gpu.json"): Path("notebooks/data/h200_gpu.json")}


class ReleaseError(RuntimeError):
    pass


def repository_files(repo: Path) -> list[Path]:
    try:
        listing = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=repo,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise ReleaseError(f"{repo}: cannot list the repository's files with git ({e})") from None
    return sorted(Path(name) for name in listing.decode().split("\0") if name)


def ships(path: Path) -> bool:
    """Whether a repository file goes into the handout as it is."""
    if path.parts[0] in (SOLUTIONS_DIR, HANDOUT_DIR):
        return False
    return path.parts[0] != TESTS_DIR or path.name in STUDENT_TESTS


def handout_files(repo: Path) -> list[Path]:
    """Relative paths of the files copied as they are (files deleted but not yet staged are left out)."""
    return [path for path in repository_files(repo) if ships(path) and (repo / path).is_file()]


def student_files(repo: Path) -> list[Path]:
    """The files of handout/, by the path they take in the handout."""
    base = repo / HANDOUT_DIR
    return sorted(path.relative_to(base) for path in base.rglob("*") if path.is_file())


def clear_notebook(source: Path, target: Path) -> None:
    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(notebook, target)


def student_book_config(text: str) -> str:
    """The course's book config with notebook execution off."""
    config, count = EXECUTE_NOTEBOOKS.subn(r'\g<key> "off"', text)
    if count != 1:
        raise ReleaseError(f"{BOOK_CONFIG}: expected one `execute_notebooks:` setting to turn off, found {count}")
    header = "# The course's book config, written by `python -m a4.course release`: notebooks are not executed.\n"
    return header + config


def release(repo: Path, out_dir: Path) -> list[Path]:
    """Write the handout to out_dir (which must not exist or be empty); returns the files written."""
    repo, out_dir = repo.resolve(), out_dir.resolve()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ReleaseError(f"{out_dir} exists and is not empty")
    if out_dir == repo or repo in out_dir.parents:
        # git would list the handout's own files on the next release and copy solutions/ twice over.
        raise ReleaseError(f"{out_dir} is inside the repository; write the handout elsewhere")
    copied, replacements = handout_files(repo), student_files(repo)
    for path in copied:
        target = out_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".ipynb":
            clear_notebook(repo / path, target)
        elif path == BOOK_CONFIG:
            target.write_text(student_book_config((repo / path).read_text()))
        else:
            shutil.copy2(repo / path, target)
    for path in replacements:
        (out_dir / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / HANDOUT_DIR / path, out_dir / path)
    # The H200 figures notebook 10 draws: measured data, not a solution, though the course keeps them with its report.
    for source, target in MEASURED_DATA.items():
        if (repo / source).is_file():
            (out_dir / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(repo / source, out_dir / target)
            replacements = [*replacements, target]
    return sorted(set(copied) | set(replacements))
