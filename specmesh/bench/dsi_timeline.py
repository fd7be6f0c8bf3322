"""`specmesh bench dsi-timeline`: DSI in the regime it exists for, emulated, with the timeline of
one session drawn.

The tiny target drafts for itself (greedy acceptance 1), the drafter's forwards last `draft_ms`,
the verifiers' `target_ms` (`--forward-latency-ms`), `verifiers` of them. Runs, one stream each:
plain decoding, SI (a chain of `lookahead`, the gateway's default pipelined rounds), DSI with
each shape asked for, and DSI with `parallel` left to the gateway. Every output is checked
against plain decoding's, token for token. The ideal walls, with the set latencies and nothing
else: SI's pipelined rounds (the gateway's default), and from the coordinator's virtual-time run
(`specmesh.core.dsi.iid_latency`) SI's serial schedule (the paper's SI: the drafter waits for each
verdict) and DSI's.

The gateway runs with `--dsi-timeline`, so every DSI session leaves its events (docs/gateway.md);
the plot draws the first asked shape's session: the drafter's and each verifier's calls as bars,
guards apart, thrown-away work in red, commits as ticks.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specmesh.bench.measure import run_gateway
from specmesh.bench.suite import running_up
from specmesh.bench.tiny import emulated_stack_flags, save_tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import iid_latency
from specmesh.core.methods import Method


@dataclass(frozen=True)
class TimelineBenchConfig:
    draft_ms: float = 10.0
    target_ms: float = 100.0
    verifiers: int = 4
    lookahead: int = 4
    parallel: Sequence[int] = (4, 2)  # DSI shapes lookahead x parallel; the first is drawn
    max_new_tokens: int = 64
    prompt: str = "w5 w6 w7 w8 w9 w10"
    pipeline: str = "auto"  # the gateway's --pipeline: SI's rounds (off: the paper's serial SI)


def ideal_seconds(cfg: TimelineBenchConfig, parallel: int, ahead: bool) -> float:
    """The coordinator's virtual-time wall for max_new_tokens at acceptance 1."""
    run = iid_latency(
        1.0,
        cfg.lookahead,
        parallel,
        cfg.draft_ms / 1000,
        cfg.target_ms / 1000,
        cfg.max_new_tokens,
        ahead=ahead,
    )
    return run.latency


def si_pipelined_seconds(cfg: TimelineBenchConfig) -> float:
    """SI's pipelined rounds at acceptance 1 with no overhead: the first chain drafted, then one
    verification per round while the next chain and its guessed bonus (k + 1 levels) are drafted."""
    rounds = -(-cfg.max_new_tokens // (cfg.lookahead + 1))
    d, t = cfg.draft_ms / 1000, cfg.target_ms / 1000
    return cfg.lookahead * d + rounds * max(t, (cfg.lookahead + 1) * d)


def bench_dsi_timeline(cfg: TimelineBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="specmesh-dsi-timeline-") as tmp:
        models = save_tiny_pair(Path(tmp) / "models")
        folder = Path(tmp) / "timelines"
        flags = emulated_stack_flags(
            models["target"], models["target"], cfg.verifiers,
            f"--forward-latency-ms {cfg.draft_ms}", f"--forward-latency-ms {cfg.target_ms}",
            f"--dsi-max-parallel {cfg.verifiers} --dsi-timeline {folder} --pipeline {cfg.pipeline}",
        )  # fmt: skip
        chain = TreeSpec(Method.CHAIN, depth=cfg.lookahead)
        texts = [cfg.prompt]

        def run(name: str, spec: TreeSpec, parallel: int | None = None) -> dict:
            for old in folder.glob("*.json"):
                old.unlink()
            m = asyncio.run(
                run_gateway(address, texts, spec, False, 0.0, cfg.max_new_tokens, 1, parallel, keep_ids=True)
            )
            files = sorted(folder.glob("*.json"))
            timeline = json.loads(files[0].read_text()) if files else None
            row = dict(name=name, **{k: v for k, v in m.items() if k != "token_ids"})
            row["dsi_shapes"] = [list(s) for s in m["dsi_shapes"]]
            row["summary"] = summarize(timeline) if timeline else None
            print(json.dumps(row), flush=True)
            return dict(row=row, token_ids=m["token_ids"], timeline=timeline)

        with running_up(flags, "dsi-timeline", probe=cfg.prompt) as address:
            run("warm-up", chain, cfg.parallel[0])
            runs = [run("none", TreeSpec(Method.NONE)), run(f"SI chain {cfg.lookahead}", chain)]
            runs += [run(f"DSI {cfg.lookahead}x{p}", chain, p) for p in cfg.parallel]
            runs.append(run(f"DSI {cfg.lookahead}, parallel left to the gateway", chain, 0))
    plain = runs[0]["token_ids"]
    rows = []
    for r in runs:
        row = r["row"]
        row["identical_to_none"] = r["token_ids"] == plain
        rows.append(row)
    ideal = {
        f"SI chain {cfg.lookahead}": (
            si_pipelined_seconds(cfg) if cfg.pipeline != "off" else ideal_seconds(cfg, 1, ahead=False)
        ),
        "SI serial": ideal_seconds(cfg, 1, ahead=False),
    }
    ideal |= {f"DSI {cfg.lookahead}x{p}": ideal_seconds(cfg, p, ahead=True) for p in cfg.parallel}
    return dict(config=asdict(cfg), ideal_seconds=ideal, rows=rows, timeline=runs[2]["timeline"])


def calls(timeline: dict) -> list[dict]:
    """The timeline's calls: {kind (draft / verify / guard), replica, start, end, outcome}, from
    its start and end events."""
    open_: dict[tuple, dict] = {}
    out: list[dict] = []
    for e in timeline["events"]:
        ev, t = e["event"], e["t"]
        if ev == "draft":
            open_[("draft", None)] = dict(kind="draft", replica=e["replica"], start=t)
        elif ev == "verify":
            open_[("verify", e["block"])] = dict(
                kind="verify", replica=e["replica"], start=t, block=e["block"]
            )
        elif ev == "guard":
            open_[("guard", None)] = dict(kind="guard", replica=e["replica"], start=t)
        else:
            key, outcome = _ends(e)
            if key is not None and key in open_:
                out.append(dict(open_.pop(key), end=t, outcome=outcome))
    end = timeline["events"][-1]["t"] if timeline["events"] else 0.0
    out += [dict(c, end=end, outcome="open") for c in open_.values()]
    return out


def _ends(e: dict) -> tuple[tuple | None, str]:
    ev = e["event"]
    if ev == "drafted":
        return ("draft", None), "kept" if e["block"] is not None else "dropped"
    if ev == "verdict":
        return ("verify", e["block"]), f"{e['accepted']} accepted"
    if ev == "guarded":
        return ("guard", None), "decided" if e["decided"] else "late"
    if ev in ("call_cancelled", "call_failed"):
        what = "cancelled" if ev == "call_cancelled" else "failed"
        if e["role"] == "drafter":
            return ("draft", None), what
        return (("verify", e["block"]) if e["block"] is not None else ("guard", None)), what
    return None, ""


def summarize(timeline: dict) -> dict:
    """What the issue asks of a timeline: how busy the drafter was, how many verifications were in
    flight on average, and how many were thrown away."""
    cs = calls(timeline)
    events = timeline["events"]
    wall = events[-1]["t"] if events else 0.0
    drafts = [c for c in cs if c["kind"] == "draft"]
    verifies = [c for c in cs if c["kind"] != "draft"]
    busy = sum(c["end"] - c["start"] for c in drafts)
    in_flight = sum(c["end"] - c["start"] for c in verifies)
    return dict(
        wall=wall,
        drafter_busy=busy / wall if wall else 0.0,
        mean_verifications_in_flight=in_flight / wall if wall else 0.0,
        verifications=sum(c["kind"] == "verify" for c in cs),
        guards=sum(c["kind"] == "guard" for c in cs),
        thrown_away=sum(c["outcome"] in ("cancelled", "failed") for c in verifies),
        drafts=len(drafts),
        drafts_dropped=sum(c["outcome"] in ("dropped", "cancelled", "failed") for c in drafts),
    )


COLORS = {"draft": "tab:gray", "verify": "tab:green", "guard": "tab:blue"}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = result["timeline"]
    cs = calls(timeline)
    replicas = sorted({c["replica"] for c in cs if c["kind"] == "draft"})
    replicas += sorted({c["replica"] for c in cs if c["kind"] != "draft"} - set(replicas))
    lane = {r: i for i, r in enumerate(replicas)}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(replicas)))
    for c in cs:
        wasted = c["outcome"] in ("cancelled", "failed", "dropped")
        ax.barh(
            lane[c["replica"]], (c["end"] - c["start"]) * 1000, left=c["start"] * 1000, height=0.7,
            color="tab:red" if wasted else COLORS[c["kind"]], edgecolor="black", linewidth=0.3,
        )  # fmt: skip
    for e in timeline["events"]:
        if e["event"] == "committed":
            ax.axvline(e["t"] * 1000, color="black", alpha=0.15, linewidth=0.8)
    names = ["drafter" if i == 0 else f"verifier {i}" for i in range(len(replicas))]
    ax.set_yticks(range(len(replicas)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the session started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLORS.values(), "tab:red")]
    ax.legend(handles, ["draft", "verify a block", "guard", "thrown away"], loc="upper right", fontsize=8)
    cfg = result["config"]
    ax.set_title(
        f"one DSI session, lookahead {cfg['lookahead']} x parallel {cfg['parallel'][0]}: drafter "
        f"{cfg['draft_ms']:g} ms / forward, verifiers {cfg['target_ms']:g} ms (emulated); grey lines: commits"
    )
    fig.tight_layout()
    fig.savefig(path)


def markdown(result: dict) -> str:
    cfg, ideal = result["config"], result["ideal_seconds"]
    lines = [
        "# One DSI session's timeline, emulated",
        "",
        "Written by `specmesh bench dsi-timeline --json docs/benchmarks/dsi_timeline.json --markdown "
        "docs/benchmarks/dsi_timeline.md --plot docs/benchmarks/dsi_timeline.png`"
        + (f" (gateway `--pipeline {cfg['pipeline']}`)" if cfg.get("pipeline", "auto") != "auto" else "")
        + ". The tiny target drafts "
        f"for itself (greedy acceptance 1); drafter {cfg['draft_ms']:g} ms a forward, {cfg['verifiers']} "
        f"verifiers at {cfg['target_ms']:g} ms; {cfg['max_new_tokens']} greedy tokens, one stream, one run "
        "each. Ideal: the coordinator's virtual-time run with those latencies and no overhead: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in ideal.items())
        + ".",
        "",
        "| run | wall s | vs ideal | target calls | drafted | in flight (most) | drafter busy "
        "| in flight (mean) | guards | verifications thrown away | same tokens as none |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if r["name"] == "warm-up":
            continue
        s = r["summary"] or {}
        key = r["name"] if r["name"] in ideal else None
        vs = f"{r['seconds'] / ideal[key]:.2f}x" if key else ""
        busy = f"{s['drafter_busy']:.0%}" if s else ""
        mean = f"{s['mean_verifications_in_flight']:.2f}" if s else ""
        lines.append(
            f"| {r['name']} | {r['seconds']:.2f} | {vs} | {r['target_calls']} | {r['drafted_tokens']} "
            f"| {r['dsi_max_in_flight']} | {busy} | {mean} | {s.get('guards', '')} "
            f"| {s.get('thrown_away', '')} "
            f"| {'yes' if r['identical_to_none'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def write(result: dict, json_path: str | None, md_path: str | None, plot_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=1))
    if md_path:
        Path(md_path).write_text(markdown(result))
    if plot_path and result["timeline"]:
        plot(result, plot_path)
