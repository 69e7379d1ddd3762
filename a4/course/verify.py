"""verify-notebooks: every notebook works on the reference solutions, and every check fails on the skeleton.

Static rules, read from the .ipynb files:
- stored without outputs or execution counts; the first cell is a markdown cell starting with an H1 title;
- a check cell has the tag `check` and exactly one `check:<id>` tag; ids are unique within a notebook; it runs its
  body in `with checking("<id>"):` (a4.course.checks), which shows the check's result without ending Run All;
- every exercise (a BEGIN SOLUTION marker) points at a notebook that exists and has at least one check cell;
- a notebook's check cells are, in order, those the table of checks (a4/course/checks/registry.py) gives it, and
  each calls its check's function there (`checks.<function>`, the notebook's check module imported as `checks`)
  and no function the table gives only to other checks; every function the table names exists.

Pass 1, A4_SOLUTIONS=1: every cell of every notebook passes.

Pass 2, the student skeleton (A4_SOLUTIONS unset):
- every check cell fails (a check that passes on the skeleton checks nothing), as the record `checking` leaves in
  its output says, and fails because an exercise is not
  written yet (NotImplementedError "Exercise ...") or because its comparison failed (AssertionError/CheckFailed),
  never for an unrelated reason such as a NameError;
- every other cell passes, or fails only with NotImplementedError "Exercise ...".

How notebooks meet pass 2 (the pattern of every notebook): a demonstration that runs the student's code sits in
`with needs_exercise():` (a4.course.demo), which prints "Not implemented yet" instead of failing, and anything that
uses its result stays inside that block; a check cell calls the student's code itself rather than reusing a
variable computed by an earlier cell. Then no cell meets a NameError left by an earlier unfinished exercise.

Each pass runs the notebooks over two workers, one notebook per kernel.
"""

from __future__ import annotations

import ast
import time
from collections import defaultdict
from pathlib import Path

import nbformat
from IPython.core.inputtransformer2 import TransformerManager

from a4._overlay import REPO_ROOT
from a4.course.checks.registry import BY_ID, CHECKS, checks_of
from a4.course.exercises import MarkerError, all_exercises
from a4.course.nbval_plugin import CHECK_ID_PREFIX, CHECK_TAG, check_ids_of
from a4.course.notebooks import CellResult, check_cells, notebook_paths, read_notebook, run_notebooks, select

# Failures of a check cell on the skeleton that mean "the check ran and found the exercise unfinished".
CHECK_FAILURES = ("AssertionError", "CheckFailed")


def lint_notebook(path: Path) -> list[str]:
    notebook = read_notebook(path)
    problems = []
    cells = notebook.cells
    if not cells or cells[0].cell_type != "markdown" or not cells[0].source.lstrip().startswith("# "):
        problems.append(f"{path.name}: the first cell must be markdown starting with an H1 title ('# ...')")
    seen: set[str] = set()
    code_number = -1
    for cell in cells:
        if cell.cell_type != "code":
            continue
        code_number += 1
        where = f"{path.name}: Cell {code_number}"
        if cell.get("outputs") or cell.get("execution_count") is not None:
            problems.append(f"{where}: stored with outputs or an execution count (clear them before committing)")
        tags = cell.metadata.get("tags", [])
        ids = check_ids_of(cell)
        if (CHECK_TAG in tags) != bool(ids) or len(ids) > 1:
            problems.append(
                f"{where}: a check cell needs the tag {CHECK_TAG!r} and exactly one '{CHECK_ID_PREFIX}<id>'"
            )
        for check_id in ids:
            if check_id in seen:
                problems.append(f"{where}: check id {check_id!r} is used twice")
            seen.add(check_id)
            if not cell.source.startswith(runner := f'with checking("{check_id}"):\n'):
                problems.append(f"{where}: a check cell runs its body in {runner.strip()} (its tag's id)")
    return problems


def _python(source: str) -> ast.Module:
    """A code cell's syntax tree, its IPython magics (`%autoreload 2`) turned into Python as the kernel does."""
    return ast.parse(TransformerManager().transform_cell(source))


def _checks_module(notebook: nbformat.NotebookNode) -> str | None:
    """The module of a4/course/checks that the notebook imports as `checks` (`from a4.course.checks import x as
    checks`), None if none."""
    for cell in notebook.cells:
        if cell.cell_type == "code" and "a4.course.checks" in cell.source:
            for node in ast.walk(_python(cell.source)):
                if isinstance(node, ast.ImportFrom) and node.module == "a4.course.checks":
                    for alias in node.names:
                        if alias.asname == "checks":
                            return alias.name
    return None


def check_function_problems(path: Path) -> list[str]:
    """How the notebook's check cells disagree with the functions the table of checks gives them."""
    notebook = read_notebook(path)
    module = _checks_module(notebook)
    problems = []
    for check_id, source in check_cells(notebook).items():
        if (check := BY_ID.get(check_id)) is None:
            continue  # lint names a check the table lacks
        calls = {
            f"{module}.{node.func.attr}"
            for node in ast.walk(_python(source))
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "checks"
        }
        if check.function not in calls:
            problems.append(
                f"{path.name}: check cell {check_id} does not call {check.function}, its function in the table of "
                "checks (a4/course/checks/registry.py)"
            )
        others = sorted(calls & {c.function for c in CHECKS} - {check.function})
        problems += [f"{path.name}: check cell {check_id} calls {name}, another check's function" for name in others]
    return problems


def lint(repo: Path, notebooks: list[Path]) -> list[str]:
    """The static rules for these notebooks and for the exercises that point at them (or at missing notebooks)."""
    problems = [p for path in notebooks for p in lint_notebook(path)]
    checked = {path.stem for path in notebooks if check_cells(read_notebook(path))}
    existing = {path.stem for path in notebook_paths(repo)}
    selected = {path.stem for path in notebooks}
    try:
        exercises = all_exercises(repo)
    except MarkerError as e:
        return problems + [str(e)]
    for path in notebooks:
        if (ids := list(check_cells(read_notebook(path)))) != (expected := checks_of(path.stem)):
            problems.append(
                f"{path.name}: its check cells {ids} are not those of the table of checks (a4/course/checks/"
                f"registry.py), in its order: {expected}"
            )
        problems += check_function_problems(path)
    for check in (c for c in CHECKS if c.notebook in selected):
        try:
            check.load()
        except (ImportError, AttributeError) as e:
            problems.append(f"a4/course/checks/registry.py: {check.id}: no function {check.function} ({e})")
    if selected == existing:
        for stem in sorted({check.notebook for check in CHECKS} - existing):
            problems.append(f"a4/course/checks/registry.py: checks of {stem}, which is not a notebook")
    for exercise in exercises:
        where = f"{exercise.solution_path}:{exercise.line}"
        if exercise.notebook not in existing:
            if selected == existing:  # a run over some notebooks only does not judge the others
                problems.append(f"{where}: exercise {exercise.id}: no notebook {exercise.notebook}.ipynb")
        elif exercise.notebook in selected and exercise.notebook not in checked:
            problems.append(f"{where}: exercise {exercise.id}: {exercise.notebook}.ipynb has no check cell")
    return problems


def solutions_violations(results: list[CellResult]) -> list[str]:
    return [f"solutions: {r.name} failed: {r.error}" for r in results if r.outcome != "passed"]


def skeleton_violations(results: list[CellResult]) -> list[str]:
    problems = []
    for r in results:
        if r.outcome == "skipped":
            problems.append(f"skeleton: {r.name} was skipped")
        elif r.check_id is not None and r.outcome == "passed":
            problems.append(f"skeleton: {r.name} passes on the untouched skeleton: it checks nothing")
        elif r.check_id is not None and r.failed and not (r.exercise_not_implemented or r.ename in CHECK_FAILURES):
            problems.append(f"skeleton: {r.name} fails for a reason other than an unwritten exercise: {r.error}")
        elif r.check_id is None and r.failed and not r.exercise_not_implemented:
            problems.append(f"skeleton: {r.name} failed: {r.error} (wrap demonstrations in needs_exercise())")
    return problems


def summary_table(notebooks: list[Path], solved: list[CellResult], skeleton: list[CellResult]) -> str:
    by_notebook: dict[tuple[str, str], list[CellResult]] = defaultdict(list)
    for label, results in (("solutions", solved), ("skeleton", skeleton)):
        for r in results:
            by_notebook[(r.notebook, label)].append(r)
    header = f"{'notebook':32} {'cells':>5} {'checks':>6}  {'solutions':>10} {'time':>6}  {'skeleton':>15} {'time':>6}"
    lines = [header, "-" * len(header)]
    for path in notebooks:
        solution_cells = by_notebook[(path.name, "solutions")]
        skeleton_cells = by_notebook[(path.name, "skeleton")]
        checks = [r for r in skeleton_cells if r.check_id]
        passed = sum(r.outcome == "passed" for r in solution_cells)
        failing_checks = sum(r.failed for r in checks)
        lines.append(
            f"{path.name:32} {len(solution_cells):>5} {len(checks):>6}  "
            f"{f'{passed}/{len(solution_cells)} pass':>10} {sum(r.duration for r in solution_cells):>5.1f}s  "
            f"{f'{failing_checks}/{len(checks)} checks fail':>15} {sum(r.duration for r in skeleton_cells):>5.1f}s"
        )
    return "\n".join(lines)


def verify(repo: Path = REPO_ROOT, workers: int = 2, prefixes: list[str] | None = None) -> int:
    """Print the summary and every problem; 0 when there is none. prefixes: only the notebooks starting so."""
    notebooks = select(notebook_paths(repo), prefixes)
    if not notebooks:
        print(f"no notebooks in {repo / 'notebooks'}")
        return 1
    problems = lint(repo, notebooks)
    results, wall = {}, {}
    for number, (label, solutions) in enumerate((("solutions", True), ("skeleton", False)), start=1):
        what = "with A4_SOLUTIONS=1" if solutions else "on the student skeleton"
        print(f"pass {number}: {len(notebooks)} notebooks {what} ...", flush=True)
        start = time.perf_counter()
        results[label] = run_notebooks(notebooks, repo, solutions=solutions, workers=workers)
        wall[label] = time.perf_counter() - start
    problems += solutions_violations(results["solutions"]) + skeleton_violations(results["skeleton"])
    print()
    print(summary_table(notebooks, results["solutions"], results["skeleton"]))
    print(f"\nwall time: solutions pass {wall['solutions']:.1f}s, skeleton pass {wall['skeleton']:.1f}s")
    if problems:
        print(f"\n{len(problems)} problem(s):")
        for problem in problems:
            print(f"  {problem}")
        return 1
    print("\nverify-notebooks: OK")
    return 0
