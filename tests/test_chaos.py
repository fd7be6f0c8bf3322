"""The short form of `specmesh bench chaos` (issue 14): a whole `specmesh up` stack on tiny models,
concurrent seeded streams while a drafter is SIGKILLed, the other drafter SIGSTOPped, the verifier
SIGKILLed and Redis restarted; every request's tokens against an undisturbed rerun."""

from __future__ import annotations

import tempfile

import pytest

from specmesh.bench.chaos import ChaosConfig, bench_chaos

pytestmark = pytest.mark.xdist_group("chaos")


def test_chaos_short_form_loses_changes_and_fails_nothing(tmp_path, monkeypatch) -> None:
    log = str(tmp_path / "stack.log")
    scratch = tmp_path / "tmp"  # where the stack's private Redis keeps its AOF (~20 MB a run)
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    cfg = ChaosConfig(streams=4, seconds=40.0, max_new_tokens=24, pause_seconds=5.0, log=log)
    result = bench_chaos(cfg)
    assert result["faults"] == ["drafter killed", "drafter paused", "verifier restarted", "redis restarted"]
    assert result["requests"] >= 8
    assert result["failed_requests"] == 0, (result["errors"], result["hung"], log)  # hung: see its task dump
    assert result["changed_requests"] == 0 and result["replay_failed"] == 0
    assert result["longest_drafter_fault_stall"] <= result["stall_limit"], result["longest_stall_by_fault"]
    assert result["ok"]
    assert not list(scratch.iterdir())  # the Redis directory went with the stack
