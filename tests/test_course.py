"""The course machinery: solution markers, sync/check, the solutions overlay, notebook rules, release and grade.

The end-to-end test makes a student handout with `release`, grades notebook 01 on it (every check must fail on
the untouched skeleton), copies the reference solutions over the student files and grades again (every check must
pass); it also runs the Qwen3 engine in the handout, where no solution exists, against transformers.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from a4._overlay import REPO_ROOT
from a4.checkpoints import cache_root
from a4.course.exercises import (
    MarkerError,
    check,
    generated_files,
    parse_exercises,
    solution_files,
    student_path_of,
    student_source,
    sync,
)
from a4.course.notebooks import CellResult, check_cells, read_notebook
from a4.course.verify import lint_notebook, skeleton_violations

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
        nbformat.v4.new_code_cell("3", metadata={"tags": ["check", "check:a"]}),
        nbformat.v4.new_code_cell("4", metadata={"tags": ["check", "check:a"]}),
    ]
    path = tmp_path / "01_demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    problems = lint_notebook(path)
    assert problems == [
        "01_demo.ipynb: the first cell must be markdown starting with an H1 title ('# ...')",
        "01_demo.ipynb: Cell 0: stored with outputs or an execution count (clear them before committing)",
        "01_demo.ipynb: Cell 1: a check cell needs the tag 'check' and exactly one 'check:<id>'",
        "01_demo.ipynb: Cell 3: check id 'a' is used twice",
    ]


def test_committed_notebooks_follow_the_rules() -> None:
    for path in sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert lint_notebook(path) == []


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


# ------------------------------------------------------------------------------------------ release, grade, engine


@pytest.fixture(scope="module")
def handout(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("handout") / "a4-handout"
    run = subprocess.run(
        [sys.executable, "-m", "a4.course", "release", str(out)],
        cwd=REPO_ROOT,
        env=_env(False),
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    return out


def test_release_has_no_solutions_and_clear_notebooks(handout: Path) -> None:
    assert not (handout / "solutions").exists()
    skeleton = "a4/models/qwen3_5_config.py"
    assert (handout / skeleton).read_text() == (REPO_ROOT / skeleton).read_text()
    for path in (handout / "notebooks").glob("*.ipynb"):
        for cell in read_notebook(path).cells:
            assert cell.cell_type != "code" or (not cell.outputs and cell.execution_count is None)


def _grade(repo: Path, junit: Path, notebook: str = "01") -> subprocess.Popen:
    # The handout builds no checkpoint of its own: it shares the repository's cache (keys are content hashes).
    # Two gradings run at once: one OpenMP thread each keeps them from oversubscribing the cores.
    env = _env(False, PYTHONPATH=str(repo), A4_CACHE_DIR=str(cache_root().parent), OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "a4.course", "grade", str(repo), "--notebook", notebook, "--junit", str(junit)]
    return subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _junit_cases(path: Path) -> dict[str, bool]:
    """check id -> passed, from the JUnit report."""
    return {case.get("name"): case.find("failure") is None for case in ET.parse(path).getroot().iter("testcase")}


def test_grade_fails_every_check_on_the_skeleton_and_passes_them_with_solutions(handout: Path, tmp_path: Path) -> None:
    check_ids = check_cells(read_notebook(REPO_ROOT / "notebooks/01_config.ipynb"))
    assert len(check_ids) >= 4
    solved = tmp_path / "solved"
    shutil.copytree(handout, solved)
    for path in solution_files(REPO_ROOT):
        shutil.copy(REPO_ROOT / path, solved / student_path_of(path))

    # Both gradings at once: each is mostly waiting for imports in its own kernel.
    skeleton, graded = _grade(handout, tmp_path / "skeleton.xml"), _grade(solved, tmp_path / "solved.xml")
    skeleton_out, graded_out = skeleton.communicate()[0], graded.communicate()[0]

    assert skeleton.returncode == 1, skeleton_out
    for check_id in check_ids:
        assert f"FAIL  01_config.ipynb::{check_id}" in skeleton_out
    assert "NotImplementedError: Exercise config-" in skeleton_out
    assert f"0/{len(check_ids)} checks pass" in skeleton_out
    assert _junit_cases(tmp_path / "skeleton.xml") == {check_id: False for check_id in check_ids}

    assert graded.returncode == 0, graded_out
    for check_id in check_ids:
        assert f"PASS  01_config.ipynb::{check_id}" in graded_out
    assert f"{len(check_ids)}/{len(check_ids)} checks pass" in graded_out
    assert _junit_cases(tmp_path / "solved.xml") == {check_id: True for check_id in check_ids}


def test_grade_puts_a_syntax_error_in_a_student_file_first_in_every_check(handout: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(handout, broken)
    student_file = broken / "a4/layers/deltanet.py"
    lines = student_file.read_text().splitlines()
    line = next(i for i, text in enumerate(lines) if text.startswith("def ")) + 1
    lines.insert(line - 1, "def broken(:")
    student_file.write_text("\n".join(lines) + "\n")
    check_ids = check_cells(read_notebook(REPO_ROOT / "notebooks/04_gated_deltanet.ipynb"))

    grading = _grade(broken, tmp_path / "broken.xml", notebook="04")
    out = grading.communicate()[0]

    assert grading.returncode == 1, out
    # The first line of every check names the cause, not the NameError it led to.
    cause = f"SyntaxError: a4/layers/deltanet.py does not import (line {line}: invalid syntax)"
    for check_id in check_ids:
        assert f"FAIL  04_gated_deltanet.ipynb::{check_id}" in out
    report = [text for text in out.splitlines() if text.startswith("FAIL  04_gated_deltanet.ipynb::")]
    assert len(report) == len(check_ids) and all(cause in text for text in report), out


QWEN3_ON_SKELETON = """
from a4 import LLM, SamplingParams
from a4.checkpoints import tiny_checkpoint
from a4.reference import hf_greedy

checkpoint = tiny_checkpoint("qwen3")
prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
outputs = LLM(checkpoint, max_prefill_tokens=8).generate(prompts, SamplingParams(max_new_tokens=4))
assert [o.token_ids for o in outputs] == hf_greedy(checkpoint, prompts, 4), outputs
print("ok")
"""


def test_qwen3_engine_runs_in_the_handout_without_any_solution(handout: Path) -> None:
    run = _python(QWEN3_ON_SKELETON, handout, solutions=False, A4_CACHE_DIR=str(cache_root().parent))
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr
