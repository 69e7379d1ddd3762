"""Exercises: regions of the reference solutions that the student files replace with `raise NotImplementedError`.

A reference file `solutions/a4/<path>.py` marks each exercise body with two comment lines at the body's indentation:

    # BEGIN SOLUTION <id> <notebook-stem>: <one line saying what to write>
    ...the reference body...
    # END SOLUTION

The student file `a4/<path>.py` is generated from it: a header comment, then the reference file with each region
replaced by `raise NotImplementedError("Exercise <id>: <one line> (notebooks/<notebook-stem>.ipynb)")`. Everything
outside the regions (signatures, docstrings, imports) is kept byte for byte, so the docstrings the student reads
are the ones the maintainers wrote.

Those `raise` lines are also the markers of what is still to write: `stubs` finds them in the student files, which
is all a handout (without solutions/) has to list its exercises. `unwritten_exercise` recognises the error one
raises wherever it surfaces (a test, a notebook cell, the demo), `exercise_named_in` a report of it in words, and
`not_written_yet` is how the course's commands say it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from a4._overlay import REPO_ROOT

SOLUTIONS_DIR = "solutions"
PACKAGE = "a4"

ID = r"[a-z0-9]+(?:-[a-z0-9]+)*"
NOTEBOOK = r"\d\d_[a-z0-9_]+"
BEGIN_RE = re.compile(
    rf"^(?P<indent>[ \t]*)# BEGIN SOLUTION (?P<id>{ID}) (?P<notebook>{NOTEBOOK}): (?P<text>\S.*?)\s*$"
)
END_RE = re.compile(r"^(?P<indent>[ \t]*)# END SOLUTION\s*$")
# Any line that mentions a marker must match one of the two patterns above exactly.
MARKER_WORDS = ("BEGIN SOLUTION", "END SOLUTION")

HEADER = (
    "# GENERATED from {solution} by `python -m a4.course sync`.\n"
    "# Students: edit this file. Course maintainers: edit {solution} instead\n"
    "# and run `python -m a4.course sync`.\n"
)
# The first line of HEADER, used to recognise generated files whose solution file has gone.
HEADER_PREFIX = "# GENERATED from solutions/"
# The message of an unwritten exercise's NotImplementedError (`Exercise.message`; its text is one line without quotes
# or backslashes, as parse_exercises requires), the line that raises it, a traceback's last line quoting it, and how
# `not_written_yet` rewords it.
TEXT = r'[^"\\\n]+'
MESSAGE_PATTERN = rf"Exercise (?P<id>{ID}): (?P<text>{TEXT}) \(notebooks/(?P<notebook>{NOTEBOOK})\.ipynb\)"
MESSAGE_RE = re.compile(MESSAGE_PATTERN)
STUB_RE = re.compile(rf'^[ \t]*raise NotImplementedError\("{MESSAGE_PATTERN}"\)\s*$')
QUOTED_RE = re.compile(rf"NotImplementedError: {MESSAGE_PATTERN}")
NOT_WRITTEN_RE = re.compile(
    rf"exercise (?P<id>{ID}) not written yet: (?P<text>{TEXT}) \(notebooks/(?P<notebook>{NOTEBOOK})\.ipynb\)"
)


class MarkerError(ValueError):
    """A solutions file whose BEGIN/END SOLUTION markers are malformed or unbalanced."""


@dataclass(frozen=True)
class Exercise:
    id: str
    notebook: str  # notebook stem, e.g. "01_config"
    text: str
    solution_path: Path  # relative to the repository root
    indent: str  # the markers' indentation, which the generated `raise` keeps
    begin: int  # 0-based index of the BEGIN line
    end: int  # 0-based index of the END line

    @property
    def line(self) -> int:
        """1-based line of the BEGIN marker, as an editor shows it."""
        return self.begin + 1

    @property
    def student_path(self) -> Path:
        return student_path_of(self.solution_path)

    @property
    def message(self) -> str:
        return f"Exercise {self.id}: {self.text} (notebooks/{self.notebook}.ipynb)"


@dataclass(frozen=True)
class Stub:
    """An exercise still to write: the `raise NotImplementedError("Exercise ...")` line standing in for it."""

    id: str
    notebook: str
    text: str
    path: Path  # the student file, relative to the repository root
    line: int  # 1-based

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def student_path_of(solution_path: Path) -> Path:
    """solutions/a4/x/y.py -> a4/x/y.py (both relative to the repository root)."""
    return solution_path.relative_to(SOLUTIONS_DIR)


def solution_files(root: Path = REPO_ROOT) -> list[Path]:
    """Every reference file, relative to the repository root, in a stable order."""
    base = root / SOLUTIONS_DIR / PACKAGE
    return sorted(p.relative_to(root) for p in base.rglob("*.py")) if base.is_dir() else []


def parse_exercises(source: str, solution_path: Path) -> list[Exercise]:
    """The exercises of one reference file, in order; a MarkerError names the first malformed marker."""
    exercises: list[Exercise] = []
    lines = source.splitlines()
    begin: re.Match | None = None  # the BEGIN line of the region being read
    begin_at = 0
    for i, line in enumerate(lines):
        where = f"{solution_path}:{i + 1}"
        if not any(word in line for word in MARKER_WORDS):
            continue
        if match := BEGIN_RE.match(line):
            if begin is not None:
                raise MarkerError(f"{where}: BEGIN SOLUTION inside the region opened at line {begin_at + 1}")
            if '"' in match["text"] or "\\" in match["text"]:
                raise MarkerError(f"{where}: the one-line description may not contain quotes or backslashes")
            begin, begin_at = match, i
        elif match := END_RE.match(line):
            if begin is None:
                raise MarkerError(f"{where}: END SOLUTION without a BEGIN SOLUTION")
            if match["indent"] != begin["indent"]:
                raise MarkerError(f"{where}: END SOLUTION is not indented like its BEGIN (line {begin_at + 1})")
            if i == begin_at + 1:
                raise MarkerError(f"{where}: empty solution region")
            exercises.append(
                Exercise(begin["id"], begin["notebook"], begin["text"], solution_path, begin["indent"], begin_at, i)
            )
            begin = None
        else:
            raise MarkerError(
                f"{where}: malformed marker {line.strip()!r}; expected "
                "'# BEGIN SOLUTION <id> <NN_notebook>: <one line>' or '# END SOLUTION'"
            )
    if begin is not None:
        raise MarkerError(f"{solution_path}:{begin_at + 1}: BEGIN SOLUTION is never closed")
    if not exercises:
        raise MarkerError(f"{solution_path}: no BEGIN SOLUTION regions (only exercise files belong in solutions/)")
    return exercises


def student_source(source: str, solution_path: Path) -> str:
    """The student file generated from one reference file's source."""
    lines = source.splitlines(keepends=True)
    out = [HEADER.format(solution=solution_path.as_posix())]
    start = 0
    for exercise in parse_exercises(source, solution_path):
        out.extend(lines[start : exercise.begin])
        out.append(f'{exercise.indent}raise NotImplementedError("{exercise.message}")\n')
        start = exercise.end + 1
    out.extend(lines[start:])
    return "".join(out)


def all_exercises(root: Path = REPO_ROOT) -> list[Exercise]:
    """Every exercise of the course; a MarkerError for a malformed file or an id used twice."""
    exercises: dict[str, Exercise] = {}
    for path in solution_files(root):
        for exercise in parse_exercises((root / path).read_text(), path):
            if first := exercises.get(exercise.id):
                raise MarkerError(
                    f"{path}:{exercise.line}: exercise id {exercise.id!r} is already used at "
                    f"{first.solution_path}:{first.line}"
                )
            exercises[exercise.id] = exercise
    return list(exercises.values())


def generated_files(root: Path = REPO_ROOT) -> dict[Path, str]:
    """What sync writes: student path (relative to root) -> contents. Raises MarkerError for a malformed file."""
    all_exercises(root)  # the checks across files (ids used twice)
    return {student_path_of(path): student_source((root / path).read_text(), path) for path in solution_files(root)}


def orphaned_files(expected: dict[Path, str], root: Path = REPO_ROOT) -> list[Path]:
    """Generated student files whose reference file no longer exists."""
    orphans = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        relative = path.relative_to(root)
        if relative not in expected and path.read_text().startswith(HEADER_PREFIX):
            orphans.append(relative)
    return orphans


def sync(root: Path = REPO_ROOT) -> list[Path]:
    """Write every student file; returns the ones that changed."""
    changed = []
    for path, text in generated_files(root).items():
        target = root / path
        if not target.exists() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            changed.append(path)
    return changed


def check(root: Path = REPO_ROOT) -> list[str]:
    """Problems that `sync` would fix (or that need a maintainer): an empty list when all is in order."""
    try:
        expected = generated_files(root)
    except MarkerError as e:
        return [str(e)]
    problems = []
    for path, text in expected.items():
        target = root / path
        if not target.exists():
            problems.append(f"{path}: missing (generated from {SOLUTIONS_DIR}/{path})")
        elif target.read_text() != text:
            problems.append(f"{path}: differs from what sync generates from {SOLUTIONS_DIR}/{path}")
        else:
            try:
                compile(text, str(path), "exec")
            except SyntaxError as e:
                problems.append(f"{path}:{e.lineno}: the generated file does not compile ({e.msg})")
    for path in orphaned_files(expected, root):
        problems.append(f"{path}: generated file without a reference file in {SOLUTIONS_DIR}/")
    return problems


def stubs(root: Path = REPO_ROOT) -> list[Stub]:
    """The exercises not written yet in the student files under root/a4, in notebook order."""
    found = []
    for path in sorted((root / PACKAGE).rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if match := STUB_RE.match(line):
                found.append(Stub(match["id"], match["notebook"], match["text"], path.relative_to(root), number))
    return sorted(found, key=lambda stub: (stub.notebook, str(stub.path), stub.line))


def unwritten_exercise(error: BaseException) -> str | None:
    """The message of the unwritten exercise whose NotImplementedError is `error` or an exception it was raised from."""
    stub = unwritten_exercise_error(error)
    return None if stub is None else str(stub)


def unwritten_exercise_error(error: BaseException | None) -> NotImplementedError | None:
    """The NotImplementedError of an unwritten exercise that is `error` or an exception it was raised from."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, NotImplementedError) and MESSAGE_RE.fullmatch(str(error)):
            return error
        error = error.__cause__ or error.__context__
    return None


def exercise_named_in(text: str) -> str | None:
    """The message of the first unwritten exercise that `text` reports, in a traceback or as `not_written_yet` says.

    For failures that only tell it in words: a test that ran the code in a subprocess, or a command's error line.
    """
    found = [match for pattern in (QUOTED_RE, NOT_WRITTEN_RE) if (match := pattern.search(text))]
    if not found:
        return None
    first = min(found, key=lambda match: match.start())
    return f"Exercise {first['id']}: {first['text']} (notebooks/{first['notebook']}.ipynb)"


def not_written_yet(message: str) -> str:
    """How a test, a check or the demo says that an exercise is missing: 'exercise <id> not written yet: ...'."""
    match = MESSAGE_RE.fullmatch(message)
    if match is None:
        return message
    return f"exercise {match['id']} not written yet: {match['text']} (notebooks/{match['notebook']}.ipynb)"
