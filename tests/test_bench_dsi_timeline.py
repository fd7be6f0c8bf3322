"""The DSI benchmarks' own arithmetic: a timeline's calls and summary
(specmesh.bench.dsi_timeline), the closed form (specmesh.bench.dsi_stack)."""

from __future__ import annotations

import pytest

from specmesh.bench.dsi_stack import closed_form_dsi_vs_si
from specmesh.bench.dsi_timeline import calls, summarize


def _timeline(*events: tuple) -> dict:
    return {"events": [dict(t=t, event=e, **f) for t, e, f in events]}


def test_a_timeline_pairs_each_call_with_its_end() -> None:
    tl = _timeline(
        (0.0, "guard", {"position": 5, "replica": "v1", "rows": 5}),
        (0.0, "draft", {"replica": "d", "version": 0, "start": 5, "fed": 5}),
        (0.04, "drafted", {"replica": "d", "block": 0, "skip": 1, "tokens": [1, 2], "version": 0}),
        (0.04, "verify", {"block": 0, "replica": "v2", "rows": 7}),
        (0.04, "draft", {"replica": "d", "version": 0, "start": 7, "fed": 2}),
        (0.10, "guarded", {"position": 5, "replica": "v1", "token": 3, "decided": True}),
        (0.10, "call_cancelled", {"role": "verifier", "replica": "v2", "block": 0}),
        (0.10, "call_cancelled", {"role": "drafter", "replica": "d", "block": None}),
        (0.20, "committed", {"tokens": 1}),
    )
    got = {(c["kind"], c["replica"]): (c["start"], c["end"], c["outcome"]) for c in calls(tl)}
    assert got[("guard", "v1")] == (0.0, 0.10, "decided")
    assert got[("verify", "v2")] == (0.04, 0.10, "cancelled")
    assert len([c for c in calls(tl) if c["kind"] == "draft"]) == 2
    s = summarize(tl)
    assert s["guards"] == 1 and s["verifications"] == 1 and s["thrown_away"] == 1
    assert s["drafts"] == 2 and s["drafts_dropped"] == 1
    assert s["drafter_busy"] == pytest.approx(0.10 / 0.20)  # 0..0.04 and 0.04..0.10
    assert s["mean_verifications_in_flight"] == pytest.approx((0.10 + 0.06) / 0.20)


def test_the_closed_form() -> None:
    # a free drafter: DSI takes (1 - a) forwards a token, SI (1 - a) / (1 - a^(k+1))
    assert closed_form_dsi_vs_si(0.5, 3, 0.0) == pytest.approx(1 / (1 - 0.5**4))
    # nothing accepted: both decide one token a forward, SI also pays its drafts
    assert closed_form_dsi_vs_si(0.0, 3, 0.5) == pytest.approx(1 + 3 * 0.5)
