"""Method suffix as it runs: the model-free drafter (`drafter_service --backend ngram`) beside a
verifier, and behind a gateway whose finished outputs go to the outputs log in Redis. The text is
the plain steps' text (lossless whatever was proposed), outputs teach the drafters through the log
(a drafter that starts late replays it), and a private request teaches nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from specmesh.core.drafting import TreeSpec
from specmesh.core.rounds import Request
from specmesh.core.sampling import SamplingParams
from specmesh.rpc import wire
from specmesh.rpc.outputs_log import STREAM
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.models import load_model
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, gateway_stub, redis_client, replica, start_all, stop_all, wait_until
from tests.test_gateway import make_request
from tests.test_ngram_services import CASES, REPEATING
from tests.test_services import LIMIT_FLAGS, Stack, remote, running

pytestmark = pytest.mark.xdist_group("suffix_services")

SUFFIX = TreeSpec("suffix", depth=4, beam_width=2)
TOKENS = "specmesh:drafter_suffix_tokens"


@pytest.fixture(scope="module")
def pair(models, tmp_path_factory) -> Iterator[tuple[Stack, SpeculativeEngine]]:
    """A model-free drafter and a torch verifier; the in-process engine on the target."""
    logs = tmp_path_factory.mktemp("suffix-pair")
    target = models["target"]
    stack = Stack(
        replica("drafter_service", target, logs / "ngram.log", [*LIMIT_FLAGS, "--backend", "ngram"]),
        replica("verifier_service", target, logs / "verifier.log", LIMIT_FLAGS),
    )
    with running(stack) as s:
        engine_target = load_model(target, dtype="fp32", device="cpu")
        yield s, SpeculativeEngine(engine_target, engine_target)


@pytest.mark.parametrize("case", list(CASES))
def test_suffix_through_the_services_is_the_plain_steps_text(pair, case: str) -> None:
    """Proposed tokens are kept only where they equal the target's own draw at their position: the
    seeded text is the plain decode's, at T = 0 the target's greedy decode, whatever was proposed."""
    stack, engine = pair
    got = remote(stack, Request(REPEATING, SUFFIX, CASES[case], 24))
    plain = engine.generate_many([Request(REPEATING, TreeSpec("none"), CASES[case], 24)])[0]
    assert got.token_ids == plain.token_ids
    assert got.stats.drafted_tokens > 0


def test_the_engine_drafts_suffix_trees_with_the_same_text(pair) -> None:
    _, engine = pair
    params = SamplingParams(1.0, seed=11)
    got = engine.generate_many([Request(REPEATING, SUFFIX, params, 24)])[0]
    plain = engine.generate_many([Request(REPEATING, TreeSpec("none"), params, 24)])[0]
    assert got.token_ids == plain.token_ids and got.stats.drafted_tokens > 0


# ---- the outputs log: what the mesh generated teaches every suffix drafter -----------------------


@dataclass
class Mesh:
    redis: RedisServer
    drafters: list[Server]
    verifier: Server
    gateway: Server
    logs: object


@pytest.fixture(scope="module")
def mesh(models, tmp_path_factory) -> Iterator[Mesh]:
    logs = tmp_path_factory.mktemp("suffix-mesh")
    with RedisServer() as redis_server:
        shared = ["--backend", "ngram", "--redis-url", redis_server.url]
        drafters = [
            replica("drafter_service", models["target"], logs / f"ngram-{i}.log", shared) for i in range(2)
        ]
        # the verifier follows the log too: the default's plain steps ride its suffix trees
        verifier = replica(
            "verifier_service", models["target"], logs / "verifier.log", ["--redis-url", redis_server.url]
        )
        args = [
            *("--ngram-drafters", ",".join(d.address for d in drafters), "--verifiers", verifier.address),
            *("--redis-url", redis_server.url, "--round-timeout", "30"),
        ]
        gateway = Server("gateway", args, logs / "gateway.log")
        try:
            start_all(*drafters, verifier, gateway)
            yield Mesh(redis_server, drafters, verifier, gateway, logs)
        finally:
            stop_all(*drafters, verifier, gateway)


def learnt(server: Server, gauge: str = TOKENS) -> float:
    return server.metrics().get((gauge, ()), 0.0)


def log_length(url: str) -> int:
    with redis_client(url) as client:
        try:
            return client.xlen(STREAM)
        except redis.ResponseError:
            return 0


def test_outputs_teach_every_drafter_through_the_log_and_private_ones_none(mesh) -> None:
    request = make_request(SUFFIX, max_new_tokens=16)
    with gateway_stub(mesh.gateway.address) as stub:
        request.private = True
        first = stub.Generate(request, timeout=60)  # nothing learnt yet, and it teaches nothing
        request.private = False
        second = stub.Generate(request, timeout=60)
        for d in mesh.drafters:  # both drafters, whichever served it
            wait_until(lambda d=d: learnt(d) == 16, what=f"{d.address} learnt the output")
        # the same request again: its drafts now come from the second one's output
        third = stub.Generate(request, timeout=60)
    wait_until(lambda: log_length(mesh.redis.url) == 2, what="the two outputs in the log")
    time.sleep(0.5)  # a private output published late would show here
    assert log_length(mesh.redis.url) == 2
    assert all(learnt(d) == 32 for d in mesh.drafters)
    assert list(first.token_ids) == list(second.token_ids) == list(third.token_ids)
    assert third.stats.accepted_tokens > first.stats.accepted_tokens
    assert third.stats.accepted_tokens >= 12  # most of the 16 tokens came drafted


def suffix_tree_of(address: str, session_id: str, tokens: list[int]) -> list[tuple[int, int]]:
    """The drafter's suffix tree after `tokens` (a session of its own, released): (token, parent)
    per node."""
    with grpc.insecure_channel(address) as channel:
        stub = pb2_grpc.DrafterStub(channel)
        request = wire.draft_request(session_id, 0, tokens, SamplingParams(0.0, seed=1), SUFFIX)
        got = stub.Draft(request, timeout=30)
        stub.Release(pb2.ReleaseRequest(session_id=session_id), timeout=30)
    return list(zip(got.tree.tokens, got.tree.parents, strict=True))


def test_a_drafter_that_starts_late_replays_the_log(mesh, models) -> None:
    """A drafter started after the mesh generated replays the log: it holds what the others learnt
    and proposes the same trees they do, so it drafts as well from its first request."""
    request = make_request(SUFFIX, max_new_tokens=8)
    with gateway_stub(mesh.gateway.address) as stub:
        output = list(stub.Generate(request, timeout=60).token_ids)
    wait_until(lambda: log_length(mesh.redis.url) >= 1, what="an output in the log")
    held = log_length(mesh.redis.url)
    late = replica(
        "drafter_service", models["target"], mesh.logs / "ngram-late.log",
        ["--backend", "ngram", "--redis-url", mesh.redis.url],
    )  # fmt: skip
    start_all(late)
    try:
        want = learnt(mesh.drafters[0])
        wait_until(lambda: learnt(late) == want, what="the late drafter replayed the log")
        assert held >= 1 and want > 0
        prompt = list(request.prompt_token_ids.ids)
        for k in (2, 4, 6):  # after the prompt and part of the output the log holds
            context = prompt + output[:k]
            early = suffix_tree_of(mesh.drafters[0].address, f"early-{k}", context)
            assert early  # it proposes something here ...
            assert suffix_tree_of(late.address, f"late-{k}", context) == early  # ... and so does the late one
    finally:
        stop_all(late)


def test_a_suffix_tree_past_the_replicas_node_limit_is_refused_naming_the_field(mesh) -> None:
    request = make_request(SUFFIX, max_new_tokens=4)
    request.speculation.depth, request.speculation.beam_width = 16, 8  # 128 nodes
    with gateway_stub(mesh.gateway.address) as stub, pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "speculation" in refused.value.details() and "--max-tree-nodes" in refused.value.details()


def test_the_default_rides_the_suffix_trees_of_what_the_mesh_generated(mesh) -> None:
    """No speculation asked: the default's plain steps carry the verifier's suffix trees, looked up
    in the outputs the verifier learnt from the log. A private answer teaches nothing; once a
    public one is in the log the same request rides it (its tokens come drafted), and the text
    stays the plain decode's. Last in the module: it adds to the log."""
    request = make_request(TreeSpec("none"), max_new_tokens=16)
    request.ClearField("speculation")  # the default
    request.prompt_token_ids.ids[:] = list(range(40, 60))  # no other test's prompt: its own outputs
    gauge = "specmesh:verifier_suffix_tokens"
    with gateway_stub(mesh.gateway.address) as stub:
        before = learnt(mesh.verifier, gauge)
        request.private = True
        first = stub.Generate(request, timeout=60)
        time.sleep(0.5)  # a private output published late would show here
        assert learnt(mesh.verifier, gauge) == before
        request.private = False
        stub.Generate(request, timeout=60)
        wait_until(lambda: learnt(mesh.verifier, gauge) == before + 16, what="the verifier learnt it")
        third = stub.Generate(request, timeout=60)
    assert list(first.token_ids) == list(third.token_ids)
    assert third.stats.accepted_tokens >= first.stats.accepted_tokens + 8  # most of 16 came riding
