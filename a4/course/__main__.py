"""The command line of the course tooling: `python -m a4.course --help`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import a4.course
from a4._overlay import REPO_ROOT


def cmd_sync(args: argparse.Namespace) -> int:
    from a4.course.exercises import MarkerError, sync

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
    from a4.course.exercises import SOLUTIONS_DIR, check

    if not (REPO_ROOT / SOLUTIONS_DIR).is_dir():
        print(f"check: no {SOLUTIONS_DIR}/ in {REPO_ROOT} (a student handout has nothing to check)", file=sys.stderr)
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
    from a4.course.exercises import MarkerError, all_exercises

    try:
        exercises = all_exercises(REPO_ROOT)
    except MarkerError as e:
        print(f"list: {e}", file=sys.stderr)
        return 1
    exercises = sorted(exercises, key=lambda e: (e.notebook, str(e.solution_path), e.line))
    rows = [(e.id, f"{e.student_path}:{e.line}", f"notebooks/{e.notebook}.ipynb", e.text) for e in exercises]
    widths = [max([len(h), *(len(row[i]) for row in rows)]) for i, h in enumerate(("exercise", "file", "notebook"))]
    print(f"{'exercise':{widths[0]}}  {'file':{widths[1]}}  {'notebook':{widths[2]}}  what to write")
    for row in rows:
        print(f"{row[0]:{widths[0]}}  {row[1]:{widths[1]}}  {row[2]:{widths[2]}}  {row[3]}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from a4.course.notebooks import NotebookRunError
    from a4.course.verify import verify

    try:
        return verify(REPO_ROOT, workers=args.workers, prefixes=args.notebook)
    except NotebookRunError as e:
        print(f"verify-notebooks: {e}", file=sys.stderr)
        return 2


def cmd_grade(args: argparse.Namespace) -> int:
    from a4.course.grade import grade
    from a4.course.notebooks import NotebookRunError

    try:
        return grade(Path(args.repo), Path(args.junit), prefixes=args.notebook, workers=args.workers)
    except NotebookRunError as e:
        print(f"grade: {e}", file=sys.stderr)
        return 2


def cmd_release(args: argparse.Namespace) -> int:
    from a4.course.release import ReleaseError, release

    try:
        files = release(REPO_ROOT, Path(args.out_dir))
    except ReleaseError as e:
        print(f"release: {e}", file=sys.stderr)
        return 1
    print(f"release: {len(files)} files written to {args.out_dir} (no solutions/)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m a4.course", description=a4.course.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("sync", help="regenerate the student files from solutions/").set_defaults(run=cmd_sync)
    commands.add_parser("check", help="fail if a student file is out of date").set_defaults(run=cmd_check)
    commands.add_parser("list", help="list the exercises").set_defaults(run=cmd_list)
    verify = commands.add_parser("verify-notebooks", help="notebooks pass on solutions, checks fail on the skeleton")
    verify.add_argument(
        "--notebook", action="append", metavar="PREFIX", help="only notebooks starting with PREFIX (repeatable)"
    )
    verify.add_argument("--workers", type=int, default=2)
    verify.set_defaults(run=cmd_verify)
    grade = commands.add_parser("grade", help="run a checkout's notebooks and report every check")
    grade.add_argument("repo", nargs="?", default=".", help="the checkout to grade (default: the current directory)")
    grade.add_argument("--junit", default="grade-report.xml", help="JUnit XML report (default: %(default)s)")
    grade.add_argument(
        "--notebook", action="append", metavar="PREFIX", help="grade only notebooks starting with PREFIX (repeatable)"
    )
    grade.add_argument("--workers", type=int, default=2)
    grade.set_defaults(run=cmd_grade)
    release = commands.add_parser("release", help="write the student handout (no solutions/)")
    release.add_argument("out_dir")
    release.set_defaults(run=cmd_release)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
