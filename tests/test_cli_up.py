"""`specmesh up --exit-after-demo` end to end on the tiny models: Redis, a drafter, an n-gram
drafter, a verifier and the gateway come up as supervised subprocesses, one demo completion
streams through the gateway, and everything stops cleanly."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from specmesh.stack.ports import free_port
from tests.servers import ROOT


def test_up_streams_a_demo_completion_then_exits_cleanly(models) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "specmesh.cli", "up", "--draft", str(models["draft"])]
    argv += ["--target", str(models["target"]), "--drafters", "1", "--port", str(port), "--dtype", "fp32"]
    argv += ["--demo-prompt", "w1 w13 w38", "--max-new-tokens", "8", "--method", "chain", "--exit-after-demo"]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = done.stdout
    assert done.returncode == 0, out[-4000:] + done.stderr[-2000:]
    # the private Redis's password is in no log line: no URL with it, no --requirepass argument
    assert not re.search(r"requirepass|redis://:", out + done.stderr)
    assert not re.findall(r'^.*"level": "error".*$', out, re.M)  # e.g. a stream's span closed elsewhere
    for child in ("redis", "drafter-0", "ngram-drafter-0", "verifier-0", "gateway"):
        assert re.search(rf"^{child} +\| ready after", out, re.M), child
        assert re.search(rf"^{child} +\| stopped \(status ", out, re.M), child  # stopped by the supervisor
    lines = out.splitlines()
    stats_line = next(line for line in lines if line.startswith("stats: "))
    completion = lines[lines.index(stats_line) - 2]
    assert completion.startswith("w1 w13 w38") and len(completion.removeprefix("w1 w13 w38").split()) == 8
    assert lines[lines.index(stats_line) - 1].startswith("finish_reason: length")
    assert json.loads(stats_line.removeprefix("stats: "))["generatedTokens"] == 8
