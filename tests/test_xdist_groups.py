"""The suite runs as `pytest -n 2 --dist loadgroup`: a module marked `xdist_group` runs on one worker,
so that its stack starts once and the modules that kill gateways run one at a time. With pytest 9.2
and pytest-xdist 3.8 the mark is silently ignored (pyproject.toml pins pytest below 9.2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

MODULE = """
import os
import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(6))
def test_worker(i):
    print(f"worker={os.environ['PYTEST_XDIST_WORKER']}")
"""


def test_a_marked_module_runs_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(MODULE)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
         "-rP", "test_grouped.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    workers = {line for line in run.stdout.splitlines() if line.startswith("worker=")}
    assert len(workers) == 1, workers
