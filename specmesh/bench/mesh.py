"""`specmesh bench mesh`: what a round through the mesh costs beyond the forwards inside it.

Tiny models (specmesh.bench.tiny) stand in for a GPU pair: every forward lasts at least
fixed + per_row x rows ms (`--forward-latency-ms`, `--forward-ms-per-row`: a forward nearly flat in
rows, a drafter several times cheaper than the target). By default the target drafts for itself,
so greedy acceptance is 1 and every round's shape is known; `--noise` makes the draft a noisy copy
(acceptance below 1).

Per shape (`none`, `chain` 4, `rsd_s` 2x4, DSI 4x4) and number of concurrent sessions (1, 8, 32) it
reports the mesh's wall, the ideal wall of the cost model (`ideal_wall`: serial rounds, each level
and each verification ONE batched forward over all sessions, nothing else), and the overhead of a
round split by where it went, from the Prometheus metrics of the gateway and the replicas (deltas
over the run, means per session-round):

  redis         the gateway's commit (phase "commit")
  queue         batching waits of a tick's forwards (specmesh:queue_wait_seconds)
  grpc          a session's wait for its replica's answer seen by the gateway minus the tick's time
                on the replica: waiting for the tick to be sent, transport, (de)serialisation
  replica_cpu   a tick's time on the replica minus its queue waits and forwards: decoding and
                validation, sampling, tree building, encoding
  gateway_cpu   the round minus its replica calls and commit: planning, cutting, bookkeeping

With pipelined rounds a Draft runs beside the previous Verify; `drafter_call` is then the time the
round really waited for its tree (0 when the pre-draft was ready), so the split stays additive.

CPU, beside the wall: each process of the stack (Redis, drafter, verifiers, gateway) is charged its
user + system seconds over the run (/proc/PID/stat, all its threads), per session-round; a model
service's part inside its forwards is the model thread's CPU time around each forward
(specmesh:forward_cpu_seconds_total, the emulated floor's sleep not counted), the rest is its
service work. `rest_per_unit_ms` is the replicas' CPU beyond their forwards per session per draft
level or verification forward (plain decoding: per token).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specmesh.bench.dsi_stack import dsi_seconds_per_token, prompts
from specmesh.bench.measure import run_gateway
from specmesh.bench.suite import running_stack_plan
from specmesh.bench.tiny import emulated_stack_flags, save_tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method


@dataclass(frozen=True)
class Shape:
    name: str
    spec: TreeSpec
    dsi_parallel: int | None = None


SHAPES = (
    Shape("none", TreeSpec(Method.NONE)),
    Shape("chain 4", TreeSpec(Method.CHAIN, depth=4)),
    Shape("rsd_s 2x4", TreeSpec(Method.RSD_S, depth=4, beam_width=2)),
    Shape("dsi 4x4", TreeSpec(Method.CHAIN, depth=4), dsi_parallel=4),
    # model-free: the n-gram drafter's lookups in what the sessions and the mesh generated
    Shape("suffix 8x2", TreeSpec(Method.SUFFIX, depth=8, beam_width=2)),
)


@dataclass(frozen=True)
class MeshBenchConfig:
    draft_ms: float = 4.0
    draft_ms_per_row: float = 0.05
    target_ms: float = 16.0
    target_ms_per_row: float = 0.1
    sessions: Sequence[int] = (1, 8, 32)
    shapes: Sequence[str] = tuple(s.name for s in SHAPES)
    max_new_tokens: int = 64
    noise: float | None = None  # None: the target drafts for itself (greedy acceptance 1)
    pipeline: Sequence[str] = ("off", "auto")  # the gateway's --pipeline, one stack each
    seed: int = 0
    repeat: int = 1  # runs per point, their CPU, walls and ideals summed (one run's CPU is noisy)

    def draft_cost(self, rows: float) -> float:
        return (self.draft_ms + self.draft_ms_per_row * rows) / 1000

    def target_cost(self, rows: float) -> float:
        return (self.target_ms + self.target_ms_per_row * rows) / 1000


# ---- the metrics of a running stack -------------------------------------------------------------


def scrape(addresses: dict[str, str]) -> dict[str, dict[tuple, float]]:
    """child name -> {(sample name, sorted labels but model_name): value} of its /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for name, address in addresses.items():
        text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = sorted((k, v) for k, v in s.labels.items() if k != "model_name")
                samples[(s.name, tuple(labels))] = s.value
        out[name] = samples
    return out


def _delta(after: dict, before: dict) -> dict:
    return {
        child: {k: v - before.get(child, {}).get(k, 0.0) for k, v in samples.items()}
        for child, samples in after.items()
    }


def process_cpu(pids: dict[str, int]) -> dict[str, float]:
    """child name -> its CPU seconds so far (user + system, every thread), from /proc/PID/stat."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # it exited
            continue
        out[name] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def cpu_split(cpu: dict[str, float], delta: dict[str, dict], rounds: float, units: float) -> dict:
    """CPU ms per session-round of each child over a run (`cpu`: seconds, `delta`: the metrics'
    deltas), its forwards' part, and the replicas' rest per level or verification (`units`)."""
    per_round = {}
    for name, seconds in sorted(cpu.items()):
        forward = _get(delta.get(name, {}), "specmesh:forward_cpu_seconds_total")
        per_round[name] = dict(total=seconds * 1000 / rounds, forward=forward * 1000 / rounds)
    replicas = [v for k, v in per_round.items() if k.startswith(("drafter", "verifier"))]
    rest = sum(r["total"] - r["forward"] for r in replicas) * rounds / units if units else 0.0
    return dict(
        per_round=per_round,
        stack=sum(r["total"] for r in per_round.values()),
        forwards=sum(r["forward"] for r in per_round.values()),
        rest_per_unit_ms=rest,
    )


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _mean(samples: dict, name: str, **labels: str) -> float:
    n = _get(samples, f"{name}_count", **labels)
    return _get(samples, f"{name}_sum", **labels) / n if n else 0.0


def _buckets(samples: dict, name: str) -> dict[str, float]:
    """A histogram's cumulative bucket counts {le: count}."""
    return {dict(k[1])["le"]: v for k, v in samples.items() if k[0] == f"{name}_bucket"}


def split(delta: dict[str, dict]) -> dict[str, float]:
    """Means per session-round, in ms (module docstring); a replica's parts are per tick, what
    every session in the tick waits."""
    gw = delta["gateway"]
    drafter = next((v for k, v in delta.items() if k.startswith("drafter")), {})
    verifiers = [v for k, v in delta.items() if k.startswith("verifier")]
    phase = "specmesh:round_phase_seconds"
    out = {p: _mean(gw, phase, phase=p) for p in ("round", "commit", "drafter_call", "verifier_call")}

    def replica(samples: list[dict], method: str) -> dict[str, float]:
        """Per tick (what every session in it waits): its handler's wall, its groups' queue waits,
        its forwards."""
        ticks = sum(_get(s, "specmesh:rpc_handler_seconds_count", method=method) for s in samples)
        if not ticks:
            return dict(handler=0.0, queue=0.0, forward=0.0)
        handler = sum(_get(s, "specmesh:rpc_handler_seconds_sum", method=method) for s in samples)
        queue = sum(_get(s, "specmesh:queue_wait_seconds_sum") for s in samples)
        forward = sum(_get(s, "specmesh:forward_seconds_sum") for s in samples)
        return dict(handler=handler / ticks, queue=queue / ticks, forward=forward / ticks)

    d = replica([drafter], "DraftTick") if drafter else dict(handler=0.0, queue=0.0, forward=0.0)
    v = replica(verifiers, "VerifyTick")
    grpc = max(0.0, out["drafter_call"] - d["handler"]) + max(0.0, out["verifier_call"] - v["handler"])
    rows = dict(
        round=out["round"],
        forwards=d["forward"] + v["forward"],
        redis=out["commit"],
        queue=d["queue"] + v["queue"],
        grpc=grpc,
        replica_cpu=(d["handler"] - d["queue"] - d["forward"]) + (v["handler"] - v["queue"] - v["forward"]),
        gateway_cpu=out["round"] - out["drafter_call"] - out["verifier_call"] - out["commit"],
        drafter_call=out["drafter_call"],
        verifier_call=out["verifier_call"],
    )
    return {k: x * 1000 for k, x in rows.items()}


# ---- the runs -----------------------------------------------------------------------------------


def ideal_wall(cfg: MeshBenchConfig, shape: Shape, sessions: int, m: dict) -> float:
    """Seconds the cost model gives the same work done by serial rounds: the sessions in lockstep,
    each round one batched forward per draft level and one per verification over the sessions
    still running (`rounds_per_stream`, the measured counts, so the same acceptance and the same
    early stops; without it every session is taken to run the mean count); DSI by its coordinator's
    virtual-time run (drafter-bound here). Pipelined runs are held against the same serial ideal."""
    counts = m.get("rounds_per_stream") or [m["target_calls"] / sessions] * sessions
    nodes = m["drafted_tokens"] / m["target_calls"] if m["target_calls"] else 0.0
    levels = shape.spec.depth  # a serial round's level forwards (a pipelined one runs one more)
    per_level = nodes / levels if levels else 0.0

    def round_seconds(active: int) -> float:
        verify = cfg.target_cost(active * (1 + nodes))
        if not shape.spec.method.needs_model:  # plain steps, and lookups: no draft forward
            return verify
        return levels * cfg.draft_cost(active * max(per_level, 1.0)) + verify

    if shape.dsi_parallel is None:
        # rounds k = 0, 1, ...: the sessions with more than k rounds run round k together
        ordered = sorted(counts)
        wall, done = 0.0, 0.0
        for i, count in enumerate(ordered):
            wall += (count - done) * round_seconds(len(ordered) - i)
            done = max(done, count)
        return wall
    # per drafted token of the verified blocks: target_calls counts DSI's guard rounds too (no
    # draft), which would make the acceptance, and so the ideal, several times too low
    acceptance = min(0.999, m["accepted_tokens"] / max(1, m["drafted_tokens"]))
    draft_token = cfg.draft_cost(sessions * max(per_level, 1.0))
    verify = cfg.target_cost(sessions * (1 + nodes))
    per_token = dsi_seconds_per_token(acceptance, shape.spec.depth, shape.dsi_parallel, draft_token, verify)
    return per_token * m["tokens"] / sessions


def _run(address: str, texts: list[str], shape: Shape, cfg: MeshBenchConfig) -> dict:
    return asyncio.run(
        run_gateway(
            address, texts, shape.spec, False, 0.0, cfg.max_new_tokens, len(texts),
            dsi_parallel=shape.dsi_parallel,
        )
    )  # fmt: skip


def _runs(address: str, texts: list[str], shape: Shape, cfg: MeshBenchConfig) -> tuple[dict, float]:
    """cfg.repeat runs of the same sessions, as one measurement: their totals, and the sum of
    their ideal walls (each run's ideal from its own measured rounds)."""
    runs = [_run(address, texts, shape, cfg) for _ in range(max(1, cfg.repeat))]
    ideal = sum(ideal_wall(cfg, shape, len(texts), m) for m in runs)
    total = {k: sum(m[k] for m in runs) for k in ("tokens", "seconds", "target_calls", "draft_calls")}
    efficiency = [(m["block_efficiency"], m["target_calls"]) for m in runs]
    total["block_efficiency"] = (
        sum(e * n for e, n in efficiency) / total["target_calls"]
        if total["target_calls"] and all(e is not None for e, _ in efficiency)
        else None
    )
    return total, ideal


def bench_stack(
    cfg: MeshBenchConfig, models: dict[str, Path], pipeline: str, shapes: list[Shape]
) -> list[dict]:
    dsi = any(s.dsi_parallel for s in shapes)
    verifiers = max((s.dsi_parallel or 1) for s in shapes)
    draft = models["target"] if cfg.noise is None else models["draft"]
    cost = "--forward-latency-ms {} --forward-ms-per-row {}"
    drafter = cost.format(cfg.draft_ms, cfg.draft_ms_per_row)
    verifier = cost.format(cfg.target_ms, cfg.target_ms_per_row)
    gateway = f"--pipeline {pipeline}" + (f" --dsi-max-parallel {verifiers}" if dsi else "")
    flags = emulated_stack_flags(draft, models["target"], verifiers, drafter, verifier, gateway)
    texts = prompts(max(cfg.sessions), cfg.seed)
    rows = []
    with running_stack_plan(flags, f"mesh-{pipeline}", probe=texts[0]) as (address, metrics, pids):
        for shape in shapes:
            _run(address, texts[:2], shape, cfg)  # warm-up: connections, first sessions
            for n in cfg.sessions:
                before, cpu_before = scrape(metrics), process_cpu(pids)
                m, ideal = _runs(address, texts[:n], shape, cfg)
                cpu_after = process_cpu(pids)
                delta = _delta(scrape(metrics), before)
                cpu = {k: v - cpu_before.get(k, 0.0) for k, v in cpu_after.items()}
                units = m["draft_calls"] + (m["target_calls"] if shape.spec.method.drafts else m["tokens"])
                verifier = next(v for k, v in delta.items() if k.startswith("verifier"))
                drafter = next((v for k, v in delta.items() if k.startswith("drafter")), {})
                row = dict(
                    shape=shape.name, sessions=n, pipeline=pipeline,
                    tokens=m["tokens"], rounds=m["target_calls"], block_efficiency=m["block_efficiency"],
                    wall=m["seconds"], ideal_wall=ideal, wall_over_ideal=m["seconds"] / ideal,
                    tokens_per_s=m["tokens"] / m["seconds"], ideal_tokens_per_s=m["tokens"] / ideal,
                    per_round_ms=split(delta),
                    cpu_ms=cpu_split(cpu, delta, m["target_calls"], units),
                    queue_wait_buckets=dict(
                        verifier=_buckets(verifier, "specmesh:queue_wait_seconds"),
                        drafter=_buckets(drafter, "specmesh:queue_wait_seconds"),
                    ),
                    pipelined=_get(delta["gateway"], "specmesh:pipelined_rounds_total", outcome="hit"),
                    pipeline_misses=_get(delta["gateway"], "specmesh:pipelined_rounds_total", outcome="miss"),
                )  # fmt: skip
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "queue_wait_buckets"}), flush=True)
    return rows


def bench_mesh(cfg: MeshBenchConfig) -> list[dict]:
    shapes = [s for s in SHAPES if s.name in cfg.shapes]
    rows = []
    with tempfile.TemporaryDirectory(prefix="specmesh-mesh-") as tmp:
        models = save_tiny_pair(Path(tmp), noise=cfg.noise or 0.02)
        for pipeline in cfg.pipeline:
            plain = [s for s in shapes if s.dsi_parallel is None]
            if plain:
                rows += bench_stack(cfg, models, pipeline, plain)
        dsi = [s for s in shapes if s.dsi_parallel is not None]
        if dsi:
            rows += bench_stack(cfg, models, cfg.pipeline[-1], dsi)
    return rows


# ---- output -------------------------------------------------------------------------------------

_SPLIT = ("forwards", "redis", "queue", "grpc", "replica_cpu", "gateway_cpu")


def markdown(rows: list[dict], cfg: MeshBenchConfig) -> str:
    acceptance = (
        "the target drafts for itself (greedy acceptance 1)"
        if cfg.noise is None
        else (f"the draft is the target plus noise {cfg.noise}")
    )
    lines = [
        "# The mesh against its cost model",
        "",
        "Written by `specmesh bench mesh` (specmesh/bench/mesh.py). Tiny models on one `specmesh up`; "
        f"every forward lasts at least drafter {cfg.draft_ms:g} ms + {cfg.draft_ms_per_row:g} ms/row, "
        f"verifier {cfg.target_ms:g} ms + {cfg.target_ms_per_row:g} ms/row; {acceptance}; greedy, "
        f"{cfg.max_new_tokens} tokens per session, all sessions at once"
        + (f"; each point {cfg.repeat} runs, measured as one" if cfg.repeat > 1 else "")
        + ". *Ideal*: the cost model's wall "
        "for the same rounds, serial, one batched forward per draft level and per verification over "
        "the sessions still running (each session its measured rounds, in lockstep; DSI: its "
        "coordinator's virtual-time run, acceptance per drafted token). Per round (ms, means per "
        "session-round, from the services' Prometheus metrics): the round as the gateway sees it, "
        "the forwards on its path, then the overhead split (module docstring of specmesh/bench/mesh.py; "
        "nan: DSI's calls overlap, the gateway does not time them per round).",
        "",
        "| shape | sessions | pipeline | tok/s | ideal tok/s | wall / ideal | round | forwards | redis "
        "| queue | grpc | replica cpu | gateway cpu | pre-drafts hit / missed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = dict(r["per_round_ms"])
        if r["shape"].startswith("dsi"):  # DSI's calls overlap and are not timed per round
            s["grpc"] = s["gateway_cpu"] = float("nan")
        lines.append(
            f"| {r['shape']} | {r['sessions']} | {r['pipeline']} | {r['tokens_per_s']:.0f} "
            f"| {r['ideal_tokens_per_s']:.0f} | {r['wall_over_ideal']:.2f} | {s['round']:.1f} | "
            + " | ".join(f"{s[k]:.1f}" for k in _SPLIT)
            + f" | {r['pipelined']:.0f} / {r['pipeline_misses']:.0f} |"
        )
    lines += [
        "",
        "CPU per session-round (ms; each process's user + system time over the run from /proc, "
        "a model service's forwards measured by its model thread's CPU time around each forward; "
        "rest / unit: the replicas' CPU beyond their forwards per session per draft level or "
        "verification forward):",
        "",
        "| shape | sessions | pipeline | drafter fwd / rest | verifier fwd / rest | gateway | redis | stack "
        "| rest / unit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("cpu_ms")
        if not c:
            continue
        per = c["per_round"]
        gateway, redis = (per.get(k, {}).get("total", 0.0) for k in ("gateway", "redis"))
        lines.append(
            f"| {r['shape']} | {r['sessions']} | {r['pipeline']} | {_role_cpu(per, 'drafter')} "
            f"| {_role_cpu(per, 'verifier')} | {gateway:.2f} | {redis:.2f} | {c['stack']:.2f} "
            f"| {c['rest_per_unit_ms']:.3f} |"
        )
    lines += ["", "Queue waits (verifier, cumulative count of steps that waited at most le seconds):", ""]
    for r in rows:
        if r["shape"] == "chain 4" and r["sessions"] in (1, max(cfg.sessions)):
            for role in ("verifier", "drafter"):
                b = r["queue_wait_buckets"][role]
                if b:
                    cells = ", ".join(f"≤{le}: {int(n)}" for le, n in b.items() if le != "+Inf")
                    lines.append(
                        f"- chain 4, {r['sessions']} sessions, pipeline {r['pipeline']}, {role}: "
                        f"{cells}, all: {int(b.get('+Inf', 0))}"
                    )
    return "\n".join(lines) + "\n"


def _role_cpu(per_round: dict, prefix: str) -> str:
    """'forward / rest' ms of a role's processes (every verifier summed)."""
    parts = [v for k, v in per_round.items() if k.startswith(prefix)]
    if not parts:
        return "-"
    forward = sum(v["forward"] for v in parts)
    return f"{forward:.2f} / {sum(v['total'] for v in parts) - forward:.2f}"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, cpu_ax) = plt.subplots(2, 1, figsize=(11, 8), sharex=True)
    labels = [f"{r['shape']}\n{r['sessions']}s {r['pipeline']}" for r in rows]
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for part, color in (("forward", "tab:green"), ("rest", "tab:red")):
        heights = []
        for r in rows:
            c = r.get("cpu_ms", {}).get("per_round", {})
            fwd = sum(v["forward"] for v in c.values())
            heights.append(fwd if part == "forward" else sum(v["total"] for v in c.values()) - fwd)
        cpu_ax.bar(list(x), heights, 0.6, bottom=bottom, color=color, label=f"stack CPU: {part}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    cpu_ax.set_ylabel("CPU ms per session-round")
    cpu_ax.legend()
    ax.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rows], 0.4, label="mesh")
    ax.bar(
        [i + 0.2 for i in x], [r["ideal_tokens_per_s"] for r in rows], 0.4, label="ideal (cost model, serial)"
    )
    cpu_ax.set_xticks(list(x), labels, fontsize=6, rotation=90)
    ax.set_ylabel("tokens/s (all sessions)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title("specmesh bench mesh: the mesh against its cost model")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write(rows: list[dict], cfg: MeshBenchConfig, json_path: str | None, md_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps({"config": asdict(cfg), "rows": rows}, indent=1))
    if md_path:
        Path(md_path).write_text(markdown(rows, cfg))


# ---- unary calls against one long-lived stream --------------------------------------------------


async def _transport_rtt(calls: int, size: int) -> dict[str, float]:
    """Mean round trip (ms) of `calls` sequential `size`-byte echoes over loopback gRPC: one unary
    call each, and one message each way on a single long-lived bidirectional stream."""
    import time

    import grpc

    async def unary(request: bytes, context) -> bytes:
        return request

    async def stream(requests, context):
        async for request in requests:
            yield request

    handler = grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    payload = b"x" * size
    out = {}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call_unary = channel.unary_unary("/bench.Echo/Unary")
            for _ in range(50):  # warm-up
                await call_unary(payload)
            start = time.perf_counter()
            for _ in range(calls):
                await call_unary(payload)
            out["unary_ms"] = (time.perf_counter() - start) * 1000 / calls
            call = channel.stream_stream("/bench.Echo/Stream")()
            for _ in range(50):
                await call.write(payload)
                await call.read()
            start = time.perf_counter()
            for _ in range(calls):
                await call.write(payload)
                await call.read()
            out["stream_ms"] = (time.perf_counter() - start) * 1000 / calls
            await call.done_writing()
    finally:
        await server.stop(None)
    return out


def transport_rtt(calls: int = 2000, size: int = 256) -> dict[str, float]:
    """`_transport_rtt` in its own event loop (uvloop, as the services run)."""
    import uvloop

    return uvloop.run(_transport_rtt(calls, size))
