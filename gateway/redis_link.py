"""The gateway's connection to Redis (`RedisLink`): one Redis or the master a Sentinel names,
every operation retried with backoff while Redis is unreachable, and a script's calls of one
event-loop turn sent as one pipeline (`ScriptPipeline`). What is stored is
gateway/session_store.py's."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff

log = logging.getLogger("specmesh.gateway.session_store")

T = TypeVar("T")

BACKOFF_FIRST, BACKOFF_MAX = 0.05, 1.0  # seconds between retries: 50 ms, doubling, at most 1 s
SENTINEL_PORT = 26379
# Redis is not there right now: worth waiting for. (redis-py's AuthenticationError is a
# ConnectionError too, but a wrong password never gets better: it is caught before these.)
_TRANSIENT = (
    redis.exceptions.ConnectionError,  # refused, reset, LOADING, no master known to the Sentinels
    redis.exceptions.TimeoutError,
    redis.exceptions.ReadOnlyError,  # a master demoted by a failover, before clients move
)


def _read_only(exc: redis.exceptions.RedisError) -> bool:
    """A write sent to a replica: directly (READONLY), or from inside a Lua script."""
    return isinstance(exc, redis.exceptions.ReadOnlyError) or (
        isinstance(exc, redis.exceptions.ResponseError) and "READONLY" in str(exc)
    )


class StoreError(Exception):
    """Redis refused an operation (wrong key type, script error, bad arguments)."""


class StoreUnavailable(StoreError):
    """Redis cannot be reached or did not answer in time; nothing was committed by this call."""


def _safe_url(url: str) -> str:
    """The URL without its password (also a `password=` query parameter), for messages and logs."""
    scheme, sep, rest = url.partition("://")
    if sep:
        netloc, slash, path = rest.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        if at:
            user, colon, _ = userinfo.partition(":")
            netloc = f"{user}:***@{hosts}" if colon else f"***@{hosts}"
        url = f"{scheme}://{netloc}{slash}{path}"
    return re.sub(r"(?i)(password=)[^&#]*", r"\1***", url)


@dataclass(frozen=True)
class SentinelUrl:
    """`redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db]`: the Sentinels to
    ask, the monitored service (master name), the database and the data nodes' credentials."""

    sentinels: list[tuple[str, int]]
    service: str
    db: int = 0
    username: str | None = None
    password: str | None = None


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith("redis+sentinel://")


def parse_sentinel_url(url: str) -> SentinelUrl:
    """ValueError naming what is wrong. A host without a port is on 26379."""
    if not is_sentinel_url(url):
        raise ValueError(f"{_safe_url(url)}: not a redis+sentinel:// URL")
    rest = url.split("://", 1)[1].split("?", 1)[0].split("#", 1)[0]
    netloc, _, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username, password = (unquote(user) or None), (unquote(secret) if colon else None)
    sentinels = []
    for item in hosts.split(","):
        item = item.strip()
        if item.startswith("["):  # [IPv6]:port
            host, _, tail = item[1:].partition("]")
            port = tail.removeprefix(":")
        else:
            host, _, port = item.partition(":")
        if not host:
            raise ValueError(f"{_safe_url(url)}: a Sentinel without a host")
        try:
            sentinels.append((host, int(port) if port else SENTINEL_PORT))
        except ValueError:
            raise ValueError(f"{_safe_url(url)}: bad port {port!r}") from None
    service, _, db = path.strip("/").partition("/")
    if not service:
        raise ValueError(f"{_safe_url(url)}: no service name (the path: /mymaster[/db])")
    if db and not db.isdigit():
        raise ValueError(f"{_safe_url(url)}: bad database {db!r}")
    return SentinelUrl(sentinels, unquote(service), int(db or 0), username, password)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """The Sentinel's pool (connects to whatever the Sentinels name as master), waiting for a free
    connection past max_connections like the plain URL's BlockingConnectionPool."""


class RedisLink:
    """Async redis-py (`redis.asyncio`) on one Redis, or on the master a Sentinel names.

    Socket timeouts are short (1 s): a Redis that does not answer is noticed quickly, and the call
    is retried with backoff for up to `reconnect_timeout` seconds, so a Redis restart or a failover
    of a few seconds costs a request time, not its stream. max_connections: Redis connections at
    most; a command past them waits for one to be free, up to pool_timeout seconds (then
    StoreUnavailable), instead of failing at once. reconnect_timeout: 0 fails at the first error,
    after redis-py's own `retries` quick retries."""

    def __init__(
        self,
        url: str,
        *,
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        retries: int = 1,
        max_connections: int = 128,
        pool_timeout: float = 30.0,
        reconnect_timeout: float = 30.0,
    ) -> None:
        if reconnect_timeout < 0:
            raise ValueError("reconnect_timeout must be >= 0")
        self.url, self.reconnect_timeout = url, reconnect_timeout
        self._down_since: float | None = None  # monotonic time of the current outage's first error
        options: dict[str, Any] = {
            "max_connections": max_connections,
            "timeout": pool_timeout,
            "decode_responses": True,
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": connect_timeout,
            "retry": Retry(ExponentialBackoff(cap=0.1, base=0.01), retries),
            "client_name": "specmesh-gateway",
        }
        self._sentinel: Sentinel | None = None
        if is_sentinel_url(url):
            where = parse_sentinel_url(url)
            timeouts = {"socket_timeout": socket_timeout, "socket_connect_timeout": connect_timeout}
            self._sentinel = Sentinel(where.sentinels, sentinel_kwargs=timeouts)
            self.redis = self._sentinel.master_for(
                where.service,
                connection_pool_class=_BlockingSentinelPool,
                db=where.db,
                username=where.username,
                password=where.password,
                **options,
            )
        else:
            pool = aioredis.BlockingConnectionPool.from_url(url, **options)
            self.redis = aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes it

    async def close(self) -> None:
        await self.redis.aclose()
        if self._sentinel is not None:
            await self._sentinel.aclose()

    async def call(
        self, op: str, call: Callable[[], Awaitable[T]], reconnect_timeout: float | None = None
    ) -> T:
        """`call()`, retried with backoff while Redis is unreachable (module docstring)."""
        budget = self.reconnect_timeout if reconnect_timeout is None else reconnect_timeout
        start = time.monotonic()
        delay = BACKOFF_FIRST
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0
        while True:
            try:
                result = await call()
                if task is not None and task.cancelling() > cancels:
                    # redis-py sends through asyncio.wait_for, which on Python 3.11 drops a cancel
                    # that lands as the send completes (CPython gh-86296): raise it here, or a
                    # cancelled loop (a lease renewer) would run on and its session never end.
                    raise asyncio.CancelledError
            except redis.exceptions.AuthenticationError as exc:
                raise StoreError(
                    f"session store: Redis at {_safe_url(self.url)} refused the credentials ({exc}): "
                    "check the password in the Redis URL"
                ) from exc
            except redis.exceptions.RedisError as exc:
                if _read_only(exc):  # reconnect: to the new master, wherever it is now
                    await self.redis.connection_pool.disconnect(inuse_connections=False)
                elif not isinstance(exc, _TRANSIENT):
                    raise StoreError(f"session store: Redis refused {op}: {exc}") from exc
                error: Exception = exc
            except OSError as exc:
                error = exc
            else:
                self._note_up()
                return result
            self._note_down(error)
            left = budget - (time.monotonic() - start)
            if left <= 0:
                waited = f" for {time.monotonic() - start:.1f}s" if budget else ""
                raise StoreUnavailable(
                    f"session store unavailable: Redis at {_safe_url(self.url)} did not answer "
                    f"{op}{waited} ({type(error).__name__}: {error})"
                ) from error
            await asyncio.sleep(min(delay, left))
            delay = min(2 * delay, BACKOFF_MAX)

    def _note_down(self, exc: BaseException) -> None:
        """One warning per outage, not one per waiting call."""
        if self._down_since is None:
            self._down_since = time.monotonic()
            log.warning(
                "Redis does not answer; retrying",
                extra={
                    "redis": _safe_url(self.url),
                    "error": f"{type(exc).__name__}: {exc}",
                    "reconnect_seconds": self.reconnect_timeout,
                },
            )

    def _note_up(self) -> None:
        if self._down_since is not None:
            down = time.monotonic() - self._down_since
            self._down_since = None
            log.warning(
                "Redis answers again", extra={"redis": _safe_url(self.url), "seconds": round(down, 3)}
            )


class ScriptPipeline:
    """A Lua script's calls: every call queued in one event-loop turn (a tick's sessions) goes to
    Redis in one pipelined round trip, each script still atomic on its own, and the answers are
    handed to their callers in one pass when the pipeline's reply is read: no future and no
    scheduled callback per call. `op` names it in errors."""

    def __init__(self, link: RedisLink, script: Any, op: str) -> None:
        self._link, self._script, self._op = link, script, op
        self._queued: list[tuple[list[Any], list[Any], Answer]] = []
        self._flush: asyncio.Handle | None = None
        self._sending: set[asyncio.Task] = set()

    def call(self, keys: list[Any], args: list[Any], done: Answer) -> None:
        """Queue one call of the script; done(its result, or the StoreError / StoreUnavailable it
        failed with) is called once, on the event loop, with the rest of its pipeline's answers."""
        self._queued.append((keys, args, done))
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._flush_queued)

    def _flush_queued(self) -> None:
        self._flush = None
        batch, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send(batch))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, batch: list[tuple[list[Any], list[Any], Answer]]) -> None:
        """One pipeline of EVALSHA, retried as a whole while Redis is unreachable (the caller makes
        a replay harmless: a commit's id makes a replay of one that was applied write nothing)."""
        sha = self._script.sha

        async def send() -> list[Any]:
            pipe = self._link.redis.pipeline(transaction=False)
            for keys, args, _ in batch:
                pipe.evalsha(sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
            for i, result in enumerate(results):  # the script is not loaded (a Redis restart)
                if isinstance(result, redis.exceptions.NoScriptError):
                    keys, args, _ = batch[i]
                    results[i] = await self._script(keys=keys, args=args)
            return results

        try:
            results = await self._link.call(self._op, send)
        except BaseException as exc:
            error = exc if isinstance(exc, Exception) else StoreUnavailable(repr(exc))
            _answer_all([(done, error) for *_, done in batch])
            if not isinstance(exc, Exception):
                raise
            return
        refused = f"session store: Redis refused {self._op}"
        _answer_all([
            (done, StoreError(f"{refused}: {r}") if isinstance(r, redis.exceptions.RedisError) else r)
            for (*_, done), r in zip(batch, results, strict=True)
        ])  # fmt: skip


Answer = Callable[[Any], None]  # a call's result, or the exception it failed with


def _answer_all(answers: list[tuple[Answer, Any]]) -> None:
    """Hand each caller its answer; one caller's bug does not keep the others' from them."""
    for done, outcome in answers:
        try:
            done(outcome)
        except Exception:
            log.exception("a store answer could not be handed over")
