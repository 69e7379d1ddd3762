"""The notebooks in a real browser, as a student runs them: JupyterLab on this repository with the reference solutions
(A4_SOLUTIONS=1) and on a fresh handout (the untouched skeleton), driven by Chromium through Playwright, each notebook
run with JupyterLab's own "Run All Cells". What is asserted is what the rendered page shows: with the solutions every
code cell ran, none shows a traceback and every check cell shows `PASSED <id>`; on the handout Run All reaches every check cell, which shows its own
`PASSED <id>` or `FAILED <id>`; nowhere "Error displaying widget"; notebook 06's dropdowns redraw their figure when
one is changed.

It needs Playwright for Python (the `browser` extra of pyproject.toml) and Debian's `chromium`; without them it is
skipped, except under A4_REQUIRE_BROWSER=1, which `make browser-test` (run by CI) sets, so that a missing browser
fails CI instead of hiding behind a skip. `make unit` leaves this file to that target.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nbformat
import psutil
import pytest
from handout_commands import environment, make_handout

from a4._overlay import REPO_ROOT
from a4.course.nbval_plugin import check_ids_of
from a4.course.notebooks import check_cells, read_notebook

NOTEBOOKS = ("01_config", "06_memory_plan", "12_serving", "13_tensor_parallel")
WIDGET_NOTEBOOK = "06_memory_plan"  # its explorer's dropdowns, changed after its run with the solutions
CHROMIUM = Path(os.environ.get("A4_CHROMIUM", "/usr/bin/chromium"))
# Playwright's own browser download needs the internet: the system's Chromium, headless, and never calling home.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
# JupyterLab's settings for the run: every cell in the page (not only those scrolled into view), no autosave (the
# outputs must not be written into the repository's notebooks), no news or update checks (no network).
LAB_SETTINGS = {
    "notebook-extension/tracker": {"windowingMode": "none"},
    "docmanager-extension/plugin": {"autosave": False},
    "apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
# Limits that only keep a hung page from hanging CI; nothing is timed.
SERVER_START_S = 120
NOTEBOOK_RUN_MS = 15 * 60 * 1000
WIDGET_MS = 3 * 60 * 1000


def _missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "Playwright is not installed (pip install -e '.[browser]')"
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (apt-get install chromium)"
    return None


if (missing := _missing()) is not None:
    if os.environ.get("A4_REQUIRE_BROWSER") == "1":
        pytest.fail(f"A4_REQUIRE_BROWSER=1 but {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)

from playwright.sync_api import Browser, Page, expect, sync_playwright  # noqa: E402 - after the skip above
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError  # noqa: E402


class Lab:
    """A JupyterLab server on a free port of 127.0.0.1 with a token, its runtime and config in `home`."""

    def __init__(self, root: Path, env: dict[str, str], home: Path) -> None:
        self.root, self.token = root, secrets.token_hex(16)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        config = home / "config"
        for name, values in LAB_SETTINGS.items():
            path = config / "lab" / "user-settings" / "@jupyterlab" / f"{name}.jupyterlab-settings"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env = {
            **env,
            "JUPYTER_CONFIG_DIR": str(config),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "IPYTHONDIR": str(home / "ipython"),
        }
        self.log = home / "server.log"
        self._log_file = self.log.open("w")
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={self.port}",
                "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={root}",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--LabApp.extension_manager=readonly",
                "--allow-root",  # CI runs as root
            ],
            env=env, stdout=self._log_file, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + SERVER_START_S
        while not self._api("status"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"JupyterLab did not start:\n{self.log.read_text()}")
            time.sleep(0.5)

    def _api(self, path: str, method: str = "GET") -> object:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/{path}", method=method, headers={"Authorization": f"token {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                body = response.read()
        except (urllib.error.URLError, ConnectionError):
            return None
        return json.loads(body) if body else True

    def url(self, notebook: str) -> str:
        return f"http://127.0.0.1:{self.port}/lab/tree/notebooks/{notebook}.ipynb?token={self.token}&reset"

    def shut_kernel_down(self, notebook: str) -> None:
        """End the notebook's session, and with it its kernel."""
        for session in self._api("sessions") or []:
            if session["path"] == f"notebooks/{notebook}.ipynb":
                self._api(f"sessions/{session['id']}", method="DELETE")

    def stop(self) -> None:
        """Shut the kernels down through the server, stop it, and kill whatever it started that is still alive."""
        children = psutil.Process(self.process.pid).children(recursive=True) if self.process.poll() is None else []
        for kernel in self._api("kernels") or []:
            self._api(f"kernels/{kernel['id']}", method="DELETE")
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log_file.close()
        # Kernels run in sessions of their own: one the server failed to stop would outlive it.
        for process in children:
            if process.is_running():
                process.kill()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def solutions_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    env = {**os.environ, "A4_SOLUTIONS": "1", "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    lab = Lab(REPO_ROOT, env, tmp_path_factory.mktemp("lab-solutions"))
    yield lab
    lab.stop()


@pytest.fixture(scope="module")
def handout_lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    handout = make_handout(tmp_path_factory.mktemp("handout"))
    lab = Lab(handout, environment(handout), tmp_path_factory.mktemp("lab-handout"))
    yield lab
    lab.stop()


def run_all(browser: Browser, lab: Lab, notebook: str) -> Page:
    """Open `notebook` in a fresh page, wait for its kernel to be idle, Run All Cells from the Run menu, and wait
    until no cell is queued or running any more."""
    page = browser.new_page()
    page.goto(lab.url(notebook))
    expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=SERVER_START_S * 1000)
    page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
    page.locator('.lm-Menu-item[data-command="runmenu:run-all"]').click()
    # Run All marks the cells it queues "[*]:"; it has started once one is marked (or all have run), and is done
    # once none is left (cells after one that raised are unmarked without running).
    prompts = "[...document.querySelectorAll('.jp-Notebook .jp-CodeCell .jp-InputPrompt')].map(p => p.textContent)"
    page.wait_for_function(
        f"() => {prompts}.some(p => p.includes('*')) || {prompts}.every(p => /\\d/.test(p))", timeout=NOTEBOOK_RUN_MS
    )
    page.wait_for_function(f"() => !{prompts}.some(p => p.includes('*'))", timeout=NOTEBOOK_RUN_MS)
    expect(page.locator("#jp-main-statusbar")).to_contain_text("Idle", timeout=NOTEBOOK_RUN_MS)
    return page


def code_cells(page: Page) -> list[dict[str, str]]:
    """Each code cell of the page, in order: its prompt ("[3]:") and the text of its outputs."""
    return page.eval_on_selector_all(
        ".jp-Notebook .jp-Cell.jp-CodeCell",
        """cells => cells.map(cell => ({
            prompt: cell.querySelector('.jp-InputPrompt').textContent.trim(),
            output: [...cell.querySelectorAll('.jp-OutputArea-output')].map(o => o.innerText).join('\\n'),
        }))""",
    )


def source_of(lab: Lab, notebook: str) -> nbformat.NotebookNode:
    return read_notebook(lab.root / "notebooks" / f"{notebook}.ipynb")


def assert_every_cell_ran(lab: Lab, notebook: str, cells: list[dict[str, str]]) -> None:
    # Run All stops at the first cell that raises: a cell without an execution count was never reached.
    expected = sum(cell.cell_type == "code" for cell in source_of(lab, notebook).cells)
    assert len(cells) == expected, f"{notebook}: the page shows {len(cells)} code cells, the notebook has {expected}"
    not_run = [i for i, cell in enumerate(cells) if not cell["prompt"].strip("[]: ").isdigit()]
    assert not not_run, f"{notebook}: Run All did not reach code cells {not_run}"


def check_outputs(lab: Lab, notebook: str, cells: list[dict[str, str]]) -> dict[str, str]:
    """Check id -> what its check cell shows, for every check cell of the notebook, in order."""
    code = [cell for cell in source_of(lab, notebook).cells if cell.cell_type == "code"]
    shown = {ids[0]: cells[index]["output"] for index, cell in enumerate(code) if (ids := check_ids_of(cell))}
    assert list(shown) == list(check_cells(source_of(lab, notebook)))
    return shown


@pytest.fixture(scope="module")
def solutions_pages() -> dict[str, Page]:
    """WIDGET_NOTEBOOK's page as its run with the solutions left it, its kernel alive, for the widget test."""
    return {}


def close(page: Page, lab: Lab, notebook: str) -> None:
    page.close()
    lab.shut_kernel_down(notebook)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_solutions_run_all_without_an_error(
    notebook: str, browser: Browser, solutions_lab: Lab, solutions_pages: dict[str, Page]
) -> None:
    stored = (REPO_ROOT / "notebooks" / f"{notebook}.ipynb").read_bytes()
    page = run_all(browser, solutions_lab, notebook)
    cells = code_cells(page)
    assert_every_cell_ran(solutions_lab, notebook, cells)
    errors = {i: cell["output"] for i, cell in enumerate(cells) if "Traceback" in cell["output"]}
    assert not errors, f"{notebook}: error output in code cells {list(errors)}:\n" + "\n\n".join(errors.values())
    shown = check_outputs(solutions_lab, notebook, cells)
    failed = [check_id for check_id, output in shown.items() if f"PASSED {check_id}" not in output]
    assert not failed, f"{notebook}: checks that did not pass: " + "\n\n".join(shown[c] for c in failed)
    assert "Error displaying widget" not in page.inner_text(".jp-Notebook")
    assert (REPO_ROOT / "notebooks" / f"{notebook}.ipynb").read_bytes() == stored, "the run saved the notebook"
    if notebook == WIDGET_NOTEBOOK:
        solutions_pages[notebook] = page
    else:
        close(page, solutions_lab, notebook)


@pytest.mark.parametrize("notebook", NOTEBOOKS)
def test_handout_run_all_shows_every_check_result(notebook: str, browser: Browser, handout_lab: Lab) -> None:
    page = run_all(browser, handout_lab, notebook)
    cells = code_cells(page)
    assert_every_cell_ran(handout_lab, notebook, cells)
    silent = [
        check_id
        for check_id, output in check_outputs(handout_lab, notebook, cells).items()
        if f"PASSED {check_id}" not in output and f"FAILED {check_id}" not in output
    ]
    assert not silent, f"{notebook}: check cells without their result: {silent}"
    assert "Error displaying widget" not in page.inner_text(".jp-Notebook")
    close(page, handout_lab, notebook)


def test_the_widgets_redraw_when_a_dropdown_changes(solutions_pages: dict[str, Page]) -> None:
    if WIDGET_NOTEBOOK not in solutions_pages:
        pytest.fail(f"{WIDGET_NOTEBOOK} did not run with the solutions (see its test)")
    page = solutions_pages[WIDGET_NOTEBOOK]
    cell = page.locator(".jp-Notebook .jp-CodeCell", has=page.locator(".widget-dropdown")).first
    before = cell.locator(".widget-output img").first.get_attribute("src")
    assert before, "the explorer shows no figure"
    cell.locator(".widget-dropdown select").first.select_option(index=1)
    try:
        page.wait_for_function(
            "([cell, before]) => (img => img && img.src !== before)(cell.querySelector('.widget-output img'))",
            arg=[cell.element_handle(), before],
            timeout=WIDGET_MS,
        )
    except PlaywrightTimeoutError:
        pytest.fail("the explorer's figure did not change when another value was chosen in its first dropdown")
    assert cell.locator(".widget-output img").count() == 1, "the explorer shows no figure, or several"
    assert "Error displaying widget" not in page.inner_text(".jp-Notebook")
