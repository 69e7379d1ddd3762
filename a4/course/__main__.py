"""The command line of the course tooling: `python -m a4.course --help`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import a4.course
from a4._overlay import REPO_ROOT


def instructor_only(command: str) -> bool:
    """True (after saying why) when this is a student handout, where `command` has nothing to work on."""
    from a4.course.exercises import SOLUTIONS_DIR

    if (REPO_ROOT / SOLUTIONS_DIR).is_dir():
        return False
    print(f"{command}: no {SOLUTIONS_DIR}/ in {REPO_ROOT}: a course maintainer's command, not a handout's",
          file=sys.stderr)  # fmt: skip
    return True


def cmd_sync(args: argparse.Namespace) -> int:
    from a4.course.exercises import MarkerError, sync

    if instructor_only("sync"):
        return 2
    try:
        changed = sync(REPO_ROOT)
    except MarkerError as e:
        print(f"sync: {e}", file=sys.stderr)
        return 1
    for path in changed:
        print(f"wrote {path}")
    print(f"sync: {len(changed)} file(s) changed")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from a4.course.exercises import check

    if instructor_only("check"):
        return 2
    problems = check(REPO_ROOT)
    for problem in problems:
        print(f"check: {problem}", file=sys.stderr)
    if problems:
        print("check: run `python -m a4.course sync` to regenerate the student files", file=sys.stderr)
        return 1
    print("check: student files are in sync with solutions/")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from a4.course.exercises import stubs

    if args.checks:
        return list_checks()

    # The raise lines of the student files: in a handout without solutions/ they are all there is to read, and the
    # list shrinks as exercises are written.
    left = stubs(REPO_ROOT)
    if not left:
        print("every exercise is written: `python -m a4.course grade` runs every check")
        return 0
    print(f"{len(left)} exercises still to write, in notebook order:\n")
    print_table(
        ("exercise", "file", "notebook", "what to write"),
        [(s.id, s.where, f"notebooks/{s.notebook}.ipynb", s.text) for s in left],
    )
    return 0


def list_checks() -> int:
    from a4.course.checks.registry import CHECKS

    print(f"{len(CHECKS)} checks, in notebook order:\n")
    print_table(
        ("check", "grade's group", "notebook", "function its cell calls (a4/course/checks/)"),
        [(c.id, c.group, f"notebooks/{c.notebook}.ipynb", c.function) for c in CHECKS],
    )
    return 0


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, the last one left as it is."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        print("  ".join(f"{cell:{width}}" for cell, width in zip(row, widths)) + f"  {row[-1]}")


def cmd_verify(args: argparse.Namespace) -> int:
    from a4.course.notebooks import NotebookRunError
    from a4.course.verify import verify

    if instructor_only("verify-notebooks"):
        return 2
    try:
        return verify(REPO_ROOT, workers=args.workers, prefixes=args.notebook)
    except NotebookRunError as e:
        print(f"verify-notebooks: {e}", file=sys.stderr)
        return 2


def cmd_grade(args: argparse.Namespace) -> int:
    from a4.course.grade import grade
    from a4.course.notebooks import NotebookRunError
    from a4.course.release import ReleaseError

    try:
        limits = {name: value for name in ("timeout", "budget") if (value := getattr(args, name)) is not None}
        junit = None if args.junit is None else Path(args.junit)
        return grade(Path(args.student), junit, prefixes=args.notebook, workers=args.workers, **limits)
    except (NotebookRunError, ReleaseError) as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2


def cmd_release(args: argparse.Namespace) -> int:
    from a4.course.release import ReleaseError, release

    try:
        files = release(REPO_ROOT, Path(args.out_dir))
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    print(f"release: {len(files)} files written to {args.out_dir} (no solutions/; the student's Makefile and README)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m a4.course", description=a4.course.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("sync", help="regenerate the student files from solutions/").set_defaults(run=cmd_sync)
    commands.add_parser("check", help="fail if a student file is out of date").set_defaults(run=cmd_check)
    listing = commands.add_parser("list", help="the exercises still to write (--checks: every check)")
    listing.add_argument("--checks", action="store_true", help="list every check, its group, its notebook and its function")
    listing.set_defaults(run=cmd_list)
    verify = commands.add_parser("verify-notebooks", help="notebooks pass on solutions, checks fail on the skeleton")
    verify.add_argument(
        "--notebook", action="append", metavar="PREFIX", help="only notebooks starting with PREFIX (repeatable)"
    )
    verify.add_argument("--workers", type=int, default=2)
    verify.set_defaults(run=cmd_verify)
    grade = commands.add_parser(
        "grade",
        help="run every check against a student's exercise files (with this repository's notebooks and checks)",
        description="Run every check against a student's exercise files; a4/course/grade.py says how.",
    )
    grade.add_argument("student", nargs="?", default=".", help="the handout to grade (default: the current directory)")
    grade.add_argument(
        "--junit", metavar="PATH", help="JUnit XML report (default: grade-report.xml in the student's directory)"
    )
    grade.add_argument(
        "--notebook", action="append", metavar="PREFIX", help="grade only notebooks starting with PREFIX (repeatable)"
    )
    grade.add_argument("--workers", type=int, default=2)
    # The defaults live in a4/course/grade.py, which `--help` should not have to import; the report shows them.
    grade.add_argument("--timeout", type=float, metavar="S", help="seconds per cell (default: grade.CELL_TIMEOUT_S)")
    grade.add_argument("--budget", type=float, metavar="S", help="seconds for the whole run (default: grade.BUDGET_S)")
    grade.set_defaults(run=cmd_grade)
    release = commands.add_parser("release", help="write the student handout (no solutions/; the student's Makefile)")
    release.add_argument("out_dir")
    release.set_defaults(run=cmd_release)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
