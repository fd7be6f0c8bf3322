"""The commands that deployment files run (docker-compose.yml, deploy/kubernetes), checked against
this repository's real entry points and flag parsers, without starting anything.

`parse_command(where, argv, env)` fails the calling test unless `argv` is `specmesh …` (the console
script, parsed by specmesh.cli's parser) or `python -m MODULE …` with MODULE a module of this repo.
For the services (drafter_service, verifier_service, gateway) the arguments go through the
service's own flag parser with the container's SPECMESH_* environment, exactly as the service
parses them at start-up, and the parsed config comes back; other modules must list every --flag
given in their --help.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXTRA_ENV = {"SPECMESH_CACHE"}  # read by specmesh.runtime.model_store, not a flag


def _model_service(module: str) -> Callable[[list[str]], Any]:
    def parse(argv: list[str]) -> Any:
        from specmesh.services import config

        defaults = getattr(config, f"{module.removesuffix('_service').upper()}_DEFAULTS")
        return config.parse_config(f"python -m {module}", argv, defaults)

    return parse


def _gateway(argv: list[str]) -> Any:
    from gateway.config import parse_config

    return parse_config(argv)


SERVICE_PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "drafter_service": _model_service("drafter_service"),
    "verifier_service": _model_service("verifier_service"),
    "gateway": _gateway,
}


def flag_env_names(config: Any) -> set[str]:
    """The SPECMESH_* variables a service reads: one per flag (specmesh.rpc.flags.add_cli_args)."""
    return {f"SPECMESH_{field.name.upper()}" for field in dataclasses.fields(config)}


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ without the caller's SPECMESH_* variables, plus `env` (the container's)."""
    saved = dict(os.environ)
    try:
        for name in [n for n in os.environ if n.startswith("SPECMESH_")]:
            del os.environ[name]
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _parse(where: str, parse: Callable[[list[str]], Any], argv: list[str], env: Mapping[str, str]) -> Any:
    stderr = io.StringIO()
    try:
        with _environment(env), contextlib.redirect_stderr(stderr):
            return parse(argv)
    except SystemExit as exc:  # argparse: unknown flag, bad value, missing required flag
        pytest.fail(f"{where}: {argv} does not parse (exit {exc.code}):\n{stderr.getvalue()[-2000:]}")


@functools.cache
def _help(module: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, f"python -m {module} --help failed:\n{result.stderr[-2000:]}"
    return result.stdout


def parse_command(where: str, argv: list[str], env: Mapping[str, str] | None = None) -> Any:
    """The parsed config of a service, the argparse namespace of `specmesh …`, else None (see the
    module docstring); fails the test if `argv` is not an entry point of this repo with its flags."""
    env = env or {}
    if argv[0] == "specmesh":
        from specmesh.cli import build_parser

        return _parse(where, build_parser().parse_args, argv[1:], env)
    if argv[:2] != ["python", "-m"] or len(argv) < 3:
        pytest.fail(f"{where}: unexpected command {argv}")
    module = argv[2]
    package_main = ROOT / module.replace(".", "/") / "__main__.py"
    plain = ROOT / (module.replace(".", "/") + ".py")
    assert package_main.exists() or plain.exists(), f"{where}: `python -m {module}`: no such module here"
    if module in SERVICE_PARSERS:
        return _parse(where, SERVICE_PARSERS[module], argv[3:], env)
    text = _help(module)
    for arg in argv[3:]:
        if arg.startswith("--"):
            assert re.search(rf"{re.escape(arg.split('=')[0])}\b", text), f"{where}: {module} has no {arg}"
    return None


def allowed_env(parsed: Any) -> set[str]:
    """SPECMESH_* variables that mean something to a command parsed by `parse_command`."""
    if parsed is None or isinstance(parsed, argparse.Namespace):
        return set(EXTRA_ENV)
    return flag_env_names(parsed) | EXTRA_ENV
