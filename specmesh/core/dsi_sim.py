"""The analytic DSI simulator: non-SI, SI and DSI latencies under the cost model of Timor et al.,
"Distributed Speculative Inference (DSI) of Large Language Models is Provably Faster" (arXiv:2405.14105).

Model-free, as in the paper: a forward is a wait of its latency, the first forward of each model costs
its TTFT and every later one its TPOT, and each drafted token is accepted independently with
probability `acceptance` (a block's accepted count is a geometric truncated at the lookahead). A target
forward verifying k drafts costs one forward (the paper's assumption; our verifier's forward is also
nearly flat in the rows it scores).

    non-SI  N target forwards: TTFT + (N-1)·TPOT.
    SI      draft k, verify (blocking), commit the accepted drafts plus the target's token, repeat
            (the paper's App. E.1), with k cut to the tokens left - 1 at the end.
    DSI     Alg. 1 with lookahead k: the drafter never waits; block v, drafted by v·k·t_draft after a
            synchronisation, is verified at once on a free target server, and that forward also decides
            the position after the block; a target forward also starts on the committed prefix at every
            synchronisation. The first wrong draft, at the q-th position after a synchronisation, is
            known one forward after the first verification covering it, at
            ceil((q-1)/k)·k·t_draft + t_target, which is the next synchronisation: drafting is all that
            is paid while blocks are accepted, plus one exposed target forward per rejection. Alg. 1's
            chain of target-only forwards bounds a synchronisation by q forwards (Theorem 1: never
            slower than non-SI). Only feasible lookaheads, ceil(t_target / (k·t_draft)) <= SP (the
            paper's rule): a server is then always free when a block is ready, and that ceiling is the
            SP degree the lookahead uses. Every target forward of the first interval is its server's
            first (the prompt's prefill) and costs TTFT; feasibility is judged on TPOTs, as the paper's.
            alg1=False is a block-only coordinator like specmesh.core.dsi's: no forward without a block,
            and a position is decided by the block that drafted it (the bonus is dropped under a younger
            block), so a wrong first draft costs a block and there is no non-SI bound.

Expectations are exact: dynamic programmes over the tokens left (SI: the truncated-geometric accepted
count of each iteration; DSI: the geometric position of the first wrong draft of each synchronisation
interval). With `repeats` > 0 the latency is sampled instead: per-position acceptance indicators drawn
from `seed` feed the token timelines `si_times` / `dsi_times` (which Table 1 also uses), and SI and DSI
with the same seed see the same indicators, the common random numbers of the paper's Theorem 2
coupling. Fig. 2's grid uses closed forms of the expected latency per token of a long generation
(renewal reward over synchronisation intervals), vectorised over (drafter latency, acceptance,
lookahead).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

SERVERS = 7  # target servers of one 8-GPU node with one GPU for the drafter: the paper's SP bound
SI_LOOKAHEADS = (1, 5, 10)  # the SI runs of Table 2
FIG2_LOOKAHEADS = range(1, 201)
FIG2_LATENCIES = np.arange(1, 101) / 100  # drafter latency / target latency
FIG2_ACCEPTANCES = np.arange(101) / 100
TABLE2_TOKENS = 50


# ---- cost model ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Forwards:
    """Forward latencies in any one unit: TPOT per forward, TTFT for each model's first (None: TPOT)."""

    target: float
    draft: float
    target_first: float | None = None
    draft_first: float | None = None

    def forward(self, warm: bool) -> float:
        """One target forward; a cold one (the model's first: the prompt's prefill) costs its TTFT."""
        return self.target if warm or self.target_first is None else self.target_first

    def drafting(self, tokens: int, warm: bool) -> float:
        """Drafting `tokens` tokens in a row; the drafter's first forward ever costs its TTFT."""
        if tokens <= 0:
            return 0 * self.draft
        first = self.draft if warm or self.draft_first is None else self.draft_first
        return first + (tokens - 1) * self.draft


def servers_needed(lookahead: int, t_target: float, t_draft: float) -> int:
    """SP degree at which a block never waits for a target server: ceil(t_target / (k·t_draft))."""
    return max(1, math.ceil(t_target / (lookahead * t_draft) * (1 - 1e-12)))  # 1e-12: 0.05·20 != 1.0


def feasible(lookahead: int, t_target: float, t_draft: float, sp: int) -> bool:
    """The paper's feasibility rule for a DSI lookahead on `sp` target servers."""
    return servers_needed(lookahead, t_target, t_draft) <= sp


def accepted_pmf(acceptance: float, lookahead: int) -> np.ndarray:
    """P(j of `lookahead` drafts accepted), j = 0..lookahead: i.i.d. acceptance up to the first rejection."""
    j = np.arange(lookahead + 1)
    pmf = acceptance**j * (1 - acceptance)
    pmf[-1] = acceptance**lookahead
    return pmf


def _check(acceptance: float, lookahead: int, n_tokens: int) -> None:
    if not 0 <= acceptance <= 1 or lookahead < 1 or n_tokens < 1:
        got = f"{acceptance}, {lookahead}, {n_tokens}"
        raise ValueError(f"need 0 <= acceptance <= 1, lookahead >= 1, n_tokens >= 1; got {got}")


# ---- token timelines: when each token is committed, for given draft outcomes --------------------------


def nonsi_times(fw: Forwards, n_tokens: int) -> list[float]:
    first = fw.forward(False)
    return [first + i * fw.target for i in range(n_tokens)]


def si_times(fw: Forwards, accepted: Sequence[bool], lookahead: int) -> list[float]:
    """Commit time of each of len(accepted) tokens under SI; accepted[p]: a draft at position p (from 0)
    would be accepted. A fully accepted block also commits the target's token after it (no draft there)."""
    n, times, now = len(accepted), [], 0 * fw.target
    while len(times) < n:
        i = len(times)
        k = min(lookahead, n - i - 1)
        now += fw.drafting(k, warm=i > 0) + fw.forward(warm=i > 0)
        j = 0
        while j < k and accepted[i + j]:
            j += 1
        times += [now] * (j + 1)
    return times


def _cover(p: int, lookahead: int, left: int, alg1: bool) -> int:
    """Which verification decides the p-th position after a synchronisation (`left` tokens to go): 0 is
    the forward started at the synchronisation, v >= 1 the one of block v. Alg. 1: block v's forward
    decides its tokens and the position after them. A block-only coordinator (no forward without a
    block; the bonus is dropped under a younger block): the block that drafted the position."""
    if alg1:
        return -(-(p - 1) // lookahead)
    return -(-min(p, left - 1) // lookahead) if left > 1 else 0


def _dsi_done(fw: Forwards, p: int, lookahead: int, left: int, warm: bool, alg1: bool) -> float:
    """Time from a synchronisation until the p-th position after it is decided (the drafts before it
    correct): the deciding forward starts when its block is drafted (a feasible lookahead: a server is
    free). In Alg. 1 the chain of target-only forwards decides it after p forwards at the latest."""
    forward = fw.forward(warm)
    v = _cover(p, lookahead, left, alg1)
    done = fw.drafting(min(v * lookahead, left - 1), warm) + forward
    return min(done, forward + (p - 1) * fw.target) if alg1 else done


def dsi_times(fw: Forwards, accepted: Sequence[bool], lookahead: int, alg1: bool = True) -> list[float]:
    """Commit time of each token under DSI (feasible lookahead), for the same draft outcomes as
    `si_times`. Every position is drafted once: after the first wrong draft, at q, the target's token
    is committed there and drafting restarts at q + 1. The first interval pays the TTFTs."""
    n, times, now = len(accepted), [], 0 * fw.target
    while len(times) < n:
        i = len(times)
        left = n - i
        q = 1
        while q < left and accepted[i + q - 1]:
            q += 1
        times += [now + _dsi_done(fw, p, lookahead, left, i > 0, alg1) for p in range(1, q + 1)]
        now = times[-1]
    return times


def _sampled(times: Callable[[Sequence[bool]], list[float]], acceptance, n_tokens, repeats, seed) -> float:
    """Mean latency over `repeats` draws of the per-position indicators (same seed, same draws)."""
    rng = np.random.default_rng(seed)
    return sum(times(rng.random(n_tokens) < acceptance)[-1] for _ in range(repeats)) / repeats


# ---- expected latencies: exact dynamic programmes over the tokens left -------------------------------


def _si_expected(fw: Forwards, acceptance: float, lookahead: int, n_tokens: int) -> float:
    left = np.zeros(n_tokens + 1)  # left[n]: expected time to generate n more tokens, both models warm

    def iteration(n: int, warm: bool) -> float:
        k = min(lookahead, n - 1)
        after = left[n - 1 - np.arange(k + 1)]
        return fw.drafting(k, warm) + fw.forward(warm) + float(accepted_pmf(acceptance, k) @ after)

    for n in range(1, n_tokens):
        left[n] = iteration(n, True)
    return iteration(n_tokens, False)


def _dsi_costs(fw: Forwards, n: int, lookahead: int, warm: bool, alg1: bool) -> np.ndarray:
    """`_dsi_done` for p = 1..n, vectorised (the DP's inner loop)."""
    p = np.arange(1, n + 1)
    if alg1:
        v = -(-(p - 1) // lookahead)
    else:
        v = -(-np.minimum(p, n - 1) // lookahead) if n > 1 else np.zeros(n, dtype=int)
    drafted = np.minimum(v * lookahead, n - 1)
    first = fw.draft if warm or fw.draft_first is None else fw.draft_first
    drafting = np.where(drafted > 0, first + (drafted - 1) * fw.draft, 0.0)
    done = drafting + fw.forward(warm)
    return np.minimum(done, fw.forward(warm) + (p - 1) * fw.target) if alg1 else done


def _dsi_expected(fw: Forwards, acceptance: float, lookahead: int, n_tokens: int, alg1: bool) -> float:
    left = np.zeros(n_tokens + 1)

    def interval(n: int, warm: bool) -> float:
        # the first wrong draft is at position q = 1..n-1 (q - 1 accepted before it), or none (q = n)
        cost = _dsi_costs(fw, n, lookahead, warm, alg1)
        return float(accepted_pmf(acceptance, n - 1) @ (cost + left[n - np.arange(1, n + 1)]))

    for n in range(1, n_tokens):
        left[n] = interval(n, True)
    return interval(n_tokens, False)


def latency_nonsi(fw: Forwards, n_tokens: int) -> float:
    return fw.forward(False) + (n_tokens - 1) * fw.target


def latency_si(
    fw: Forwards, acceptance: float, lookahead: int, n_tokens: int, repeats: int = 0, seed: int = 0
) -> float:
    """Expected SI latency of n_tokens tokens: exact, or the mean of `repeats` sampled timelines."""
    _check(acceptance, lookahead, n_tokens)
    if repeats:
        return _sampled(lambda ok: si_times(fw, ok, lookahead), acceptance, n_tokens, repeats, seed)
    return _si_expected(fw, acceptance, lookahead, n_tokens)


def latency_dsi(
    fw: Forwards,
    acceptance: float,
    lookahead: int,
    n_tokens: int,
    sp: int = SERVERS,
    repeats: int = 0,
    seed: int = 0,
    alg1: bool = True,
) -> float:
    """Expected DSI latency on `sp` target servers; a lookahead infeasible on them is refused (the model
    assumes a free server for every block). alg1=False: the block-only coordinator of `_cover`."""
    _check(acceptance, lookahead, n_tokens)
    if not feasible(lookahead, fw.target, fw.draft, sp):
        need = servers_needed(lookahead, fw.target, fw.draft)
        raise ValueError(f"lookahead {lookahead} needs SP {need} > {sp}")
    if repeats:

        def times(ok: Sequence[bool]) -> list[float]:
            return dsi_times(fw, ok, lookahead, alg1)

        return _sampled(times, acceptance, n_tokens, repeats, seed)
    return _dsi_expected(fw, acceptance, lookahead, n_tokens, alg1)


# ---- best lookahead / SP, and the prediction for a deployment ----------------------------------------


@dataclass(frozen=True)
class Choice:
    lookahead: int
    sp: int  # target servers used (SI: 1)
    latency: float


def best_si(
    fw: Forwards, acceptance: float, n_tokens: int, lookaheads: Iterable[int] = SI_LOOKAHEADS, **kw
) -> Choice:
    """SI at its best lookahead (ties: the shortest); kw: repeats, seed."""
    runs = [Choice(k, 1, latency_si(fw, acceptance, k, n_tokens, **kw)) for k in sorted(lookaheads)]
    return min(runs, key=lambda c: c.latency)


def best_dsi(
    fw: Forwards,
    acceptance: float,
    n_tokens: int,
    max_sp: int = SERVERS,
    lookaheads: Iterable[int] | None = None,
    **kw,
) -> Choice:
    """DSI at its best (lookahead, SP): every lookahead feasible on some SP <= max_sp, each on the least
    SP that runs it (more servers would idle). Default lookaheads 1..n_tokens-1 (longer blocks than the
    tokens left are cut anyway). kw: repeats, seed, alg1."""
    ks = sorted(lookaheads or range(1, max(2, n_tokens)))
    ks = [k for k in ks if feasible(k, fw.target, fw.draft, max_sp)]
    if not ks:
        raise ValueError(f"no feasible lookahead on {max_sp} target servers")
    runs = [
        Choice(
            k, servers_needed(k, fw.target, fw.draft), latency_dsi(fw, acceptance, k, n_tokens, max_sp, **kw)
        )
        for k in ks
    ]
    return min(runs, key=lambda c: c.latency)


@dataclass(frozen=True)
class Prediction:
    lookahead: int  # DSI's best
    sp: int  # target servers it keeps busy
    si_lookahead: int
    latency_nonsi: float
    latency_si: float
    latency_dsi: float

    @property
    def speedup_vs_si(self) -> float:
        return self.latency_si / self.latency_dsi

    @property
    def speedup_vs_nonsi(self) -> float:
        return self.latency_nonsi / self.latency_dsi


def predict(
    t_draft: float,
    t_target: float,
    acceptance: float,
    max_sp: int,
    n_tokens: int = 128,
    lookaheads: Iterable[int] = range(1, 65),
    t_target_first: float | None = None,
    t_draft_first: float | None = None,
    alg1: bool = True,
) -> Prediction:
    """For measured latencies (t_draft per drafted token, t_target per target forward, whatever it
    verifies; optional TTFTs) and acceptance rate: DSI's best lookahead and SP on up to max_sp target
    servers, and the expected latencies of non-SI, SI (at its own best lookahead, any of `lookaheads`)
    and DSI for n_tokens tokens. Exact expectations; about 0.1-1 s, so cache it per measurement.
    speedup_vs_si can fall (by < 1 %) below 1 where feasibility forces long DSI blocks: drafts at ~1 % of
    a forward on 7 servers (docs/benchmarks/dsi.md, Fig. 2). alg1=False: a block-only coordinator."""
    fw = Forwards(t_target, t_draft, t_target_first, t_draft_first)
    ks = list(lookaheads)
    si = best_si(fw, acceptance, n_tokens, ks)
    dsi = best_dsi(fw, acceptance, n_tokens, max_sp, ks, alg1=alg1)
    nonsi = latency_nonsi(fw, n_tokens)
    return Prediction(dsi.lookahead, dsi.sp, si.lookahead, nonsi, si.latency, dsi.latency)


# ---- Fig. 2: expected latency per token of a long generation, vectorised -----------------------------


def per_token_si(latency, acceptance, lookahead) -> np.ndarray:
    """SI's expected time per token (target forward = 1; latency = drafter's / target's) as N -> inf:
    an iteration costs k·latency + 1 and yields (1 - a^(k+1)) / (1 - a) tokens."""
    r, a, k = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (latency, acceptance, lookahead)))
    tokens = np.divide(1 - a ** (k + 1), 1 - a, out=np.array(k + 1), where=a < 1)
    return (k * r + 1) / tokens


def _below_cap(r, a, k) -> np.ndarray:
    """E[max(0, c - q)] over synchronisation intervals, c = v·k·r + 1 the uncapped time of a first wrong
    draft at q in block v: what Alg. 1's non-SI chain saves. Only blocks with q < c count, which needs
    k·r > 1 and v <= (k - 1) / (k (1 - r)); closed-form geometric sums block by block."""
    out = np.zeros(r.shape)
    idx = np.flatnonzero((k * r > 1) & (r < 1) & (a < 1))
    v = 1
    while idx.size:
        rr, aa, kk = r.flat[idx], a.flat[idx], k.flat[idx]
        c = v * kk * rr + 1
        lo, hi = (v - 1) * kk + 2, np.minimum(v * kk + 1, np.floor(c))  # q in [lo, hi] has q <= c
        live = hi >= lo
        idx, rr, aa, kk, c, lo, hi = (x[live] for x in (idx, rr, aa, kk, c, lo, hi))
        mass = aa ** (lo - 1) - aa**hi  # P(lo <= q <= hi), P(q) = a^(q-1) (1 - a)
        first = aa ** (lo - 1) * (lo - 1) - aa**hi * hi + mass / (1 - aa)  # sum of q·P(q) there
        out.flat[idx] += c * mass - first
        v += 1
    return out


def per_token_dsi(latency, acceptance, lookahead) -> np.ndarray:
    """DSI's expected time per token as N -> inf (feasibility not checked here). An interval ends at the
    first wrong draft, q ~ geometric (q tokens), and costs min(ceil((q-1)/k)·k·r + 1, q), whose mean is
    1 + k·r·a / (1 - a^k) less `_below_cap`. Acceptance 1: drafting only."""
    r, a, k = np.broadcast_arrays(*(np.asarray(x, dtype=float) for x in (latency, acceptance, lookahead)))
    blocks = np.divide(a, 1 - a**k, out=np.zeros(r.shape), where=a < 1)  # E[ceil((q-1)/k)]
    per = (1 + k * r * blocks - _below_cap(r, a, k)) * (1 - a)
    per = np.where(a < 1, per, np.minimum(r, 1.0))
    return np.where(r < 1, per, 1.0)  # a drafter as slow as the target: DSI is non-SI


@dataclass(frozen=True)
class Fig2Grid:
    """Expected time per token (target forward = 1) at each (drafter latency, acceptance); non-SI is 1.
    si: best lookahead among those feasible for DSI (the paper: "in all the simulations, we only used
    feasible lookahead values"); si_any: best among all lookaheads."""

    latencies: np.ndarray  # rows
    acceptances: np.ndarray  # columns
    max_sp: int
    si: np.ndarray
    si_any: np.ndarray
    dsi: np.ndarray
    si_lookahead: np.ndarray
    si_any_lookahead: np.ndarray
    dsi_lookahead: np.ndarray
    dsi_sp: np.ndarray

    def dsi_slower(self, si: np.ndarray | None = None, rtol: float = 1e-12) -> np.ndarray:
        """Cells where DSI is slower than min(SI, non-SI) beyond float rounding."""
        base = np.minimum(self.si if si is None else si, 1.0)
        return self.dsi > base * (1 + rtol)


def fig2_grid(
    latencies: Sequence[float] = FIG2_LATENCIES,
    acceptances: Sequence[float] = FIG2_ACCEPTANCES,
    lookaheads: Sequence[int] = FIG2_LOOKAHEADS,
    max_sp: int = SERVERS,
) -> Fig2Grid:
    """The paper's Fig. 2 grid (default 100 latencies x 101 acceptances x 200 lookaheads), one latency
    row at a time (arrays of acceptances x lookaheads)."""
    a = np.asarray(acceptances, dtype=float)[:, None]
    ks = np.asarray(list(lookaheads), dtype=float)[None, :]
    rows = []
    for r in np.asarray(latencies, dtype=float):
        need = np.array([servers_needed(int(k), 1.0, r) for k in ks[0]])
        ok = need <= max_sp
        si_all = per_token_si(r, a, ks)
        si = np.where(ok, si_all, np.inf)
        dsi = np.where(ok, per_token_dsi(r, a, ks), np.inf)
        best_si, best_any, best_dsi = si.argmin(1), si_all.argmin(1), dsi.argmin(1)
        lines = np.arange(len(a))
        times = (si[lines, best_si], si_all[lines, best_any], dsi[lines, best_dsi])
        rows.append((*times, ks[0][best_si], ks[0][best_any], ks[0][best_dsi], need[best_dsi]))
    cols = [np.stack(c) for c in zip(*rows, strict=True)]
    times, lookahead = cols[:3], [c.astype(int) for c in cols[3:]]
    return Fig2Grid(np.asarray(latencies, dtype=float), a[:, 0], max_sp, *times, *lookahead)


# ---- Table 2 -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Table2Row:
    """A row of the paper's Table 2, with the TTFT/TPOT ratios of its App. E.2 Table 3 (None: not
    given there, taken as 1)."""

    target: str
    drafter: str
    dataset: str
    target_ms: float  # target TPOT
    drafter_ms: float  # drafter TPOT as printed (2 digits)
    drafter_pct: float  # drafter TPOT / target TPOT in %, as printed (3 digits: the one we use)
    acceptance: float
    paper: float  # the paper's DSI-vs-SI speedup
    target_ttft: float | None
    drafter_ttft: float | None

    def forwards(self) -> Forwards:
        draft = self.target_ms * self.drafter_pct / 100
        target_first = self.target_ms * (self.target_ttft or 1.0)
        return Forwards(self.target_ms, draft, target_first, draft * (self.drafter_ttft or 1.0))


TABLE2 = (
    Table2Row("Vicuna-13B", "Vicuna-68M", "CNN-DM", 37.7, 2.5, 6.5, 0.63, 1.47, 5.36, 1.04),
    Table2Row("Vicuna-13B", "Vicuna-68M", "Alpaca", 33.3, 2.5, 7.4, 0.58, 1.41, 1.15, 1.05),
    Table2Row("Vicuna-7B", "Vicuna-68M", "CNN-DM", 29.4, 2.5, 8.4, 0.67, 1.29, 4.53, 1.06),
    Table2Row("Vicuna-7B", "Vicuna-68M", "Alpaca", 26.0, 2.5, 9.5, 0.59, 1.70, 1.19, 1.06),
    Table2Row("Starcoder-15B", "Starcoder-168M", "HumanEval", 20.6, 6.8, 32.3, 0.93, 1.92, 1.35, 1.19),
    Table2Row("Starcoder-15B", "Starcoder-168M", "MBPP", 21.0, 6.8, 32.9, 0.90, 1.66, 1.54, 1.20),
    Table2Row("Phi3-14B", "Phi3-4B", "HumanEval", 52.1, 34.0, 65.3, 0.95, 1.41, 1.29, 1.23),
    Table2Row("Phi3-14B", "Phi3-4B", "MBPP", 52.2, 34.3, 65.8, 0.94, 1.37, 1.43, 1.27),
    Table2Row("Phi3-14B", "Phi3-4B", "CNN-DM", 52.4, 34.6, 66.0, 0.93, 1.39, 4.77, 3.88),
    Table2Row("Phi3-14B", "Phi3-4B", "Alpaca", 49.6, 33.4, 67.4, 0.87, 1.60, None, None),
)


@dataclass(frozen=True)
class Table2Result:
    row: Table2Row
    nonsi: float  # ms
    si: Choice
    dsi: Choice

    @property
    def speedup(self) -> float:
        return self.si.latency / self.dsi.latency

    @property
    def ratio(self) -> float:
        """Ours over the paper's."""
        return self.speedup / self.row.paper


def table2_row(
    row: Table2Row, n_tokens: int = TABLE2_TOKENS, max_sp: int = SERVERS, repeats: int = 0, seed: int = 0
) -> Table2Result:
    """The paper's protocol: SI at its best of lookaheads 1, 5, 10; DSI at its best feasible lookahead
    and SP <= max_sp; n_tokens tokens including the first (TTFT)."""
    fw = row.forwards()
    kw = {"repeats": repeats, "seed": seed}
    si = best_si(fw, row.acceptance, n_tokens, **kw)
    dsi = best_dsi(fw, row.acceptance, n_tokens, max_sp, **kw)
    return Table2Result(row, latency_nonsi(fw, n_tokens), si, dsi)


def emulator_latencies(
    t_target: float, t_draft: float, acceptance: float, lookahead: int, n_tokens: int, max_run: int = 20
) -> tuple[float, float]:
    """Expected (SI, DSI) latency under the accounting of the authors' emulator as changed on their later
    branch `add_1_from_target` (keyboardAnt/distributed-speculative-inference, commits 0e688ec and 1fb0623,
    July 2024; TPOT only), which is not the code that produced the paper's Table 2: that one, at 057adbb,
    commits C tokens per cycle in ⌊C/k⌋+1 blocks and ends the last cycle at its first target call, and is
    ported in specmesh.core.dsi_emulator. Here, per cycle between rejections, C = min(geometric run of
    accepted drafts, max_run) and C + 1 tokens; v = ceil(C/k) blocks are drafted, the last cycle paid in
    full. SI pays a blocking target forward before drafting and then v (draft k + verify): no bonus token
    for a fully accepted block and an extra forward per cycle; DSI pays v·k·t_draft + one forward, as in
    our model."""
    runs = np.arange(max_run + 1)
    v = -(-runs // lookahead)
    si_cost = t_target + v * (lookahead * t_draft + t_target)
    dsi_cost = v * lookahead * t_draft + t_target
    pmf = accepted_pmf(acceptance, max_run)
    si, dsi = np.zeros(n_tokens + 1), np.zeros(n_tokens + 1)
    for n in range(1, n_tokens + 1):
        rest = np.maximum(n - runs - 1, 0)
        si[n] = pmf @ (si_cost + si[rest])
        dsi[n] = pmf @ (dsi_cost + dsi[rest])
    return float(si[n_tokens]), float(dsi[n_tokens])


def emulator_speedup(row: Table2Row, n_tokens: int = TABLE2_TOKENS, max_sp: int = SERVERS) -> float:
    """Table 2's DSI-vs-SI figure with `emulator_latencies` (same lookahead searches as `table2_row`)."""
    t, d, a = row.target_ms, row.target_ms * row.drafter_pct / 100, row.acceptance
    si = min(emulator_latencies(t, d, a, k, n_tokens)[0] for k in SI_LOOKAHEADS)
    ks = [k for k in range(1, n_tokens) if feasible(k, t, d, max_sp)]
    return si / min(emulator_latencies(t, d, a, k, n_tokens)[1] for k in ks)


# ---- Fig. 1 / Table 1 --------------------------------------------------------------------------------

TABLE1_PAPER = {
    "non-SI": (2, 4, 8, 9),
    "SI worst": (1, 4, 7, 8),
    "SI best": (2, 8, 14, 16),
    "DSI worst": (2, 4, 8, 9),
    "DSI best": (8, 26, 50, 58),
}


def fig1_timelines(draft: Fraction = Fraction(1, 7), n_tokens: int = 80) -> dict[str, list[Fraction]]:
    """Commit times (target forward = 1, exact fractions) of Fig. 1's timelines, lookahead 1: worst
    case every draft rejected, best case every draft accepted. DSI at lookahead 1 needs SP 1/draft."""
    fw = Forwards(Fraction(1), draft)
    out = {"non-SI": nonsi_times(fw, n_tokens)}
    for case, ok in (("worst", False), ("best", True)):
        out[f"SI {case}"] = si_times(fw, [ok] * n_tokens, 1)
        out[f"DSI {case}"] = dsi_times(fw, [ok] * n_tokens, 1)
    return out


def fig1_marks(timelines: dict[str, list[Fraction]]) -> tuple[Fraction, ...]:
    """t1..t4: the ends of non-SI's 2nd forward, SI's 4th iteration, non-SI's 8th forward and SI's 8th
    iteration. Our reading: the figure does not label them, but with a drafter at 1/7 of the target
    (the caption's "14%") these are the instants at which every count of Table 1 holds."""
    nonsi, si = timelines["non-SI"], timelines["SI worst"]  # SI worst: one token per iteration
    return nonsi[1], si[3], nonsi[7], si[7]


def fig1_table(draft: Fraction = Fraction(1, 7)) -> dict[str, tuple[int, ...]]:
    """Tokens committed by t1..t4 (a token counts from the end of the forward that decides it)."""
    timelines = fig1_timelines(draft)
    marks = fig1_marks(timelines)
    return {name: tuple(sum(t <= mark for t in times) for mark in marks) for name, times in timelines.items()}
