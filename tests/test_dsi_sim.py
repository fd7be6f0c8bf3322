"""The analytic DSI simulator (specmesh.core.dsi_sim) against the paper's claims and figures: Table 1
exactly, DSI never slower than min(SI, non-SI), Table 2 row by row, and the cost model's rules."""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from specmesh.core import dsi_emulator as emu
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


# ---- the authors' emulator (specmesh.core.dsi_emulator; docs/benchmarks/dsi_table2_causes.md) --------------

TINY = sim.Forwards(target=10.0, draft=1.0, target_first=30.0, draft_first=2.0)
ROWS = {(r.target, r.dataset): r for r in sim.TABLE2}


def test_emulator_si_by_hand():
    """C = 3, 0, then the last cycle; k = 2. Cycle 1: the blocking prefix call at TTFT (30), then
    3 // 2 + 1 = 2 blocks: 4 drafts (2 + 3·1: the drafter's TTFT, nothing committed yet) and 2 calls (20),
    55. Cycle 2: prefix 10, 0 // 2 + 1 = 1 block, 2 drafts + 10: 22. Last cycle: its prefix call, 10."""
    assert emu.si_generation(TINY, 2, [3, 0, 5]) == 87


def test_emulator_dsi_by_hand():
    """Same draws, SP 2. Cycle 1 (drafts done at 2, 3, 4, ...; a call every 2 drafts, at 0, 3, 5, 7, ...):
    the prefix call takes thread 0 (TTFT, ends 30), the block of 2 drafts thread 1 (TTFT, ends 33); later
    blocks queue. At 30 thread 0 takes the newest (LIFO) block, of 28 drafts (submitted at 29; TPOT,
    ends 40); at 33 thread 1 takes the 30-draft block. The first call with more than 3 drafts to return is
    the 28-draft one: the cycle ends at 40. Cycle 2 (drafts at TPOT: calls at 0, 2, 4, ...; threads warm):
    thread 1's 2-draft block, 2 > 0, ends it at 12. Last cycle: thread 0's prefix call, 10. With SP 3 the
    4-draft block gets a third thread at 5 (TTFT, ends 35), which ends cycle 1 at 35."""
    assert emu.dsi_cycle(TINY, 2, 2, 3, True, 0, False) == (40.0, 2)
    assert emu.dsi_generation(TINY, 2, 2, [3, 0, 5]) == 62
    assert emu.dsi_cycle(TINY, 2, 3, 3, True, 0, False) == (35.0, 3)
    assert emu.dsi_generation(TINY, 2, 3, [3, 0, 5]) == 57


def test_emulator_pool_reuses_idle_threads_and_serves_the_newest_call():
    """The pool's rules by hand, drafts warm (1 per draft), thread 0 warm, C = 3 (a call with > 3 drafts ends
    the cycle). Target 1, k = 2, SP 3: calls at 0, 2, 4 each find thread 0 idle again (the idle semaphore:
    no new thread and no TTFT), and the 4-draft call ends the cycle at 5 with one thread warm. Target 10,
    k = 1, SP 1: calls at 0, 1, 2, ... queue behind thread 0; at 10 it takes the newest, the 9-draft call
    (LIFO; the 10-draft one comes just after), which ends the cycle at 20 (FIFO: the 4-draft one, at 50)."""
    fast = sim.Forwards(target=1.0, draft=1.0, target_first=3.0, draft_first=1.0)
    assert emu.dsi_cycle(fast, 2, 3, 3, False, 1, False) == (5.0, 1)
    slow = sim.Forwards(target=10.0, draft=1.0, target_first=30.0, draft_first=1.0)
    assert emu.dsi_cycle(slow, 1, 1, 3, False, 1, False) == (20.0, 1)


def test_emulator_draws_are_the_authors():
    """Their _get_correct_token_list: one draw at a time from the seeded legacy generator until the total
    passes 50; the next generation continues the stream."""
    rng = np.random.RandomState(42)
    theirs = []
    for _ in range(3):
        runs = []
        while sum(runs) <= sim.TABLE2_TOKENS:
            runs.append(min(int(rng.geometric(1 - 0.67, 1)[0]) - 1, 20))
        theirs.append(runs)
    ours = emu.draw_cycles(0.67, 3, 42)
    assert [list(row[row >= 0]) for row in ours] == theirs


def test_emulator_matches_the_deterministic_copy():
    """The lost port's seed-42 figures (dsi_table2_causes.md §2, given to the ms), pinned exactly."""
    v7, starcoder = ROWS["Vicuna-7B", "CNN-DM"], ROWS["Starcoder-15B", "HumanEval"]
    runs = emu.draw_cycles(v7.acceptance, 1, 42)[0]
    runs = runs[runs >= 0]
    assert len(runs) == 34
    flat = dataclasses.replace(v7, target_ttft=None, drafter_ttft=None).forwards()
    assert emu.si_generation(flat, 5, runs) == pytest.approx(2502.528)
    assert emu.dsi_generation(flat, 5, 3, runs) == pytest.approx(1444.128)
    assert emu.si_generation(v7.forwards(), 5, runs) == pytest.approx(2606.458176)
    assert emu.dsi_generation(v7.forwards(), 10, 6, runs) == pytest.approx(1918.498176)
    runs = emu.draw_cycles(starcoder.acceptance, 1, 42)[0]
    assert list(runs) == [6, 20, 18, 12]
    assert emu.si_generation(starcoder.forwards(), 5, runs) == pytest.approx(683.433222)
    assert emu.dsi_generation(starcoder.forwards(), 1, 5, runs) == pytest.approx(396.392822)


def test_emulator_means_are_the_generations():
    """The vectorised means over generations equal the per-generation event simulations."""
    row = ROWS["Vicuna-13B", "Alpaca"]
    run = emu.emulator_run(row, repeats=20, seed=3)
    gens = [g[g >= 0] for g in emu.draw_cycles(row.acceptance, 20, 3)]
    fw = row.forwards()
    assert run.si_ms == pytest.approx(np.mean([emu.si_generation(fw, run.si_lookahead, g) for g in gens]))
    dsi = [emu.dsi_generation(fw, run.dsi_lookahead, run.sp, g) for g in gens]
    assert run.dsi_ms == pytest.approx(np.mean(dsi))
    assert run.cycles == np.mean([len(g) for g in gens])


def test_emulator_restart_cost_lowers_the_figure():
    for key in (("Vicuna-13B", "Alpaca"), ("Phi3-14B", "HumanEval")):
        run = emu.emulator_run(ROWS[key], repeats=100)
        restarted = emu.emulator_run(ROWS[key], repeats=100, restart_ms=(14.0, 17.0))
        assert restarted.speedup < run.speedup
        r = emu.restart_for(run, 1.4, dsi_extra_ms=3.0)
        at = emu.emulator_run(ROWS[key], repeats=100, restart_ms=(r, r + 3.0))
        assert at.speedup == pytest.approx(1.4)
    # many short cycles (Vicuna, a = 0.58) pay far more restarts than few long ones (Phi3, a = 0.95)
    assert emu.emulator_run(ROWS["Vicuna-13B", "Alpaca"], repeats=100).cycles > 30
    assert emu.emulator_run(ROWS["Phi3-14B", "HumanEval"], repeats=100).cycles < 6


@pytest.mark.parametrize("row", sim.TABLE2, ids=lambda r: f"{r.target}-{r.dataset}")
def test_emulator_ttft_rule_is_the_authors_check(row):
    """ConfigRunDSI: num_target_servers >= ceil(failure_cost / (max(1, k) · c)), TTFTs in both fields."""
    run = emu.emulator_run(row, repeats=20, ttft_rule=True)
    fw = row.forwards()
    assert math.ceil(fw.target_first / (run.dsi_lookahead * fw.draft_first)) <= run.sp <= sim.SERVERS
    tpot = emu.emulator_run(row, repeats=20)
    assert sim.feasible(tpot.dsi_lookahead, fw.target, fw.draft, tpot.sp)


def test_emulator_ttft_rule_forces_long_blocks_on_cnn_dm():
    """Vicuna-13B/CNN-DM: TTFT 5.36x TPOT admits no lookahead of 1, 5, 10 on 7 servers; Vicuna-7B/CNN-DM
    only 10 (on 6), where the TPOT rule takes 5 (on 3)."""
    v13 = emu.emulator_run(ROWS["Vicuna-13B", "CNN-DM"], repeats=20, ttft_rule=True)
    assert (v13.dsi_lookahead, v13.sp) == (12, 7)
    v7 = ROWS["Vicuna-7B", "CNN-DM"]
    ttft, tpot = emu.emulator_run(v7, repeats=20, ttft_rule=True), emu.emulator_run(v7, repeats=20)
    assert (ttft.dsi_lookahead, ttft.sp, tpot.dsi_lookahead, tpot.sp) == (10, 6, 5, 3)


# The port's figures (1000 generations, seed 0): TPOT rule; TTFT rule with 14/17 ms restarts.
EMULATED = {
    ("Vicuna-13B", "CNN-DM"): (1.72, 1.24),
    ("Vicuna-7B", "CNN-DM"): (1.69, 1.25),
    ("Phi3-14B", "HumanEval"): (1.53, 1.50),
}
# On the authors' own draws (seed 42, one run), TTFT rule and restarts: the doc's "Seed 42" column.
SEED42 = (1.24, 1.51, 1.235, 1.44, 1.44, 1.59, 1.44, 1.49, 1.47, 1.58)


@pytest.mark.parametrize("key", EMULATED, ids="-".join)
def test_emulator_table2_figures(key):
    tpot, ttft = EMULATED[key]
    assert emu.emulator_run(ROWS[key]).speedup == pytest.approx(tpot, abs=0.01)
    restarted = emu.emulator_run(ROWS[key], ttft_rule=True, restart_ms=(14.0, 17.0)).speedup
    assert restarted == pytest.approx(ttft, abs=0.01)


def test_emulator_seed42_figures():
    got = [emu.emulator_run(r, 1, 42, ttft_rule=True, restart_ms=(14.0, 17.0)).speedup for r in sim.TABLE2]
    assert got == pytest.approx(SEED42, abs=0.006)
