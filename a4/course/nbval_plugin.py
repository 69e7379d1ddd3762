"""pytest plugin for notebooks run by nbval: names check cells by their check id and records every cell's result.

Load it with `pytest -p a4.course.nbval_plugin --nbval-lax ...`. A check cell carries the tags `check` and
`check:<id>`; its pytest item is renamed from `Cell N` to `<id>`, so reports read
`notebooks/05_state_pool.ipynb::decode-varlen`. With `--a4-results PATH`, one JSON line per cell (its notebook, cell
number, check id, outcome and the error it raised) is written to PATH: `a4.course.notebooks` reads it back.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from nbval.plugin import IPyNbCell

CHECK_TAG = "check"
CHECK_ID_PREFIX = "check:"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def check_ids_of(cell: Any) -> list[str]:
    """The ids in a cell's `check:<id>` tags (a well-formed check cell has exactly one)."""
    tags = cell.get("metadata", {}).get("tags", [])
    return [tag[len(CHECK_ID_PREFIX) :] for tag in tags if tag.startswith(CHECK_ID_PREFIX)]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--a4-results", metavar="PATH", help="write one JSON line per notebook cell result to PATH")


class CheckCell(IPyNbCell):
    """A notebook cell tagged `check:<id>`, named by its id rather than by its position."""

    def reportinfo(self):
        return self.path, 0, f"{self.path.name}::{self.name}"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = [_named_by_check_id(item) for item in items]


def _named_by_check_id(item: pytest.Item) -> pytest.Item:
    if not isinstance(item, IPyNbCell):
        return item
    check_ids = check_ids_of(item.cell)
    if check_ids:
        item = CheckCell.from_parent(
            item.parent, name=check_ids[0], cell_num=item.cell_num, cell=item.cell, options=item.options
        )
        item.user_properties.append(("a4_check", check_ids[0]))
    item.user_properties.append(("a4_cell", item.cell_num))
    return item


# A cell that fails with one of these could not import a module (a student's file that does not even parse): every
# later cell of its notebook that uses the names it should have defined fails for that reason.
IMPORT_ERRORS = ("SyntaxError", "IndentationError", "TabError", "ImportError", "ModuleNotFoundError")
# A file named in a traceback: `File "/path/to/a4/layers/deltanet.py", line 12` (IPython also writes `File path:12`).
TRACEBACK_FILE = re.compile(r'File "?([^",\n]+\.py)"?(?:, line |:)(\d+)')
SYNTAX_ERROR_PLACE = re.compile(r" \([^()]*, line \d+\)$")
# notebook path -> (ename, first line) of its first import failure: one notebook runs in one process (loadfile).
_import_failures: dict[Path, tuple[str, str]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    outputs = getattr(item, "test_outputs", None) or []
    errors = [out for out in outputs if out.get("output_type") == "error"]
    if call.when == "call" and errors:
        error = errors[-1]
        ename, evalue = error["ename"], error["evalue"]
        traceback = ANSI_ESCAPE.sub("", "\n".join(error.get("traceback", [])))
        notebook = Path(item.path)
        if notebook in _import_failures:
            # Put the cause first: "NameError: name 'GatedDeltaNet' is not defined" sends a student looking in
            # the wrong place.
            cause_name, cause = _import_failures[notebook]
            ename, evalue = cause_name, f"{cause}\n(this cell then failed with {ename}: {evalue})"
        elif ename in IMPORT_ERRORS:
            _import_failures[notebook] = (ename, _import_failure(evalue, traceback, Path(item.config.rootpath)))
            evalue = f"{_import_failures[notebook][1]}\n{evalue}"
        report.user_properties.append(("a4_error", (ename, evalue, traceback)))
    return report


def _import_failure(evalue: str, traceback: str, root: Path) -> str:
    """One line naming the file that does not import and why, e.g. "a4/layers/deltanet.py does not import (line 12:
    invalid syntax): fix it, then run the notebook again from the top"."""
    files = [(Path(path), line) for path, line in TRACEBACK_FILE.findall(traceback)]
    inside = [(path, line) for path, line in files if path.is_relative_to(root)]
    reason = evalue.strip().splitlines()[0] if evalue.strip() else "an import error"
    reason = SYNTAX_ERROR_PLACE.sub("", reason)  # "invalid syntax (deltanet.py, line 12)": the place is said below
    if not inside:
        return f"the notebook's imports failed ({reason}): fix that, then run the notebook again from the top"
    path, line = inside[-1]
    return (
        f"{path.relative_to(root)} does not import (line {line}: {reason}): fix it, then run the notebook again "
        f"from the top"
    )


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("a4_results")
    # Under xdist only the controller writes: it sees every worker's reports.
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ResultsWriter(Path(path)), "a4-results-writer")


class ResultsWriter:
    """Appends one JSON line per notebook cell: what `a4.course.notebooks.CellResult` reads."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call" and not (report.failed or report.skipped):
            return
        properties = dict(report.user_properties)
        if "a4_cell" not in properties:
            return
        ename, evalue, traceback = properties.get("a4_error", ("", "", ""))
        if report.failed and not ename:  # nbval failed the cell itself (a timeout, a dead kernel)
            ename, evalue, traceback = "NbvalError", report.longreprtext.strip().splitlines()[0], report.longreprtext
        record = {
            "notebook": Path(report.fspath).name,
            "cell": properties["a4_cell"],
            "check_id": properties.get("a4_check"),
            "outcome": report.outcome,
            "ename": ename,
            "evalue": evalue,
            "traceback": traceback,
            "duration": report.duration,
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
