"""Helpers for the notebooks' check cells: one module per notebook topic, shared plumbing here.

A check compares the student's result with transformers or with an independent computation written in these
modules, never with a4's reference solutions (under A4_SOLUTIONS=1 the reference solution is the code under test,
not the ground truth). A failing check raises `CheckFailed` (an AssertionError) whose first line names the first
problem in words a student can act on, and whose following lines list every problem. A NotImplementedError from an
unwritten exercise is left to propagate: its message already names the exercise to write.

The unit tests drive these same checks. Shared by both: `_harness` (how close is close enough: one tolerance rule
and one comparison for every check and test; random inputs) and `_model_runner` (layers and models stepped by hand).
`_earlier` makes an engine-level check that fails name the earlier notebook whose own checks fail.
"""

from __future__ import annotations

from collections.abc import Callable


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
