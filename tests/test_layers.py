"""The dependency rule of docs/architecture.md, as pyproject.toml's import-linter contracts state it:
the project keeps it, and a wrong import is reported (on a copy of the tree, never on the tree)."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("specmesh", "gateway", "drafter_service", "verifier_service")
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's packages and pyproject.toml, copied."""
    copy = tmp_path_factory.mktemp("layers")
    for name in PACKAGES:
        shutil.copytree(ROOT / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "v1"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


def test_the_project_keeps_its_contracts(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


def test_a_core_module_importing_the_runtime_is_reported(tree: Path) -> None:
    wrong = tree / "specmesh" / "core" / "wrong_import.py"
    shutil.copy(ROOT / "tests" / "fixtures" / "wrong_import.py", wrong)
    try:
        result = _lint(tree)
    finally:
        wrong.unlink()
    assert result.returncode != 0
    assert "specmesh.core is not allowed to import specmesh.runtime" in result.stdout
    assert "specmesh.core.wrong_import -> specmesh.runtime.runner" in result.stdout
    # the same import also closes a cycle core -> runtime -> core
    assert "No cycles are allowed in specmesh" in result.stdout


@pytest.mark.parametrize(
    "path",
    [
        "specmesh.sampling:SamplingParams", "specmesh.sampling:warp", "specmesh.tree:DraftTree",
        "specmesh.drafting:TreeSpec", "specmesh.drafting:build_tree", "specmesh.verification:verify_tree",
        "specmesh.verification:Verdict", "specmesh.models:load_model", "specmesh.engine:SpeculativeEngine",
    ],
)  # fmt: skip
def test_the_public_import_paths_still_work(path: str) -> None:
    module, name = path.split(":")
    assert getattr(importlib.import_module(module), name) is not None
