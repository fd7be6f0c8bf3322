"""Flags written once (specmesh.rpc.flags): a config field's declaration gives its flag, its
environment variable, its default, its bound and its row in the docs' tables."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import pytest

from specmesh.cli import main
from specmesh.rpc.flags import ServerConfig, add_cli_args, default_of, flag, flag_table, parse_flags


@dataclass(frozen=True)
class _Config(ServerConfig):
    model: str = flag("the model")
    steps: int = flag("steps per call", 4, bound=">= 1")
    ratio: float = flag("a share of 100 %%", 0.5, bound=">= 0")
    fast: bool = flag("go fast | or not", True)

    def check(self) -> None:
        super().check()
        if self.steps > 8:
            raise ValueError("--steps must be at most 8")


def _parse(argv: list[str], defaults: dict | None = None) -> _Config:
    return parse_flags("prog", _Config, ["--port", "1", *argv], defaults)


def test_a_flag_defaults_to_its_environment_then_the_role_then_its_declaration(monkeypatch) -> None:
    assert _parse(["--model", "m"]).steps == 4
    assert _parse(["--model", "m"], {"steps": 6}).steps == 6
    monkeypatch.setenv("SPECMESH_STEPS", "7")
    assert _parse(["--model", "m"], {"steps": 6}).steps == 7
    assert _parse(["--model", "m", "--steps", "2"], {"steps": 6}).steps == 2
    monkeypatch.setenv("SPECMESH_FAST", "no")
    assert _parse(["--model", "m"]).fast is False
    assert _parse(["--model", "m", "--fast"]).fast is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "the following arguments are required: --model"),
        (["--model", "m", "--steps", "0"], "--steps must be >= 1"),
        (["--model", "m", "--ratio", "-1"], "--ratio must be >= 0"),
        (["--model", "m", "--steps", "9"], "--steps must be at most 8"),
        (["--model", "m", "--tls-cert", "missing.pem"], "--tls-key"),
    ],
)
def test_a_bad_value_exits_with_usage_naming_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_bound_must_be_one_the_parser_checks() -> None:
    with pytest.raises(ValueError, match="bound"):
        flag("x", 1, bound="> 1")


def test_the_table_row_is_the_declaration() -> None:
    table = flag_table(_Config, {"model": "a", "steps": 4}, {"model": "b", "steps": 4})
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in table.splitlines()[2:]}
    assert rows["`--model`"] == "| `--model` | `a` / `b` | the model |"  # the roles differ
    assert rows["`--steps`"] == "| `--steps` | 4 | steps per call |"  # they agree
    assert rows["`--ratio`"].endswith("| a share of 100 % |")  # argparse's %% unescaped
    assert rows["`--fast` / `--no-fast`"] == "| `--fast` / `--no-fast` | on | go fast \\| or not |"
    assert rows["`--port`"].startswith("| `--port` | required |")
    assert default_of(_Config, "steps") == 4


def test_only_and_no_environment_give_another_command_the_same_flag(monkeypatch) -> None:
    import argparse

    monkeypatch.setenv("SPECMESH_STEPS", "7")
    parser = argparse.ArgumentParser()
    add_cli_args(parser, _Config, only=("steps",), env=False)
    assert vars(parser.parse_args([])) == {"steps": 4}
    assert "SPECMESH_STEPS" not in parser.format_help()


def test_the_docs_flag_tables_are_the_declarations() -> None:
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "flag_tables.py"
    done = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--gateway-flags", "--plain-steps 0"],
            "specmesh up --gateway-flags: error: --plain-steps must be >= 1",
        ),
        (["--drafter-flags", "--max-batch-sise 4"], "unrecognized arguments: --max-batch-sise 4"),
        (["--verifier-flags", "--max-wait-ms -1"], "--max-wait-ms must be >= 0"),
    ],
)
def test_up_checks_each_role_s_flags_before_it_starts_anything(flags, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--no-demo", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
