"""The analytic DSI simulator (specmesh.core.dsi_sim) against the paper's claims and figures: Table 1
exactly, DSI never slower than min(SI, non-SI), Table 2 row by row, and the cost model's rules."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from specmesh.core import dsi_sim as sim

FW = sim.Forwards(target=1.0, draft=0.1, target_first=3.0, draft_first=0.12)


# ---- Fig. 1 / Table 1 --------------------------------------------------------------------------------


def test_table1_timeline_is_the_papers():
    assert sim.fig1_table() == sim.TABLE1_PAPER


def test_table1_depends_on_the_drafter_latency():
    """The counts come from the simulated timelines, not from the table: at a drafter of exactly 0.14
    of the target (instead of 1/7) DSI's best case commits one more token by t3 and t4."""
    table = sim.fig1_table(Fraction(14, 100))
    assert table["DSI best"] == (8, 26, 51, 59)
    assert {k: v for k, v in table.items() if k != "DSI best"} == {
        k: v for k, v in sim.TABLE1_PAPER.items() if k != "DSI best"
    }


def test_timelines_commit_every_token_in_order():
    ok = np.random.default_rng(0).random(60) < 0.7
    for times in (sim.si_times(FW, ok, 4), sim.dsi_times(FW, ok, 4), sim.nonsi_times(FW, 60)):
        assert len(times) == 60
        assert all(b >= a for a, b in itertools.pairwise(times))


# ---- the cost model's rules --------------------------------------------------------------------------


def test_nonsi_is_ttft_plus_tpots():
    assert sim.latency_nonsi(FW, 50) == pytest.approx(3.0 + 49 * 1.0)
    assert sim.nonsi_times(FW, 50)[-1] == pytest.approx(3.0 + 49 * 1.0)
    assert sim.latency_nonsi(sim.Forwards(37.7, 2.5), 1) == 37.7


def test_feasibility_rule():
    assert sim.servers_needed(5, 1.0, 0.05) == 4  # the paper's example: 5 % drafter, lookahead 5 -> SP 4
    assert sim.servers_needed(2, 1.0, 0.1) == 5  # and 10 % drafter, lookahead 2 -> 5 target GPUs
    assert sim.feasible(15, 1.0, 0.01, 7) and not sim.feasible(14, 1.0, 0.01, 7)
    assert sim.servers_needed(20, 1.0, 0.05) == 1  # 0.05 * 20 is 1.0000000000000002 in floats
    with pytest.raises(ValueError, match="needs SP"):
        sim.latency_dsi(FW, 0.5, 1, 20, sp=7)  # 1 / (1 * 0.1) = 10 servers
    assert sim.best_dsi(FW, 0.5, 20, max_sp=7).sp <= 7
    grid = sim.fig2_grid(latencies=[0.01, 0.05, 0.3], acceptances=[0.5], lookaheads=range(1, 30))
    assert (grid.dsi_sp <= 7).all()
    assert grid.dsi_lookahead[0, 0] >= 15  # 1 / (7 * 0.01) = 14.3


def test_dsi_with_every_draft_accepted_pays_drafting_only():
    """Verification is hidden while blocks are accepted: N tokens cost drafting N-1 of them and the one
    target forward that decides the last, whatever the number of blocks. A model that exposed the
    verification of every block (ceil((N-1)/k) forwards) would fail this for every k here."""
    n = 40
    for k in (1, 2, 4, 10):
        expected = 0.12 + (n - 2) * 0.1 + 3.0
        assert sim.latency_dsi(FW, 1.0, k, n, sp=10) == pytest.approx(expected)
        assert sim.dsi_times(FW, [True] * n, k)[-1] == pytest.approx(expected)
        exposed = expected + (math.ceil((n - 1) / k) - 1) * 1.0
        assert sim.latency_dsi(FW, 1.0, k, n, sp=10) < exposed - 0.5


def test_dsi_with_every_draft_rejected_is_nonsi():
    """Each first draft is wrong: the forward started at the synchronisation decides every token."""
    for k in (1, 3):
        assert sim.latency_dsi(FW, 0.0, k, 30, sp=10) == pytest.approx(sim.latency_nonsi(FW, 30))


def test_block_only_coordinator_is_slower():
    """Without Alg. 1's forward at each synchronisation a wrong first draft costs a whole block."""
    fw = sim.Forwards(1.0, 0.2)
    for a in (0.2, 0.6, 0.9):
        assert sim.latency_dsi(fw, a, 3, 40, alg1=False) > sim.latency_dsi(fw, a, 3, 40)


def test_accepted_pmf_is_truncated_geometric():
    pmf = sim.accepted_pmf(0.6, 4)
    assert pmf.sum() == pytest.approx(1.0)
    assert pmf @ np.arange(5) == pytest.approx(sum(0.6**i for i in range(1, 5)))


# ---- exact expectations, sampling, coupling ----------------------------------------------------------


@pytest.mark.parametrize(("acceptance", "lookahead"), [(0.3, 2), (0.7, 3), (0.9, 5)])
def test_exact_expectation_matches_sampled_timelines(acceptance, lookahead):
    """The dynamic programmes and the token timelines are two implementations of one model."""
    kw = {"repeats": 2000, "seed": 1}
    exact, sampled = (
        sim.latency_si(FW, acceptance, lookahead, 40),
        sim.latency_si(FW, acceptance, lookahead, 40, **kw),
    )
    assert sampled == pytest.approx(exact, rel=0.02)
    exact, sampled = (sim.latency_dsi(FW, acceptance, lookahead, 40, **k) for k in ({}, kw))
    assert sampled == pytest.approx(exact, rel=0.02)


def test_common_random_numbers_dsi_never_slower_per_draw():
    """Theorem 2's coupling: on the same acceptance draws, a DSI generation finishes no later than SI's
    with the same lookahead (feasible, and a block drafted within one target forward)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        r, a, n = rng.choice([0.05, 0.1, 0.25, 0.5, 0.9]), rng.random(), int(rng.integers(2, 50))
        fw = sim.Forwards(1.0, r, 1 + 4 * rng.random(), r * (1 + 2 * rng.random()))
        ok = rng.random(n) < a
        for k in range(1, int(1 / r) + 1):
            if sim.feasible(k, 1.0, r, 7):
                assert sim.dsi_times(fw, ok, k)[-1] <= sim.si_times(fw, ok, k)[-1] + 1e-12


def _brute_per_token_dsi(r, a, k, q_max=40_000):
    q = np.arange(1, q_max + 1)
    blocks = np.ceil((q - 1) / k)
    return float((a ** (q - 1) * (1 - a) * np.minimum(blocks * k * r + 1, q)).sum() * (1 - a))


def test_per_token_closed_forms():
    for r in (0.01, 0.3, 0.6, 0.95):
        for a in (0.0, 0.4, 0.9, 0.99):
            for k in (1, 3, 20, 150):
                assert sim.per_token_dsi(r, a, k) == pytest.approx(_brute_per_token_dsi(r, a, k), rel=1e-9)
    # and a long generation's exact latency per token tends to them (the last interval is cut short)
    fw = sim.Forwards(1.0, 0.2)
    for a, k in ((0.6, 3), (0.95, 4)):
        assert sim.latency_dsi(fw, a, k, 1000) / 1000 == pytest.approx(sim.per_token_dsi(0.2, a, k), rel=5e-3)
        assert sim.latency_si(fw, a, k, 1000) / 1000 == pytest.approx(sim.per_token_si(0.2, a, k), rel=5e-3)
    assert sim.per_token_dsi(0.3, 1.0, 5) == pytest.approx(0.3)  # all accepted: drafting only
    assert sim.per_token_si(0.3, 1.0, 5) == pytest.approx((5 * 0.3 + 1) / 6)


# ---- Fig. 2: DSI <= min(SI, non-SI) ------------------------------------------------------------------


def test_dsi_never_slower_than_si_or_nonsi_on_a_grid():
    """Exact per-token expectations on a coarse version of the paper's grid (same lookahead range and
    SP bound): no cell where DSI is slower than min(SI, non-SI)."""
    grid = sim.fig2_grid(latencies=np.arange(1, 101, 3) / 100, acceptances=np.arange(0, 101, 3) / 100)
    assert not grid.dsi_slower().any()
    assert (grid.si > 1).any()  # while SI does lose to non-SI somewhere
    assert (grid.dsi < 1).any() and (grid.dsi <= 1 + 1e-12).all()


def test_dsi_never_slower_for_finite_generations():
    """The same with the exact dynamic programmes for 30 tokens, TTFT included."""
    for r in (0.05, 0.2, 0.5, 0.9):
        for a in (0.0, 0.3, 0.6, 0.9, 1.0):
            fw = sim.Forwards(1.0, r, 2.0, 1.5 * r)
            ks = [k for k in range(1, 30) if sim.feasible(k, 1.0, r, 7)]
            si = sim.best_si(fw, a, 30, ks).latency
            assert sim.best_dsi(fw, a, 30, 7, ks).latency <= min(si, sim.latency_nonsi(fw, 30)) * (1 + 1e-12)


def test_si_free_lookahead_beats_feasible_dsi_at_the_fastest_drafter():
    """docs/benchmarks/dsi.md, Fig. 2: with SI free to take any lookahead, feasible-only DSI loses by
    less than 1 % at drafter latency 0.01 (it must draft >= 15 tokens per block there)."""
    grid = sim.fig2_grid(latencies=[0.01, 0.02], acceptances=np.arange(0, 101, 5) / 100)
    slower = grid.dsi_slower(grid.si_any)
    assert slower[0].any() and not slower[1].any()
    assert (grid.dsi / grid.si_any).max() < 1.01


# ---- Table 2 -----------------------------------------------------------------------------------------

# Our figure per row where it is not within 10 % of the paper's; docs/benchmarks/dsi.md ("Why the rows
# differ") explains each: Table 2 is a wall-clock run of the authors' emulator, whose SI is dearer than
# the paper's cost model. EMULATOR: rows that the emulator's SI accounting brings within 10 %.
OURS = {
    ("Vicuna-13B", "CNN-DM"): 1.16,
    ("Vicuna-13B", "Alpaca"): 1.24,
    ("Vicuna-7B", "Alpaca"): 1.29,
    ("Starcoder-15B", "HumanEval"): 1.36,
    ("Starcoder-15B", "MBPP"): 1.38,
    ("Phi3-14B", "HumanEval"): 1.19,
    ("Phi3-14B", "MBPP"): 1.21,
    ("Phi3-14B", "CNN-DM"): 1.21,
    ("Phi3-14B", "Alpaca"): 1.24,
}
EMULATOR = {
    ("Vicuna-7B", "Alpaca"),
    ("Starcoder-15B", "MBPP"),
    ("Phi3-14B", "HumanEval"),
    ("Phi3-14B", "MBPP"),
    ("Phi3-14B", "CNN-DM"),
    ("Phi3-14B", "Alpaca"),
}


@pytest.mark.parametrize("row", sim.TABLE2, ids=lambda r: f"{r.target}-{r.dataset}")
def test_table2_row(row):
    res = sim.table2_row(row)
    key = (row.target, row.dataset)
    assert res.si.lookahead in sim.SI_LOOKAHEADS and res.dsi.sp <= sim.SERVERS
    assert 1 < res.speedup < res.row.paper  # DSI wins, by less than the paper's emulator measured
    if key in OURS:
        assert res.speedup == pytest.approx(OURS[key], abs=0.006)
        assert abs(res.ratio - 1) > 0.10
    else:
        assert abs(res.ratio - 1) <= 0.10
    emulator = sim.emulator_speedup(row) / row.paper
    assert (abs(emulator - 1) <= 0.10) == (key in EMULATOR)


# ---- predict -----------------------------------------------------------------------------------------


def test_predict():
    p = sim.predict(t_draft=0.004, t_target=0.030, acceptance=0.7, max_sp=3, n_tokens=64)
    assert sim.feasible(p.lookahead, 0.030, 0.004, 3) and p.sp <= 3
    fw = sim.Forwards(0.030, 0.004)
    assert p.latency_dsi == pytest.approx(sim.latency_dsi(fw, 0.7, p.lookahead, 64, sp=3))
    assert p.latency_si == pytest.approx(sim.latency_si(fw, 0.7, p.si_lookahead, 64))
    assert p.latency_nonsi == pytest.approx(64 * 0.030)
    assert p.speedup_vs_si > 1 and p.speedup_vs_nonsi > p.speedup_vs_si
    blocks_only = sim.predict(
        t_draft=0.004, t_target=0.030, acceptance=0.7, max_sp=3, n_tokens=64, alg1=False
    )
    assert blocks_only.latency_dsi > p.latency_dsi and blocks_only.latency_si == p.latency_si
    slow = sim.predict(t_draft=0.004, t_target=0.030, acceptance=0.7, max_sp=1, n_tokens=64)
    assert slow.sp == 1 and slow.latency_dsi >= p.latency_dsi  # fewer servers, longer blocks
    with pytest.raises(ValueError, match="no feasible"):
        sim.predict(0.001, 0.030, 0.7, max_sp=1, n_tokens=64, lookaheads=range(1, 10))
