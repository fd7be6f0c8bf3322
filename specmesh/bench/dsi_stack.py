"""`specmesh bench dsi-stack`: DSI against SI and plain decoding through a real stack, next to the
DSI simulation's prediction for the same latencies and the measured acceptance.

Two real 1.5B verifiers cannot run in parallel on a 2-core machine, so the stack runs tiny models
(specmesh.bench.tiny) whose services take the per-forward latencies of a row of the DSI paper's
Table 2 (`--forward-latency-ms`: every forward lasts at least that long, the rest slept, so
replicas overlap like separate GPUs would). One `specmesh up` per row with one drafter and
max(verifiers) verifiers; per row: plain decoding, SI (chain of `lookahead`), and DSI with 1..N
verifications in flight. Greedy decoding, so acceptance is the paper's exact-match rate.

The prediction: per-token acceptance a from SI's accepted tokens per round (the truncated geometric
mean inverted); SI's time per token (L·t_d + t_t) / (1 + a + ... + a^L); DSI's from the
virtual-time run of the same coordinator (specmesh.core.dsi.iid_latency). It is given twice: with
the row's latencies, and with the latencies the stack really shows in SI's rounds (a block's draft
time as the drafter reports it, per token; the rest of a round, i.e. the verify forward plus gRPC,
queueing and the Redis commit, as the target's). The 15 % check uses the second.
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
from specmesh.bench.tiny import save_tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import acceptance_from_blocks, iid_latency
from specmesh.core.methods import Method


@dataclass(frozen=True)
class LatencyRow:
    """A row of the DSI paper's Table 2: the target's and the drafter's time per token (ms)."""

    name: str
    target_ms: float
    draft_ms: float
    acceptance: float  # the paper's (exact-match) rate
    noise: float  # the tiny draft's distance from its target that comes near that rate (measured)


TABLE2_ROWS = (
    LatencyRow("Vicuna-7B / Vicuna-68M, CNN-DM", 29.4, 2.5, 0.67, 0.0025),
    LatencyRow("StarCoder-15B / StarCoder-168M, HumanEval", 20.6, 6.8, 0.93, 0.0008),
    LatencyRow("Phi3-14B / Phi3-4B, Alpaca", 49.6, 33.4, 0.87, 0.0012),
)


@dataclass(frozen=True)
class StackBenchConfig:
    rows: Sequence[LatencyRow] = TABLE2_ROWS
    verifiers: Sequence[int] = (1, 2, 3, 4)
    lookahead: int = 3
    prompts: int = 6
    max_new_tokens: int = 96
    seed: int = 0
    extra: dict = field(default_factory=dict)


def prompts(n: int, seed: int) -> list[str]:
    """Random 8-word prompts in the tiny tokenizer's words."""
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(1, 90)}" for _ in range(8)) for _ in range(n)]


def si_seconds_per_token(acceptance: float, lookahead: int, draft_s: float, target_s: float) -> float:
    """SI under the i.i.d. model: one block of drafts and one target forward per round."""
    tokens = sum(acceptance**i for i in range(lookahead + 1))
    return (lookahead * draft_s + target_s) / tokens


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
    service = "--torch-threads 1 --forward-latency-ms"
    flags = [
        *("--draft", str(models["draft"]), "--target", str(models["target"]), "--dtype", "fp32"),
        *("--draft-dtype", "fp32", "--drafters", "1", "--verifiers", str(most)),
        *("--drafter-flags", f"{service} {row.draft_ms}", "--verifier-flags", f"{service} {row.target_ms}"),
        *("--gateway-flags", f"--dsi-max-parallel {most}"),
    ]
    chain = TreeSpec(Method.CHAIN, depth=cfg.lookahead)

    def run(spec: TreeSpec, parallel: int | None = None) -> dict:
        return asyncio.run(
            run_gateway(address, texts, spec, False, 0.0, cfg.max_new_tokens, 1, dsi_parallel=parallel)
        )

    with running_up(flags, "dsi-stack", probe=texts[0]) as address:
        run(chain)  # warm-up: connections, the drafter's and verifiers' first sessions
        plain, si = run(TreeSpec(Method.NONE)), run(chain)
        dsi = {sp: run(chain, sp) for sp in cfg.verifiers}
    t_d, t_t = row.draft_ms / 1000, row.target_ms / 1000
    a = acceptance_from_blocks(si["accepted_tokens"] / si["target_calls"], cfg.lookahead)
    # The stack's own latencies, from SI's rounds: a block's draft as the drafter reports it, and
    # everything else in a round (verify forward, network, queueing, the Redis commit).
    draft_block = si["draft_seconds"] / si["target_calls"]
    rest = si["seconds"] / si["target_calls"] - draft_block
    si_tps = si["tokens"] / si["seconds"]
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
                predicted_dsi_vs_si=predicted["paper_latencies"],
                predicted_dsi_vs_si_stack=predicted["stack_latencies"],
                within_15pct=abs(tps / si_tps / predicted["stack_latencies"] - 1) <= 0.15,
            )
        )
        print(json.dumps(out[-1]), flush=True)
    return out


def bench_dsi_stack(cfg: StackBenchConfig) -> list[dict]:
    texts = prompts(cfg.prompts, cfg.seed)
    return [r for row in cfg.rows for r in bench_row(cfg, row, texts)]


def markdown(rows: list[dict], cfg: StackBenchConfig) -> str:
    lines = [
        "# DSI through a real stack, against the simulation",
        "",
        "Written by `specmesh bench dsi-stack --json docs/benchmarks/dsi_stack.json --markdown "
        "docs/benchmarks/dsi_stack.md`. One `specmesh up` per row: Redis, one drafter, four verifiers, "
        "the gateway, on tiny random models whose forwards last the row's latencies "
        "(`--forward-latency-ms`), so verifiers overlap like separate accelerators. "
        f"Greedy, lookahead {cfg.lookahead}, {cfg.prompts} prompts x {cfg.max_new_tokens} tokens, one "
        "stream at a time. Latencies *in the stack*: from SI's rounds, a block's draft time as the "
        "drafter reports it (per token) and the rest of a round (verify forward, gRPC, queueing, the "
        "Redis commit). Predictions: SI by (L t_d + t_t) / (1 + a + ... + a^L), DSI by the "
        "coordinator's virtual-time run (`specmesh.core.dsi.iid_latency`), with the measured per-token "
        "acceptance a. *In flight*: the most verifications the gateway had out at once.",
        "",
        "| latencies (Table 2 row) | t_target / t_draft ms: set | in the stack | a (paper) | SP | in flight "
        "| plain | SI | DSI | DSI/SI measured | predicted: set | in the stack | within 15 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['row']} | {r['target_ms']:g} / {r['draft_ms']:g} "
            f"| {r['stack_target_ms']:.1f} / {r['stack_draft_ms']:.1f} "
            f"| {r['acceptance']:.2f} ({r['paper_acceptance']:.2f}) "
            f"| {r['sp']} | {r['dsi_max_in_flight']} | {r['plain_tps']:.1f} "
            f"| {r['si_tps']:.1f} | {r['dsi_tps']:.1f} | {r['measured_dsi_vs_si']:.2f}x "
            f"| {r['predicted_dsi_vs_si']:.2f}x | {r['predicted_dsi_vs_si_stack']:.2f}x "
            f"| {'yes' if r['within_15pct'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def write(rows: list[dict], cfg: StackBenchConfig, json_path: str | None, md_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(cfg), "rows": rows}, indent=1))
    if md_path:
        Path(md_path).write_text(markdown(rows, cfg))
