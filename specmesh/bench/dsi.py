"""`specmesh bench dsi`: the DSI paper's simulations (Timor et al., arXiv:2405.14105) redone with the
analytic simulator specmesh.core.dsi_sim, written to docs/benchmarks/dsi.md with its plots.

Table 2 (DSI vs SI on ten model pairs, from their latencies and acceptance rates), Fig. 2 (the
drafter latency x acceptance grid: where SI loses to non-SI, and that DSI never does) and Fig. 1 /
Table 1 (tokens done at t1..t4). Every number in the report comes from this run.
"""

from __future__ import annotations

import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from specmesh.core import dsi_emulator as emu
from specmesh.core import dsi_sim as sim

TOLERANCE = 0.10  # a Table 2 row is reproduced when ours is within 10 % of the paper's figure
PINK = (248 / 256, 24 / 256, 148 / 256, 1.0)  # the paper's colour for slowdowns
# Per-cycle process restart (ms, SI and DSI) that the authors' emulator keeps in its wall time: measured on
# our 2-core VM by running their code (docs/benchmarks/dsi_table2_causes.md §2), a constant here.
RESTART_MS = (14.0, 17.0)
EMULATOR_REPEATS = 1000  # generations for the authors' emulator when --repeats 0 (it has no exact mode)


# ---- computations --------------------------------------------------------------------------------


def _within(ratio: float) -> bool:
    return abs(ratio - 1) <= TOLERANCE


def table2_rows(repeats: int, seed: int) -> list[dict]:
    """Each Table 2 row: the paper's figure, ours (exact), ours sampled at the same lookaheads with
    common random numbers, ours under the later emulator accounting (`sim.emulator_speedup`), and the
    authors' emulator that produced the figure (`authors_emulator`)."""
    out = []
    for row in sim.TABLE2:
        res = sim.table2_row(row)
        fw, n = row.forwards(), sim.TABLE2_TOKENS
        sampled = None
        if repeats:
            si = sim.latency_si(fw, row.acceptance, res.si.lookahead, n, repeats, seed)
            dsi = sim.latency_dsi(fw, row.acceptance, res.dsi.lookahead, n, sim.SERVERS, repeats, seed)
            sampled = si / dsi
        emulator = sim.emulator_speedup(row)
        authors = authors_emulator(row, repeats or EMULATOR_REPEATS, seed)
        out.append(
            {
                "target": row.target,
                "drafter": row.drafter,
                "dataset": row.dataset,
                "target_tpot_ms": row.target_ms,
                "drafter_tpot_ms": round(fw.draft, 3),
                "drafter_latency_pct": row.drafter_pct,
                "acceptance": row.acceptance,
                "ttft_ratio_target": row.target_ttft,
                "ttft_ratio_drafter": row.drafter_ttft,
                "paper_speedup": row.paper,
                "speedup": res.speedup,
                "ratio": res.ratio,
                "within_10pct": _within(res.ratio),
                "si_lookahead": res.si.lookahead,
                "dsi_lookahead": res.dsi.lookahead,
                "dsi_sp": res.dsi.sp,
                "latency_ms": {"nonsi": res.nonsi, "si": res.si.latency, "dsi": res.dsi.latency},
                "sampled_speedup": sampled,
                "emulator_speedup": emulator,
                "authors_emulator": authors,
            }
        )
    return out


def _choice(run: emu.EmulatorRun) -> dict:
    return {"si_lookahead": run.si_lookahead, "dsi_lookahead": run.dsi_lookahead, "dsi_sp": run.sp}


def authors_emulator(row: sim.Table2Row, repeats: int, seed: int) -> dict:
    """The row on the port of the authors' emulator (specmesh.core.dsi_emulator): the paper's TPOT
    feasibility rule without restart cost; their TTFT-based config check, without and with the measured
    restart cost; that on their own draws (seed 42, one run); and the SI restart costs (DSI's 3 ms more,
    as measured) that bring the TTFT-rule figure within 10 % of the paper's."""
    tpot = emu.emulator_run(row, repeats, seed)
    ttft = emu.emulator_run(row, repeats, seed, ttft_rule=True, restart_ms=RESTART_MS)
    seed42 = emu.emulator_run(row, 1, emu.AUTHORS_SEED, ttft_rule=True, restart_ms=RESTART_MS)
    extra = RESTART_MS[1] - RESTART_MS[0]
    high, low = (emu.restart_for(ttft, f * row.paper, extra) for f in (1 - TOLERANCE, 1 + TOLERANCE))
    return {
        "tpot_rule": tpot.speedup,
        "ttft_rule": ttft.si_ms / ttft.dsi_ms,
        "ttft_rule_restart": ttft.speedup,
        "seed42_ttft_rule_restart": seed42.speedup,
        "tpot_rule_choice": _choice(tpot),
        "ttft_rule_choice": _choice(ttft),
        "restart_ms": list(RESTART_MS),
        "cycles": tpot.cycles,
        "seed42_cycles": seed42.cycles,
        "restart_ms_within_10pct": [max(low, 0.0), high] if high >= 0 else None,
    }


def grid_summary(grid: sim.Fig2Grid, seconds: float) -> dict:
    slower, slower_any = grid.dsi_slower(), grid.dsi_slower(grid.si_any)
    excess = grid.dsi / np.minimum(grid.si_any, 1.0)
    return {
        "latencies": len(grid.latencies),
        "acceptances": len(grid.acceptances),
        "lookaheads": len(sim.FIG2_LOOKAHEADS),
        "max_sp": grid.max_sp,
        "seconds": seconds,
        "cells": int(grid.dsi.size),
        "dsi_slower_cells": int(slower.sum()),
        "si_slower_than_nonsi_share": float((grid.si > 1).mean()),
        "si_any_slower_than_nonsi_share": float((grid.si_any > 1).mean()),
        "max_speedup_vs_best_baseline": float((np.minimum(grid.si, 1.0) / grid.dsi).max()),
        "any_si": {
            "dsi_slower_cells": int(slower_any.sum()),
            "max_excess": float(excess.max() - 1),
            "latency_range": _range(grid.latencies[slower_any.any(1)]),
            "acceptance_range": _range(grid.acceptances[slower_any.any(0)]),
        },
    }


def _range(values: np.ndarray) -> list[float] | None:
    return [float(values.min()), float(values.max())] if values.size else None


def _span(bounds: list[float]) -> str:
    low, high = bounds
    return f"{low:.2f}" if low == high else f"{low:.2f}-{high:.2f}"


# ---- markdown --------------------------------------------------------------------------------------


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cells) + " |" for cells in body]


def _para(text: str) -> str:
    """One markdown paragraph from an indented triple-quoted string."""
    return " ".join(text.split())


TABLE2_INTRO = """
    {n} tokens per generation, the first at TTFT (App. E.2 Table 3's TTFT/TPOT ratio; Phi3 on Alpaca is
    not in that table, so TTFT = TPOT there), the others at TPOT. The drafter's TPOT is the table's drafter
    latency % of the target's (three digits, more than its ms column). SI takes its best lookahead of {si};
    DSI its best feasible lookahead on SP <= {sp} target servers (SP: the least that runs it). Ours: exact
    expectations. Sampled: the same lookaheads, {repeats} sampled generations, SI and DSI on the same
    acceptance draws (seed {seed}). Emulator acct.: our model with the accounting of the authors' later
    branch (below). Authors' emulator: a deterministic port of the code that produced the paper's figures
    (specmesh/core/dsi_emulator.py), {emu_repeats} generations whose draws both arms share (seed {seed}),
    Table 3's TTFTs, SI lookahead {si}, DSI lookahead {si} x SP <= {sp}; *TPOT rule*: DSI configurations
    feasible on TPOTs, as the paper states, and no restart cost; *TTFT rule + restart*: the authors' own
    config check, which uses the TTFTs, and the per-cycle process restart their wall time holds, {restart}
    ms (SI / DSI) as measured on our VM. ✅: within 10 % of the paper's figure.
"""

TABLE2_WHY = """
    **Why the rows differ.** Table 2's figures are not outputs of the analytic cost model: the paper
    measured the wall-clock time of a multithreaded emulator in which every forward is a sleep of its
    latency (§4; the cost model is used only for Fig. 2). [dsi_table2_causes.md](dsi_table2_causes.md) sets
    out how its code (keyboardAnt/distributed-speculative-inference at commit 057adbb) produced them, and
    checks each row's cause; the *Authors' emulator* columns are its accounting replayed in virtual time.
    That accounting differs from the paper's cost model, which ours follows (SI as in App. E.1: draft k,
    verify, commit the accepted drafts plus the target's token): a generation runs in cycles, one OS process
    each, that commit the run of accepted drafts (capped at 20) and no target token; SI blocks on a target
    call on the committed prefix at the start of every cycle; a cycle takes floor(C/k)+1 blocks, and the
    last cycle ends at its first target call. This raises every Vicuna row from about 1.2x to about 1.7x.
    Two things the paper does not state lower some rows again: the authors' config check requires SP >=
    ceil(TTFT_target / (k TTFT_drafter)), which on CNN-DM (TTFT 4.5-5.4x TPOT) forces long DSI blocks, and
    each cycle's process restart (fork, shared-dict proxies, pool start, kill, join) stays in the measured
    time, which matters for rows with many short cycles. The paper's driver for the table is unpublished,
    so which rule and grid it used cannot be checked, and no one setting reproduces every row. `Emulator
    acct.` (`emulator_latencies` in specmesh/core/dsi_sim.py) follows the authors' later branch
    `add_1_from_target` instead (C+1 tokens and ceil(C/k) blocks per cycle, the last cycle paid in full),
    which is not the code that produced the paper.
"""


def _cause(r: dict, rows: dict[tuple[str, str], dict]) -> str:
    """The checked cause of the row's difference (dsi_table2_causes.md §3), with this run's figures; the
    measured constants (restart cost, their code's wall-clock results) come from that doc."""
    e = r["authors_emulator"]
    x = {
        "ours": r["speedup"],
        "tpot": e["tpot_rule"],
        "ttft0": e["ttft_rule"],
        "ttft": e["ttft_rule_restart"],
        "seed42": e["seed42_ttft_rule_restart"],
        "paper": r["paper_speedup"],
    }
    f = {name: f"{value:.2f}x" for name, value in x.items()}
    ratio, cycles = r["ttft_ratio_target"], e["cycles"]
    k, sp = e["ttft_rule_choice"]["dsi_lookahead"], e["ttft_rule_choice"]["dsi_sp"]
    restart = e["restart_ms_within_10pct"]
    match r["target"], r["dataset"]:
        case "Vicuna-13B", "CNN-DM":
            return (
                f"Partly explained: the emulator's accounting raises ours ({f['ours']}) to {f['tpot']}; "
                f"the authors' TTFT-based config check (TTFT {ratio}x TPOT) admits DSI only from k = {k} "
                f"(SP {sp}), giving {f['ttft0']}, {f['ttft']} with the restart cost; the paper's figure lies "
                "between these settings, and which one its unpublished driver used cannot be known."
            )
        case "Vicuna-13B", "Alpaca":
            return (
                f"The per-cycle process restart: about {cycles:.0f} short cycles pay it in both arms, which "
                f"at the {RESTART_MS[0]:.0f}/{RESTART_MS[1]:.0f} ms measured on our VM lowers the "
                f"emulator's {f['tpot']} to {f['ttft']}; within 10 % for an SI restart cost of "
                f"{restart[0]:.1f}-{restart[1]:.1f} ms per cycle (DSI's 3 ms more)."
            )
        case "Vicuna-7B", "CNN-DM":
            return (
                f"The TTFT-based config check plus the restart cost: with TTFT {ratio}x TPOT their check "
                f"admits DSI only k = {k}, SP = {sp}, giving {f['ttft']} (their code run here: 1.23x, "
                f"measured); our cost model's match ({f['ours']}) is a coincidence of two larger, opposite "
                "effects."
            )
        case "Vicuna-7B", "Alpaca":
            other = rows["Vicuna-13B", "Alpaca"]["authors_emulator"]["restart_ms_within_10pct"]
            return (
                f"Not reproducible together with Vicuna-13B/Alpaca: the emulator's accounting gives "
                f"{f['tpot']}, within 10 % only for an SI restart cost of at most {restart[1]:.1f} ms per "
                f"cycle ({f['ttft']} at the measured cost), while Vicuna-13B/Alpaca, with nearly the same "
                f"parameters, needs at least {other[0]:.1f} ms: no one restart cost fits both rows."
            )
        case "Starcoder-15B", "HumanEval":
            return (
                f"Not reproducible by any setting of the authors' code: the most it gives is {f['tpot']}, "
                "within 10 % only with no restart cost, which their code does pay (with it "
                f"{f['ttft']}, {f['seed42']} on their seed-42 draws; their code run here: 1.52x, "
                f"measured); nothing in it reaches the paper's {f['paper']}."
            )
        case "Phi3-14B", "CNN-DM":
            return (
                f"The emulator's accounting ({f['tpot']}; {f['ttft']} with the TTFT rule and restart cost) "
                f"plus the authors' single run on seed 42, which draws only {e['seed42_cycles']:.0f} "
                f"cycles and gives {f['seed42']}."
            )
        case "Phi3-14B", "HumanEval":
            return (
                f"The emulator's accounting ({f['tpot']}); with about {cycles:.0f} cycles the restart cost "
                f"hardly matters ({f['ttft']})."
            )
    return f"The emulator's accounting: {f['tpot']}; {f['ttft']} with the TTFT rule and the restart cost."


def _mark(value: float, paper: float) -> str:
    return f"{value:.2f}x" + (" ✅" if _within(value / paper) else "")


def _table2_md(rows: list[dict], repeats: int, seed: int) -> list[str]:
    header = ["Target", "Drafter", "Dataset", "Target TPOT ms", "Drafter %", "Accept.", "Paper", "Ours",
              "Ours / paper", "Within 10 %", "SI k", "DSI k, SP", f"Sampled ({repeats} runs)",
              "Emulator acct.", "Authors' emulator, TPOT rule", "Authors' emulator, TTFT rule + restart",
              "Cause (checked)"]  # fmt: skip
    by_key = {(r["target"], r["dataset"]): r for r in rows}
    body = [
        [
            r["target"],
            r["drafter"],
            r["dataset"],
            f"{r['target_tpot_ms']:.1f}",
            f"{r['drafter_latency_pct']:.1f}",
            f"{r['acceptance']:.2f}",
            _x(r["paper_speedup"]),
            _x(r["speedup"]),
            f"{r['ratio']:.2f}",
            "✅" if r["within_10pct"] else "❌",
            str(r["si_lookahead"]),
            f"{r['dsi_lookahead']}, {r['dsi_sp']}",
            _x(r["sampled_speedup"]),
            _x(r["emulator_speedup"]),
            _mark(r["authors_emulator"]["tpot_rule"], r["paper_speedup"]),
            _mark(r["authors_emulator"]["ttft_rule_restart"], r["paper_speedup"]),
            _cause(r, by_key),
        ]
        for r in rows
    ]
    ratios = [r["ratio"] for r in rows]
    paper = [r["paper_speedup"] for r in rows]
    others = {
        "Emulator acct.": [r["emulator_speedup"] for r in rows],
        "the authors' emulator, TPOT rule": [r["authors_emulator"]["tpot_rule"] for r in rows],
        "the authors' emulator, TTFT rule + restart": [
            r["authors_emulator"]["ttft_rule_restart"] for r in rows
        ],
    }
    intro = TABLE2_INTRO.format(
        n=sim.TABLE2_TOKENS,
        si=", ".join(map(str, sim.SI_LOOKAHEADS)),
        sp=sim.SERVERS,
        repeats=repeats,
        seed=seed,
        emu_repeats=repeats or EMULATOR_REPEATS,
        restart="/".join(f"{x:.0f}" for x in RESTART_MS),
    )
    tally = f"Within 10 %: {sum(map(_within, ratios))} of {len(rows)} rows with our cost model (ours / paper "
    tally += f"{min(ratios):.2f}-{max(ratios):.2f})"
    for name, speedups in others.items():
        rs = [s / p for s, p in zip(speedups, paper, strict=True)]
        tally += f"; {sum(map(_within, rs))} of {len(rows)} with {name} ({min(rs):.2f}-{max(rs):.2f})"
    return ["## Table 2: DSI vs SI on the paper's model pairs", "", _para(intro), "", *_table(header, body),
            "", tally + ".", "", _para(TABLE2_WHY), ""]  # fmt: skip


GRID_INTRO = """
    The paper's grid in full: drafter latency 0.01-1 (x target) in {latencies} steps, acceptance 0-1 in
    {acceptances} steps, lookahead 1-{lookaheads}, SP <= {max_sp}: {cells} cells, each at its best lookahead
    per algorithm ({seconds:.1f} s). Expected time per token of a long generation (N -> infinity; the paper
    does not state N for Fig. 2), in closed form, so the comparison is exact rather than sampled. As in the
    paper ("in all the simulations, we only used feasible lookahead values", which is also what the
    authors' simulator does), both SI and DSI choose among the lookaheads feasible on {max_sp} target
    servers.
"""

GRID_ANY_SI = """
    - If SI may use any lookahead while DSI keeps to feasible ones, DSI is slower in {cells} cells, by at
    most {excess:.2f} % ({where}). There feasibility forces long DSI blocks (at least ceil(1 / (7 x
    latency)) drafts), so a rejection in the first block is found only once the whole block is drafted,
    while SI may verify after a few drafts.
"""

TABLE1_INTRO = """
    The timelines simulated with lookahead 1 (worst case: every draft rejected; best case: every draft
    accepted). Assumptions, since the figure gives no numbers: the drafter takes 1/7 of a target forward
    (the caption's "14%"), and t1..t4 are the ends of non-SI's 2nd forward, SI's 4th iteration, non-SI's
    8th forward and SI's 8th iteration (exact fractions; a token counts from the end of the forward that
    decides it). With the drafter at 0.14 of the target instead, the same reading gives {alt}.
"""

MODEL = """
    specmesh/core/dsi_sim.py implements the paper's cost model: a forward is a wait of its latency (a
    target forward verifying k drafts costs one forward), each drafted token is accepted independently,
    and the first forward of each model costs its TTFT. Non-SI: TTFT + (N-1) TPOT. SI: draft k, verify,
    commit the accepted drafts and the target's token. DSI (Alg. 1): the drafter never waits; a block's
    verification starts as soon as it is drafted and also decides the position after it, and a target
    forward starts on the committed prefix at every synchronisation, so the first wrong draft at the q-th
    position is known at ceil((q-1)/k) k t_draft + t_target, but no later than q target forwards (Alg. 1's
    target-only chain, Theorem 1); lookaheads only with ceil(t_target / (k t_draft)) <= SP. Expectations
    are exact (dynamic programmes over the tokens left; per-token closed forms for the grid); sampled runs
    use per-position acceptance draws shared by SI and DSI (the coupling of Theorem 2). `predict()` there
    gives DSI's best lookahead and SP and the expected latencies for measured latencies and acceptance.
"""


def _grid_md(g: dict, png: str) -> list[str]:
    any_si = g["any_si"]
    where = "none"
    if any_si["dsi_slower_cells"]:
        spans = _span(any_si["latency_range"]), _span(any_si["acceptance_range"])
        where = "all at drafter latency {} and acceptance {}".format(*spans)
    slower = f"**DSI slower than min(SI, non-SI): {g['dsi_slower_cells']} of {g['cells']} cells**"
    share, share_any = 100 * g["si_slower_than_nonsi_share"], 100 * g["si_any_slower_than_nonsi_share"]
    any_si_text = GRID_ANY_SI.format(cells=any_si["dsi_slower_cells"], excess=100 * any_si["max_excess"],
                                     where=where)  # fmt: skip
    return [
        "## Fig. 2: drafter latency x acceptance",
        "",
        _para(GRID_INTRO.format(**g)),
        "",
        f"- {slower} (beyond float rounding, relative 1e-12).",
        f"- SI slower than non-SI in {share:.1f} % of the grid ({share_any:.1f} % if SI may use any "
        f"lookahead 1-{g['lookaheads']}): roughly wherever the acceptance rate is below the drafter's "
        "relative latency.",
        f"- DSI up to {g['max_speedup_vs_best_baseline']:.2f}x faster than min(SI, non-SI) (paper: 1.6x).",
        _para(any_si_text),
        "",
        f"![SI/non-SI, DSI/SI, DSI/non-SI and DSI/min(SI, non-SI)]({png})",
        "",
        "Latency ratios X/Y (below 1: X is faster); pink marks X slower than Y.",
        "",
    ]


def _table1_md(ours: dict[str, tuple[int, ...]], png: str) -> list[str]:
    paper = {name: "/".join(map(str, counts)) for name, counts in sim.TABLE1_PAPER.items()}
    at_014 = sim.fig1_table(Fraction(14, 100))
    alt = [f"{name} {'/'.join(map(str, c))}" for name, c in at_014.items() if c != sim.TABLE1_PAPER[name]]
    body = [
        [name, paper[name], "/".join(map(str, counts)), "✅" if counts == sim.TABLE1_PAPER[name] else "❌"]
        for name, counts in ours.items()
    ]
    return [
        "## Fig. 1 / Table 1: tokens done at t1..t4",
        "",
        _para(TABLE1_INTRO.format(alt=", ".join(alt) or "the same counts")),
        "",
        *_table(["Case", "Paper", "Ours", "Same"], body),
        "",
        f"![Fig. 1 timelines]({png})",
        "",
    ]


# ---- plots -----------------------------------------------------------------------------------------


def _pyplot():
    """pyplot on the Agg backend (no display on benchmark hosts)."""
    try:
        import matplotlib
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the DSI plots need matplotlib: pip install 'specmesh[bench]'") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _heatmaps(grid: sim.Fig2Grid, path: Path) -> str:
    plt = _pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    best = np.minimum(grid.si, 1.0)
    panels = [("SI / non-SI", grid.si), ("DSI / SI", grid.dsi / grid.si), ("DSI / non-SI", grid.dsi),
              ("DSI / min(SI, non-SI)", grid.dsi / best)]  # fmt: skip
    top = max(2.0, max(float(z.max()) for _, z in panels))
    bounds = [*np.linspace(0, 1, 11)[:-1], 1 + 1e-9, top]  # 1 exactly (e.g. DSI = non-SI) is not pink
    cmap = ListedColormap([*plt.get_cmap("viridis")(np.linspace(0, 1, 10)), PINK])
    norm = BoundaryNorm(bounds, cmap.N)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2))
    for ax, (title, z) in zip(axes, panels, strict=True):
        mesh = ax.pcolormesh(grid.latencies, grid.acceptances, z.T, cmap=cmap, norm=norm, shading="nearest")
        ax.set(title=title, xlabel="drafter latency / target latency", ylabel="acceptance rate")
    fig.colorbar(mesh, ax=axes, ticks=bounds[:-1], label="latency ratio (pink: > 1, slower)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path.name


def _timeline_plot(path: Path) -> str:
    plt = _pyplot()
    timelines = sim.fig1_timelines()
    marks = [float(t) for t in sim.fig1_marks(timelines)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, times in timelines.items():
        xs = [0.0, *map(float, times)]
        style = (
            {"ls": "--", "lw": 3, "label": "non-SI (= DSI worst)"} if name == "non-SI" else {"label": name}
        )
        ax.step(xs, range(len(xs)), where="post", **style)
    for i, t in enumerate(marks, 1):
        ax.axvline(t, color="grey", ls=":", lw=1)
        ax.text(t, 61, f"t{i}", ha="center", fontsize=8)
    ax.set(xlim=(0, marks[-1] + 0.5), ylim=(0, 64), xlabel="time (target forwards)", ylabel="tokens done")
    ax.set_title("Fig. 1: lookahead 1, drafter at 1/7 of the target")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


# ---- the command -----------------------------------------------------------------------------------


def bench_dsi(out: Path, repeats: int = 1000, seed: int = 0) -> dict:
    """Run all three reproductions, write out/dsi.md and its plots; returns what --json writes."""
    start = time.perf_counter()
    rows = table2_rows(repeats, seed)
    t0 = time.perf_counter()
    grid = sim.fig2_grid()
    summary = grid_summary(grid, time.perf_counter() - t0)
    table1 = sim.fig1_table()
    out.mkdir(parents=True, exist_ok=True)
    heat, line = _heatmaps(grid, out / "dsi_heatmaps.png"), _timeline_plot(out / "dsi_timeline.png")
    lines = [
        "# DSI: the paper's simulations, reproduced",
        "",
        'Timor et al., "Distributed Speculative Inference (DSI) of Large Language Models is Provably '
        'Faster" (arXiv:2405.14105), with the analytic simulator specmesh/core/dsi_sim.py. Generated by '
        f"`specmesh bench dsi --repeats {repeats} --seed {seed}` in {time.perf_counter() - start:.1f} s; "
        "every number below comes from that run.",
        "",
        *_table2_md(rows, repeats, seed),
        *_grid_md(summary, heat),
        *_table1_md(table1, line),
        "## The model",
        "",
        _para(MODEL),
        "",
    ]
    (out / "dsi.md").write_text("\n".join(lines))
    for r in rows:
        mark = "ok " if r["within_10pct"] else "off"
        e = r["authors_emulator"]
        print(f"{mark} {r['target']:>13} {r['dataset']:<9} paper {r['paper_speedup']:.2f}x ours "
              f"{r['speedup']:.2f}x (emulator acct. {r['emulator_speedup']:.2f}x; authors' emulator "
              f"{e['tpot_rule']:.2f}x, + TTFT rule, restart {e['ttft_rule_restart']:.2f}x)")  # fmt: skip
    slower = f"{summary['dsi_slower_cells']} of {summary['cells']} cells"
    print(f"Fig. 2: DSI slower than min(SI, non-SI) in {slower}")
    print(f"Table 1: {'reproduced' if table1 == sim.TABLE1_PAPER else 'DIFFERS'}; wrote {out / 'dsi.md'}")
    table1_out = {k: {"paper": sim.TABLE1_PAPER[k], "ours": v} for k, v in table1.items()}
    return {"table2": rows, "fig2": summary, "table1": table1_out}
