"""The course machinery: solution markers, sync/check, the solutions overlay, notebook rules, the stubs of unwritten
exercises. The handout and grading are tested end to end in test_handout.py, test_handout_solved.py, test_grade.py.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from a4._overlay import REPO_ROOT
from a4.course import verify
from a4.course.__main__ import list_checks
from a4.course.demo import explore, needs_exercise
from a4.course.exercises import (
    MarkerError,
    all_exercises,
    check,
    exercise_named_in,
    generated_files,
    not_written_yet,
    parse_exercises,
    stubs,
    student_source,
    sync,
    unwritten_exercise,
)
from a4.course.checks import config as config_checks
from a4.course.checks._earlier import EARLIER_CHECKS
from a4.course.checks.registry import BY_ID, CHECKS, checks_of
from a4.course.grade import REQUIRED_CHECKS
from a4.course.notebooks import CellResult, check_cells, read_notebook
from a4.course.verify import lint, lint_notebook, skeleton_violations

SOLUTION = textwrap.dedent(
    '''\
    """A module."""


    def double(x: int) -> int:
        """Twice x."""
        # BEGIN SOLUTION double 01_config: twice the input
        y = x * 2
        return y
        # END SOLUTION


    class Box:
        def area(self) -> int:
            # BEGIN SOLUTION box-area 02_weights: width times height
            return 6
            # END SOLUTION

    KEPT = "everything outside the regions"
    '''
)


def _env(solutions: bool, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "A4_SOLUTIONS"}
    if solutions:
        env["A4_SOLUTIONS"] = "1"
    return {**env, **extra}


def _python(code: str, cwd: Path, solutions: bool, **extra_env: str) -> subprocess.CompletedProcess:
    env = _env(solutions, PYTHONPATH=str(cwd), **extra_env)
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)


# ------------------------------------------------------------------------------------------------- markers and sync


def test_student_source_replaces_each_region_and_keeps_the_rest() -> None:
    path = Path("solutions/a4/demo.py")
    generated = student_source(SOLUTION, path)
    expected_body = SOLUTION.replace(
        "    # BEGIN SOLUTION double 01_config: twice the input\n    y = x * 2\n    return y\n    # END SOLUTION\n",
        '    raise NotImplementedError("Exercise double: twice the input (notebooks/01_config.ipynb)")\n',
    ).replace(
        "        # BEGIN SOLUTION box-area 02_weights: width times height\n        return 6\n        # END SOLUTION\n",
        '        raise NotImplementedError("Exercise box-area: width times height (notebooks/02_weights.ipynb)")\n',
    )
    assert expected_body != SOLUTION
    header, body = generated.split('"""A module."""', 1)
    assert "solutions/a4/demo.py" in header and "python -m a4.course sync" in header
    assert '"""A module."""' + body == expected_body
    namespace: dict = {}
    exec(compile(generated, "demo.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"^Exercise double: twice the input \(notebooks/01_config.ipynb\)$"):
        namespace["double"](1)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        ("# BEGIN SOLUTION a 01_x: y\nx = 1\n", "never closed"),
        ("x = 1\n# END SOLUTION\n", "without a BEGIN"),
        ("# BEGIN SOLUTION a 01_x: y\n# BEGIN SOLUTION b 01_x: z\n# END SOLUTION\n", "inside the region"),
        ("    # BEGIN SOLUTION a 01_x: y\n    x = 1\n# END SOLUTION\n", "not indented like"),
        ("# BEGIN SOLUTION a 01_x: y\n# END SOLUTION\n", "empty solution region"),
        ("# BEGIN SOLUTION a: y\nx = 1\n# END SOLUTION\n", "malformed marker"),
        ("# BEGIN SOLUTION Bad_Id 01_x: y\nx = 1\n# END SOLUTION\n", "malformed marker"),
        ('# BEGIN SOLUTION a 01_x: say "hi"\nx = 1\n# END SOLUTION\n', "quotes"),
        ("x = 1\n", "no BEGIN SOLUTION regions"),
    ],
)
def test_malformed_markers_are_rejected(source: str, message: str) -> None:
    with pytest.raises(MarkerError, match=message):
        parse_exercises(source, Path("solutions/a4/bad.py"))


def _write(root: Path, relative: str, text: str) -> None:
    (root / relative).parent.mkdir(parents=True, exist_ok=True)
    (root / relative).write_text(text)


def test_check_names_missing_stale_and_orphaned_files(tmp_path: Path) -> None:
    _write(tmp_path, "solutions/a4/pkg/demo.py", SOLUTION)
    assert check(tmp_path) == ["a4/pkg/demo.py: missing (generated from solutions/a4/pkg/demo.py)"]
    assert sync(tmp_path) == [Path("a4/pkg/demo.py")]
    assert check(tmp_path) == [] and sync(tmp_path) == []

    (tmp_path / "a4/pkg/demo.py").write_text((tmp_path / "a4/pkg/demo.py").read_text() + "# edited\n")
    assert check(tmp_path) == ["a4/pkg/demo.py: differs from what sync generates from solutions/a4/pkg/demo.py"]
    sync(tmp_path)

    shutil.copy(tmp_path / "a4/pkg/demo.py", tmp_path / "a4/pkg/old.py")
    assert check(tmp_path) == ["a4/pkg/old.py: generated file without a reference file in solutions/"]


def test_duplicate_exercise_ids_are_rejected(tmp_path: Path) -> None:
    _write(tmp_path, "solutions/a4/one.py", SOLUTION)
    _write(tmp_path, "solutions/a4/two.py", SOLUTION)
    with pytest.raises(MarkerError, match="exercise id 'double' is already used at solutions/a4/one.py:6"):
        generated_files(tmp_path)
    assert "already used" in check(tmp_path)[0]


def test_check_command_passes_on_the_repository() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "a4.course", "check"], cwd=REPO_ROOT, env=_env(False), capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


# ---------------------------------------------------------------------------------------------------------- overlay


IMPORT_CONFIG_EXERCISE = """
import a4.models.qwen3_5_config as module
print(module.__file__)
try:
    module.qwen3_5_layer_types({"num_hidden_layers": 4})
except NotImplementedError as e:
    print("raised:", e)
"""


def test_overlay_serves_solutions_to_subpackages() -> None:
    with_solutions = _python(IMPORT_CONFIG_EXERCISE, REPO_ROOT, solutions=True)
    skeleton = _python(IMPORT_CONFIG_EXERCISE, REPO_ROOT, solutions=False)
    assert with_solutions.returncode == 0 and skeleton.returncode == 0, with_solutions.stderr + skeleton.stderr
    assert with_solutions.stdout.splitlines() == [str(REPO_ROOT / "solutions/a4/models/qwen3_5_config.py")]
    file, raised = skeleton.stdout.splitlines()
    assert file == str(REPO_ROOT / "a4/models/qwen3_5_config.py")
    assert raised.startswith("raised: Exercise config-layer-types: ")


# -------------------------------------------------------------------------------------------------- notebook rules


def test_lint_flags_outputs_titles_and_check_tags(tmp_path: Path) -> None:
    cells = [
        nbformat.v4.new_markdown_cell("No title here"),
        nbformat.v4.new_code_cell("1", execution_count=3),
        nbformat.v4.new_code_cell("2", metadata={"tags": ["check"]}),
        nbformat.v4.new_code_cell('with checking("a"):\n    3', metadata={"tags": ["check", "check:a"]}),
        nbformat.v4.new_code_cell('with checking("a"):\n    4', metadata={"tags": ["check", "check:a"]}),
        nbformat.v4.new_code_cell('with checking("b"):\n    5', metadata={"tags": ["check", "check:c"]}),
    ]
    path = tmp_path / "01_demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    problems = lint_notebook(path)
    assert problems == [
        "01_demo.ipynb: the first cell must be markdown starting with an H1 title ('# ...')",
        "01_demo.ipynb: Cell 0: stored with outputs or an execution count (clear them before committing)",
        "01_demo.ipynb: Cell 1: a check cell needs the tag 'check' and exactly one 'check:<id>'",
        "01_demo.ipynb: Cell 3: check id 'a' is used twice",
        """01_demo.ipynb: Cell 4: a check cell runs its body in with checking("c"): (its tag's id)""",
    ]


def test_committed_notebooks_follow_the_rules() -> None:
    for path in sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert lint_notebook(path) == []


def test_the_table_of_checks_is_what_the_notebooks_grade_and_the_engine_checks_name(tmp_path: Path) -> None:
    notebooks = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert lint(REPO_ROOT, notebooks) == []
    assert [c.id for c in CHECKS] == [i for path in notebooks for i in check_cells(read_notebook(path))]
    assert REQUIRED_CHECKS == {
        "config-parsing", "weight-loading", "decode-single", "decode-varlen", "decode-chunked", "decode-slot-reuse",
        "prefix-cache-refuse", "prefix-cache-checkpoint",
    }  # fmt: skip
    assert set(EARLIER_CHECKS) <= set(BY_ID)
    # A notebook whose check cells differ from the table's is named.
    notebook = read_notebook(REPO_ROOT / "notebooks/01_config.ipynb")
    notebook.cells = [cell for cell in notebook.cells if "check:config-moe" not in cell.metadata.get("tags", [])]
    nbformat.write(notebook, tmp_path / "01_config.ipynb")
    assert [p for p in lint(REPO_ROOT, [tmp_path / "01_config.ipynb"]) if "table of checks" in p] == [
        f"01_config.ipynb: its check cells {checks_of('01_config')[:3] + checks_of('01_config')[4:]} are not those of "
        f"the table of checks (a4/course/checks/registry.py), in its order: {checks_of('01_config')}"
    ]


def test_a_check_cell_calls_the_function_the_table_gives_its_id(tmp_path: Path, monkeypatch) -> None:
    assert BY_ID["config-rope"].load() is config_checks.check_rotary_dims
    # The cell of config-rope calls config-layer-patterns' function (a copied cell whose tag was changed).
    notebook = read_notebook(REPO_ROOT / "notebooks/01_config.ipynb")
    [cell] = [cell for cell in notebook.cells if "check:config-rope" in cell.metadata.get("tags", [])]
    cell.source = cell.source.replace("checks.check_rotary_dims(", "checks.check_layer_patterns(")
    nbformat.write(notebook, tmp_path / "01_config.ipynb")
    assert lint(REPO_ROOT, [tmp_path / "01_config.ipynb"]) == [
        "01_config.ipynb: check cell config-rope does not call config.check_rotary_dims, its function in the table "
        "of checks (a4/course/checks/registry.py)",
        "01_config.ipynb: check cell config-rope calls config.check_layer_patterns, another check's function",
    ]
    # A table that names a function its module lacks (renamed in a4/course/checks/config.py, say).
    renamed = [dataclasses.replace(c, function="config.check_rope") if c.id == "config-rope" else c for c in CHECKS]
    monkeypatch.setattr(verify, "CHECKS", tuple(renamed))
    assert [p for p in lint(REPO_ROOT, [REPO_ROOT / "notebooks/01_config.ipynb"]) if "registry.py: " in p] == [
        "a4/course/checks/registry.py: config-rope: no function config.check_rope "
        "(module 'a4.course.checks.config' has no attribute 'check_rope')"
    ]


def test_list_checks_prints_each_checks_group_notebook_and_function(capsys) -> None:
    assert list_checks() == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{len(CHECKS)} checks, in notebook order:"
    assert [line.split() for line in lines[3:]] == [
        [c.id, c.group, f"notebooks/{c.notebook}.ipynb", c.function] for c in CHECKS
    ]


def _cell(check_id: str | None, outcome: str, ename: str = "", evalue: str = "") -> CellResult:
    return CellResult("01_x.ipynb", 3, check_id, outcome, ename, evalue, "", 0.1)


def test_skeleton_rules() -> None:
    stub = ("NotImplementedError", "Exercise a: b (notebooks/01_x.ipynb)")
    fine = [
        _cell("a", "failed", *stub),
        _cell("a", "failed", "CheckFailed", "layer 3: expected full_attention"),
        _cell(None, "failed", *stub),
        _cell(None, "passed"),
    ]
    assert skeleton_violations(fine) == []
    bad = [
        _cell("a", "passed"),
        _cell("a", "failed", "NameError", "name 'config' is not defined"),
        _cell(None, "failed", "NameError", "name 'config' is not defined"),
        _cell(None, "failed", "NotImplementedError", "some library's own stub"),
    ]
    assert [v.split(":")[0] for v in skeleton_violations(bad)] == ["skeleton"] * 4


# ---------------------------------------------------------------------------------------- stubs of unwritten exercises


def test_the_skeletons_stubs_are_the_exercises_of_the_solutions() -> None:
    from_solutions = {(e.id, e.notebook, e.text, e.student_path) for e in all_exercises(REPO_ROOT)}
    assert {(s.id, s.notebook, s.text, s.path) for s in stubs(REPO_ROOT)} == from_solutions
    notebooks = [stub.notebook for stub in stubs(REPO_ROOT)]
    assert notebooks == sorted(notebooks)


def test_an_unwritten_exercise_is_recognised_through_the_errors_raised_from_it() -> None:
    message = "Exercise gdn-layer: the layer (notebooks/04_gated_deltanet.ipynb)"
    try:
        try:
            raise NotImplementedError(message)
        except NotImplementedError as e:
            raise RuntimeError("the engine failed") from e
    except RuntimeError as wrapped:
        assert unwritten_exercise(wrapped) == message
    assert unwritten_exercise(NotImplementedError("some library's own stub")) is None
    # Failures that only say it in words: a subprocess's traceback, a command's error line.
    assert exercise_named_in(f"Traceback (most recent call last):\n  ...\nNotImplementedError: {message}\n") == message
    assert exercise_named_in(f"error: {not_written_yet(message)}\n") == message
    assert exercise_named_in("NotImplementedError: some library's own stub") is None
    reworded = "exercise gdn-layer not written yet: the layer (notebooks/04_gated_deltanet.ipynb)"
    assert not_written_yet(message) == reworded


def test_a_demonstration_names_the_missing_exercise_and_lets_other_errors_through(capsys) -> None:
    message = "Exercise gdn-layer: the layer (notebooks/04_gated_deltanet.ipynb)"
    server_error = RuntimeError(f"Error code: 500 - the step raised NotImplementedError: {message}")
    for error in (NotImplementedError(message), server_error):
        with needs_exercise():
            raise error
        assert capsys.readouterr().out.startswith(f"Not implemented yet. {message}\n")
    for error in (NotImplementedError("some library's own stub"), RuntimeError("Error code: 500")):
        with pytest.raises(type(error)), needs_exercise():
            raise error


def test_an_explorer_shows_every_choice_by_name_and_calls_with_its_value(monkeypatch) -> None:
    """A None choice included (notebook 06's state_fraction): an ipywidgets Dropdown whose value is None shows none."""
    import ipywidgets

    monkeypatch.delenv("A4_STATIC", raising=False)
    built = []  # the interactive that interact would display
    monkeypatch.setattr(ipywidgets, "interact", lambda f, **widgets: built.append(ipywidgets.interactive(f, **widgets)))
    calls = []
    explore(lambda **kwargs: calls.append(kwargs), state_fraction=[None, 0.5], model=["0.8B", "35B-A3B"])
    (interactive,) = built
    state_fraction, model = interactive.children[:2]
    assert [label for label, _ in state_fraction.options] == ["None", "0.5"] and state_fraction.label == "None"
    model.index = 1
    state_fraction.index = 1
    assert calls == [
        {"state_fraction": None, "model": "0.8B"},
        {"state_fraction": None, "model": "35B-A3B"},
        {"state_fraction": 0.5, "model": "35B-A3B"},
    ]


@pytest.mark.parametrize("command", ["check", "sync", "verify-notebooks"])
def test_maintainer_commands_say_a_handout_has_nothing_for_them(command: str, tmp_path: Path) -> None:
    shutil.copytree(REPO_ROOT / "a4", tmp_path / "a4", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run(
        [sys.executable, "-m", "a4.course", command], cwd=tmp_path, env=_env(False, PYTHONPATH=str(tmp_path)),
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2 and "a course maintainer's command, not a handout's" in run.stderr, run.stderr
