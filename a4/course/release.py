"""release: the student handout, i.e. the repository without `solutions/`, notebooks cleared of outputs.

The files are those git would commit: tracked files plus untracked files that .gitignore does not exclude (so a
release made before the latest commit still holds the latest work). The student files in `a4/` are already the
skeleton (`check` keeps them in sync), so the handout's `a4` imports and runs Qwen3 without any solution.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import nbformat

from a4.course.exercises import SOLUTIONS_DIR


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


def handout_files(repo: Path) -> list[Path]:
    """Relative paths of the handout's files: everything but solutions/ (and files deleted but not yet staged)."""
    return [
        path
        for path in repository_files(repo)
        if path.parts[0] != SOLUTIONS_DIR and (repo / path).is_file()
    ]


def clear_notebook(source: Path, target: Path) -> None:
    notebook = nbformat.read(source, as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nbformat.write(notebook, target)


def release(repo: Path, out_dir: Path) -> list[Path]:
    """Write the handout to out_dir (which must not exist or be empty); returns the files written."""
    repo, out_dir = repo.resolve(), out_dir.resolve()
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ReleaseError(f"{out_dir} exists and is not empty")
    if out_dir == repo or repo in out_dir.parents:
        # git would list the handout's own files on the next release and copy solutions/ twice over.
        raise ReleaseError(f"{out_dir} is inside the repository; write the handout elsewhere")
    files = handout_files(repo)
    for path in files:
        target = out_dir / path
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".ipynb":
            clear_notebook(repo / path, target)
        else:
            shutil.copy2(repo / path, target)
    return files
