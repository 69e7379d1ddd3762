"""Course tooling: exercises cut from reference solutions, notebook checks, grading, the student handout.

    python -m a4.course sync               regenerate the student files a4/<path>.py from solutions/a4/<path>.py
    python -m a4.course check              fail if a student file is out of date or a solutions file is malformed
    python -m a4.course list               the exercises still to write: id, file, notebook
    python -m a4.course verify-notebooks   every notebook passes on the solutions and every check fails on the skeleton
    python -m a4.course grade [STUDENT]    every check against a student's exercise files, with this repository's
                                           notebooks and checks, in bounded time (JUnit XML too)
    python -m a4.course release OUT_DIR    the student handout: no solutions/, the student's Makefile, README, tests

Modules: `exercises` (solution markers, sync, check, the stubs of unwritten exercises), `notebooks` (running
notebooks under nbval and reading the results), `nbval_plugin` (names notebook cells by their check id, bounds their
time), `verify`, `grade`, `release` (with the student's files from `handout/`), `checks` (helpers
the notebooks' check cells call, one module per notebook), `demo` (`needs_exercise` for demonstrations that run
the student's code, `explore` for widgets with a static fallback). The rules every notebook follows are in
`verify`'s docstring.
"""
