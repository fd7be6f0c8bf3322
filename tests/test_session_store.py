"""gateway.session_store against a real redis-server (specmesh.stack.redis_server), no fakes: the
hardened server of `specmesh up` (password, AOF, CONFIG / DEBUG / KEYS disabled), restarted, and
a master / replica / Sentinel trio that fails over."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest
import redis

from gateway.redis_link import SentinelUrl, _safe_url, parse_sentinel_url
from gateway.session_store import (
    NotOwner,
    SessionExists,
    SessionNotFound,
    SessionStore,
    StoreError,
    StoreUnavailable,
)
from specmesh.core.stats import GenerationStats
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer, find_redis_server, redis_ping


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

            # a prompt's and a commit's tokens go packed in one argument each and are pushed in
            # slices of 1000
            big, prompt = sid(), list(range(7, 2107))
            await store.create(big, prompt)
            assert (await store.load(big)).tokens == prompt
            many = list(range(2500))
            assert await store.commit_round(big, 0, many, round_stats(1), {"d:1": 4600})
            assert (await store.load(big)).tokens == [*prompt, *many]
            with pytest.raises(ValueError, match="whitespace"):
                await store.commit_round(big, 1, [3], round_stats(1), {"unix:/a b": 3})

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
            assert await store.expire(s, 4.0)  # a finished session kept a little for a late resume
            assert all(3_000 < raw.pttl(k) <= 4_000 for k in keys.all()), [raw.pttl(k) for k in keys.all()]
            assert not await store.expire(sid(), 4.0)
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


def test_a_replicas_prefix_summary_is_replaced_by_newer_ones_only(server, raw):
    """gateway/prefixes.py: a summary of another incarnation, or a higher version, replaces what
    is there; an older one writes nothing. held_prefixes: the deepest hash each replica holds."""
    hashes = [f"{i:016x}" for i in range(2500)]  # more than one SADD batch in the script

    async def scenario():
        async with SessionStore(server.url) as store:
            assert await store.put_prefixes("r1:1", "inc-a", 5, hashes[:2000])
            assert not await store.put_prefixes("r1:1", "inc-a", 4, hashes[:10])  # older: nothing
            assert not await store.put_prefixes("r1:1", "inc-a", 5, hashes[:10])
            assert await store.put_prefixes("r2:1", "inc-b", 1, hashes[1:3])
            held = await store.held_prefixes(["r1:1", "r2:1", "r3:1"], hashes[:4])
            assert held == {"r1:1": 4, "r2:1": 3, "r3:1": 0}  # r2 holds #1 and #2: 3 deep
            assert await store.put_prefixes("r1:1", "inc-c", 1, hashes[3:4])  # restarted: its own now
            assert (await store.held_prefixes(["r1:1"], hashes[:3])) == {"r1:1": 0}
            await store.add_prefixes("r1:1", hashes[:2])  # a session placed there
            assert (await store.held_prefixes(["r1:1"], hashes[:3])) == {"r1:1": 2}
            assert await store.put_prefixes("r1:1", "inc-c", 2, hashes[2500:])  # empty, read before:
            assert (await store.held_prefixes(["r1:1"], hashes[:3])) == {"r1:1": 2}  # the placement stays

    run(scenario())
    assert 0 < raw.pttl("specmesh:replica:{r2:1}:prefixes") <= 3600_000


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
        async with SessionStore(f"redis://:secret@127.0.0.1:{free_port()}/0", reconnect_timeout=0) as store:
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
        async with SessionStore(srv.url, socket_timeout=0.3, reconnect_timeout=0) as store:
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


# ---- Redis restarts, lost answers, the hardened server ----------------------------------------------


def test_an_operation_during_a_redis_restart_waits_and_finds_the_data_intact():
    """Issue 14: Redis killed (SIGKILL, as a crash) and started again ~2 s later on the same port
    with the same AOF directory. Operations issued while it is down wait for it and succeed; what
    was committed before is all there."""

    async def scenario(srv: RedisServer):
        async with SessionStore(srv.url, reconnect_timeout=20) as store:
            s = sid()
            await store.create(s, [1, 2], drafter="d:1", verifier="v:1", sampling={"seed": 7})
            assert await store.commit_round(s, 0, [3, 4], round_stats(1), {"d:1": 4, "v:1": 4})
            assert await store.commit_round(s, 1, [5], round_stats(0), {"d:1": 5, "v:1": 5})
            srv.kill()
            restart = threading.Timer(2.0, srv.start)
            restart.start()
            start = time.monotonic()
            other = sid()
            committed, created, loaded = await asyncio.gather(
                store.commit_round(s, 2, [6, 7, 8], round_stats(2)),
                store.create(other, [9]),
                store.load(s),
            )
            waited = time.monotonic() - start
            restart.join()
            assert waited >= 1.9, waited  # they really waited for the restart
            assert committed and created.tokens == [9]
            assert loaded.tokens in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6, 7, 8])  # before or after the commit
            session = await store.load(s)
            assert session.tokens == [1, 2, 3, 4, 5, 6, 7, 8] and session.round == 3
            assert session.stats.rounds == 3 and session.stats.accepted_tokens == 3
            assert session.replica_lengths == {"d:1": 5, "v:1": 5} and session.sampling == {"seed": 7}
            assert 590 < await store.ttl(s) <= 600  # the TTL survived the restart too
            assert (await store.load(other)).tokens == [9]

    with RedisServer() as srv:  # its own server: this test kills it
        run(scenario(srv))


def test_redis_down_longer_than_the_reconnect_timeout_is_store_unavailable():
    async def scenario():
        url = f"redis://:secret@127.0.0.1:{free_port()}/0"
        async with SessionStore(url, reconnect_timeout=1.0) as store:
            start = time.monotonic()
            with pytest.raises(StoreUnavailable, match=r"did not answer commit_round for \d+\.\ds") as info:
                await store.commit_round(sid(), 0, [1])
            assert 1.0 <= time.monotonic() - start < 3.0
            assert "secret" not in str(info.value)
            start = time.monotonic()
            with pytest.raises(StoreUnavailable):  # cleanup waits less: the TTL is the backstop
                await store.delete(sid())
            assert time.monotonic() - start < 3.0

    run(scenario())


# A Lua script that keeps Redis busy for ARGV[1] microseconds: commands sent meanwhile wait in their
# sockets and run afterwards, even from a client that gave up on them (a lost answer).
_BUSY = """
local t0 = redis.call('TIME')
repeat local t = redis.call('TIME') until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) > tonumber(ARGV[1])
return 1
"""


def test_a_create_or_commit_whose_answer_was_lost_is_applied_once(server, raw):
    """The first try reaches Redis and runs, but its answer comes after the client's timeout; the
    retry finds its own create / commit applied (same id) and succeeds without applying it again,
    while a real duplicate create is still refused."""

    def evalsha_calls() -> int:
        return raw.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    async def while_busy(call):
        before = evalsha_calls()
        busy = asyncio.create_task(asyncio.to_thread(raw.eval, _BUSY, 0, 800_000))
        await asyncio.sleep(0.1)  # the busy script runs: our command waits in its socket
        result = await call
        await busy
        return result, evalsha_calls() - before

    async def scenario():
        async with SessionStore(server.url, socket_timeout=0.2, reconnect_timeout=10) as store:
            warm = sid()  # load the scripts first: NOSCRIPT must not count as a try
            await store.create(warm, [1])
            await store.commit_round(warm, 0, [2])
            s = sid()
            created, tries = await while_busy(store.create(s, [1, 2]))
            assert created.tokens == [1, 2] and tries >= 2, tries  # >= 2 tries ran in Redis
            committed, tries = await while_busy(store.commit_round(s, 0, [3, 4], round_stats(1)))
            assert committed and tries >= 2, tries
            session = await store.load(s)
            assert session.tokens == [1, 2, 3, 4] and session.round == 1 and session.stats.rounds == 1
            with pytest.raises(SessionExists):  # another create of the same id: refused
                await store.create(s, [1, 2])

    run(scenario())


def test_the_stack_redis_refuses_strangers_and_config_debug_keys(server, raw):
    """specmesh.stack.redis_server's server, which `specmesh up` and the tests run: a password, the
    dangerous commands gone, AOF on, and the password on no command line."""
    anonymous = redis.Redis(host=server.host, port=server.port, retry=None)  # no client-side retries
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    assert not redis_ping(server.host, server.port) and redis_ping(
        server.host, server.port, password=server.password
    )
    for command in (("KEYS", "*"), ("CONFIG", "GET", "requirepass"), ("DEBUG", "SLEEP", "0")):
        with pytest.raises(redis.ResponseError, match="unknown command"):
            raw.execute_command(*command)
    assert list(raw.scan_iter("no-such-prefix:*")) == []  # SCAN is how keys are listed
    persistence = raw.info("persistence")
    assert persistence["aof_enabled"] == 1 and persistence["rdb_changes_since_last_save"] >= 0
    config = server.data_dir / "redis.conf"
    assert config.stat().st_mode & 0o077 == 0  # the password is in a file only its owner reads
    assert "appendfsync everysec" in config.read_text()
    cmdline = Path(f"/proc/{server.process.pid}/cmdline")
    if cmdline.exists():
        assert server.password not in cmdline.read_text()

    async def wrong_password():
        url = server.url.replace(server.password, "not-the-password")
        async with SessionStore(url, reconnect_timeout=10) as store:
            start = time.monotonic()
            with pytest.raises(StoreError, match="refused the credentials") as info:
                await store.load(sid())
            assert time.monotonic() - start < 1.0  # never retried: waiting does not fix a password
            assert not isinstance(info.value, StoreUnavailable) and "not-the-password" not in str(info.value)

    run(wrong_password())


def test_sentinel_urls_and_password_free_messages():
    assert parse_sentinel_url("redis+sentinel://:p%40ss@h1:26380,[::1],h3/mymaster/2") == SentinelUrl(
        [("h1", 26380), ("::1", 26379), ("h3", 26379)], "mymaster", 2, None, "p@ss"
    )
    assert parse_sentinel_url("redis+sentinel://s1/m") == SentinelUrl([("s1", 26379)], "m")
    for bad in (
        "redis+sentinel://h1:1/",
        "redis+sentinel://h1:x/m",
        "redis+sentinel://h1/m/x",
        "redis://h/0",
    ):
        with pytest.raises(ValueError):
            parse_sentinel_url(bad)
    assert _safe_url("redis+sentinel://u:pw@h1:1,h2:2/m/0") == "redis+sentinel://u:***@h1:1,h2:2/m/0"
    assert _safe_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert _safe_url("redis://pw@h:1/0") == "redis://***@h:1/0"
    assert _safe_url("redis://h:1/0?password=pw&db=1") == "redis://h:1/0?password=***&db=1"


class Sentinel:
    """`redis-server sentinel.conf --sentinel`, watching one master (quorum 1, down after 1 s)."""

    def __init__(self, workdir: Path, master: RedisServer, renamed_config: str) -> None:
        self.port = free_port()
        workdir.mkdir()
        self.config = workdir / "sentinel.conf"
        self.config.write_text(  # Sentinel rewrites this file: its own copy, writable
            f"port {self.port}\nbind 127.0.0.1\ndir {workdir}\n"
            f"sentinel monitor specmesh 127.0.0.1 {master.port} 1\n"
            f"sentinel auth-pass specmesh {master.password}\n"
            "sentinel down-after-milliseconds specmesh 1000\n"
            "sentinel failover-timeout specmesh 10000\n"
            f"sentinel rename-command specmesh CONFIG {renamed_config}\n"
        )
        self.log = open(workdir / "sentinel.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [find_redis_server(), str(self.config), "--sentinel"], stdout=self.log, stderr=subprocess.STDOUT
        )
        wait_for(lambda: redis_ping("127.0.0.1", self.port), 10, "the Sentinel")
        self.client = redis.Redis(port=self.port, decode_responses=True)

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        self.proc.wait(10)
        self.log.close()


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def test_a_sentinel_url_follows_a_failover(tmp_path):
    """One master, one replica, one Sentinel, real processes. The store reaches the master through
    the Sentinel; the master is killed; a commit issued then waits through the failover (~3 s) and
    lands on the promoted replica, after everything committed before (replicated, WAIT)."""
    renamed = f"CONFIG-{uuid.uuid4().hex}"  # a failover sends CONFIG REWRITE: renamed, not disabled
    hardened = {"disabled_commands": ("DEBUG", "KEYS"), "renamed_commands": {"CONFIG": renamed}}
    master = RedisServer(**hardened).start()
    replica = RedisServer(
        password=master.password, extra_config=[f"replicaof 127.0.0.1 {master.port}"], **hardened
    )
    sentinel = None
    try:
        replica.start()
        with redis.Redis.from_url(replica.url, decode_responses=True) as r:
            wait_for(lambda: r.info("replication")["master_link_status"] == "up", 10, "the replica to sync")
        sentinel = Sentinel(tmp_path / "sentinel", master, renamed)
        known = lambda: any(r["port"] == replica.port for r in sentinel.client.sentinel_slaves("specmesh"))  # noqa: E731
        wait_for(known, 15, "the Sentinel to see the replica")
        url = f"redis+sentinel://:{master.password}@127.0.0.1:{sentinel.port}/specmesh/0"

        async def scenario():
            async with SessionStore(url, reconnect_timeout=25) as store:
                s = sid()
                await store.create(s, [1, 2])
                assert await store.commit_round(s, 0, [3], round_stats(0))
                with redis.Redis.from_url(master.url) as m:
                    assert m.wait(1, 5000) == 1  # the replica has it all (replication is asynchronous)
                master.kill()
                start = time.monotonic()
                assert await store.commit_round(s, 1, [4, 5], round_stats(1))
                failover = time.monotonic() - start
                session = await store.load(s)
                assert session.tokens == [1, 2, 3, 4, 5] and session.round == 2 and session.stats.rounds == 2
                return failover

        failover = run(scenario())
        _, port = sentinel.client.sentinel_get_master_addr_by_name("specmesh")
        assert int(port) == replica.port and failover > 0.5, failover
        with redis.Redis.from_url(replica.url, decode_responses=True) as r:
            assert r.info("replication")["role"] == "master"
    finally:
        if sentinel is not None:
            sentinel.stop()
        replica.stop()
        master.stop()


# ---- ownership: the lease and fencing (a resume on another gateway) ------------------------------


def test_only_one_gateway_owns_a_session_and_a_stale_owner_is_fenced(server, raw) -> None:
    async def go() -> None:
        a = SessionStore(server.url, lease_seconds=0.5, gateway_id="gw-a")
        b = SessionStore(server.url, lease_seconds=0.5, gateway_id="gw-b")
        c = SessionStore(server.url, lease_seconds=0.5, gateway_id="gw-c")
        async with a, b, c:
            s = sid()
            created = await a.create(s, [1, 2, 3])
            assert created.owner == "gw-a:1"
            assert await a.commit_round(s, 0, [4], owner=created.owner)
            with pytest.raises(NotOwner) as held:  # A's lease is live
                await b.take(s)
            assert 0 < held.value.retry_after <= 0.5
            # two takers at the same moment once A is gone (its lease ran out): exactly one wins
            await asyncio.sleep(0.6)
            outcomes = await asyncio.gather(b.take(s), c.take(s), return_exceptions=True)
            winners = [o for o in outcomes if not isinstance(o, BaseException)]
            assert len(winners) == 1 and winners[0].owner.endswith(":2"), outcomes
            assert isinstance(next(o for o in outcomes if isinstance(o, BaseException)), NotOwner)
            assert winners[0].tokens == [1, 2, 3, 4] and winners[0].round == 1
            # A comes back (it was paused, not dead): its commits write nothing now
            with pytest.raises(NotOwner):
                await a.commit_round(s, 1, [9], owner=created.owner)
            assert not await a.renew(s, created.owner)
            new = winners[0].owner
            store = b if new.startswith("gw-b") else c
            assert await store.commit_round(s, 1, [5], owner=new)
            # a handover: released, the next take is at once, and the released owner stays fenced
            assert await store.release(s, new)
            other = c if store is b else b
            again = await other.take(s)
            assert again.owner.endswith(":3") and again.tokens == [1, 2, 3, 4, 5]
            with pytest.raises(NotOwner):
                await store.commit_round(s, 2, [6], owner=new)
            assert await other.commit_round(s, 2, [6], owner=again.owner)
            # the lease key lost (a Redis restart without it) is set again by the owner's commit
            raw.delete(other.keys(s).owner)
            assert await other.commit_round(s, 3, [7], owner=again.owner)
            assert raw.get(other.keys(s).owner) == again.owner
            await other.delete(s)
            assert not raw.exists(*other.keys(s).with_owner())
            with pytest.raises(SessionNotFound):
                await a.take(s)

    run(go())


def test_a_cancelled_call_is_cancelled_wherever_the_cancel_lands(server) -> None:
    """redis-py sends a command through asyncio.wait_for (its socket_timeout), which on Python 3.11
    returns the result and drops a cancel that lands as the send completes. A gateway's lease
    renewer cancelled there went on renewing forever, and its session never ended. Each call is
    cancelled after 0 to 12 passes of the event loop: every cancel that found it running ends it."""

    async def go() -> list[tuple[str, int]]:
        async with SessionStore(server.url, lease_seconds=5.0) as store:
            s = sid()
            owner = (await store.create(s, [1, 2, 3])).owner
            calls = {"renew": lambda: store.renew(s, owner), "load": lambda: store.load(s)}
            swallowed = []
            for name, call in calls.items():
                for passes in range(13):
                    for _ in range(5):
                        task = asyncio.ensure_future(call())
                        for _ in range(passes):
                            await asyncio.sleep(0)
                        if not task.cancel():
                            continue
                        try:
                            await task
                        except asyncio.CancelledError:
                            continue
                        swallowed.append((name, passes))
            await store.delete(s)
            return swallowed

    assert run(go()) == []


def test_a_turns_commits_are_each_fenced_and_answered_by_callback(server, raw) -> None:
    """The gateway's rounds commit with `commit_round_then`: the commits queued in one event-loop
    turn (a tick's sessions) go out after it, one pipeline, each still fenced and conditional on
    its own (a stale round: False; another gateway's token: NotOwner), and a caller whose callback
    raises keeps nobody else from their answer."""

    async def go() -> None:
        async with SessionStore(server.url, gateway_id="gw-one-pass") as store:
            ids = [sid() for _ in range(5)]
            owners = [(await store.create(s, [1, 2, 3])).owner for s in ids]
            answers: list[tuple[str, object]] = []

            def done(session: str, outcome: object) -> None:
                answers.append((session, outcome))
                if session == ids[2]:
                    raise RuntimeError("a caller's bug")

            expected = [0, 0, 0, 5, 0]  # ids[3] commits for a round it is not at: False
            owner = list(owners)
            owner[4] = "gw-other:1"  # ids[4]: another gateway's token, fenced
            for s, at, o in zip(ids, expected, owner, strict=True):
                store.commit_round_then(s, at, [7, 8], owner=o, done=functools.partial(done, s))
            assert answers == []  # nothing is sent before the turn ends
            while len(answers) < 5:
                await asyncio.sleep(0.01)
            outcomes = dict(answers)
            assert [outcomes[s] for s in ids[:4]] == [True, True, True, False]
            assert isinstance(outcomes[ids[4]], NotOwner)
            loaded = [await store.load(s) for s in ids]
            assert [x.tokens for x in loaded] == [[1, 2, 3, 7, 8]] * 3 + [[1, 2, 3]] * 2

    run(go())
