"""`specmesh bench mesh`'s arithmetic: the ideal wall of the cost model and the per-round split
from metric deltas (the benchmark itself runs real stacks: `specmesh bench mesh`)."""

from __future__ import annotations

import pytest

from specmesh.bench.mesh import SHAPES, MeshBenchConfig, ideal_wall, split

CFG = MeshBenchConfig(draft_ms=4, draft_ms_per_row=0.05, target_ms=16, target_ms_per_row=0.1)
SHAPE = {s.name: s for s in SHAPES}


def test_the_ideal_is_serial_rounds_of_one_batched_forward_per_level_and_verification() -> None:
    # 8 sessions, 10 rounds each of a 4-node chain: 4 levels of 8 rows, one verification of 8 x 5
    m = dict(target_calls=80, drafted_tokens=320, draft_calls=400, accepted_tokens=320, tokens=400)
    per_round = 4 * (4 + 0.05 * 8) + (16 + 0.1 * 40)
    assert ideal_wall(CFG, SHAPE["chain 4"], 8, m) == pytest.approx(10 * per_round / 1000)
    # a pipelined run (one more draft forward per round) is held against the same serial ideal
    assert ideal_wall(CFG, SHAPE["chain 4"], 8, {**m, "draft_calls": 480}) == pytest.approx(
        10 * per_round / 1000
    )
    plain = dict(target_calls=64, drafted_tokens=0, draft_calls=0, accepted_tokens=0, tokens=64)
    assert ideal_wall(CFG, SHAPE["none"], 1, plain) == pytest.approx(64 * 16.1 / 1000)


def test_sessions_that_stop_early_leave_the_later_rounds_to_fewer_sessions() -> None:
    """Lockstep: 2 plain sessions of 10 and 6 rounds are 6 forwards of 2 rows, then 4 of 1 row
    (the mean, 8 rounds of 2 rows, would be a wall no run could reach)."""
    m = dict(target_calls=16, drafted_tokens=0, draft_calls=0, accepted_tokens=0, tokens=16)
    lockstep = ideal_wall(CFG, SHAPE["none"], 2, {**m, "rounds_per_stream": [10, 6]})
    assert lockstep == pytest.approx((6 * 16.2 + 4 * 16.1) / 1000)
    assert ideal_wall(CFG, SHAPE["none"], 2, m) == pytest.approx(8 * 16.2 / 1000)
    equal = {**m, "rounds_per_stream": [8, 8]}
    assert ideal_wall(CFG, SHAPE["none"], 2, equal) == pytest.approx(8 * 16.2 / 1000)


def test_dsis_ideal_at_full_acceptance_is_bound_by_the_drafter_not_by_its_guard_rounds() -> None:
    """One session drafting for itself (acceptance 1): 16 verified blocks of 4 and 11 guard rounds
    (target-only, no draft). Its ideal is about one draft forward per token, faster than SI's."""
    si = dict(target_calls=13, drafted_tokens=52, draft_calls=52, accepted_tokens=52, tokens=64)
    dsi = dict(target_calls=27, drafted_tokens=64, draft_calls=64, accepted_tokens=64, tokens=64)
    wall = ideal_wall(CFG, SHAPE["dsi 4x4"], 1, dsi)
    assert wall < ideal_wall(CFG, SHAPE["chain 4"], 1, si)
    assert wall == pytest.approx(64 * 4.05 / 1000, rel=0.15)


def _histogram(name: str, total: float, count: float, **labels: str) -> dict:
    key = tuple(sorted(labels.items()))
    return {(f"{name}_sum", key): total, (f"{name}_count", key): count}


def test_the_split_adds_up_to_the_round() -> None:
    phase = "specmesh:round_phase_seconds"
    gateway = {
        **_histogram(phase, 0.400, 10, phase="round"),
        **_histogram(phase, 0.010, 10, phase="commit"),
        **_histogram(phase, 0.180, 10, phase="drafter_call"),
        **_histogram(phase, 0.200, 10, phase="verifier_call"),
    }
    drafter = {
        **_histogram("specmesh:rpc_handler_seconds", 0.170, 10, method="DraftTick"),
        **_histogram("specmesh:queue_wait_seconds", 0.004, 40),
        **_histogram("specmesh:forward_seconds", 0.160, 40),
    }
    verifier = {
        **_histogram("specmesh:rpc_handler_seconds", 0.185, 10, method="VerifyTick"),
        **_histogram("specmesh:queue_wait_seconds", 0.001, 10),
        **_histogram("specmesh:forward_seconds", 0.165, 10),
    }
    ms = split({"gateway": gateway, "drafter-0": drafter, "verifier-0": verifier})  # 10 ticks each
    assert ms["round"] == pytest.approx(40.0)
    assert ms["forwards"] == pytest.approx(16.0 + 16.5)
    assert (ms["redis"], ms["queue"]) == (pytest.approx(1.0), pytest.approx(0.5))
    assert ms["grpc"] == pytest.approx((18 - 17) + (20 - 18.5))
    assert ms["replica_cpu"] == pytest.approx((17 - 0.4 - 16) + (18.5 - 0.1 - 16.5))
    assert ms["gateway_cpu"] == pytest.approx(40 - 18 - 20 - 1)
    parts = ("forwards", "redis", "queue", "grpc", "replica_cpu", "gateway_cpu")
    assert sum(ms[k] for k in parts) == pytest.approx(ms["round"])
