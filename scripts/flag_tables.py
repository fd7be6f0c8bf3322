"""Writes the flag tables of docs/gateway.md and docs/services.md from the flags' declarations
(specmesh.rpc.flags): `python scripts/flag_tables.py`; with --check, exits 1 if a table is stale
(tests/test_cli_help.py runs the check)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_TABLE = re.compile(r"(<!-- flags: (\w+)[^>]*-->\n).*?(<!-- /flags -->)", re.S)


def tables() -> dict[str, str]:
    """Each doc's tables by name, as the declarations write them."""
    from gateway.config import GatewayConfig
    from specmesh.rpc.flags import flag_table
    from specmesh.services.config import DRAFTER_DEFAULTS, VERIFIER_DEFAULTS, ServiceConfig

    services = flag_table(ServiceConfig, DRAFTER_DEFAULTS, VERIFIER_DEFAULTS)
    return {"gateway": flag_table(GatewayConfig), "services": services}


def rewrite(text: str, written: dict[str, str]) -> str:
    return _TABLE.sub(lambda m: m.group(1) + written[m.group(2)] + m.group(3), text)


DOCS = ("docs/gateway.md", "docs/services.md")


def main(check: bool) -> int:
    written, stale = tables(), []
    for doc in DOCS:
        path = ROOT / doc
        text = path.read_text()
        new = rewrite(text, written)
        if new != text:
            stale.append(doc)
            if not check:
                path.write_text(new)
    if stale and check:
        print(f"stale flag tables in {', '.join(stale)}: run python scripts/flag_tables.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main("--check" in sys.argv[1:]))
