"""Helpers for the notebooks' check cells: one module per notebook topic, shared plumbing here.

A check compares the student's result with transformers or with an independent computation written in these
modules, never with a4's reference solutions (under A4_SOLUTIONS=1 the reference solution is the code under test,
not the ground truth). A failing check raises `CheckFailed` (an AssertionError) whose first line names the first
problem in words a student can act on, and whose following lines list every problem. A NotImplementedError from an
unwritten exercise is left to propagate: its message already names the exercise to write.

The unit tests drive these same checks. Shared by both: `_harness` (how close is close enough: one tolerance rule
and one comparison for every check and test; random inputs) and `_model_runner` (layers and models stepped by hand).
`_earlier` makes an engine-level check that fails name the earlier notebook whose own checks fail. `registry` is the
table of checks (each check's id, notebook, function and grading group); `common` holds what several notebooks share
(the real configs and sizes read from them, the H200 figures, the engine checks' prompts and transformers' tokens).

A check cell runs its body in `with checking("<id>"):`, the id of its `check:<id>` tag. The cell then ends without
an error whether the check passes or fails, so that JupyterLab's Run All goes on to every later check: it prints
`PASSED <id>`, or shows `FAILED <id>` with the exercise to write or the problems found, and leaves in the cell's
output a record of the failure (`FAILURE_MIME`) from which the nbval plugin, and so `grade` and
`verify-notebooks`, count the cell as failed.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from a4._overlay import REPO_ROOT
from a4.course.exercises import not_written_yet, unwritten_exercise_error

# The MIME type of a failed check's record in its cell's output: {"check_id", "ename", "evalue", "traceback"}.
FAILURE_MIME = "application/vnd.a4.check-failure+json"


class CheckFailed(AssertionError):
    """A check found the student's result different from the reference."""


def conclude(problems: list[str], success: str, likely: str | None = None) -> None:
    """Raise CheckFailed listing `problems`, or print `success` when there are none.

    likely: the probable cause, from a cheap test of a usual mistake (the output equals what that mistake computes);
    when there are problems it comes first, so that the student reads a cause before the numbers.
    """
    if problems:
        if likely:
            problems = [f"likely cause: {likely}", *problems]
        more = f" (and {len(problems) - 1} more below)" if len(problems) > 1 else ""
        raise CheckFailed(f"{problems[0]}{more}\n" + "\n".join(f"  - {p}" for p in problems))
    print(f"PASSED: {success}")


def error_problems(
    label: str, action: Callable[[], object], error: type[Exception], mentions: str, accepted: str
) -> list[str]:
    """What is wrong with how `action()` rejects a broken input: it must raise `error` with `mentions` in its message.

    `accepted` says what happened when nothing was raised (e.g. "loaded without an error").
    """
    try:
        action()
    except error as e:
        if mentions not in str(e):
            return [f"{label}: the {error.__name__} should name {mentions!r}; it says: {e}"]
        return []
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any other exception is the failure being reported
        return [f"{label}: expected a {error.__name__} naming {mentions!r}, got {type(e).__name__}: {e}"]
    return [f"{label}: {accepted}; expected a {error.__name__} naming {mentions!r}"]


@contextmanager
def checking(check_id: str) -> Iterator[None]:
    """Run a check cell's body: print `PASSED <id>`, or show and record why the check failed (see the module's
    docstring). Outside IPython a failure propagates as usual: only a kernel has a cell output to record it in."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever the student's code raised, this check failed
        from IPython import get_ipython

        if get_ipython() is None:
            raise
        _show_failure(check_id, e)
    else:
        print(f"PASSED {check_id}")


def _show_failure(check_id: str, error: Exception) -> None:
    from IPython.display import display

    if stub := unwritten_exercise_error(error):
        # An unwritten exercise, wherever it surfaced (a server wraps it in its own error): no traceback, its place.
        ename, evalue = "NotImplementedError", str(stub)
        text = f"FAILED {check_id}: {not_written_yet(evalue)}{_written_at(stub)}"
    elif isinstance(error, AssertionError):  # CheckFailed: its message lists the problems
        ename, evalue = type(error).__name__, str(error)
        text = f"FAILED {check_id}: {evalue}"
    else:  # the student's code raised: where it did is the useful part
        ename, evalue = type(error).__name__, str(error)
        text = f"FAILED {check_id}: {ename}: {evalue}\n\n" + "".join(traceback.format_exception(error))
    # "traceback": what the cell shows, for grade's JUnit report.
    record = {"check_id": check_id, "ename": ename, "evalue": evalue, "traceback": text}
    sys.stdout.flush()  # what the check printed before it failed comes first
    display({"text/plain": text, FAILURE_MIME: record}, raw=True)


def _written_at(stub: NotImplementedError) -> str:
    """'\n  write it at a4/x.py:12': the line of the checkout that raised an unwritten exercise's error ('' if none)."""
    if not stub.__traceback__:
        return ""
    raised = traceback.extract_tb(stub.__traceback__)[-1]
    path = Path(raised.filename)
    return f"\n  write it at {path.relative_to(REPO_ROOT)}:{raised.lineno}" if path.is_relative_to(REPO_ROOT) else ""
