"""The type checker over the whole package, as a ratchet: no module may have more errors
than tests/data/mypy-baseline.json allows, and a module not in it none at all. New code is
typed clean from the start; the baseline only shrinks as modules are mended (write the new
counts with `python tests/test_types.py`)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BASELINE = Path(__file__).with_name("data") / "mypy-baseline.json"
ERROR = re.compile(r"^(speccli/[^:]+):\d+: error:")


def type_errors() -> Counter[str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "speccli",
            "--no-error-summary",
            "--no-color-output",
            "--cache-dir",
            str(REPO / ".mypy_cache"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    if result.returncode not in (0, 1) or "error: " in result.stderr:
        raise AssertionError(f"mypy did not run: {result.stderr or result.stdout}")
    return Counter(found.group(1) for line in result.stdout.splitlines() if (found := ERROR.match(line)))


@pytest.mark.slow
def test_no_module_has_more_type_errors_than_its_baseline():
    allowed = json.loads(BASELINE.read_text())
    found = type_errors()
    worse = {
        path: f"{count} (baseline {allowed.get(path, 0)})"
        for path, count in found.items()
        if count > allowed.get(path, 0)
    }
    assert not worse, f"type errors past the baseline (run mypy speccli): {worse}"


if __name__ == "__main__":
    BASELINE.write_text(json.dumps(dict(sorted(type_errors().items())), indent=1) + "\n")
    print(f"wrote {BASELINE}")
