"""The type checker over the whole package: mypy must find no error in speccli/ (the protocols
in speccli/backends/base.py and speccli/drafters/base.py are what let it prove the decode
loop's calls). `.ci/run` runs it too, before the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_finds_no_error_in_the_package():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "speccli", "--no-color-output", "--cache-dir", str(REPO / ".mypy_cache")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert result.returncode == 0, f"mypy speccli:\n{result.stdout}{result.stderr}"
    assert result.stdout.startswith("Success: no issues found")
