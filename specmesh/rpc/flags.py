"""Flags written once: a server's config is a frozen dataclass whose every field is a flag.

A field declares its flag with `flag(help, default, bound=...)`: its help, its default and its
bound in one place. From those declarations, and nothing else:
- `add_cli_args(parser, cls, defaults)` adds --foo-bar for every field, defaulting to
  $SPECMESH_FOO_BAR, then to the role's `defaults`, then to the declaration (vLLM's add_cli_args);
- `parse_flags` builds the config and checks the bounds and the config's own `check`;
- `flag_table` writes the docs' flag tables (scripts/flag_tables.py; a test keeps them current).

A role's own defaults (the drafter's port against the verifier's) are a mapping beside the
config, not a second declaration. No torch and no gRPC here: `specmesh up` builds its parser from
these declarations on every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_KINDS: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}
_TRUE = ("1", "true", "yes", "on")
_BOUNDS = {">= 1": lambda v: v >= 1, "> 0": lambda v: v > 0, ">= 0": lambda v: v >= 0}
EPILOG = "Every flag --foo-bar may also be set as the environment variable SPECMESH_FOO_BAR."


@dataclass(frozen=True)
class Flag:
    help: str
    default: Any = None  # None: required, unless the role's defaults set it
    bound: str = ""  # ">= 1", "> 0" or ">= 0", checked by parse_flags
    shown: str = ""  # the default as the docs' table says it, where the value alone says too little


def flag(help: str, default: Any = None, *, bound: str = "", shown: str = "") -> Any:
    """A config field that is a flag (`help` may use %%, as argparse wants)."""
    if bound and bound not in _BOUNDS:
        raise ValueError(f"bound: one of {', '.join(_BOUNDS)}")
    return dataclasses.field(metadata={"flag": Flag(help, default, bound, shown)})


def declared(cls: type) -> list[tuple[str, type, Flag]]:
    """(name, type, declaration) of every field of the config class `cls`, in field order."""
    return [(f.name, _kind(f), f.metadata["flag"]) for f in dataclasses.fields(cls)]


def default_of(cls: type, name: str) -> Any:
    """The declared default of `cls`'s flag `name` (for a type that shares it, e.g. ModelLimits)."""
    return next(decl.default for field, _, decl in declared(cls) if field == name)


def option(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def env_name(name: str) -> str:
    return f"SPECMESH_{name.upper()}"


def add_cli_args(
    parser: argparse.ArgumentParser,
    cls: type,
    defaults: Mapping[str, Any] | None = None,
    only: Sequence[str] | None = None,
    env: bool = True,
) -> None:
    """--foo-bar for every field of `cls` (or the fields `only` names), each defaulting to
    $SPECMESH_FOO_BAR (unless not `env`), then to `defaults`, then to its declaration; none of
    them: required."""
    defaults = defaults or {}
    for name, kind, decl in declared(cls):
        if only is not None and name not in only:
            continue
        default = defaults.get(name, decl.default)
        text = decl.help
        if env:
            default = os.environ.get(env_name(name), default)
            text = f"{text} [{env_name(name)}]"
        if kind is bool:  # --foo / --no-foo; $SPECMESH_FOO is 1, true, yes or on to turn it on
            on = default.lower() in _TRUE if isinstance(default, str) else bool(default)
            parser.add_argument(option(name), action=argparse.BooleanOptionalAction, default=on, help=text)
            continue
        parser.add_argument(option(name), type=kind, default=default, required=default is None, help=text)


def parse_flags(
    prog: str, cls: type, argv: Sequence[str] | None, defaults: Mapping[str, Any] | None = None
) -> Any:
    """`cls(**flags)`, its bounds and its own `check()` (ValueError) met; else exit with usage."""
    parser = argparse.ArgumentParser(
        prog=prog, epilog=EPILOG, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_cli_args(parser, cls, defaults)
    config = cls(**vars(parser.parse_args(argv)))
    try:
        config.check()
    except ValueError as exc:
        parser.error(str(exc))
    for name, _, decl in declared(cls):
        if decl.bound and not _BOUNDS[decl.bound](getattr(config, name)):
            parser.error(f"{option(name)} must be {decl.bound}")
    return config


def flag_table(cls: type, *role_defaults: Mapping[str, Any]) -> str:
    """The docs' Markdown table of `cls`'s flags; with several roles' defaults (drafter, verifier),
    a default that differs between them shows as `a / b`."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for name, kind, decl in declared(cls):
        shown = decl.shown or " / ".join(
            dict.fromkeys(_shown(d.get(name, decl.default), kind) for d in role_defaults or ({},))
        )
        spelled = f"`{option(name)}` / `--no-{option(name)[2:]}`" if kind is bool else f"`{option(name)}`"
        meaning = decl.help.replace("%%", "%").replace("|", "\\|")
        rows.append(f"| {spelled} | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


def _shown(value: Any, kind: type) -> str:
    if value is None:
        return "required"
    if kind is bool:
        return "on" if value else "off"
    if value == "":
        return "empty"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`" if isinstance(value, str) else str(value)


def _kind(f: dataclasses.Field) -> type:
    """A field's type, spelled as a string under `from __future__ import annotations`."""
    return f.type if isinstance(f.type, type) else _KINDS[f.type]


# ---- the flags every server has, and the tree caps both replicas and the gateway have ----------


@dataclass(frozen=True)
class ServerConfig:
    """The flags every specmesh server has; a server's own config subclasses this."""

    host: str = flag("address to listen on (gRPC and metrics)", "127.0.0.1")
    port: int = flag("gRPC port; 0 picks a free one (logged in the `serving` line)")
    metrics_port: int = flag("Prometheus /metrics port (0 = off)", 0, bound=">= 0")
    grace_seconds: float = flag(
        "on SIGTERM / SIGINT: health goes NOT_SERVING, new RPCs are refused (UNAVAILABLE, or "
        "CANCELLED on an open connection), in-flight ones get this long to finish, then the process "
        "exits 0",
        10.0,
        bound=">= 0",
    )
    log_level: str = flag(
        "debug, info, warning or error: JSON lines on stderr (`ts`, `level`, `logger`, `msg` and "
        "fields); every refused request at info, every answered one at debug. SIGUSR1 logs each "
        "asyncio task and the chain of awaits it waits in, at warning, and the server goes on: the "
        "first look at a request that hangs",
        "info",
    )
    tls_cert: str = flag(
        "PEM certificate: when set (with --tls-key) the server listens with TLS only: gRPC, and "
        "HTTPS on the gateway's HTTP port and on /metrics (docs/security.md)",
        "",
        shown="empty (plaintext)",
    )
    tls_key: str = flag("PEM private key of --tls-cert", "")
    tls_client_ca: str = flag(
        "PEM CA: when set, mutual TLS: every client (gRPC and HTTPS) must show a certificate this CA signed",
        "",
    )
    reflection: bool = flag("serve gRPC server reflection (grpcurl without the .proto files)", False)

    def server_tls(self) -> Any:
        """specmesh.rpc.tls.ServerTls, or None for plaintext."""
        from specmesh.rpc.tls import server_tls  # gRPC: not needed to build a parser

        return server_tls(self.tls_cert, self.tls_key, self.tls_client_ca)

    def check(self) -> None:
        """Settings that only work together; raises ValueError (parse_flags exits with it)."""
        self.server_tls()


@dataclass(frozen=True)
class Limits:
    """The largest tree one replica accepts (its --max-* flags), and the gateway's defaults too."""

    max_tree_nodes: int = 64
    max_depth: int = 16
    max_branching: int = 8
    max_beam_width: int = 8
