"""grade: run every check of the notebooks against a student's code and report each one, in bounded time.

Run from the course repository (the one with solutions/), `python -m a4.course grade STUDENT_DIR` grades the
student's exercise files only: they are copied into a fresh release of this repository, so the notebooks, the check
code and the rest of the engine are the instructor's, whatever the student's copies say. The student's notebooks
are only compared with the instructor's: a check cell missing or altered there is reported (nbgrader's practice with
its read-only test cells), and so is every other file of `a4/` that differs. Run in a handout (no solutions/),
`grade` runs the handout's own notebooks: a student grading themselves.

Report: the JUnit XML file goes by default to grade-report.xml in the student's directory, so that grading one
student after another never writes one's report over another's; it names the student directory it grades, and an
existing report that names another student is never overwritten (grade stops before running anything). A failing cell
that is not a check is named by the nearest markdown heading above it, as the student reads the notebook.

Time: each cell, checks included, has `timeout` seconds (default CELL_TIMEOUT_S: the slowest reference cell with a
wide margin); a looping exercise is interrupted, its check reported `TIMEOUT after N s`, and the next check runs.
Cells that would start once `budget` seconds are spent are reported `NOT RUN`, and so are those of a notebook that
has spent its share of the budget (`notebook_share`): an exercise that loops in every cell of one notebook leaves
the other notebooks their time. Every check of the notebooks graded gets a line, read from the notebooks before the
run, so a run cut short never shrinks the total.

The report groups the checks as the table of checks says (a4/course/checks/registry.py): the required ones (the
assignment's four checks: config parsing, weight loading, greedy decoding equal to transformers in four settings,
the prefix cache), the other checks, and the optional extensions (notebooks from EXTENSIONS_FROM on), each with its
own total. The exit status is 0 when every required and other
check passes. The JUnit XML file has one test case per check id (classname: the notebook), one test suite per group.
"""

from __future__ import annotations

import filecmp
import os
import re
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from a4._overlay import REPO_ROOT
from a4.course.checks.registry import CHECKS, EXTENSIONS_FROM, group_of
from a4.course.exercises import SOLUTIONS_DIR, solution_files, student_path_of
from a4.course.nbval_plugin import NOT_RUN, TIMEOUT
from a4.course.notebooks import (
    CellResult,
    cell_places,
    check_cells,
    notebook_paths,
    read_notebook,
    run_notebooks,
    select,
)
from a4.course.release import release

REQUIRED_CHECKS = frozenset(check.id for check in CHECKS if check.required)
GROUPS = {
    "required": "required: the assignment's checks",
    "other": "other checks",
    "optional": f"optional: extensions (notebook {EXTENSIONS_FROM} and later)",
}
# The slowest reference cell took 12 s (notebook 04's chunked-vs-recurrence comparison, on 2 busy cores).
CELL_TIMEOUT_S = 60
# A whole reference run takes about 2.5 min on 2 cores: six times that before the remaining cells are given up.
BUDGET_S = 900
# The JUnit report's name in the student's directory, where it goes unless --junit says otherwise.
REPORT_NAME = "grade-report.xml"


@dataclass(frozen=True)
class Graded:
    notebook: str  # file name, e.g. "01_config.ipynb"
    check_id: str
    status: str  # PASS, FAIL, TIMEOUT, NOT RUN (or SKIP)
    why: str  # the first line of the failure
    traceback: str
    duration: float
    tampered: str  # how the student's copy of the check cell differs: "", "altered" or "missing"

    @property
    def name(self) -> str:
        return f"{self.notebook}::{self.check_id}"

    @property
    def group(self) -> str:
        return group_of(self.notebook, self.check_id)


def notebook_share(budget: float, workers: int, notebooks: int) -> float:
    """Each notebook's share of the run's budget, with `workers` notebooks running side by side."""
    return budget * min(workers, notebooks) / notebooks


def tampered_checks(notebooks: list[Path], student: Path) -> tuple[dict[str, str], list[str]]:
    """How the student's notebooks differ from the instructor's `notebooks` in their check cells.

    Returns ({check name: "altered" or "missing"}, notes on whole notebooks and on check ids the instructor's lack).
    """
    tampered, notes = {}, []
    for path in notebooks:
        copy = student / "notebooks" / path.name
        if not copy.is_file():
            notes.append(f"notebooks/{path.name}: not in the student's directory, nothing to compare")
            continue
        try:
            theirs = check_cells(read_notebook(copy))
        except Exception as e:  # noqa: BLE001 - an unreadable notebook is reported, not fatal
            notes.append(f"notebooks/{path.name}: the student's copy does not read as a notebook ({e})")
            continue
        ours = check_cells(read_notebook(path))
        for check_id, source in ours.items():
            if check_id not in theirs:
                tampered[f"{path.name}::{check_id}"] = "missing"
            elif theirs[check_id].strip() != source.strip():
                tampered[f"{path.name}::{check_id}"] = "altered"
        unknown = sorted(theirs.keys() - ours)
        notes += [f"notebooks/{path.name}: check id {i!r} is not the instructor's (not graded)" for i in unknown]
    return tampered, notes


def changed_files(workspace: Path, student: Path, exercise_files: set[Path]) -> list[str]:
    """Files of the instructor's a4/ (other than the exercise files) that the student's copy changes or lacks."""
    changed = []
    for path in sorted((workspace / "a4").rglob("*.py")):
        relative = path.relative_to(workspace)
        if relative in exercise_files:
            continue
        copy = student / relative
        if not copy.is_file():
            changed.append(f"{relative}: missing")
        elif not filecmp.cmp(path, copy, shallow=False):
            changed.append(f"{relative}: differs")
    return changed


# How a check's first line says that more problems follow it (checks.conclude): below it in the notebook, but in the
# JUnit report's failure text for a reader of grade's console.
MORE_BELOW = re.compile(r"\(and (?P<more>\d+) more below\)")


def graded(notebook: str, check_id: str, result: CellResult | None, tampered: str) -> Graded:
    if result is None:
        return Graded(notebook, check_id, "NOT RUN", "NOT RUN: the run ended before this check", "", 0.0, tampered)
    if result.ename in (TIMEOUT, NOT_RUN):
        status = "TIMEOUT" if result.ename == TIMEOUT else "NOT RUN"
    else:
        status = {"passed": "PASS", "failed": "FAIL"}.get(result.outcome, "SKIP")
    why = "" if status == "PASS" else MORE_BELOW.sub(r"(and \g<more> more in the JUnit report)", result.error)
    return Graded(notebook, check_id, status, why, result.traceback, result.duration, tampered)


def report_student(path: Path) -> str | None:
    """The student directory that the JUnit report at `path` grades, as write_junit records it; None when there is no
    such report there (no file, not XML, or not written by grade)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    found = root.find("testsuite/properties/property[@name='student']")
    return None if found is None else found.get("value")


def write_junit(checks: list[Graded], path: Path, student: Path) -> None:
    root = ET.Element("testsuites")
    for group in GROUPS:
        cases = [c for c in checks if c.group == group]
        suite = ET.SubElement(
            root,
            "testsuite",
            name=f"a4-{group}",
            tests=str(len(cases)),
            failures=str(sum(c.status != "PASS" for c in cases)),
            time=f"{sum(c.duration for c in cases):.3f}",
        )
        # Whose report this is: what keeps the next student's grading from writing over it.
        properties = ET.SubElement(suite, "properties")
        ET.SubElement(properties, "property", name="student", value=str(student))
        for c in cases:
            case = ET.SubElement(suite, "testcase", classname=c.notebook, name=c.check_id, time=f"{c.duration:.3f}")
            if c.tampered:
                properties = ET.SubElement(case, "properties")
                ET.SubElement(properties, "property", name="student-copy", value=c.tampered)
            if c.status != "PASS":
                ET.SubElement(case, "failure", message=c.why, type=c.status).text = c.traceback
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def print_report(
    checks: list[Graded], results: list[CellResult], notes: list[str], places: dict[str, dict[int, str]]
) -> None:
    """places: for each notebook, where each code cell is (notebooks.cell_places), to name the failing ones."""
    width = max((len(c.name) for c in checks), default=0)
    totals = []
    for group, title in GROUPS.items():
        cases = [c for c in checks if c.group == group]
        if not cases:
            continue
        print(f"\n{title}")
        for c in cases:
            tag = f"  [student's cell {c.tampered}: graded with the instructor's]" if c.tampered else ""
            print(f"  {c.status:7}  {c.name:{width}}  {c.why}{tag}".rstrip())
        totals.append(f"{group} {sum(c.status == 'PASS' for c in cases)}/{len(cases)}")
    # Failures outside check cells are not graded, but they often explain a failing check.
    others = [r for r in results if not (r.check_id or r.exercise_not_implemented) and r.failed and r.ename != NOT_RUN]
    # One line per cause: a file that does not import fails every cell after it with the same first line.
    others = list({r.error: r for r in reversed(others)}.values())[::-1]
    if others:
        print("\nerrors in other cells (not graded):")
        for r in others:
            print(f"  {r.notebook}, {places[r.notebook][r.cell]}: {r.error}")
    if notes:
        print("\nthe student's copy differs from the instructor's, whose files were used:")
        for note in notes:
            print(f"  {note}")
    print(f"\nchecks passed: {', '.join(totals)}")


def prepare(repo: Path, student: Path, workspace: Path) -> list[str]:
    """A fresh release of `repo` in `workspace` with the student's exercise files; returns notes on what differs."""
    exercise_files = {student_path_of(path) for path in solution_files(repo)}
    release(repo, workspace)
    notes = []
    for path in sorted(exercise_files):
        if (student / path).is_file():
            (workspace / path).write_bytes((student / path).read_bytes())
        else:
            notes.append(f"{path}: missing, graded as the untouched skeleton")
    return notes + changed_files(workspace, student, exercise_files)


def grade(
    student: Path,
    junit: Path | None = None,
    prefixes: list[str] | None = None,
    workers: int = 2,
    timeout: float = CELL_TIMEOUT_S,
    budget: float = BUDGET_S,
    repo: Path = REPO_ROOT,
) -> int:
    """Print the report and write the JUnit file (by default REPORT_NAME in the student's directory); 0 when every
    required and other check passes, 2 when nothing was run."""
    from a4.checkpoints import cache_root  # imports torch: not for `--help`

    student = student.resolve()
    if not (student / "a4").is_dir():
        print(f"{student} has no a4/ directory: not an a4 handout")
        return 2
    junit = (junit or student / REPORT_NAME).resolve()
    if (owner := report_student(junit)) not in (None, str(student)):
        print(f"{junit} is the report of {owner}: grading {student} would overwrite it; give another --junit path "
              f"(without one, each student's report is {REPORT_NAME} in their own directory)")
        return 2
    # Before the run, not after it: a report that cannot be written would lose the whole run.
    try:
        junit.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(junit.parent, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        print(f"cannot write the report {junit} (its directory cannot be written): give a --junit path")
        return 2
    with tempfile.TemporaryDirectory(prefix="a4-grade-") as tmp:
        if (repo / SOLUTIONS_DIR).is_dir():
            print(f"grading the exercise files of {student} with the notebooks and checks of {repo}")
            workspace = Path(tmp) / "handout"
            notes = prepare(repo, student, workspace)
            notebooks = select(notebook_paths(workspace), prefixes)
            tampered, notebook_notes = tampered_checks(notebooks, student)
            notes = notebook_notes + notes
        else:
            print(f"grading {student} with its own notebooks")
            workspace, tampered, notes = student, {}, []
            notebooks = select(notebook_paths(workspace), prefixes)
        if not notebooks:
            print(f"no notebooks to grade in {workspace / 'notebooks'}")
            return 1
        expected = [(path.name, check_id) for path in notebooks for check_id in check_cells(read_notebook(path))]
        places = {path.name: cell_places(read_notebook(path)) for path in notebooks}
        share = notebook_share(budget, workers, len(notebooks))
        print(f"{len(notebooks)} notebooks, {len(expected)} checks; {timeout:g} s per cell, {share:g} s per notebook, "
              f"{budget:g} s in all ...", flush=True)  # fmt: skip
        # The checkpoint cache is keyed by content: the workspace shares this repository's.
        results = run_notebooks(
            notebooks, workspace, solutions=False, workers=workers, timeout=timeout, budget=budget,
            notebook_budget=share, env={"A4_CACHE_DIR": str(cache_root().parent)},
        )  # fmt: skip
    by_name = {r.name: r for r in results if r.check_id}
    checks = [
        graded(notebook, check_id, by_name.get(f"{notebook}::{check_id}"), tampered.get(f"{notebook}::{check_id}", ""))
        for notebook, check_id in expected
    ]
    print_report(checks, results, notes, places)
    write_junit(checks, junit, student)
    print(f"JUnit report: {junit}")
    return 0 if all(c.status == "PASS" for c in checks if c.group != "optional") else 1
