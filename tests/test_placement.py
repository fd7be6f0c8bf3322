"""A session's placement (gateway/placement.py) and its committed transcript (gateway/transcript.py)
on their own: real replicas' health servers in real pools, a real redis-server, no gateway. The
whole round path through them: tests/test_gateway.py, tests/test_resume.py, tests/test_chaos.py."""

from __future__ import annotations

import asyncio
import uuid

import grpc
import pytest

from gateway.env import GatewayEnv, GatewayError, Piece
from gateway.metrics import GatewayMetrics
from gateway.placement import Placer
from gateway.pools import ReplicaPool
from gateway.requests import GenerationPlan
from gateway.retries import RetryBudget
from gateway.session_store import SessionStore
from gateway.text import TextStream
from gateway.transcript import Transcript
from specmesh.bench.tiny import make_byte_tokenizer
from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationStats
from specmesh.rpc.round_client import ReplicaFailure, Role
from specmesh.rpc.tick_client import ItemError
from specmesh.stack.redis_server import RedisServer
from tests.test_pools import FAST, servers, until

PLAN = GenerationPlan(
    prompt_ids=[72, 105], max_new_tokens=6, stop=("!",), stop_token_ids=(257,),
    params=SamplingParams(seed=1), spec=TreeSpec(Method.NONE),
)  # fmt: skip


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def _env(store: SessionStore, verifiers: ReplicaPool, **kw) -> GatewayEnv:
    return GatewayEnv(store, None, verifiers, GatewayMetrics("test"), round_timeout=5.0, max_attempts=3, **kw)


def _failure(code: grpc.StatusCode, details: str = "", per_try: bool = False) -> ReplicaFailure:
    return ReplicaFailure(Role.VERIFIER, ItemError(code, details), {Role.VERIFIER: 0}, per_try)


def test_a_session_stays_on_its_replica_while_healthy_and_moves_when_not(redis_url) -> None:
    async def scenario() -> None:
        a, b = await servers(2)
        store = SessionStore(redis_url)
        async with ReplicaPool([a.address, b.address], name="verifier", role=Role.VERIFIER, **FAST) as pool:
            sid = uuid.uuid4().hex
            placer = Placer(_env(store, pool), sid, PLAN, deadline=None)
            await store.create(sid, PLAN.prompt_ids, verifier="")
            first = await placer.place(PLAN.prompt_ids, recorded=True)
            on = placer.addresses[Role.VERIFIER]
            assert (await store.load(sid)).verifier == on  # recorded where it went
            placer.remember({Role.VERIFIER: 2})
            now = placer.now()
            assert now is not None and now.verifier is first.verifier and now.held == {Role.VERIFIER: 2}
            await (a if on == a.address else b).stop()
            await until(lambda: on not in pool.healthy())
            assert placer.now() is None  # its replica is gone: place anew
            moved = await placer.place(PLAN.prompt_ids, recorded=True)
            assert moved.verifier is not first.verifier and moved.held == {Role.VERIFIER: 0}
            assert placer.touched == {(Role.VERIFIER, a.address), (Role.VERIFIER, b.address)}
            assert (await store.load(sid)).verifier == placer.addresses[Role.VERIFIER]
        await store.close()
        for server in (a, b):
            await server.stop()

    asyncio.run(scenario())


@pytest.mark.parametrize(
    ("code", "details", "per_try", "raised", "blamed"),
    [
        (grpc.StatusCode.ABORTED, "busy", False, None, False),  # our own earlier call: the same replica again
        (grpc.StatusCode.UNAVAILABLE, "gone", False, None, True),  # the transport: fail over
        (grpc.StatusCode.DEADLINE_EXCEEDED, "", True, None, True),  # slower than its per-try timeout
        (grpc.StatusCode.INTERNAL, "bug", False, grpc.StatusCode.INTERNAL, False),  # the request's own
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            "tree_spec.depth: at most 4",
            False,
            grpc.StatusCode.INVALID_ARGUMENT,
            False,
        ),
    ],
)
def test_what_a_failed_call_does_to_its_replica(redis_url, code, details, per_try, raised, blamed) -> None:
    async def scenario() -> None:
        (a,) = await servers(1)
        store = SessionStore(redis_url)
        async with ReplicaPool([a.address], name="verifier", role=Role.VERIFIER, **FAST) as pool:
            env = _env(store, pool)
            placer = Placer(env, uuid.uuid4().hex, PLAN, deadline=None, lengths={a.address: 5})
            await placer.place(PLAN.prompt_ids, recorded=False)
            try:
                await placer.recover(_failure(code, details, per_try))
            except GatewayError as exc:
                assert exc.code == raised
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    assert str(exc).startswith("speculation.depth") and exc.field == "speculation.depth"
            else:
                assert raised is None
            assert (a.address not in pool.healthy()) == blamed
            assert (a.address not in placer.lengths) == blamed  # what a failed replica held is gone
            assert env.metrics.failovers.labels(Role.VERIFIER)._value.get() == int(blamed)
        await store.close()
        await a.stop()

    asyncio.run(scenario())


def test_a_spent_retry_budget_fails_the_request_and_blames_no_replica(redis_url) -> None:
    async def scenario() -> None:
        (a,) = await servers(1)
        store = SessionStore(redis_url)
        async with ReplicaPool([a.address], name="verifier", role=Role.VERIFIER, **FAST) as pool:
            env = _env(store, pool, retries=RetryBudget(ratio=0.0, minimum=0))
            placer = Placer(env, uuid.uuid4().hex, PLAN, deadline=None)
            await placer.place(PLAN.prompt_ids, recorded=False)
            with pytest.raises(GatewayError, match="retry budget is spent") as exc:
                await placer.recover(_failure(grpc.StatusCode.UNAVAILABLE))
            assert exc.value.code == grpc.StatusCode.UNAVAILABLE and a.address in pool.healthy()
        await store.close()
        await a.stop()

    asyncio.run(scenario())


def test_the_client_s_deadline_bounds_every_call_and_a_timeout_at_it_blames_no_replica(redis_url) -> None:
    async def scenario() -> None:
        (a,) = await servers(1)
        store = SessionStore(redis_url)
        async with ReplicaPool([a.address], name="verifier", role=Role.VERIFIER, **FAST) as pool:
            deadline = asyncio.get_running_loop().time() + 0.3
            placer = Placer(_env(store, pool), uuid.uuid4().hex, PLAN, deadline=deadline)
            placement = await placer.place(PLAN.prompt_ids, recorded=False)
            assert placement.timeout <= 0.3 and placement.deadline == deadline  # not the round's 5 s
            await asyncio.sleep(0.3)
            with pytest.raises(GatewayError, match="client's deadline has passed") as exc:
                await placer.recover(_failure(grpc.StatusCode.DEADLINE_EXCEEDED))
            assert exc.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and a.address in pool.healthy()
            with pytest.raises(GatewayError, match="client's deadline has passed"):
                placer.time_left()
        await store.close()
        await a.stop()

    asyncio.run(scenario())


# ---- the transcript --------------------------------------------------------------------------------


def _transcript(store: SessionStore, sid: str, lost: list) -> Transcript:
    text = TextStream(make_byte_tokenizer(), PLAN.stop, context=PLAN.prompt_ids)
    return Transcript(sid, PLAN, _env(store, None), text, None, lost=lambda: lost.append(sid))  # type: ignore[arg-type]


async def _commit(transcript: Transcript, kept: list[int]) -> Piece | None:
    """One round's commit as the rounds make it: `commit_then`, its answer read by `committed`,
    then `apply` (None: Redis is at another round)."""
    answer = asyncio.get_running_loop().create_future()
    transcript.commit_then(kept, None, GenerationStats(), {}, answer.set_result)
    ok = transcript.committed(await answer)
    return transcript.apply(kept, None, GenerationStats(), began=0.0, start=0.0) if ok else None


def test_a_round_is_cut_committed_and_handed_out_as_redis_holds_it(redis_url) -> None:
    async def scenario() -> None:
        store, sid, lost = SessionStore(redis_url), uuid.uuid4().hex, []
        transcript = _transcript(store, sid, lost)
        transcript.owner = (await store.create(sid, PLAN.prompt_ids)).owner
        kept, finish = transcript.cut([97, 98, 33, 99])  # "ab!c": the stop sequence ends it
        assert (kept, finish) == ([97, 98, 33], "stop")  # through the token that completes it
        assert transcript.cut([97] * 9) == ([97] * 6, "length")  # max_new_tokens
        piece = await _commit(transcript, [97])
        assert (piece.token_ids, piece.text, piece.finish_reason) == ([97], "a", None)
        assert (transcript.round, transcript.tokens) == (1, [72, 105, 97])
        stored = await store.load(sid)
        assert (stored.round, stored.tokens) == (1, [72, 105, 97])
        assert not lost
        await store.close()

    asyncio.run(scenario())


def test_a_commit_that_finds_another_round_takes_redis_s_tokens(redis_url) -> None:
    async def scenario() -> None:
        store, sid = SessionStore(redis_url), uuid.uuid4().hex
        owner = (await store.create(sid, PLAN.prompt_ids)).owner
        await store.commit_round(sid, 0, [97, 98], owner=owner)  # a commit that seemed to fail went through
        transcript = _transcript(store, sid, [])
        transcript.owner = owner
        assert await _commit(transcript, [97, 98]) is None
        piece = await transcript.resume_from_store()
        assert piece.token_ids == [97, 98] and transcript.round == 1
        await store.close()

    asyncio.run(scenario())


def test_a_session_another_gateway_took_is_lost_and_its_commit_aborted(redis_url) -> None:
    async def scenario() -> None:
        store, other, sid, lost = SessionStore(redis_url), SessionStore(redis_url), uuid.uuid4().hex, []
        transcript = _transcript(store, sid, lost)
        transcript.owner = (await store.create(sid, PLAN.prompt_ids)).owner
        await store.release(sid, transcript.owner)
        await other.take(sid)  # another gateway resumed it
        with pytest.raises(GatewayError) as exc:
            await _commit(transcript, [97])
        assert exc.value.code == grpc.StatusCode.ABORTED and lost == [sid]
        await store.close()
        await other.close()

    asyncio.run(scenario())


def test_a_store_that_lost_committed_rounds_ends_the_session(redis_url) -> None:
    async def scenario() -> None:
        store, sid = SessionStore(redis_url), uuid.uuid4().hex
        transcript = _transcript(store, sid, [])
        transcript.owner = (await store.create(sid, PLAN.prompt_ids)).owner
        await _commit(transcript, [97])
        await store.delete(sid)
        await store.create(sid, PLAN.prompt_ids)  # Redis came back without the round
        with pytest.raises(GatewayError, match="lost committed rounds"):
            await transcript.resume_from_store()
        await store.close()

    asyncio.run(scenario())
