"""specmesh.stack.supervisor with small real child processes (TCP and gRPC health servers)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from specmesh.stack.ports import free_port
from specmesh.stack.supervisor import ChildFailed, ChildSpec, Supervisor, grpc_ready, plan_stack, tcp_ready

CHILD = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    name, port, events, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]

    def record(what):
        with open(events, "a") as f:
            f.write(f"{name} {what}\\n")

    def on_signal(sig, frame):
        record(signal.Signals(sig).name)
        if mode != "ignore-term":
            sys.exit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if mode == "fail-early":
        print("cannot load the model", flush=True)
        sys.exit(3)
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", port))
    srv.listen()
    print(f"hello from {name}", flush=True)
    record("started")
    marker = events + "." + name + ".crashed"
    if mode == "crash" or (mode == "crash-once" and not os.path.exists(marker)):
        open(marker, "w").close()
        time.sleep(0.3)
        sys.exit(1)
    while True:
        time.sleep(0.05)
    """
)

GRPC_CHILD = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    import grpc
    from grpc_health.v1 import health, health_pb2_grpc
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port("127.0.0.1:" + sys.argv[1])
    server.start()
    server.wait_for_termination()
    """
)


@pytest.fixture
def child(tmp_path: Path):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    events = tmp_path / "events.txt"

    def make(name: str, mode: str = "serve", stage: int = 0, **options) -> ChildSpec:
        port = free_port()
        argv = [sys.executable, str(script), name, str(port), str(events), mode]
        return ChildSpec(name, argv, tcp_ready("127.0.0.1", port), stage=stage, **options)

    make.events = events  # type: ignore[attr-defined]
    return make


def events(make) -> list[str]:
    path = make.events
    return path.read_text().splitlines() if path.exists() else []


def test_stages_start_in_order_logs_are_prefixed_stop_is_reversed(child):
    async def scenario():
        out = io.StringIO()
        specs = [child("redis"), child("drafter-0", stage=1), child("drafter-1", stage=1)]
        sup = Supervisor([*specs, child("gateway", stage=2)], grace=5, output=out)
        await sup.start()
        assert events(child)[0] == "redis started" and events(child)[-1] == "gateway started"
        await sup.stop()
        stopped = [e.split()[0] for e in events(child) if e.endswith("SIGTERM")]
        assert stopped == ["gateway", "drafter-1", "drafter-0", "redis"]
        text = out.getvalue()
        assert "drafter-0 | hello from drafter-0" in text
        assert "gateway   | stopped (status 0)" in text  # names padded to one width

    asyncio.run(scenario())


def test_a_crashed_child_is_restarted(child):
    async def scenario():
        sup = Supervisor([child("verifier-0", "crash-once", restart_delay=0.05)], output=io.StringIO())
        await sup.start()
        first = sup.pid("verifier-0")
        deadline = time.monotonic() + 5
        while events(child).count("verifier-0 started") < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert events(child).count("verifier-0 started") == 2
        await asyncio.sleep(0.2)  # it is ready again, not crashing
        assert sup.pid("verifier-0") != first
        await sup.stop()
        assert "restart 1/3" in sup.output.getvalue()

    asyncio.run(scenario())


def test_restarts_are_bounded_then_the_stack_stops(child):
    async def scenario():
        sup = Supervisor(
            [child("redis"), child("drafter-0", "crash", stage=1, max_restarts=2, restart_delay=0.05)],
            output=io.StringIO(),
        )
        async with asyncio.timeout(20):
            status = await sup.run(install_signal_handlers=False)
        assert status == 1
        assert events(child).count("drafter-0 started") == 3  # the first run and two restarts
        assert "gave up after 2 restarts" in sup.output.getvalue()
        assert "redis SIGTERM" in events(child)  # the rest of the stack was stopped

    asyncio.run(scenario())


def _wait_for(predicate, timeout: float = 15.0):
    async def wait() -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            await asyncio.sleep(0.05)

    return wait()


def test_crashes_spread_over_time_never_exhaust_the_budget(child):
    """Issue 14, finding 8: the budget was per lifetime, so the 4th crash ever stopped the stack."""

    async def scenario():
        crashing = child("drafter-0", "crash", max_restarts=2, restart_window=0.25, restart_delay=0.05)
        sup = Supervisor([crashing], output=io.StringIO())
        await sup.start()
        await _wait_for(lambda: events(child).count("drafter-0 started") >= 5)  # > 2 restarts
        assert not sup._done.is_set()
        await sup.stop()

    asyncio.run(scenario())


def test_an_expendable_childs_crash_loop_leaves_the_others_serving(child):
    """Issue 14, finding 8: one drafter's crash loop stopped the stack, Redis and the healthy drafter
    included."""

    async def scenario():
        specs = [
            child("redis"),
            child("drafter-0", "crash", stage=1, max_restarts=1, restart_delay=0.05, expendable=True),
            child("drafter-1", stage=1),
        ]
        sup = Supervisor(specs, grace=5, output=io.StringIO())
        await sup.start()
        await _wait_for(lambda: "goes on without it" in sup.output.getvalue())
        await asyncio.sleep(0.3)
        assert not sup._done.is_set() and not any("SIG" in e for e in events(child))
        await sup.stop()
        assert "drafter-1 SIGTERM" in events(child) and "redis SIGTERM" in events(child)

    asyncio.run(scenario())


def test_the_children_die_with_a_sigkilled_supervisor(child, tmp_path):
    """Issue 14, finding 8: a SIGKILLed supervisor left its children running."""
    specs = [child("redis", stage=0), child("gateway", stage=1)]
    proc = _supervisor_process(specs)
    try:
        _wait_all_ready(proc)
        proc.kill()
        proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
    # A set, not a list: Linux sends the parent-death signal again each time the child is
    # reparented to another thread of the dying supervisor (asyncio's watcher threads), so one
    # child may record SIGTERM twice; what matters is that each got it (and each exits on it).
    deadline = time.monotonic() + 15
    while {e for e in events(child) if "SIG" in e} != {"gateway SIGTERM", "redis SIGTERM"}:
        assert time.monotonic() < deadline, events(child)
        time.sleep(0.05)


def test_a_child_that_fails_to_start_stops_the_stack_at_once(child):
    async def scenario():
        out = io.StringIO()
        sup = Supervisor([child("redis"), child("verifier-0", "fail-early", stage=1)], output=out)
        with pytest.raises(ChildFailed, match="verifier-0 exited with status 3 before it was ready"):
            await sup.start()
        await sup.stop()
        assert "verifier-0 | cannot load the model" in out.getvalue()
        slow = ChildSpec(
            "slow", [sys.executable, "-c", "import time; time.sleep(30)"], tcp_ready("127.0.0.1", 1)
        )
        start = time.monotonic()
        sup = Supervisor([slow, child("broken", "fail-early")], output=io.StringIO())
        with pytest.raises(ChildFailed, match="broken exited"):
            await sup.start()  # at once, not after slow's ready timeout
        await sup.stop()
        assert time.monotonic() - start < 5
        assert events(child) == ["redis started", "redis SIGTERM"]
        missing = Supervisor([ChildSpec("x", ["/nonexistent/binary"])], output=io.StringIO())
        with pytest.raises(ChildFailed, match="cannot start"):
            await missing.start()

    asyncio.run(scenario())


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace_period(child):
    async def scenario():
        sup = Supervisor([child("stubborn", "ignore-term")], grace=0.5, output=io.StringIO())
        await sup.start()
        start = time.monotonic()
        await sup.stop()
        assert 0.4 < time.monotonic() - start < 3
        assert "killing it" in sup.output.getvalue()
        assert events(child)[-1] == "stubborn SIGTERM"

    asyncio.run(scenario())


def test_a_second_stop_request_kills_at_once(child):
    async def scenario():
        sup = Supervisor(
            [child("a", "ignore-term"), child("b", "ignore-term")], grace=30, output=io.StringIO()
        )
        await sup.start()
        start = time.monotonic()
        sup.request_stop(signal.SIGINT)
        stopping = asyncio.create_task(sup.stop())
        await asyncio.sleep(0.3)
        sup.request_stop(signal.SIGINT)  # like a second Ctrl-C
        await stopping
        assert time.monotonic() - start < 5
        assert "b SIGINT" in events(child) and "a SIGINT" not in events(child)  # a: killed at once

    asyncio.run(scenario())


def test_not_ready_in_time(child):
    async def scenario():
        port = free_port()  # nothing listens there
        spec = ChildSpec(
            "slow", [sys.executable, "-c", "import time; time.sleep(30)"], tcp_ready("127.0.0.1", port)
        )
        spec.ready_timeout = 0.5
        sup = Supervisor([spec], grace=1, output=io.StringIO())
        with pytest.raises(ChildFailed, match="not ready after"):
            await sup.start()
        await sup.stop()

    asyncio.run(scenario())


def test_grpc_health_readiness(tmp_path):
    async def scenario():
        port = free_port()
        argv = [sys.executable, "-c", GRPC_CHILD, str(port)]
        address = f"127.0.0.1:{port}"
        assert not await grpc_ready(address)()
        sup = Supervisor(
            [ChildSpec("grpc", argv, grpc_ready(address), ready_timeout=30)], output=io.StringIO()
        )
        await sup.start()
        assert await grpc_ready(address)()
        await sup.stop()

    asyncio.run(scenario())


def test_sigint_to_the_supervisor_is_forwarded_in_reverse_order(child, tmp_path):
    """The real thing: a supervisor process gets Ctrl-C's SIGINT and passes it on."""
    specs = [child("redis", stage=0), child("verifier-0", stage=1), child("gateway", stage=2)]
    proc = _supervisor_process(specs)
    try:
        _wait_all_ready(proc)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    got = [e for e in events(child) if "SIG" in e]
    assert got == ["gateway SIGINT", "verifier-0 SIGINT", "redis SIGINT"]


def _supervisor_process(specs: list[ChildSpec]) -> subprocess.Popen:
    """A real supervisor process running `specs`; it prints ALL READY once they are."""
    program = textwrap.dedent(
        f"""
        import asyncio, sys
        from specmesh.stack.supervisor import ChildSpec, Supervisor, tcp_ready
        specs = [{", ".join(_spec_source(s) for s in specs)}]
        sup = Supervisor(specs, grace=5, on_ready=lambda: print("ALL READY", flush=True))
        sys.exit(asyncio.run(sup.run()))
        """
    )
    return subprocess.Popen(
        [sys.executable, "-c", program], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent
    )


def _wait_all_ready(proc: subprocess.Popen) -> None:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ALL READY" in line:
            return
    pytest.fail("".join(lines))


def _spec_source(spec: ChildSpec) -> str:
    port = spec.argv[3]
    return (
        f"ChildSpec({spec.name!r}, {list(spec.argv)!r}, tcp_ready('127.0.0.1', {port}), stage={spec.stage})"
    )


def test_plan_stack_runs_several_gateways_on_the_same_replicas():
    plan = plan_stack("d", "t", drafters=1, port=50100, http_port=8100, gateways=2, python="py")
    gateways = [s for s in plan.specs if s.name.startswith("gateway")]
    assert [g.name for g in gateways] == ["gateway", "gateway-1"]
    assert plan.gateways == [("127.0.0.1:50100", "127.0.0.1:8100"), ("127.0.0.1:50101", "127.0.0.1:8101")]
    assert (plan.gateway, plan.http) == plan.gateways[0]
    for g, port, http in zip(gateways, ("50100", "50101"), ("8100", "8101"), strict=True):
        assert g.argv[3:7] == ["--port", port, "--http-port", http]
        assert g.argv[7:] == ["--drafters", plan.drafters[0], "--verifiers", plan.verifiers[0]]
        assert g.env == {"SPECMESH_REDIS_URL": plan.redis_url}
    assert plan.metrics["gateway-1"] == "127.0.0.1:8101"
    plan.cleanup()


def test_the_ngram_drafters_and_verifiers_get_the_stacks_redis_in_their_environment_only():
    """They follow the gateways' outputs log (method suffix, suffix rides); the URL holds the
    password, so it is in no argv, and the model drafters do not get it."""
    plan = plan_stack("d", "t", drafters=1, ngram_drafters=2, python="py")
    envs = {s.name: s.env for s in plan.specs if s.name != "redis"}
    shared = {"SPECMESH_REDIS_URL": plan.redis_url}
    assert envs == {"drafter-0": None, "ngram-drafter-0": shared, "ngram-drafter-1": shared,
                    "verifier-0": shared, "gateway": shared}  # fmt: skip
    assert all(urlsplit(plan.redis_url).password not in " ".join(s.argv) for s in plan.specs)
    plan.cleanup()


def test_plan_stack_command_lines():
    plan = plan_stack("draft-dir", "target-dir", drafters=2, port=50099, dtype="bf16", python="py")
    names = [s.name for s in plan.specs]
    assert names == ["redis", "drafter-0", "drafter-1", "verifier-0", "gateway"]
    # one model replica at a time (each measures its forward costs at start-up), drafters first
    assert [s.stage for s in plan.specs] == [0, 1, 2, 3, 4]
    redis, d0, _, v0, gw = plan.specs
    # the private Redis runs from a config file (password, AOF, CONFIG / DEBUG / KEYS off) in a
    # directory that outlives its restarts; the password is in no argv, only in the gateway's env
    password = urlsplit(plan.redis_url).password
    assert os.path.basename(redis.argv[0]) == "redis-server" and len(redis.argv) == 2
    config = Path(redis.argv[1])
    assert config.parent == Path(plan.redis_dir) and config.stat().st_mode & 0o077 == 0
    text = config.read_text()
    assert f"requirepass {password}\n" in text and "appendonly yes\nappendfsync everysec\n" in text
    assert 'rename-command CONFIG ""' in text and 'rename-command KEYS ""' in text
    assert f'dir "{plan.redis_dir}"' in text and len(password) >= 32
    assert all(password not in " ".join(spec.argv) for spec in plan.specs)
    assert gw.env == {"SPECMESH_REDIS_URL": plan.redis_url}
    assert d0.argv[:5] == ["py", "-m", "drafter_service", "--model", "draft-dir"]
    assert v0.argv[:5] == ["py", "-m", "verifier_service", "--model", "target-dir"]
    assert d0.argv[-2:] == ["--dtype", "bf16"]
    assert f"--port {plan.drafters[0].rpartition(':')[2]}" in " ".join(d0.argv)
    assert gw.argv == [
        "py",
        "-m",
        "gateway",
        "--port",
        "50099",
        "--http-port",
        "8000",
        "--drafters",
        ",".join(plan.drafters),
        "--verifiers",
        plan.verifiers[0],
    ]
    assert len(set(plan.drafters + plan.verifiers)) == 3
    assert plan.http == "127.0.0.1:8000" and plan.metrics["gateway"] == plan.http
    for spec in (d0, v0):  # every replica serves /metrics on its own port
        port = spec.argv[spec.argv.index("--metrics-port") + 1]
        assert plan.metrics[spec.name] == f"127.0.0.1:{port}"
    plan.cleanup()
    assert not Path(plan.redis_dir).exists()
    external = plan_stack("d", "t", drafters=1, redis_url="redis://:pw@cache:6379/0", python="py")
    assert [s.name for s in external.specs] == ["drafter-0", "verifier-0", "gateway"]
    assert external.specs[-1].env == {"SPECMESH_REDIS_URL": "redis://:pw@cache:6379/0"}
    assert external.redis_dir == "" and "--redis-url" not in external.specs[-1].argv


@pytest.mark.parametrize("module", ["verifier_service", "drafter_service", "gateway"])
def test_sigint_before_serving_stops_a_service_without_a_traceback(module, tmp_path):
    """`specmesh up` stopped while a service still imports or loads its model: the SIGINT it
    forwards ends the service quietly (as SIGTERM does), not with a KeyboardInterrupt traceback."""
    from specmesh.bench.tiny import save_tiny_pair

    model = save_tiny_pair(tmp_path)["target"]
    argv = [sys.executable, "-m", module, "--port", str(free_port()), "--metrics-port", "0"]
    if module == "gateway":
        argv += ["--drafters", "127.0.0.1:1", "--verifiers", "127.0.0.1:1", "--tokenizer", str(model)]
    else:
        argv += ["--model", str(model), "--backend", "torch", "--dtype", "fp32"]
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent)
    time.sleep(1.0)  # importing torch alone takes longer
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Traceback" not in err, err[-2000:]
    assert proc.returncode in (-signal.SIGINT, 0), err[-2000:]
