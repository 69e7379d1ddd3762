"""Grading an instructor can trust: the instructor's notebooks and check code run against the student's exercise
files only (tampering changes nothing and is reported), every check has a bounded time (a looping exercise is
reported TIMEOUT and the next check runs, even when the loop ignores the interrupt), the run and each notebook have
a budget, and the report and the JUnit file keep one entry per check id, in the groups required / other / optional.

Each grading covers notebook 01 of a handout from `release` (tests/handout_commands.py); the budget per notebook and
the names of failing cells are tested on small notebooks of their own. A failing check cell ends without an error,
so that Run All in JupyterLab reaches every check, and grading still counts it failed. Each student's report goes to
their own directory, and no report of one student is overwritten by another's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest
from handout_commands import environment, make_handout, solve
from nbclient import NotebookClient

from a4._overlay import REPO_ROOT
from a4.course.checks import FAILURE_MIME
from a4.course.exercises import stubs
from a4.course.grade import EXTENSIONS_FROM, REPORT_NAME, REQUIRED_CHECKS, graded, print_report, report_student
from a4.course.nbval_plugin import NOT_RUN, TIMEOUT, check_ids_of
from a4.course.notebooks import CellResult, cell_places, check_cells, notebook_paths, read_notebook, run_notebooks

NOTEBOOK = "01_config.ipynb"
CHECKS = list(check_cells(read_notebook(REPO_ROOT / "notebooks" / NOTEBOOK)))


def grade(student: Path, junit: Path | None, *options: str, notebook: str = "01") -> tuple[int, str]:
    """`python -m a4.course grade STUDENT` run from the course repository, on one notebook (01 by default); junit
    None: the report where grade puts it by default."""
    command = [sys.executable, "-m", "a4.course", "grade", str(student), "--notebook", notebook]
    if junit is not None:
        command += ["--junit", str(junit)]
    env = environment(REPO_ROOT, PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([*command, *options], cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    return run.returncode, run.stdout + run.stderr


def report_lines(out: str, notebook: str = NOTEBOOK) -> dict[str, str]:
    """check id -> its report line (status and why)."""
    lines = {}
    for line in out.splitlines():
        words = line.split()
        for word in words:
            if word.startswith(f"{notebook}::"):
                lines[word.split("::")[1]] = line.strip()
    return lines


def junit_cases(path: Path) -> dict[str, tuple[str, str | None, str | None]]:
    """check id -> (test suite, failure type or None, student-copy property or None)."""
    cases = {}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for case in suite.iter("testcase"):
            failure = case.find("failure")
            tampered = case.find("properties/property[@name='student-copy']")
            cases[case.get("name")] = (
                suite.get("name"),
                None if failure is None else failure.get("type"),
                None if tampered is None else tampered.get("value"),
            )
    return cases


def edit_notebook(path: Path, replace: dict[str, str], delete: set[str]) -> None:
    notebook = nbformat.read(path, as_version=4)
    cells = []
    for cell in notebook.cells:
        ids = [t.split(":", 1)[1] for t in cell.metadata.get("tags", []) if t.startswith("check:")]
        if ids and ids[0] in delete:
            continue
        if ids and ids[0] in replace:
            cell.source = replace[ids[0]]
        cells.append(cell)
    notebook.cells = cells
    nbformat.write(notebook, path)


def test_required_checks_and_extensions_name_real_checks() -> None:
    ids = {check_id for path in notebook_paths(REPO_ROOT) for check_id in check_cells(read_notebook(path))}
    assert REQUIRED_CHECKS <= ids
    assert any(path.name >= EXTENSIONS_FROM for path in notebook_paths(REPO_ROOT))


def test_tampered_handout_is_graded_with_the_instructors_notebooks_and_checks(tmp_path: Path) -> None:
    # The skeleton, with the tampering that used to pass: a check cell emptied to print("PASSED"), another deleted,
    # and a check helper that passes whatever it is given.
    student = make_handout(tmp_path)
    notebook = student / "notebooks" / NOTEBOOK
    edit_notebook(notebook, replace={"config-parsing": 'print("PASSED")'}, delete={"config-errors"})
    helper = student / "a4/course/checks/config.py"
    passes_all = "def check_rotary_dims(*args):\n    return\n\n\ndef _replaced("
    helper.write_text(helper.read_text().replace("def check_rotary_dims(", passes_all, 1))

    status, out = grade(student, tmp_path / "tampered.xml")

    assert status == 1, out
    lines = report_lines(out)
    assert set(lines) == set(CHECKS), out  # the deleted check still has its line
    assert all(line.startswith("FAIL") and "not written yet" in line for line in lines.values()), out
    assert "student's cell altered" in lines["config-parsing"] and "student's cell missing" in lines["config-errors"]
    assert "a4/course/checks/config.py: differs" in out
    assert f"required 0/{len(REQUIRED_CHECKS & set(CHECKS))}" in out
    cases = junit_cases(tmp_path / "tampered.xml")
    assert set(cases) == set(CHECKS)
    assert cases["config-parsing"] == ("a4-required", "FAIL", "altered")
    assert cases["config-errors"] == ("a4-other", "FAIL", "missing")


LOOPS = {
    # Loops on one input of the layer-pattern check only; an ordinary interrupt stops it. (Both loops sleep rather
    # than spin, to leave the cores to the other tests.)
    "# BEGIN SOLUTION config-layer-types": (
        "    while text.get('full_attention_interval') == 3:\n"
        "        __import__('time').sleep(0.01)\n"
    ),
    # Loops on one input of the RoPE check only, prints all along and swallows the interrupt: its kernel is killed.
    "# BEGIN SOLUTION config-partial-rope": (
        "    while text.get('head_dim') == 128:\n"
        "        try:\n"
        "            print('still going')\n"
        "            __import__('time').sleep(0.01)\n"
        "        except KeyboardInterrupt:\n"
        "            pass\n"
    ),
}  # fmt: skip


def test_looping_exercises_time_out_and_grading_goes_on(tmp_path: Path) -> None:
    student = make_handout(tmp_path)
    solve(student)
    config = student / "a4/models/qwen3_5_config.py"
    source = config.read_text()
    for marker, loop in LOOPS.items():
        source = source.replace(f"    {marker}", f"{loop}    {marker}", 1)
    config.write_text(source)

    status, out = grade(student, tmp_path / "loop.xml", "--timeout", "20")

    assert status == 1, out
    lines = report_lines(out)
    patterns = lines["config-layer-patterns"]
    assert patterns.startswith("TIMEOUT") and "TIMEOUT after 20 s, stopped in a4/models/qwen3_5_config.py" in patterns
    assert "TIMEOUT after 20 s" in lines["config-rope"] and "it was killed, and restarted" in lines["config-rope"], out
    # The checks after the loops run, the last ones in the kernel started after the RoPE loop was killed.
    for check_id in set(CHECKS) - {"config-layer-patterns", "config-rope"}:
        assert lines[check_id].startswith("PASS"), out
    assert junit_cases(tmp_path / "loop.xml")["config-rope"][1] == "TIMEOUT"


def test_checks_after_the_budget_are_reported_not_run(tmp_path: Path) -> None:
    status, out = grade(make_handout(tmp_path), tmp_path / "budget.xml", "--budget", "0")

    assert status == 1, out
    lines = report_lines(out)
    assert set(lines) == set(CHECKS)
    assert all(line.startswith("NOT RUN") and "budget of 0 s" in line for line in lines.values()), out
    assert {case[1] for case in junit_cases(tmp_path / "budget.xml").values()} == {"NOT RUN"}


def test_a_syntax_error_in_a_student_file_is_the_first_line_of_every_check(tmp_path: Path) -> None:
    """The cause first, not the NameError it leads to in every check cell after the import."""
    handout = make_handout(tmp_path)
    student_file = handout / "a4/layers/deltanet.py"
    lines = student_file.read_text().splitlines()
    line = next(i for i, text in enumerate(lines) if text.startswith("def ")) + 1
    lines.insert(line - 1, "def broken(:")
    student_file.write_text("\n".join(lines) + "\n")
    notebook = "04_gated_deltanet.ipynb"
    check_ids = check_cells(read_notebook(REPO_ROOT / "notebooks" / notebook))

    code, out = grade(handout, tmp_path / "broken.xml", notebook="04")

    assert code == 1, out
    cause = f"a4/layers/deltanet.py does not import (line {line}: invalid syntax)"
    report = {check: line for check, line in report_lines(out, notebook).items() if line.startswith("FAIL")}
    assert set(check_ids) <= set(report), out
    assert all(cause in line for line in report.values()), out


def small_notebook(path: Path, *cells: tuple[str, str | None]) -> Path:
    """A notebook of code cells, each (source, check id or None)."""
    code = [nbformat.v4.new_code_cell(src, metadata={"tags": ["check", f"check:{i}"]} if i else {}) for src, i in cells]
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# A notebook"), *code]), path)
    return path


def test_a_notebook_that_spends_its_budget_leaves_the_next_notebook_its_own(tmp_path: Path) -> None:
    looping = small_notebook(
        tmp_path / "01_loops.ipynb",
        ("x = 1", None),
        ("import time\nwhile True:\n    time.sleep(0.01)", "loops"),
        ("assert x == 1", "after-the-loop"),
    )
    fine = small_notebook(tmp_path / "02_fine.ipynb", ("y = 2", None), ("assert y == 2", "fine"))

    # One worker: the second notebook runs after the first, on the same clock.
    results = run_notebooks([looping, fine], tmp_path, solutions=False, workers=1, timeout=3, notebook_budget=1.5)

    outcomes = {r.name: (r.ename, r.evalue) for r in results if r.check_id}
    assert outcomes["01_loops.ipynb::loops"] == (TIMEOUT, "TIMEOUT after 3 s")
    spent = "NOT RUN: the budget of 1.5 s for this notebook was spent"
    assert outcomes["01_loops.ipynb::after-the-loop"] == (NOT_RUN, spent)
    assert outcomes["02_fine.ipynb::fine"] == ("", "")


def test_a_failing_cell_that_is_not_a_check_is_named_by_the_heading_above_it(tmp_path: Path, capsys) -> None:
    """As a student finds it in the notebook: the nearest heading above it, and which code cell under that heading,
    not nbval's count of code cells ("Cell 5")."""
    cells = [
        nbformat.v4.new_markdown_cell("# A notebook"),
        nbformat.v4.new_code_cell("x = 1"),
        nbformat.v4.new_markdown_cell("## 1. Setting up\n\nSome prose."),
        nbformat.v4.new_code_cell("y = 2"),
        nbformat.v4.new_code_cell("raise ValueError('the second cell of section 1')"),
        nbformat.v4.new_markdown_cell("Prose without a heading: still section 1."),
        nbformat.v4.new_code_cell("raise KeyError('the third cell of section 1')"),
        nbformat.v4.new_markdown_cell("## 2. The check\n\n```python\n# a comment in a fence, not a heading\n```"),
        nbformat.v4.new_code_cell("raise RuntimeError('the only cell of section 2')"),
    ]
    path = tmp_path / "01_headings.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)

    results = run_notebooks([path], tmp_path, solutions=False, workers=1)
    print_report([], results, [], {path.name: cell_places(read_notebook(path))})

    out = capsys.readouterr().out
    lines = out.split("errors in other cells (not graded):\n")[1].splitlines()
    assert lines[:3] == [
        f'  {path.name}, under "1. Setting up", its 2nd code cell: ValueError: the second cell of section 1',
        f'  {path.name}, under "1. Setting up", its 3rd code cell: KeyError: \'the third cell of section 1\'',
        f'  {path.name}, under "2. The check": RuntimeError: the only cell of section 2',
    ], out
    assert "Cell " not in out


def test_each_students_report_is_their_own(tmp_path: Path) -> None:
    """Without --junit, a student's report goes to their own directory; a report that names another student is never
    written over, and grade stops before running anything. (--budget 0: no cell runs, only the reports matter.)"""
    alice, bob = (make_handout(tmp_path / name) for name in ("alice", "bob"))
    for student in (alice, bob):
        status, out = grade(student, None, "--budget", "0")
        assert status == 1 and f"JUnit report: {student / REPORT_NAME}" in out, out
        assert report_student(student / REPORT_NAME) == str(student)
    kept = (alice / REPORT_NAME).read_bytes()

    shared = tmp_path / "reports" / "report.xml"  # its directory made by grade
    assert grade(alice, shared, "--budget", "0")[0] == 1 and report_student(shared) == str(alice)
    status, out = grade(bob, shared, "--budget", "0")
    assert status == 2 and f"{shared} is the report of {alice}: grading {bob} would overwrite it" in out, out
    assert "checks;" not in out  # stopped before the run
    assert report_student(shared) == str(alice)
    assert grade(alice, shared, "--budget", "0")[0] == 1  # the same student again: the report is theirs to replace
    assert (alice / REPORT_NAME).read_bytes() == kept


def run_all(path: Path, **env: str) -> nbformat.NotebookNode:
    """The notebook after Run All as JupyterLab does it: stopping at the first cell that ends in an error (nbclient
    raises CellExecutionError there). The kernel runs the student's code (A4_SOLUTIONS unset)."""
    notebook = nbformat.read(path, as_version=4)
    kernel_env = {k: v for k, v in os.environ.items() if k != "A4_SOLUTIONS"} | {"PYTHONPATH": str(REPO_ROOT), **env}
    NotebookClient(notebook, timeout=600, resources={"metadata": {"path": str(path.parent)}}).execute(env=kernel_env)
    return notebook


def shown(cell: nbformat.NotebookNode) -> str:
    """The text a reader sees in a cell's output."""
    return "".join(out.get("text", "") or out.get("data", {}).get("text/plain", "") for out in cell.outputs)


STUB = 'raise NotImplementedError("Exercise config-moe: the expert fields (notebooks/01_config.ipynb)")'


def test_failing_checks_end_without_an_error_and_are_counted_failed(tmp_path: Path) -> None:
    path = small_notebook(
        tmp_path / "01_checks.ipynb",
        ("from a4.course.checks import CheckFailed, checking", None),
        (f'with checking("unwritten"):\n    {STUB}', "unwritten"),
        ('with checking("wrong"):\n    raise CheckFailed("layer 3 is wrong (and 1 more below)\\n  - x")', "wrong"),
        ('with checking("crashes"):\n    {}["missing"]', "crashes"),
        ('with checking("fine"):\n    print("all good")', "fine"),
    )

    notebook = run_all(path)  # no CellExecutionError: every cell ran
    outputs = {check_ids_of(cell)[0]: shown(cell) for cell in notebook.cells[2:]}
    assert outputs["unwritten"].startswith(
        "FAILED unwritten: exercise config-moe not written yet: the expert fields (notebooks/01_config.ipynb)"
    ), outputs
    assert outputs["wrong"].startswith("FAILED wrong: layer 3 is wrong"), outputs
    assert outputs["crashes"].startswith("FAILED crashes: KeyError: 'missing'") and "Traceback" in outputs["crashes"]
    assert outputs["fine"] == "all good\nPASSED fine\n", outputs

    results = run_notebooks([path], tmp_path, solutions=False, workers=1)
    outcomes = {r.check_id: (r.outcome, r.ename) for r in results if r.check_id}
    assert outcomes == {
        "unwritten": ("failed", "NotImplementedError"),
        "wrong": ("failed", "CheckFailed"),
        "crashes": ("failed", "KeyError"),
        "fine": ("passed", ""),
    }
    assert next(r for r in results if r.check_id == "unwritten").exercise_not_implemented


def test_run_all_on_the_untouched_skeleton_reaches_every_check() -> None:
    notebook = run_all(REPO_ROOT / "notebooks" / NOTEBOOK)

    checks = {ids[0]: cell for cell in notebook.cells if (ids := check_ids_of(cell))}
    assert list(checks) == CHECKS
    for check_id, cell in checks.items():
        records = [out.data[FAILURE_MIME] for out in cell.outputs if FAILURE_MIME in out.get("data", {})]
        assert shown(cell).startswith(f"FAILED {check_id}: exercise config-"), shown(cell)
        assert [record["ename"] for record in records] == ["NotImplementedError"]
    # One first exercise: the previews, the first check and `make demo` (tests/test_handout.py) name the first stub.
    first = stubs(REPO_ROOT)[0].id
    code = [shown(cell) for cell in notebook.cells if cell.cell_type == "code"]
    previews = [text for text in code if "Not implemented yet." in text]
    assert previews and all(f"Not implemented yet. Exercise {first}:" in text for text in previews), previews
    assert shown(checks[CHECKS[0]]).startswith(f"FAILED {CHECKS[0]}: exercise {first} not written yet")


def test_a_fail_line_says_where_the_other_problems_are() -> None:
    """The console shows a check's first line only: its other problems are in the JUnit report, not "below"."""
    evalue = "layer 3: max error 0.5 (and 2 more below)\n  - layer 3: max error 0.5\n  - layer 4\n  - layer 5"
    result = CellResult(NOTEBOOK, 3, "config-parsing", "failed", "CheckFailed", evalue, evalue, 0.1)
    check = graded(NOTEBOOK, "config-parsing", result, "")
    assert check.why == "CheckFailed: layer 3: max error 0.5 (and 2 more in the JUnit report)"
    assert check.traceback == evalue
