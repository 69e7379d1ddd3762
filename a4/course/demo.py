"""Helpers for the notebooks' demonstration cells (the cells that are not checks).

`needs_exercise()` wraps a demonstration that runs the student's code: until the exercise is written it prints
which one is missing instead of failing (also when the error that reached the cell only names it: a server's), so
the rest of the notebook still runs. A cell that uses what such a demonstration computed does so inside the same
`with` block (a later cell would meet a NameError).

`explore(show, **choices)` is a small ipywidgets explorer with a static fallback: with `A4_STATIC=1` (the book
build sets it) or without ipywidgets it calls `show` once with the first value of each choice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from a4.course.exercises import exercise_named_in, unwritten_exercise


@contextmanager
def needs_exercise() -> Iterator[None]:
    try:
        yield
    except Exception as e:
        # The exercise's own error, or one that reports it in words: a server's 500, another process's failure.
        if (missing := unwritten_exercise(e) or exercise_named_in(str(e))) is None:
            raise
        print(f"Not implemented yet. {missing}\nThis cell shows its result once that exercise is done.")


def static_mode() -> bool:
    return os.environ.get("A4_STATIC", "").strip().lower() in ("1", "true", "yes")


def explore(show: Callable[..., None], **choices: Sequence[Any]) -> None:
    """Let the reader call `show(**kwargs)` with any combination of `choices` (each a list of values)."""
    try:
        import ipywidgets
    except ImportError:
        ipywidgets = None
    if ipywidgets is None or static_mode():
        show(**{name: values[0] for name, values in choices.items()})
        return

    def show_chosen(**indices: int) -> None:
        show(**{name: choices[name][i] for name, i in indices.items()})

    # Each dropdown's values are the choices' indices: a Dropdown whose value is None shows no label, as if nothing
    # were chosen, and a choice may be None (the default of an option).
    dropdowns = {
        name: ipywidgets.Dropdown(options=[(str(value), i) for i, value in enumerate(values)], description=name)
        for name, values in choices.items()
    }
    ipywidgets.interact(show_chosen, **dropdowns)
