"""`specmesh … --help`: every flag of every subcommand says what it does and what its default is,
the `--{role}-flags` examples of `specmesh up` are real flags of that role, and the commands that
`specmesh up` prints run without an activated venv."""

from __future__ import annotations

import argparse
import re
import shlex
import sys
from pathlib import Path

import pytest

from specmesh.cli import all_parsers, build_parser, specmesh_command

PARSERS = {p.prog: p for p in all_parsers(build_parser())}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_the_subcommands_are_all_found() -> None:
    expected = {"specmesh up", "specmesh generate", "specmesh bench report", "specmesh models pull"}
    assert expected <= set(PARSERS)
    assert len(PARSERS) > 15


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_flag_has_a_help_that_shows_its_default(prog: str) -> None:
    parser = PARSERS[prog]
    formatter = parser.formatter_class(prog=prog)
    text = parser.format_help()  # every help string formats (no stray %)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{prog} {name}: no help"
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        shown = " ".join(formatter._expand_help(action).split())
        assert re.search(r"\bdefault: |\(required\)$", shown, re.IGNORECASE), f"{prog} {name}: {shown!r}"
        assert "(default: None)" not in shown, f"{prog} {name}: say what None means"
    flags = [o for a in _options(parser) for o in a.option_strings]
    if flags:
        assert "default: " in " ".join(text.split())


def test_the_formatter_shows_values_and_states() -> None:
    text = " ".join(PARSERS["specmesh up"].format_help().split())
    assert "the gateway's gRPC port (default: 50051)" in text
    assert "stop the stack after the demo (default: off)" in text
    assert "(default: none)" in text  # --drafter-flags ''
    assert "(required)" in " ".join(PARSERS["specmesh certs"].format_help().split())


def test_api_keys_from_the_environment_never_show_in_help(monkeypatch) -> None:
    monkeypatch.setenv("SPECMESH_API_KEYS", "secret-up-key")
    monkeypatch.setenv("SPECMESH_API_KEY", "secret-client-key")
    parsers = {p.prog: p for p in all_parsers(build_parser())}
    assert parsers["specmesh up"].parse_args([]).api_keys == "secret-up-key"
    for prog in ("specmesh up", "specmesh generate"):
        assert "secret" not in parsers[prog].format_help()


def _role_help(role: str, capsys) -> str:
    if role == "gateway":
        from gateway.config import parse_config

        call = lambda: parse_config(["--help"])  # noqa: E731
    else:
        from specmesh.services import config

        defaults = getattr(config, f"{role.upper()}_DEFAULTS")
        call = lambda: config.parse_config(f"python -m {role}_service", ["--help"], defaults)  # noqa: E731
    with pytest.raises(SystemExit):
        call()
    return capsys.readouterr().out


@pytest.mark.parametrize("role", ["drafter", "verifier", "gateway"])
def test_the_role_flags_examples_are_flags_of_that_role(role: str, capsys) -> None:
    up = PARSERS["specmesh up"]
    action = next(a for a in up._actions if f"--{role}-flags" in a.option_strings)
    example = re.search(r"e\.g\. '([^']+)'", action.help).group(1)
    flag = shlex.split(example)[0]
    assert re.search(rf"^\s+{re.escape(flag)}\b", _role_help(role, capsys), re.M), (role, example)


def test_the_printed_specmesh_command_runs_without_an_activated_venv(monkeypatch, tmp_path) -> None:
    script = Path(sys.executable).parent / "specmesh"
    if not script.exists():
        pytest.skip("no specmesh script beside this interpreter")
    monkeypatch.setenv("PATH", str(tmp_path))  # not activated: no specmesh on PATH
    assert specmesh_command() == shlex.quote(str(script))
    monkeypatch.setenv("PATH", str(script.parent))  # activated
    assert specmesh_command() == "specmesh"
    other = tmp_path / "specmesh"  # another install first on PATH: not the one that is running
    other.write_text("#!/bin/sh\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{script.parent}")
    assert specmesh_command() == shlex.quote(str(script))
