"""`specmesh bench dsi-stack`: DSI against SI and plain decoding through a real stack, next to the
DSI simulation's prediction and the closed form for the same latencies and the measured acceptance.

Several real verifiers cannot run in parallel on a 2-core machine, so the stack runs tiny models
(specmesh.bench.tiny) whose services take emulated per-forward latencies (`--forward-latency-ms`:
every forward lasts at least that long, the rest slept, so replicas overlap like separate GPUs
would): by default a 40 ms target and drafter / target cost ratios of 0.05, 0.15 and 0.5, or
(--table2) rows of the DSI paper's Table 2. One `specmesh up` per row with one drafter and
max(verifiers) verifiers; per row: plain decoding, SI (chain of `lookahead`; serial rounds unless
--pipeline says otherwise), DSI with 1..N verifications in flight, and DSI with its shape left to
the gateway. Greedy decoding, so acceptance is the exact-match rate.

The predictions: per-token acceptance a from SI's accepted tokens per round (the truncated
geometric mean inverted); SI's time per token (L·t_d + t_t) / (1 + a + ... + a^L); DSI's from the
virtual-time run of the same coordinator (specmesh.core.dsi.iid_latency), and the closed form with
the guard (enough verifiers assumed). The simulation is given twice: with the row's latencies, and
with the latencies the stack really shows in SI's rounds (a block's draft time as the drafter
reports it, per token; the rest of a round, i.e. the verify forward plus gRPC, queueing and the
Redis commit, as the target's). The 15 % checks use the second.
"""

from __future__ import annotations

import asyncio
import json
import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specmesh.bench.measure import run_gateway
from specmesh.bench.suite import running_up
from specmesh.bench.tiny import emulated_stack_flags, save_tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import acceptance_from_blocks, iid_latency
from specmesh.core.methods import Method


@dataclass(frozen=True)
class LatencyRow:
    """A row of the DSI paper's Table 2: the target's and the drafter's time per token (ms)."""

    name: str
    target_ms: float
    draft_ms: float
    acceptance: float | None  # the paper's (exact-match) rate, for a Table 2 row
    noise: float  # the tiny draft's distance from its target that comes near that rate (measured)


TABLE2_ROWS = (
    LatencyRow("Vicuna-7B / Vicuna-68M, CNN-DM", 29.4, 2.5, 0.67, 0.0025),
    LatencyRow("StarCoder-15B / StarCoder-168M, HumanEval", 20.6, 6.8, 0.93, 0.0008),
    LatencyRow("Phi3-14B / Phi3-4B, Alpaca", 49.6, 33.4, 0.87, 0.0012),
)
# Drafter / target cost ratios c of 0.05, 0.15 and 0.5 on a 40 ms target, acceptance ~0.8.
RATIO_ROWS = tuple(LatencyRow(f"c = {c:g}", 40.0, 40.0 * c, None, 0.0012) for c in (0.05, 0.15, 0.5))


@dataclass(frozen=True)
class StackBenchConfig:
    rows: Sequence[LatencyRow] = RATIO_ROWS
    verifiers: Sequence[int] = (1, 2, 3, 4)
    lookahead: int = 3
    prompts: int = 6
    max_new_tokens: int = 96
    seed: int = 0
    pipeline: str = "off"  # the gateway's --pipeline: off is the paper's (serial) SI
    extra: dict = field(default_factory=dict)


def prompts(n: int, seed: int) -> list[str]:
    """Random 8-word prompts in the tiny tokenizer's words."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(1, 90)}" for _ in range(8)) for _ in range(n)]


def si_seconds_per_token(acceptance: float, lookahead: int, draft_s: float, target_s: float) -> float:
    """SI under the i.i.d. model: one block of drafts and one target forward per round."""
    tokens = sum(acceptance**i for i in range(lookahead + 1))
    return (lookahead * draft_s + target_s) / tokens


def closed_form_dsi_vs_si(acceptance: float, lookahead: int, cost_ratio: float) -> float:
    """DSI's speed over SI's in the closed forms (time per token in target forwards, enough
    verifiers): DSI with the guard (1 - a)(1 + a k c / (1 - a^k)); SI (1 + k c)(1 - a) / (1 - a^(k+1))."""
    a, k, c = min(acceptance, 0.999), lookahead, cost_ratio
    dsi = (1 - a) * (1 + a * k * c / (1 - a**k))
    si = (1 + k * c) * (1 - a) / (1 - a ** (k + 1))
    return si / dsi


def dsi_seconds_per_token(
    acceptance: float, lookahead: int, sp: int, draft_s: float, target_s: float, n: int = 400
) -> float:
    runs = [iid_latency(acceptance, lookahead, sp, draft_s, target_s, n, seed) for seed in range(5)]
    return sum(r.latency for r in runs) / (len(runs) * n)


def bench_row(cfg: StackBenchConfig, row: LatencyRow, texts: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="specmesh-dsi-stack-") as tmp:
        models = save_tiny_pair(Path(tmp), noise=row.noise)
        return _bench_row(cfg, row, models, texts)


def _bench_row(
    cfg: StackBenchConfig, row: LatencyRow, models: dict[str, Path], texts: list[str]
) -> list[dict]:
    most = max(cfg.verifiers)
    flags = emulated_stack_flags(
        models["draft"], models["target"], most,
        f"--forward-latency-ms {row.draft_ms}", f"--forward-latency-ms {row.target_ms}",
        f"--dsi-max-parallel {most} --pipeline {cfg.pipeline}",
    )  # fmt: skip
    chain = TreeSpec(Method.CHAIN, depth=cfg.lookahead)

    def run(spec: TreeSpec, parallel: int | None = None) -> dict:
        return asyncio.run(
            run_gateway(address, texts, spec, False, 0.0, cfg.max_new_tokens, 1, dsi_parallel=parallel)
        )

    with running_up(flags, "dsi-stack", probe=texts[0]) as address:
        run(chain)  # warm-up: connections, the drafter's and verifiers' first sessions
        plain, si = run(TreeSpec(Method.NONE)), run(chain)
        dsi = {sp: run(chain, sp) for sp in cfg.verifiers}
        auto = run(chain, 0)  # the gateway chooses: SI's schedule or DSI, and how many in flight
    t_d, t_t = row.draft_ms / 1000, row.target_ms / 1000
    a = acceptance_from_blocks(si["accepted_tokens"] / si["target_calls"], cfg.lookahead)
    # The stack's own latencies, from SI's rounds: a block's draft as the drafter reports it, and
    # everything else in a round (verify forward, network, queueing, the Redis commit).
    draft_block = si["draft_seconds"] / si["target_calls"]
    rest = si["seconds"] / si["target_calls"] - draft_block
    si_tps = si["tokens"] / si["seconds"]
    auto_tps = auto["tokens"] / auto["seconds"]
    closed = closed_form_dsi_vs_si(a, cfg.lookahead, draft_block / cfg.lookahead / rest)
    out = []
    for sp, m in dsi.items():
        tps = m["tokens"] / m["seconds"]
        predicted = {}
        for label, draft_s, target_s in (
            ("paper_latencies", t_d, t_t),
            ("stack_latencies", draft_block / cfg.lookahead, rest),
        ):
            si_s = si_seconds_per_token(a, cfg.lookahead, draft_s, target_s)
            dsi_s = dsi_seconds_per_token(a, cfg.lookahead, sp, draft_s, target_s)
            predicted[label] = si_s / dsi_s
        out.append(
            dict(
                row=row.name,
                target_ms=row.target_ms,
                draft_ms=row.draft_ms,
                lookahead=cfg.lookahead,
                sp=sp,
                acceptance=a,
                paper_acceptance=row.acceptance,
                stack_draft_ms=draft_block * 1000 / cfg.lookahead,
                stack_target_ms=rest * 1000,
                plain_tps=plain["tokens"] / plain["seconds"],
                si_tps=si_tps,
                dsi_tps=tps,
                dsi_max_in_flight=m["dsi_max_in_flight"],
                measured_dsi_vs_si=tps / si_tps,
                measured_dsi_vs_plain=tps / (plain["tokens"] / plain["seconds"]),
                predicted_dsi_vs_si=predicted["paper_latencies"],
                predicted_dsi_vs_si_stack=predicted["stack_latencies"],
                within_15pct=abs(tps / si_tps / predicted["stack_latencies"] - 1) <= 0.15,
                closed_form_dsi_vs_si=closed,
                within_15pct_closed_form=abs(tps / si_tps / closed - 1) <= 0.15,
                auto_tps=auto_tps,
                auto_shape=auto["dsi_shapes"],
            )
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def bench_dsi_stack(cfg: StackBenchConfig) -> list[dict]:
    texts = prompts(cfg.prompts, cfg.seed)
    return [r for row in cfg.rows for r in bench_row(cfg, row, texts)]


def markdown(rows: list[dict], cfg: StackBenchConfig) -> str:
    si = "the paper's serial SI" if cfg.pipeline == "off" else f"SI with `--pipeline {cfg.pipeline}`"
    lines = [
        "# DSI through a real stack, against the simulation and the closed form",
        "",
        "Written by `specmesh bench dsi-stack --json docs/benchmarks/dsi_stack.json --markdown "
        "docs/benchmarks/dsi_stack.md --plot docs/benchmarks/dsi_stack.png`. One `specmesh up` per row: "
        "Redis, one drafter, four verifiers, the gateway, on a tiny random pair (the draft a noisy copy "
        "of the target) whose forwards last the row's latencies (`--forward-latency-ms`), so verifiers "
        f"overlap like separate accelerators. Greedy, lookahead {cfg.lookahead}, {cfg.prompts} prompts x "
        f"{cfg.max_new_tokens} tokens, one stream at a time, one run each; SI is {si}. Latencies *in the "
        "stack*: from SI's rounds, a block's draft time as the drafter reports it (per token) and the "
        "rest of a round (verify forward, gRPC, queueing, the Redis commit). Predictions of DSI/SI, "
        "with the measured per-token acceptance a and the stack's latencies (c = t_draft / t_target): "
        "*simulated*, SI by (L t_d + t_t) / (1 + a + ... + a^L) against the coordinator's virtual-time "
        "run at that SP (`specmesh.core.dsi.iid_latency`, guards included); *closed form*, DSI with the "
        "guard (1 - a)(1 + a k c / (1 - a^k)) against SI's (1 + k c)(1 - a) / (1 - a^(k+1)), which "
        "assumes enough verifiers. *In flight*: the most verifications the gateway had out at once.",
        "",
        "| row | t_target / t_draft ms: set | in the stack | a | SP | in flight | plain tok/s | SI | DSI "
        "| DSI/SI | DSI/plain | simulated | closed form | within 15 %: sim / closed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paper = f" ({r['paper_acceptance']:.2f})" if r.get("paper_acceptance") is not None else ""
        lines.append(
            f"| {r['row']} | {r['target_ms']:g} / {r['draft_ms']:g} "
            f"| {r['stack_target_ms']:.1f} / {r['stack_draft_ms']:.1f} "
            f"| {r['acceptance']:.2f}{paper} "
            f"| {r['sp']} | {r['dsi_max_in_flight']} | {r['plain_tps']:.1f} "
            f"| {r['si_tps']:.1f} | {r['dsi_tps']:.1f} | {r['measured_dsi_vs_si']:.2f}x "
            f"| {r['measured_dsi_vs_plain']:.2f}x | {r['predicted_dsi_vs_si_stack']:.2f}x "
            f"| {r['closed_form_dsi_vs_si']:.2f}x "
            f"| {_yes(r['within_15pct'])} / {_yes(r['within_15pct_closed_form'])} |"
        )
    lines += [
        "",
        "The gateway's own choice (`parallel` and SI's schedule left to it, lookahead set) against the "
        "best of plain, SI and every DSI SP above:",
        "",
        "| row | chosen (lookahead, parallel, ahead) | tok/s | best of the rest | chosen / best |",
        "|---|---|---|---|---|",
    ]
    for name in dict.fromkeys(r["row"] for r in rows):
        mine = [r for r in rows if r["row"] == name]
        first = mine[0]
        best = max(first["plain_tps"], first["si_tps"], *(r["dsi_tps"] for r in mine))
        shape = ", ".join(str(tuple(s)) for s in first["auto_shape"])
        lines.append(
            f"| {name} | {shape} | {first['auto_tps']:.1f} | {best:.1f} | {first['auto_tps'] / best:.2f}x |"
        )
    return "\n".join(lines) + "\n"


def _yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["row"] for r in rows))
    fig, axes = plt.subplots(1, len(names), figsize=(4 * len(names), 3.5), sharey=True, squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        mine = [r for r in rows if r["row"] == name]
        sp = [r["sp"] for r in mine]
        ax.plot(sp, [r["measured_dsi_vs_si"] for r in mine], "o-", label="DSI/SI measured")
        ax.plot(sp, [r["measured_dsi_vs_plain"] for r in mine], "s-", label="DSI/plain measured")
        ax.plot(sp, [r["predicted_dsi_vs_si_stack"] for r in mine], "--", label="DSI/SI simulated")
        ax.plot(sp, [r["closed_form_dsi_vs_si"] for r in mine], ":", label="DSI/SI closed form")
        ax.axhline(1.0, color="black", linewidth=0.6)
        ax.set_title(f"{name}, a = {mine[0]['acceptance']:.2f}")
        ax.set_xlabel("SP (verifications in flight at most)")
        ax.set_xticks(sp)
    axes[0][0].set_ylabel("speed ratio")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def write(
    rows: list[dict],
    cfg: StackBenchConfig,
    json_path: str | None,
    md_path: str | None,
    plot_path: str | None = None,
) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(cfg), "rows": rows}, indent=1))
    if md_path:
        Path(md_path).write_text(markdown(rows, cfg))
    if plot_path:
        plot(rows, plot_path)
