"""gateway.session_store against a real redis-server (specmesh.stack.redis_server), no fakes."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from gateway.session_store import (
    SessionExists,
    SessionNotFound,
    SessionStore,
    StoreError,
    StoreUnavailable,
)
from specmesh.core.stats import GenerationStats
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer


@pytest.fixture(scope="module")
def server():
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def raw(server):
    client = redis.Redis.from_url(server.url, decode_responses=True)
    yield client
    client.close()


def run(coro):
    return asyncio.run(coro)


def sid() -> str:
    return uuid.uuid4().hex


def round_stats(accepted: int, depth: int = 3) -> GenerationStats:
    return GenerationStats.for_round(
        drafted_tokens=depth,
        accepted_tokens=accepted,
        tree_depth=depth,
        draft_calls=depth,
        draft_seconds=0.01,
        verify_seconds=0.02,
        total_seconds=0.05,
    )


def snapshot(raw: redis.Redis, store: SessionStore, session_id: str) -> dict:
    """Every key of the session, raw, to show that nothing at all changed."""
    k = store.keys(session_id)
    return {
        "meta": raw.hgetall(k.meta),
        "tokens": raw.lrange(k.tokens, 0, -1),
        "replicas": raw.hgetall(k.replicas),
        "stats": raw.hgetall(k.stats),
    }


def test_create_load_commit_delete(server):
    async def scenario():
        async with SessionStore(server.url) as store:
            s = sid()
            await store.create(
                s,
                [1, 2, 3],
                drafter="10.0.0.1:50061",
                verifier="10.0.0.2:50062",
                sampling={"temperature": 0.7, "seed": 42},
                speculation={"method": "rsd_s", "depth": 3, "beam_width": 2},
                max_new_tokens=16,
                extra={"stop": ["\n\n"]},
            )
            with pytest.raises(SessionExists):
                await store.create(s, [9])
            loaded = await store.load(s)
            assert loaded.tokens == [1, 2, 3] and loaded.round == 0 and loaded.generated == []
            assert loaded.sampling == {"temperature": 0.7, "seed": 42}
            assert loaded.speculation["method"] == "rsd_s" and loaded.extra == {"stop": ["\n\n"]}
            assert (loaded.drafter, loaded.verifier, loaded.max_new_tokens) == (
                "10.0.0.1:50061",
                "10.0.0.2:50062",
                16,
            )

            lengths = {"10.0.0.1:50061": 5, "10.0.0.2:50062": 5}
            assert await store.commit_round(s, 0, [4, 5], round_stats(1), lengths)
            assert await store.commit_round(s, 1, [6, 7, 8, 9], round_stats(3), finish_reason="length")
            done = await store.load(s)
            assert done.tokens == [1, 2, 3, 4, 5, 6, 7, 8, 9] and done.generated == [4, 5, 6, 7, 8, 9]
            assert done.round == 2 and done.finish_reason == "length"
            assert done.replica_lengths == lengths
            assert done.stats.rounds == 2 and done.stats.accepted_tokens == 4
            assert done.stats.accepted_per_depth == [2, 1, 1]
            assert done.stats.block_efficiency == pytest.approx(3.0)
            assert done.stats.network_seconds == pytest.approx(0.04)
            assert done.updated_at >= done.created_at

            assert await store.delete(s)
            assert await store.load(s) is None
            assert not await store.delete(s)
            with pytest.raises(SessionNotFound):
                await store.commit_round(s, 2, [1])

    run(scenario())


def test_stale_or_duplicate_commit_changes_nothing(server, raw):
    async def scenario():
        async with SessionStore(server.url) as store:
            s = sid()
            await store.create(s, [1, 2])
            assert await store.commit_round(s, 0, [3], round_stats(0), {"a:1": 3})
            before = snapshot(raw, store, s)
            # the same reply delivered twice, and a late reply for an older round
            assert not await store.commit_round(s, 0, [3], round_stats(0), {"a:1": 3})
            assert not await store.commit_round(s, 0, [7, 7], round_stats(1), {"b:2": 9})
            assert not await store.commit_round(s, 5, [7], round_stats(0))  # a future round
            assert snapshot(raw, store, s) == before
            # a finished session accepts nothing, not even for its current round
            assert await store.commit_round(s, 1, [4], round_stats(0), finish_reason="stop")
            finished = snapshot(raw, store, s)
            assert not await store.commit_round(s, 2, [5], round_stats(0))
            assert snapshot(raw, store, s) == finished

    run(scenario())


def test_concurrent_commits_for_one_round_exactly_one_wins(server):
    async def scenario():
        # independent clients (own connections), like several gateway tasks or processes
        stores = [SessionStore(server.url) for _ in range(8)]
        s = sid()
        await stores[0].create(s, [1])
        for expected in range(3):
            results = await asyncio.gather(
                *(st.commit_round(s, expected, [100 + i], round_stats(0)) for i, st in enumerate(stores))
            )
            assert sum(results) == 1
        session = await stores[0].load(s)
        assert session.round == 3 and len(session.tokens) == 4 and session.stats.rounds == 3
        for st in stores:
            await st.close()

    run(scenario())


def test_ttl_is_set_refreshed_and_expires(server, raw):
    async def scenario():
        async with SessionStore(server.url, ttl_seconds=30) as store:
            s = sid()
            await store.create(s, [1])
            await store.commit_round(s, 0, [2], round_stats(0), {"a:1": 2})
            keys = store.keys(s)
            for key in keys.all():  # all four keys carry the TTL, not just the meta hash
                assert 25_000 < raw.pttl(key) <= 30_000, key
            raw.pexpire(keys.meta, 5_000)
            raw.pexpire(keys.tokens, 5_000)
            assert await store.commit_round(s, 1, [3], round_stats(0))
            assert all(raw.pttl(k) > 25_000 for k in keys.all())
            raw.pexpire(keys.meta, 5_000)
            assert await store.touch(s)
            assert await store.ttl(s) > 25
            assert not await store.touch(sid())
        async with SessionStore(server.url, ttl_seconds=0.2) as short:
            s = sid()
            await short.create(s, [1, 2])
            await asyncio.sleep(0.4)
            assert await short.load(s) is None
            assert all(not raw.exists(k) for k in short.keys(s).all())
            await short.create(s, [5])  # the id can be reused once expired
            assert (await short.load(s)).tokens == [5]

    run(scenario())


def test_assign_moves_a_session_to_other_replicas(server):
    async def scenario():
        async with SessionStore(server.url) as store:
            s = sid()
            await store.create(s, [1, 2], drafter="d1:1", verifier="v1:1")
            await store.commit_round(s, 0, [3], round_stats(0), {"d1:1": 3, "v1:1": 3})
            await store.assign(s, drafter="d2:1", replica_lengths={"d2:1": 3}, drop_replicas=["d1:1"])
            session = await store.load(s)
            assert (session.drafter, session.verifier) == ("d2:1", "v1:1")
            assert session.replica_lengths == {"d2:1": 3, "v1:1": 3}
            with pytest.raises(SessionNotFound):
                await store.assign(sid(), drafter="x:1")

    run(scenario())


def test_long_prompt_and_invalid_input(server):
    async def scenario():
        async with SessionStore(server.url) as store:
            s = sid()
            prompt = list(range(20_000))  # more values than Lua's unpack() takes at once
            await store.create(s, prompt)
            assert await store.commit_round(s, 0, list(range(3000)))
            assert len((await store.load(s)).tokens) == 23_000
            with pytest.raises(ValueError):
                await store.create("bad{id}", [1])
            with pytest.raises(ValueError):
                await store.commit_round(s, 1, [-1])
            assert (await store.load(s)).round == 1

    run(scenario())


def test_a_script_that_cannot_finish_writes_nothing(server, raw):
    async def scenario():
        async with SessionStore(server.url) as store:
            s = sid()
            await store.create(s, [1])
            raw.set(store.keys(s).stats, "not a hash")  # the last group of writes would fail
            before = snapshot_without_stats(raw, store, s)
            with pytest.raises(StoreError, match="WRONGTYPE"):
                await store.commit_round(s, 0, [2, 3], round_stats(1), {"a:1": 3})
            assert snapshot_without_stats(raw, store, s) == before

    def snapshot_without_stats(raw, store, s):
        k = store.keys(s)
        return raw.hgetall(k.meta), raw.lrange(k.tokens, 0, -1), raw.hgetall(k.replicas)

    run(scenario())


def test_redis_down_is_store_unavailable_quickly():
    async def scenario():
        async with SessionStore(f"redis://:secret@127.0.0.1:{free_port()}/0") as store:
            for call in (
                store.ping(),
                store.create(sid(), [1]),
                store.load(sid()),
                store.commit_round(sid(), 0, [1]),
                store.delete(sid()),
            ):
                start = time.monotonic()
                with pytest.raises(StoreUnavailable, match="session store unavailable") as info:
                    await call
                assert time.monotonic() - start < 1.0
                assert "secret" not in str(info.value)

    run(scenario())


def test_redis_stopping_mid_session_commits_nothing_half():
    async def scenario(srv: RedisServer):
        async with SessionStore(srv.url, socket_timeout=0.3) as store:
            s = sid()
            await store.create(s, [1, 2])
            assert await store.commit_round(s, 0, [3], round_stats(0))
            # Writes paused: the commit times out on the client, then runs whole when Redis resumes.
            admin = redis.Redis.from_url(srv.url, decode_responses=True)
            admin.execute_command("CLIENT", "PAUSE", 700, "WRITE")
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.commit_round(s, 1, [4, 5], round_stats(1))
            assert time.monotonic() - start < 1.5
            await asyncio.sleep(1.0)
            session = await store.load(s)
            assert session.tokens in ([1, 2, 3], [1, 2, 3, 4, 5])  # all or nothing
            assert session.round == len(session.tokens) - 2 and session.stats.rounds == session.round
            # a second try for the same round learns whether the first one went through
            retried = await store.commit_round(s, 1, [4, 5], round_stats(1))
            assert retried == (session.round == 1)
            assert (await store.load(s)).tokens == [1, 2, 3, 4, 5]
            admin.close()
            srv.stop()
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):
                await store.commit_round(s, 2, [6], round_stats(0))
            assert time.monotonic() - start < 1.0

    with RedisServer() as srv:  # its own server: this test stops it
        run(scenario(srv))


def test_more_concurrent_commands_than_connections_wait_instead_of_failing(server):
    """Issue 14, finding 4: past 100 concurrent streams redis-py's pool raised "Too many
    connections" mid-stream; the store's pool now waits for a free connection."""

    async def main() -> None:
        async with SessionStore(server.url, max_connections=4) as store:
            ids = [sid() for _ in range(150)]
            await asyncio.gather(*(store.create(i, [1, 2, 3], drafter="d", verifier="v") for i in ids))
            loaded = await asyncio.gather(*(store.load(i) for i in ids))
            assert [s.tokens for s in loaded] == [[1, 2, 3]] * 150
            await asyncio.gather(*(store.delete(i) for i in ids))

    run(main())


def test_the_default_pool_serves_more_than_a_hundred_concurrent_commands(server):
    async def main() -> None:
        async with SessionStore(server.url) as store:
            assert all(s is None for s in await asyncio.gather(*(store.load(sid()) for _ in range(300))))

    run(main())
