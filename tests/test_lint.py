"""ruff over the package, the launcher and the tests, with the configuration in pyproject.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_ruff_finds_nothing():
    beside = Path(sys.executable).parent / "ruff"
    ruff = [str(beside)] if beside.exists() else [sys.executable, "-m", "ruff"]
    done = subprocess.run([*ruff, "check", "--no-cache", "switchboard", "switchboard.py", "tests"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
