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


def test_every_module_is_named_in_the_architecture_s_module_table() -> None:
    """docs/architecture.md's module table has a row for every module: a specmesh module by its
    stem in a row of its layer (`ticks` under rpc), any other by its path (`gateway/session`), or
    in its folder's row (`gateway/http/` (`app`, ...))."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("Every module, by layer") :].split("\n## ")[0]
    rows = [line.split(" | ") for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    missing = []
    for name in PACKAGES:
        for path in sorted((ROOT / name).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if (
                path.name in ("__init__.py", "__main__.py")
                or "v1" in rel.parts
                or (len(rel.parts) == 2 and name == "specmesh")
            ):
                continue
            folder, stem = "/".join(rel.parts[:-1]), path.stem
            if name == "specmesh" and len(rel.parts) == 3:  # specmesh/<layer>/<module>
                layer = {"services": "services", "stack": "stack"}.get(rel.parts[1], rel.parts[1])
                found = any(r[0].strip("| ") == layer and f"`{stem}`" in r[1] for r in rows)
                found = found or any(f"`{folder}/`" in r[1] and f"`{stem}`" in r[1] for r in rows)
            else:
                found = any(
                    f"`{folder}/{stem}`" in r[1] or (f"`{folder}/`" in r[1] and f"`{stem}`" in r[1])
                    for r in rows
                )
            if not found:
                missing.append(str(rel))
    assert not missing, f"not in docs/architecture.md's module table: {missing}"


MAX_CLASS_LINES, MAX_FUNCTION_LINES = 400, 80  # issue 60's bars: a piece one reads in a sitting


def test_no_class_is_over_400_lines_and_no_function_over_80() -> None:
    import ast

    big = []
    for name in PACKAGES:
        for path in sorted((ROOT / name).rglob("*.py")):
            if "v1" in path.relative_to(ROOT).parts or path.name.endswith("_pb2.py"):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
                if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                    big.append(f"class {node.name} ({path.relative_to(ROOT)}): {lines} lines")
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and lines > MAX_FUNCTION_LINES:
                    big.append(f"def {node.name} ({path.relative_to(ROOT)}): {lines} lines")
    assert not big, big
