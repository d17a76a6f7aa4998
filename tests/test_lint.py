"""ruff over the code (settings in pyproject.toml: line length 120, pycodestyle and pyflakes):
the lint passes and the files are as `ruff format` writes them. `ruff format speccli tests scripts`
mends the second."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TREES = ["speccli", "tests", "scripts"]


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *TREES], capture_output=True, text=True, cwd=REPO, timeout=300
    )


@pytest.mark.parametrize("args", [("check", "--no-cache"), ("format", "--check", "--no-cache")], ids=["lint", "format"])
def test_ruff_passes(args):
    result = ruff(*args)
    assert result.returncode == 0, result.stdout + result.stderr
