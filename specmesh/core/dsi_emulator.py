"""A deterministic port of the authors' wall-clock emulator that produced Table 2 of Timor et al.
(arXiv:2405.14105): keyboardAnt/distributed-speculative-inference at
057adbbfcb458664a3f9c682219d3b6c7a78dc09, files dsi/online/run/core.py, dsi/online/run/run.py and
dsi/configs/run/run.py. Their code sleeps for each forward and measures wall time; here the same events are
replayed in virtual time, so a run is exact and model-free. What it reproduces, and why some rows still
differ: docs/benchmarks/dsi_table2_causes.md.

Their accounting, which this module follows (item numbers as in that doc's §1):
1. A generation is a sequence of cycles, one OS process each. Cycle i draws C_i = min(Geometric(1-a) - 1,
   20) and commits C_i tokens, no target token. Draws are made until their sum passes S = 50; the cycle
   whose draw takes the total past S is the last.
2. A cycle first calls the target on the committed prefix (`draft_tokens=0`; SI blocks on it), then drafts
   and calls the target every k drafts. The first call returning with more drafts than C ends the cycle
   (fix_history kills the process): floor(C/k) + 1 blocks. In the last cycle the first call, the prefix's,
   stops the run.
3. DSI submits every call to `ThreadPoolExecutor(max_workers=SP)` whose queue is a `LifoQueue`. A pool
   thread pays the target's TTFT on the first call its index (the thread-name suffix, the same in every
   cycle's new pool) makes in the generation, TPOT after; SI's main thread pays TTFT once. The drafter pays
   its TTFT on a cycle's first draft while nothing is committed yet.
4. The draws come from numpy's legacy global generator, seeded (`np.random.seed(42)`) at the start of every
   run: SI and DSI see the same draws (common random numbers).
5. Their wall time also holds a per-cycle process restart (fork, Manager proxies, pool start, SIGTERM,
   join): `restart_ms`, the same count of cycles in both arms.
6. `ConfigRunDSI` refuses SP < ceil(failure_cost / (k·c)); with TTFTs in those fields that is a TTFT-based
   rule (`ttft_rule`), otherwise the paper's TPOT feasibility rule applies.
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specmesh.core.dsi_sim import (
    SERVERS,
    SI_LOOKAHEADS,
    TABLE2_TOKENS,
    Forwards,
    Table2Row,
    feasible,
    servers_needed,
)

MAX_RUN = 20  # their `maximum_correct_tokens`: the cap on C
AUTHORS_SEED = 42  # their set_random_seed() default


# ---- draws -------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def draw_cycles(
    acceptance: float, repeats: int, seed: int, n_tokens: int = TABLE2_TOKENS, max_run: int = MAX_RUN
) -> np.ndarray:
    """C per cycle of `repeats` generations (rows), -1 after a generation's last cycle. One stream of
    numpy's legacy generator seeded `seed`, consumed in order, generation after generation, each drawing
    until its total passes n_tokens: their `_get_correct_token_list` (a batch draw equals their
    one-at-a-time draws), so seed 42 gives their draws exactly. Cached and read-only."""
    if not 0 < acceptance < 1 or repeats < 1:
        raise ValueError(f"need 0 < acceptance < 1 and repeats >= 1; got {acceptance}, {repeats}")
    rng = np.random.RandomState(seed)
    stream = total = np.empty(0, dtype=int)
    chunk = max(1024, 64 * repeats)
    gens, pos = [], 0
    while len(gens) < repeats:
        base = total[pos - 1] if pos else 0
        end = int(np.searchsorted(total, base + n_tokens, side="right"))  # first cycle past n_tokens
        if end == len(stream):  # the stream ran out mid-generation: extend it, same sequence
            stream = np.concatenate([stream, np.minimum(rng.geometric(1 - acceptance, chunk) - 1, max_run)])
            total = np.cumsum(stream)
            continue
        gens.append(stream[pos : end + 1])
        pos = end + 1
    runs = np.full((repeats, max(map(len, gens))), -1)
    for i, g in enumerate(gens):
        runs[i, : len(g)] = g
    runs.flags.writeable = False
    return runs


def _flags(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cycle: live (a cycle of the generation), last, fresh (nothing committed before: drafter TTFT)."""
    live = runs >= 0
    last = live & ~np.pad(live[:, 1:], ((0, 0), (0, 1)))
    before = np.cumsum(np.where(live, runs, 0), axis=1) - np.where(live, runs, 0)
    return live, last, before == 0


# ---- one cycle of each arm ------------------------------------------------------------------------------


def si_cycle(
    fw: Forwards, k: int, run: np.ndarray, first: np.ndarray, fresh: np.ndarray, last: np.ndarray
) -> np.ndarray:
    """SI cycle time (elementwise on arrays): the blocking prefix call (TTFT in the generation's first cycle),
    then, unless last, floor(C/k) + 1 blocks of k drafts and a target call."""
    prefix = np.where(first, fw.forward(False), fw.target)
    blocks = np.asarray(run) // k + 1
    drafting = np.where(fresh, fw.drafting(1, False), fw.draft) + (blocks * k - 1) * fw.draft
    return prefix + np.where(last, 0.0, drafting + blocks * fw.target)


@functools.lru_cache(maxsize=65536)
def dsi_cycle(
    fw: Forwards, k: int, sp: int, run: int, fresh: bool, warm: int, last: bool
) -> tuple[float, int]:
    """One DSI cycle in virtual time: (its duration, pool thread indices warm after it). `warm`: indices
    that have already paid TTFT in this generation. Replays CPython's ThreadPoolExecutor: submit pushes the
    call on the LIFO queue, where an idle worker (first-come first-served) takes it; then
    `_adjust_thread_count` takes the idle semaphore (released after every finished call, idle or not) or
    else starts thread `len(threads)` while below SP, which takes the newest call. A finished worker runs
    its callback (which may kill the process) before it releases the semaphore and takes the newest queued
    call. Ties: a call ending when a block is drafted ends first."""
    pending: list[int] = []  # drafts of the calls waiting in the LIFO queue
    idle: deque[int] = deque()
    running: list[tuple[float, int, int]] = []  # heap of (end, thread, drafts)
    used = set(range(warm))
    semaphore = threads = calls = 0

    def start(thread: int, now: float) -> None:
        cold = thread not in used
        used.add(thread)
        heapq.heappush(running, (now + fw.forward(not cold), thread, pending.pop()))

    while True:
        submit = fw.drafting(calls * k, not fresh) if calls else 0.0  # the drafter never waits
        if running and running[0][0] <= submit:
            end, thread, drafts = heapq.heappop(running)
            if last or drafts > run:  # the stop flag, or fix_history: the process is killed
                return end, len(used)  # new threads take a call at once, so `used` is 0..n-1
            semaphore += 1
            if pending:
                start(thread, end)
            else:
                idle.append(thread)
            continue
        pending.append(calls * k)
        if idle:
            start(idle.popleft(), submit)
        if semaphore:
            semaphore -= 1
        elif threads < sp:
            if pending:
                start(threads, submit)
            else:
                idle.append(threads)
            threads += 1
        calls += 1


# ---- generations ----------------------------------------------------------------------------------------


def si_generation(fw: Forwards, k: int, runs: Sequence[int]) -> float:
    """One SI generation for the given C per cycle (the last one ends the generation)."""
    return _si_mean(fw, k, np.asarray(runs)[None, :])


def dsi_generation(fw: Forwards, k: int, sp: int, runs: Sequence[int]) -> float:
    """One DSI generation for the given C per cycle; the warm pool indices carry over cycles."""
    total, warm, committed = 0.0, 0, 0
    for i, run in enumerate(runs):
        took, warm = dsi_cycle(fw, k, sp, int(run), committed == 0, warm, i == len(runs) - 1)
        total, committed = total + took, committed + int(run)
    return total


def _si_mean(fw: Forwards, k: int, runs: np.ndarray) -> float:
    live, last, fresh = _flags(runs)
    first = np.arange(runs.shape[1])[None, :] == 0
    return float(np.where(live, si_cycle(fw, k, runs, first, fresh, last), 0.0).sum() / len(runs))


def _dsi_mean(fw: Forwards, k: int, sp: int, runs: np.ndarray) -> float:
    """`dsi_generation` averaged over the rows of `runs`, a cycle index at a time over all generations: each
    distinct (C, fresh, warm, last) of that index is simulated once."""
    live, last, fresh = _flags(runs)
    total, warm = np.zeros(len(runs)), np.zeros(len(runs), dtype=int)
    for i in range(runs.shape[1]):
        rows = np.flatnonzero(live[:, i])
        run = np.where(last[rows, i], 0, runs[rows, i])  # C does not matter in the last cycle
        fr = fresh[rows, i] & ~last[rows, i]
        states, inverse = np.unique(
            np.stack([run, fr, warm[rows], last[rows, i]]), axis=1, return_inverse=True
        )
        out = [dsi_cycle(fw, k, sp, int(c), bool(f), int(w), bool(e)) for c, f, w, e in states.T]
        took, warm_after = np.array(out).T
        inverse = inverse.reshape(-1)  # numpy 2.0.0 shaped it like the input
        total[rows] += took[inverse]
        warm[rows] = warm_after[inverse].astype(int)
    return float(total.mean())


# ---- Table 2 --------------------------------------------------------------------------------------------


def admitted(fw: Forwards, k: int, sp: int, ttft_rule: bool) -> bool:
    """Their ConfigRunDSI check with TTFTs (failure_cost, c), or the paper's rule on TPOTs."""
    if ttft_rule:
        return servers_needed(k, fw.forward(False), fw.drafting(1, False)) <= sp
    return feasible(k, fw.target, fw.draft, sp)


@dataclass(frozen=True)
class EmulatorRun:
    """The best SI and DSI configurations and their mean latencies (ms) without the restart cost."""

    si_lookahead: int
    dsi_lookahead: int
    sp: int
    si_ms: float
    dsi_ms: float
    cycles: float  # mean cycles (process restarts) per generation, the same in both arms
    restart_ms: tuple[float, float]  # per cycle: SI, DSI

    @property
    def speedup(self) -> float:
        si_restart, dsi_restart = self.restart_ms
        return (self.si_ms + si_restart * self.cycles) / (self.dsi_ms + dsi_restart * self.cycles)


@functools.lru_cache(maxsize=4096)
def _mean(fw: Forwards, acceptance: float, repeats: int, seed: int, max_run: int, k: int, sp: int) -> float:
    """Mean latency of one configuration (sp 0: SI); cached: the settings share their configurations."""
    runs = draw_cycles(acceptance, repeats, seed, TABLE2_TOKENS, max_run)
    return _si_mean(fw, k, runs) if sp == 0 else _dsi_mean(fw, k, sp, runs)


def emulator_run(
    row: Table2Row,
    repeats: int = 1000,
    seed: int = 0,
    ttft_rule: bool = False,
    restart_ms: tuple[float, float] = (0.0, 0.0),
    max_run: int = MAX_RUN,
) -> EmulatorRun:
    """Table 2's protocol (§4) on the emulator: SI at its best lookahead of 1, 5, 10; DSI at its best
    (lookahead in 1, 5, 10; SP <= 7) admitted by the rule, or of lookaheads 1..max_run if none is (the
    driver is unpublished: this grid is the paper's text). Ties: the smaller lookahead, then SP.
    `.speedup` is Table 2's DSI-vs-SI figure as the authors' emulator gives it, without its noise."""
    fw = row.forwards()
    mean = functools.partial(_mean, fw, row.acceptance, repeats, seed, max_run)
    si_ms, si_k = min((mean(k, 0), k) for k in SI_LOOKAHEADS)
    sps = range(1, SERVERS + 1)
    grid = [(k, sp) for k in SI_LOOKAHEADS for sp in sps if admitted(fw, k, sp, ttft_rule)]
    grid = grid or [(k, sp) for k in range(1, max_run + 1) for sp in sps if admitted(fw, k, sp, ttft_rule)]
    dsi_ms, dsi_k, sp = min((mean(k, sp), k, sp) for k, sp in grid)
    live = draw_cycles(row.acceptance, repeats, seed, TABLE2_TOKENS, max_run) >= 0
    return EmulatorRun(si_k, dsi_k, sp, si_ms, dsi_ms, float(live.sum() / repeats), restart_ms)


def restart_for(run: EmulatorRun, speedup: float, dsi_extra_ms: float = 0.0) -> float:
    """The per-cycle restart cost of SI (ms; DSI's is dsi_extra_ms more) at which `run` gives `speedup`:
    restarts add the same n cycles to both arms, so (SI + r·n) / (DSI + (r + e)·n) = s gives
    r = (SI - s·(DSI + e·n)) / (n·(s - 1))."""
    n = run.cycles
    return (run.si_ms - speedup * (run.dsi_ms + dsi_extra_ms * n)) / (n * (speedup - 1))
