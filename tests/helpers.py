"""Helpers shared by several test files."""

from __future__ import annotations

import os
import subprocess
import sys

from a4._overlay import REPO_ROOT


def run_python(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter from the repository root, with this environment (A4_SOLUTIONS included):
    for what only a new process shows, such as which modules an import pulls in."""
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=os.environ.copy(), capture_output=True, text=True
    )
