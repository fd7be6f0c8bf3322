"""DSI through the gateway (gateway/dsi.py): a real Redis, one drafter, three verifiers and the
gateway as processes on the tiny models, driven over the public gRPC API.

The replicas run with the benchmark knob --forward-latency-ms (verifier 40 ms, drafter 2 ms a
forward), the DSI regime: a block of 3 drafts in ~8 ms while a verification takes 40, so several
verifications of one session are in flight at once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from specmesh.core.sampling import SamplingParams
from specmesh.rpc.flags import Limits
from specmesh.runtime.models import load_model
from specmesh.stack.redis_server import RedisServer
from tests.servers import (
    Server,
    gateway_stub,
    redis_client,
    replica,
    session_keys,
    start_all,
    stop_all,
    wait_until,
)
from tests.test_engine import PROMPT, hf_greedy
from tests.test_gateway import LONG, gateway_grpc, gateway_pb2, stream

pytestmark = pytest.mark.xdist_group("gateway-dsi")

VERIFIERS = 3
LOOKAHEAD = 3
GREEDY = SamplingParams(0.0)


@dataclass
class DsiStack:
    redis: RedisServer
    drafter: Server
    verifiers: list[Server]
    gateway: Server


@pytest.fixture(scope="module")
def dsi_stack(models, tmp_path_factory) -> Iterator[DsiStack]:
    logs = tmp_path_factory.mktemp("dsi-stack")
    with RedisServer() as redis_server:
        fast, slow = ["--forward-latency-ms", "2"], ["--forward-latency-ms", "40"]
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log", fast)
        verifiers = [
            replica("verifier_service", models["target"], logs / f"verifier-{i}.log", slow)
            for i in range(VERIFIERS)
        ]
        gateway = Server("gateway", gateway_args(drafter, verifiers, redis_server), logs / "gateway.log")
        servers = [drafter, *verifiers, gateway]
        try:
            start_all(*servers)
            yield DsiStack(redis_server, drafter, verifiers, gateway)
        finally:
            stop_all(*servers)


def gateway_args(drafter: Server, verifiers: list[Server], redis_server: RedisServer) -> list[str]:
    return [
        *("--drafters", drafter.address, "--verifiers", ",".join(v.address for v in verifiers)),
        *("--redis-url", redis_server.url, "--max-new-tokens-limit", "200"),
        *("--health-interval", "0.2", "--round-timeout", "30", "--dsi-max-parallel", str(VERIFIERS)),
    ]


@pytest.fixture(scope="module")
def stub(dsi_stack) -> Iterator:
    with gateway_stub(dsi_stack.gateway.address) as stub:
        yield stub


@pytest.fixture(scope="module")
def one_verifier_stub(dsi_stack, tmp_path_factory) -> Iterator:
    """A second gateway on the same Redis and drafter that knows only the first verifier."""
    args = gateway_args(dsi_stack.drafter, dsi_stack.verifiers[:1], dsi_stack.redis)
    gateway = Server("gateway", args, tmp_path_factory.mktemp("dsi-one") / "gateway.log")
    try:
        start_all(gateway)
        with grpc.insecure_channel(gateway.address) as channel:
            yield gateway_grpc.GatewayStub(channel)
    finally:
        stop_all(gateway)


@pytest.fixture(scope="module")
def target_greedy(models) -> list[int]:
    target = load_model(models["target"], dtype="fp32", device="cpu")
    return hf_greedy(target.model, PROMPT, LONG)


@pytest.fixture(scope="module")
def raw_redis(dsi_stack) -> Iterator[redis.Redis]:
    with redis_client(dsi_stack.redis.url) as client:
        yield client


def dsi_request(
    n: int, parallel: int = 0, depth: int = LOOKAHEAD, params: SamplingParams = GREEDY, **extra
) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=PROMPT),
        max_new_tokens=n,
        speculation=gateway_pb2.Speculation(dsi=True, depth=depth, parallel=parallel, **extra),
    )
    request.sampling.temperature = params.temperature
    if params.seed is not None:
        request.sampling.seed = params.seed
    return request


def assert_released(stack: DsiStack, raw_redis: redis.Redis) -> None:
    assert session_keys(raw_redis) == []
    for server in (stack.drafter, *stack.verifiers):
        idle = lambda s=server: s.metrics()[("specmesh:num_sessions", ())] == 0  # noqa: E731
        wait_until(idle, what=f"{server.module} release")


@pytest.mark.parametrize("parallel", [1, 2, 3])
def test_dsi_greedy_equals_the_targets_greedy_decode(
    stub, dsi_stack, raw_redis, target_greedy, parallel: int
) -> None:
    n = 60
    unary = stub.Generate(dsi_request(n, parallel), timeout=120)
    streamed = stream(stub, dsi_request(n, parallel))
    assert list(unary.token_ids) == target_greedy[:n] == streamed.token_ids
    stats = unary.stats
    assert (stats.dsi_lookahead, stats.dsi_parallel, stats.dsi_ahead) == (LOOKAHEAD, parallel, True)
    assert 1 <= stats.dsi_max_in_flight <= parallel
    if parallel > 1:
        assert stats.dsi_max_in_flight > 1  # verifications really overlapped
    assert stats.generated_tokens == n and stats.drafted_tokens > 0
    if parallel == 1:
        assert stats.accepted_tokens > 0
    # else guards run: they decide each position where this noisy pair disagrees (its greedy
    # agreement is ~0.2), and a block's first token when it matches, so accepted may be 0
    assert_released(dsi_stack, raw_redis)


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_lookahead_at_the_replicas_deepest_tree_stays_within_it(stub, target_greedy, parallel: int) -> None:
    """DSI drafts one token more than its lookahead while every verifier is busy (so that the
    lookahead is still verified after a bonus); at --max-depth (16, the replicas' too) that
    extra token would be a tree the drafter refuses."""
    depth = Limits().max_depth
    reply = stub.Generate(dsi_request(40, parallel, depth=depth), timeout=120)
    assert list(reply.token_ids) == target_greedy[:40]
    assert reply.stats.dsi_lookahead == depth


def test_dsi_sampling_gives_the_requested_length(stub, dsi_stack, raw_redis) -> None:
    reply = stub.Generate(dsi_request(40, 3, params=SamplingParams(1.0, seed=7)), timeout=120)
    assert len(reply.token_ids) == 40 or reply.finish_reason == "stop"
    assert reply.stats.rounds > 0 and reply.stats.dsi_parallel == 3
    assert_released(dsi_stack, raw_redis)


def test_the_gateway_chooses_when_dsi_leaves_depth_and_parallel_unset(stub, target_greedy) -> None:
    reply = stub.Generate(dsi_request(20, parallel=0, depth=0), timeout=120)
    assert list(reply.token_ids) == target_greedy[:20]
    assert reply.stats.dsi_lookahead >= 1 and 1 <= reply.stats.dsi_parallel <= VERIFIERS
    if not reply.stats.dsi_ahead:
        assert reply.stats.dsi_parallel == reply.stats.dsi_max_in_flight == 1


def test_with_one_verifier_the_gateway_chooses_the_schedule_and_a_set_parallel_is_kept(
    one_verifier_stub, dsi_stack, raw_redis, target_greedy
) -> None:
    # One verifier: left to the gateway, the schedule (drafting ahead or SI's, which
    # tests/test_dsi.py shows choose_shape picking from costs) is reported in the stats, one
    # verification at a time; a parallel the request sets drafts ahead. Both give the target's
    # greedy decode.
    n = 30
    auto = one_verifier_stub.Generate(dsi_request(n, parallel=0, depth=1), timeout=120)
    fixed = one_verifier_stub.Generate(dsi_request(n, parallel=1, depth=1), timeout=120)
    assert list(auto.token_ids) == list(fixed.token_ids) == target_greedy[:n]
    assert (auto.stats.dsi_lookahead, auto.stats.dsi_parallel) == (1, 1)
    assert auto.stats.dsi_max_in_flight == 1
    assert (fixed.stats.dsi_parallel, fixed.stats.dsi_ahead, fixed.stats.dsi_max_in_flight) == (1, True, 1)
    assert_released(dsi_stack, raw_redis)


@pytest.mark.parametrize(
    "extra,field",
    [
        ({"method": "rsd_s"}, "speculation.method"),
        ({"adaptive": True}, "speculation.adaptive"),
        ({"beam_width": 2}, "speculation.beam_width"),
        ({"parallel": VERIFIERS + 1}, "speculation.parallel"),
    ],
)
def test_bad_dsi_requests_are_refused_naming_the_field(stub, dsi_stack, raw_redis, extra, field) -> None:
    parallel = extra.pop("parallel", 0)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(dsi_request(10, parallel, **extra), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith(field)
    assert session_keys(raw_redis) == []


def test_parallel_without_dsi_is_refused(stub) -> None:
    request = dsi_request(10)
    request.speculation.dsi = False
    request.speculation.parallel = 2
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("speculation.parallel")


def test_a_cancelled_dsi_stream_releases_its_session_on_every_replica(stub, dsi_stack, raw_redis) -> None:
    call = stub.GenerateStream(dsi_request(LONG, VERIFIERS), timeout=60)
    first = next(call)
    assert raw_redis.exists(f"specmesh:{{{first.session_id}}}:meta")
    call.cancel()
    wait_until(lambda: not session_keys(raw_redis), what="the session's keys to go")
    assert_released(dsi_stack, raw_redis)


def test_the_clients_deadline_ends_a_dsi_session_everywhere(stub, dsi_stack, raw_redis) -> None:
    with pytest.raises(grpc.RpcError) as error:
        stub.Generate(dsi_request(LONG, VERIFIERS), timeout=0.3)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: not session_keys(raw_redis), what="the session's keys to go")
    assert_released(dsi_stack, raw_redis)


def test_a_verifier_killed_with_dsi_verifications_in_flight_changes_no_token(
    stub, dsi_stack, raw_redis, target_greedy
) -> None:
    victim = dsi_stack.verifiers[0]
    name = ("specmesh:failovers_total", (("role", "verifier"),))

    def kill(_chunk) -> None:
        os.kill(victim.proc.pid, signal.SIGKILL)

    # Whether the victim holds one of the session's calls at the first chunk is timing: when it
    # holds none, the health check drops it and no call fails. Every try must give the same tokens;
    # the tries end once one killed a call in flight (a failover), which the test then requires.
    for _ in range(3):
        before = dsi_stack.gateway.metrics().get(name, 0)
        try:
            streamed = stream(stub, dsi_request(LONG, VERIFIERS), after_first=kill)
            # every token once, in order: a duplicate or a lost commit would shift the sequence
            assert streamed.token_ids == target_greedy[:LONG]
            assert streamed.last.finish_reason == "length"
        finally:
            victim.proc.wait()
            victim.start()
            victim.wait_serving()
        failed_over = dsi_stack.gateway.metrics().get(name, 0) > before
        if failed_over:
            break
        time.sleep(1.0)  # five health intervals: the gateway takes the restarted victim back
    assert failed_over
    assert session_keys(raw_redis) == []
