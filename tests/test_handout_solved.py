"""The student handout with the reference solutions copied over the student files: every command its documents
mention passes (the same commands as test_handout.py, run the same way)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from handout_commands import make_handout, run_in, runs, solve

from a4._overlay import REPO_ROOT
from a4.course.grade import REQUIRED_CHECKS
from a4.course.notebooks import check_cells, read_notebook


@pytest.fixture(scope="module")
def solved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    handout = make_handout(tmp_path_factory.mktemp("solved"))
    solve(handout)
    return handout


@pytest.mark.parametrize("run", runs(), ids=shlex.join)
def test_each_documented_command_passes_on_the_solved_handout(run: tuple[str, ...], solved: Path) -> None:
    result = run_in(solved, run)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "not written yet" not in out and "Traceback (most recent call last)" not in out, out
    if run == ("make", "demo"):
        assert "model: Qwen3_5ForConditionalGeneration" in out
        assert "all 8 requests match transformers token for token" in out
    elif run[:2] == ("make", "grade"):
        checks = check_cells(read_notebook(REPO_ROOT / "notebooks/01_config.ipynb"))
        required, other = len(set(checks) & REQUIRED_CHECKS), len(set(checks) - REQUIRED_CHECKS)
        assert f"checks passed: required {required}/{required}, other {other}/{other}" in out
    elif run == ("python", "-m", "a4.course", "list"):
        assert "every exercise is written" in out
