"""The solutions overlay: with A4_SOLUTIONS=1, `import a4.x` takes `solutions/a4/x.py` when it exists.

Students edit the files in `a4/`; the reference solutions live in `solutions/a4/` at the same paths. Putting the
solutions folder in front of a package's `__path__` makes Python find the reference module first, so the same
notebooks, tests and demo run against either tree. Every package of a4 calls `overlay(__name__, __path__)`.
"""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS_ROOT = REPO_ROOT / "solutions"


def solutions_enabled() -> bool:
    return os.environ.get("A4_SOLUTIONS", "").strip().lower() in ("1", "true", "yes")


def overlay(package_name: str, package_path: list[str]) -> None:
    if not solutions_enabled():
        return
    if not SOLUTIONS_ROOT.is_dir():
        raise RuntimeError(
            f"A4_SOLUTIONS=1 is set but {SOLUTIONS_ROOT} does not exist (a student handout has no solutions): "
            "unset A4_SOLUTIONS to run your own code."
        )
    folder = SOLUTIONS_ROOT.joinpath(*package_name.split("."))
    if folder.is_dir() and str(folder) not in package_path:
        package_path.insert(0, str(folder))
