"""pytest plugin for notebooks run by nbval: names check cells by their check id, bounds each cell's time and the
run's, and records every cell's result.

Load it with `pytest -p a4.course.nbval_plugin --nbval-lax --nbval-cell-timeout S ...`.
- Names: a check cell carries the tags `check` and `check:<id>`; its pytest item is renamed from `Cell N` to `<id>`,
  so reports read `notebooks/05_state_pool.ipynb::decode-varlen`.
- Time: nbval interrupts the kernel once a cell has run S seconds. Such a cell is reported `TIMEOUT after S s`, with
  where the interrupt found the code, and the cells after it still run (nbval would mark them all as expected
  failures). A kernel that does not stop at the interrupt is shut down: by nbval once it falls silent, or by a
  watchdog GRACE_S later if it keeps printing. The next cell then starts a new kernel and first replays the cells
  that had completed before, so that it finds the notebook's state. With `--a4-budget B`, a cell that would start
  after B seconds of the run is reported `NOT RUN` instead; with `--a4-notebook-budget N`, so is a cell that would
  start after N seconds of its notebook, so that one notebook's timeouts cannot leave another unrun.
- Failed checks: a check cell whose check fails ends without an error (`a4.course.checks.checking`, so that Run All
  goes on) but leaves a record of the failure in its output; such a cell is reported failed, with the error recorded.
- Results: with `--a4-results PATH`, one JSON line per cell (its notebook, cell number, check id, outcome and the
  error it raised) is written to PATH: `a4.course.notebooks` reads it back.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from nbval.plugin import IPyNbCell

from a4.course.checks import FAILURE_MIME

CHECK_TAG = "check"
CHECK_ID_PREFIX = "check:"
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# How long a kernel may take to stop after the interrupt before it is killed.
GRACE_S = 10
# The errors this plugin reports in place of the kernel's.
TIMEOUT = "Timeout"
NOT_RUN = "NotRun"
# A frame of an IPython traceback in the package: "File /tmp/x/a4/layers/deltanet.py:215, in intra_chunk(...)".
A4_FRAME = re.compile(r"File \S*/(?P<path>a4/\S+\.py):(?P<line>\d+), in (?P<function>\w+)")

_started = time.monotonic()


def check_ids_of(cell: Any) -> list[str]:
    """The ids in a cell's `check:<id>` tags (a well-formed check cell has exactly one)."""
    tags = cell.get("metadata", {}).get("tags", [])
    return [tag[len(CHECK_ID_PREFIX) :] for tag in tags if tag.startswith(CHECK_ID_PREFIX)]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--a4-results", metavar="PATH", help="write one JSON line per notebook cell result to PATH")
    parser.addoption("--a4-budget", type=float, metavar="S", help="run no cell once S seconds of the run are spent")
    parser.addoption(
        "--a4-notebook-budget", type=float, metavar="S", help="run no cell of a notebook once S seconds of it are spent"
    )


def pytest_configure(config: pytest.Config) -> None:
    global _started
    _started = time.monotonic()
    path = config.getoption("a4_results")
    # Under xdist only the controller writes: it sees every worker's reports.
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(ResultsWriter(Path(path)), "a4-results-writer")


def stopped_at(traceback: str) -> str:
    """Where in a4 an interrupted cell was: 'a4/layers/deltanet.py:215 in intra_chunk', or '' when not in a4."""
    frames = list(A4_FRAME.finditer(traceback))
    return f"{frames[-1]['path']}:{frames[-1]['line']} in {frames[-1]['function']}" if frames else ""


class Stopped(Exception):
    """The cell ran out of time, or was not started because the run's budget was spent."""


class CheckCellFailed(Exception):
    """A check cell ended without an error but recorded in its output that its check failed."""


class BoundedCell(IPyNbCell):
    """A notebook cell run with a time limit; a check cell is named by its check id."""

    check_id: str | None = None
    # (ename, evalue, traceback) reported instead of the kernel's error: a timeout, a cell not run, a failed check.
    override: tuple[str, str, str] | None = None

    def reportinfo(self):
        if self.check_id is None:
            return super().reportinfo()
        return self.path, 0, f"{self.path.name}::{self.name}"

    def setup(self) -> None:
        """Nothing: nbval's setup marks every cell after a timeout as an expected failure; here they all run."""

    def runtest(self) -> None:
        if spent := self.budget_spent():
            self.override = (NOT_RUN, f"NOT RUN: {spent}", "")
            raise Stopped(self.override[1])
        if not self.parent.kernel.is_alive():
            self.restart_kernel()
        failure = None
        try:
            self.run_bounded()
        except Exception as e:  # noqa: BLE001 - re-raised below unless the cell ran out of time
            failure = e
        if not self.parent.timed_out:
            if self.check_id is None:  # it ran to its end, passed or failed: it may have built state later cells use
                _run_of(self.parent).completed.append(self)
            if failure is not None:
                raise failure
            if record := self.check_failure():
                self.override = (record["ename"], record["evalue"], record["traceback"])
                raise CheckCellFailed(f"FAILED {record['check_id']}: {record['ename']}: {record['evalue']}")
            return
        traceback = "\n".join("\n".join(error.get("traceback", [])) for error in self.errors())
        where = stopped_at(ANSI_ESCAPE.sub("", traceback))
        message = f"TIMEOUT after {self.config.option.nbval_cell_timeout:g} s"
        if where:
            message += f", stopped in {where}"
        if not self.parent.kernel.is_alive():
            message += " (the kernel did not stop at the interrupt: it was killed, and restarted for the next cell)"
        self.override = (TIMEOUT, message, traceback)
        raise Stopped(self.override[1])

    def budget_spent(self) -> str:
        """Why this cell may not start ('' when it may): the run's or its notebook's budget is spent."""
        now = time.monotonic()
        budget, share = self.config.getoption("a4_budget"), self.config.getoption("a4_notebook_budget")
        if budget is not None and now - _started > budget:
            return f"the budget of {budget:g} s for the whole run was spent"
        if share is not None and now - _run_of(self.parent).started > share:
            return f"the budget of {share:g} s for this notebook was spent"
        return ""

    def run_bounded(self) -> None:
        """nbval's run of the cell (it sets the notebook's `timed_out`); a kernel that will not stop is killed."""
        notebook = self.parent
        notebook.timed_out = False
        watchdog = threading.Timer(self.config.option.nbval_cell_timeout + GRACE_S, _kill, [notebook.kernel])
        watchdog.start()
        try:
            super().runtest()
        finally:
            watchdog.cancel()

    def restart_kernel(self) -> None:
        """A new kernel for the notebook, with the cells that had completed replayed in order."""
        notebook = self.parent
        if hasattr(notebook.kernel, "km"):  # dead, but not shut down by nbval
            notebook.kernel.stop()
        notebook.setup()
        for cell in _run_of(notebook).completed:
            try:
                cell.run_bounded()
            except Exception:  # noqa: BLE001 - the state is rebuilt as far as it can be; the cell run next reports
                pass

    def errors(self) -> list[dict[str, Any]]:
        return [out for out in self.test_outputs or [] if out.get("output_type") == "error"]

    def check_failure(self) -> dict[str, str] | None:
        """The record that `a4.course.checks.checking` left in the output of a check that failed; None if none."""
        for out in self.test_outputs or []:
            if out.get("output_type") == "display_data" and FAILURE_MIME in out.get("data", {}):
                return out["data"][FAILURE_MIME]
        return None


@dataclass
class NotebookRun:
    """What the plugin keeps per notebook: when its first cell started, and the cells that ran to their end."""

    started: float = field(default_factory=time.monotonic)
    completed: list[BoundedCell] = field(default_factory=list)


def _run_of(notebook: pytest.Collector) -> NotebookRun:
    if not hasattr(notebook, "a4_run"):
        notebook.a4_run = NotebookRun()
    return notebook.a4_run


def _kill(kernel: Any) -> None:
    """Kill the kernel process (from the watchdog thread): nbval then finds no output and gives the cell up."""
    try:
        kernel.km.provisioner.process.kill()
    except AttributeError:  # already shut down
        pass


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items[:] = [_bounded(item) for item in items]


def _bounded(item: pytest.Item) -> pytest.Item:
    if not isinstance(item, IPyNbCell):
        return item
    check_ids = check_ids_of(item.cell)
    name = check_ids[0] if check_ids else item.name
    cell = BoundedCell.from_parent(item.parent, name=name, cell_num=item.cell_num, cell=item.cell, options=item.options)
    if check_ids:
        cell.check_id = check_ids[0]
        cell.user_properties.append(("a4_check", check_ids[0]))
    cell.user_properties.append(("a4_cell", item.cell_num))
    return cell


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
    if call.when != "call" or not isinstance(item, BoundedCell):
        return report
    if item.override is not None:
        ename, evalue, traceback = item.override
    elif errors := item.errors():
        error = errors[-1]
        ename, evalue, traceback = error["ename"], error["evalue"], "\n".join(error.get("traceback", []))
    else:
        return report
    traceback = ANSI_ESCAPE.sub("", traceback)
    notebook = Path(item.path)
    if notebook in _import_failures:
        # Put the cause first: "NameError: name 'GatedDeltaNet' is not defined" sends a student looking in the wrong
        # place.
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
        if report.failed and not ename:  # nbval failed the cell itself (a dead kernel)
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
