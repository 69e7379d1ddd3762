"""grade: run a checkout's notebooks under nbval and report every check: pass or fail, with the first line of why.

The notebooks run in the current environment against the checkout's own `a4` (A4_SOLUTIONS is left as the caller
set it: unset, a student's code is graded). One line per check id, the total, and a JUnit XML file with one test
case per check (classname: the notebook, name: the check id) for CI systems.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

from a4.course.notebooks import CellResult, notebook_paths, run_notebooks, select


def write_junit(results: list[CellResult], path: Path) -> None:
    checks = [r for r in results if r.check_id]
    suite = ET.Element(
        "testsuite",
        name="a4-grade",
        tests=str(len(checks)),
        failures=str(sum(r.failed for r in checks)),
        skipped=str(sum(r.outcome == "skipped" for r in checks)),
        time=f"{sum(r.duration for r in results):.3f}",
    )
    for r in checks:
        case = ET.SubElement(suite, "testcase", classname=r.notebook, name=r.check_id, time=f"{r.duration:.3f}")
        if r.failed:
            ET.SubElement(case, "failure", message=r.error).text = r.traceback
        elif r.outcome == "skipped":
            ET.SubElement(case, "skipped")
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="unicode", xml_declaration=True)


def grade(repo: Path, junit: Path, prefixes: list[str] | None = None, workers: int = 2) -> int:
    """Print the report; 0 when every check passes."""
    repo = repo.resolve()
    notebooks = select(notebook_paths(repo), prefixes)
    if not notebooks:
        print(f"no notebooks to grade in {repo / 'notebooks'}")
        return 1
    print(f"grading {len(notebooks)} notebook(s) of {repo} ...", flush=True)
    results = run_notebooks(notebooks, repo, solutions=None, workers=workers)
    checks = [r for r in results if r.check_id]
    width = max((len(r.name) for r in checks), default=0)
    for r in checks:
        status = {"passed": "PASS", "failed": "FAIL"}.get(r.outcome, "SKIP")
        print(f"{status:4}  {r.name:{width}}  {r.error if r.failed else ''}".rstrip())
    # Failures outside check cells are not graded, but they often explain a failing check.
    others = [r for r in results if not r.check_id and r.failed and not r.exercise_not_implemented]
    # One line per cause: a file that does not import fails every cell after it with the same first line.
    others = list({r.error: r for r in reversed(others)}.values())[::-1]
    if others:
        print("\nerrors in other cells:")
        for r in others:
            print(f"      {r.name}  {r.error}")
    passed = sum(r.outcome == "passed" for r in checks)
    print(f"\n{passed}/{len(checks)} checks pass")
    write_junit(results, junit)
    print(f"JUnit report: {junit}")
    return 0 if passed == len(checks) else 1
