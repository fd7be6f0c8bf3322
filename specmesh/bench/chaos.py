"""`specmesh bench chaos`: concurrent seeded streams through a whole local stack while its processes
are killed, paused and restarted; every request's tokens against an undisturbed run of the same
request.

The stack is `specmesh up`'s (plan_stack + Supervisor, in this process's event loop, so the
supervisor restarts what dies as it would in production) on tiny models: Redis, 2 drafters, 1
verifier and the gateway. `streams` clients each send requests back to back for `seconds`
(greedy and seeded T = 1 alternating by stream, fixed speculation shapes so sampled outputs are
reproducible) while the faults fire at fixed fractions of the run:

    0.15  SIGKILL a drafter           (the supervisor restarts it; its sessions move to the spare)
    0.35  SIGSTOP the other drafter   (for `pause_seconds`, then SIGCONT; the per-try timeout moves
                                       its sessions to the spare)
    0.55  SIGKILL the verifier        (restarted; sessions wait for it, then resync)
    0.75  SIGTERM Redis               (restarted from its append-only file; the gateway reconnects)

Each fault waits until the stack is whole again after the one before (a killed child restarted
and ready, and a few seconds for the gateway's health checks to see it), so the pause always
finds a spare drafter.

Afterwards every request is sent again on the quiet stack and the tokens compared. A stall is the
longest wait for a stream's next chunk (or its first); stalls are reported per fault, as the fault
last begun when the wait ended, so the drafter faults' stalls can be held against the per-try
timeout (with a spare drafter a stall should not exceed two of them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc

from specmesh.bench.tiny import save_tiny_pair
from specmesh.rpc.proto import load
from specmesh.stack.ports import free_port
from specmesh.stack.supervisor import ChildSpec, Supervisor, plan_stack

# The shapes the streams cycle through (gateway Speculation fields)
SHAPES: tuple[dict[str, Any], ...] = (
    {"method": "chain", "depth": 4},
    {"method": "mcsd", "depth": 3, "branching": [2, 2, 1]},
    {"method": "rsd_c", "depth": 3, "branching": [2, 1, 1]},
    {"method": "none"},
)
QUIET = "quiet"  # the fault label of the time before the first fault
# after a child is back, before the next fault: the gateway's health checks (every second) must
# have seen it, or the drafter pause could find the restarted drafter not yet a spare
SETTLE_SECONDS = 3.0
HUNG_SECONDS = 60.0  # a stream without a chunk this long: the gateway is asked where its tasks wait


@dataclass(frozen=True)
class ChaosConfig:
    streams: int = 16
    seconds: float = 120.0
    max_new_tokens: int = 48
    pause_seconds: float = 10.0
    seed: int = 0
    try_timeout_floor: float = 2.0  # the gateway's --try-timeout-floor
    log: str | None = None  # where the stack's output goes (default: a temp file)


@dataclass(frozen=True)
class Fault:
    at: float  # fraction of the run
    name: str
    child: str
    signal: int
    resume_after: float | None = None  # SIGCONT after this many seconds


def faults(cfg: ChaosConfig) -> list[Fault]:
    return [
        Fault(0.15, "drafter killed", "drafter-0", signal.SIGKILL),
        Fault(0.35, "drafter paused", "drafter-1", signal.SIGSTOP, cfg.pause_seconds),
        Fault(0.55, "verifier restarted", "verifier-0", signal.SIGKILL),
        Fault(0.75, "redis restarted", "redis", signal.SIGTERM),
    ]


@dataclass
class Outcome:
    """One request of the chaos phase."""

    stream: int
    index: int
    tokens: list[int] = field(default_factory=list)
    error: str = ""
    stalls: list[tuple[float, float]] = field(default_factory=list)  # (end time, seconds waited)
    waiting_since: float | None = None  # while the request runs: its last chunk's time (or start's)


def request_of(pb2: Any, stream: int, index: int, cfg: ChaosConfig) -> Any:
    rng = random.Random(cfg.seed * 1_000_003 + stream * 1009 + index)
    prompt = " ".join(f"w{rng.randrange(1, 90)}" for _ in range(8))
    sampling = pb2.Sampling(temperature=0.0 if stream % 2 == 0 else 1.0, seed=rng.randrange(1, 2**31))
    shape = SHAPES[(stream // 2) % len(SHAPES)]
    return pb2.GenerateRequest(
        prompt=prompt,
        max_new_tokens=cfg.max_new_tokens,
        sampling=sampling,
        speculation=pb2.Speculation(**shape),
    )


async def _stream(stub: Any, request: Any, outcome: Outcome) -> None:
    last = outcome.waiting_since = time.monotonic()
    try:
        async for chunk in stub.GenerateStream(request, timeout=300):
            now = outcome.waiting_since = time.monotonic()
            outcome.stalls.append((now, now - last))
            last = now
            outcome.tokens += chunk.token_ids
    except grpc.aio.AioRpcError as exc:
        outcome.error = f"{exc.code().name}: {exc.details()}"
    finally:
        outcome.waiting_since = None


async def _watch_for_hangs(sup: Supervisor, live: list[Outcome], hung: list[str]) -> None:
    """A request with no chunk for HUNG_SECONDS: SIGUSR1 the gateway once, so that its log says
    which await every task waits in (specmesh/rpc/server.py, dump_tasks)."""
    while not hung:
        await asyncio.sleep(5.0)
        now = time.monotonic()
        for o in live:
            if o.waiting_since is not None and now - o.waiting_since > HUNG_SECONDS:
                hung.append(f"stream {o.stream} request {o.index}")
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(sup.pid("gateway"), signal.SIGUSR1)  # type: ignore[arg-type]
                break


async def _client(
    stub: Any, pb2: Any, stream: int, cfg: ChaosConfig, until: float, live: list[Outcome]
) -> list[Outcome]:
    outcomes = []
    index = 0
    while time.monotonic() < until:
        outcome = Outcome(stream, index)
        live.append(outcome)
        await _stream(stub, request_of(pb2, stream, index, cfg), outcome)
        outcomes.append(outcome)
        index += 1
    return outcomes


async def _inject(
    sup: Supervisor, specs: dict[str, ChildSpec], plan: list[Fault], start: float, seconds: float,
    fired: list[tuple[float, str]], recovered: dict[str, float],
) -> None:  # fmt: skip
    """Fire the faults in turn; each waits for the stack to be whole again after the one before
    (a restarted child ready), so the drafter pause always has a spare drafter."""
    for fault in plan:
        await asyncio.sleep(max(0.0, start + fault.at * seconds - time.monotonic()))
        pid = sup.pid(fault.child)
        if pid is None:
            continue
        began = time.monotonic()
        fired.append((began, fault.name))
        os.kill(pid, fault.signal)
        if fault.resume_after is not None:
            await asyncio.sleep(fault.resume_after)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        else:
            await _restarted(sup, specs[fault.child], pid)
        recovered[fault.name] = round(time.monotonic() - began, 2)
        await asyncio.sleep(SETTLE_SECONDS)


async def _restarted(sup: Supervisor, spec: ChildSpec, old_pid: int, timeout: float = 180.0) -> None:
    """Until the supervisor has restarted the child and it is ready again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = sup.pid(spec.name)
        if pid is not None and pid != old_pid and (spec.ready is None or await spec.ready()):
            return
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{spec.name} was not restarted within {timeout:g} s")


def _fault_at(fired: Sequence[tuple[float, str]], when: float) -> str:
    label = QUIET
    for t, name in fired:
        if t <= when:
            label = name
    return label


async def run_chaos(cfg: ChaosConfig, models: dict[str, Path], log: Any) -> dict:
    plan = plan_stack(  # a free port: a gateway already on 50051 (a user's, another run's) broke the run
        str(models["draft"]), str(models["target"]), drafters=2, port=free_port(), dtype="fp32", http_port=0,
        drafter_args=["--torch-threads", "1"], verifier_args=["--torch-threads", "1"],
        gateway_args=["--try-timeout-floor", str(cfg.try_timeout_floor)],
    )  # fmt: skip
    sup = Supervisor(plan.specs, output=log)
    pb2, pb2_grpc = load("gateway")
    try:
        await sup.start()  # a failure leaves the children it started running: stopped below
        async with grpc.aio.insecure_channel(plan.gateway) as channel:
            stub = pb2_grpc.GatewayStub(channel)
            await stub.Generate(request_of(pb2, 0, -1, cfg), timeout=120)  # warm-up
            start = time.monotonic()
            fired: list[tuple[float, str]] = []
            recovered: dict[str, float] = {}
            specs = {s.name: s for s in plan.specs}
            injector = asyncio.create_task(
                _inject(sup, specs, faults(cfg), start, cfg.seconds, fired, recovered)
            )
            live: list[Outcome] = []
            hung: list[str] = []
            watch = asyncio.create_task(_watch_for_hangs(sup, live, hung))
            clients = [_client(stub, pb2, s, cfg, start + cfg.seconds, live) for s in range(cfg.streams)]
            per_stream = await asyncio.gather(*clients)
            watch.cancel()
            await injector
            chaos_seconds = time.monotonic() - start
            outcomes = [o for stream in per_stream for o in stream]
            for pid in (sup.pid(f.child) for f in faults(cfg)):  # the stack whole and quiet again
                with contextlib.suppress(ProcessLookupError, TypeError):
                    os.kill(pid, signal.SIGCONT)
            quiet = await _replay(stub, pb2, outcomes, cfg)
    finally:
        await sup.stop()
        plan.cleanup()  # the private Redis's directory (its AOF: ~20 MB a run)
    summary = _summary(cfg, outcomes, quiet, fired, chaos_seconds)
    return {**summary, "back_after_seconds": recovered, "hung": hung}


async def _replay(stub: Any, pb2: Any, outcomes: list[Outcome], cfg: ChaosConfig) -> list[Outcome]:
    """Every request again, `streams` at a time, on the undisturbed stack."""
    out = []
    for first in range(0, len(outcomes), cfg.streams):
        batch = [Outcome(o.stream, o.index) for o in outcomes[first : first + cfg.streams]]
        await asyncio.gather(*(_stream(stub, request_of(pb2, o.stream, o.index, cfg), o) for o in batch))
        out += batch
    return out


def _summary(
    cfg: ChaosConfig,
    outcomes: list[Outcome],
    quiet: list[Outcome],
    fired: list[tuple[float, str]],
    seconds: float,
) -> dict:
    failed = [o for o in outcomes if o.error]
    changed = [o for o, q in zip(outcomes, quiet, strict=True) if not o.error and o.tokens != q.tokens]
    replay_failed = [q for q in quiet if q.error]
    stalls: dict[str, float] = {}
    for o in outcomes:
        for end, waited in o.stalls:
            label = _fault_at(fired, end)
            stalls[label] = max(stalls.get(label, 0.0), waited)
    streams_failed = len({o.stream for o in failed})
    drafter_stall = max(stalls.get("drafter killed", 0.0), stalls.get("drafter paused", 0.0))
    return {
        "config": {k: v for k, v in asdict(cfg).items() if k != "log"},
        "seconds": round(seconds, 1),
        "requests": len(outcomes),
        "tokens": sum(len(o.tokens) for o in outcomes),
        "faults": [name for _, name in fired],
        "failed_requests": len(failed),
        "failed_streams": streams_failed,
        "errors": sorted({o.error for o in failed})[:10],
        "changed_requests": len(changed),
        "replay_failed": len(replay_failed),
        "longest_stall_by_fault": {k: round(v, 2) for k, v in sorted(stalls.items())},
        "longest_drafter_fault_stall": round(drafter_stall, 2),
        "stall_limit": 2 * cfg.try_timeout_floor,
        "ok": not failed and not changed and not replay_failed and drafter_stall <= 2 * cfg.try_timeout_floor,
    }


def bench_chaos(cfg: ChaosConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="specmesh-chaos-") as tmp:
        models = save_tiny_pair(Path(tmp))
        log_path = cfg.log or str(Path(tmp) / "stack.log")
        with open(log_path, "w") as log:
            return asyncio.run(run_chaos(cfg, models, log))


def write(result: dict, json_path: str | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
