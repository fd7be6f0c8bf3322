"""Session metadata in Redis: committed tokens, replica cache lengths, assignment, round, stats.

No replica is the only holder of a session (docs/architecture.md): the committed tokens live here, so a
restarted or replaced replica can be resynced from them. The key schema and the commit protocol
are documented in docs/redis.md; in short, each session has four keys sharing one hash tag

    specmesh:{<id>}:meta      hash   round, prompt_len, drafter, verifier, params, times, finish_reason
    specmesh:{<id>}:tokens    list   committed token ids (prompt + generated)
    specmesh:{<id>}:replicas  hash   replica address -> KV cache length it holds
    specmesh:{<id>}:stats     hash   GenerationStats counters (`stats_int_fields`, `stats_float_fields`)
    specmesh:{<id>}:owner     string the ownership lease: present while the owner is alive (short expiry)

Ownership (fencing): a session's rounds run on one gateway at a time. The owner's token,
"<gateway>:<epoch>", is the meta field `owner`; the lease key says the owner is alive. The gateway
that creates a session owns it; it renews the lease while it runs (`renew`, and every commit).
Another gateway takes the session over (`take`, a resume) only once the lease is gone (expired:
the owner died; released: a handover), and becomes the owner with the next epoch. A commit whose
token is not the meta's `owner` writes nothing (`NotOwner`): a gateway that lost its lease
(paused, partitioned) and was replaced can never append to the session again. A lease key lost
with a Redis restart is set again by the owner's next commit or renewal.

and every write is one Lua script that checks before its first write that it can finish (Redis
does not roll back a script that fails halfway) and refreshes the TTL of all four keys. A round
commits only when the stored round equals the caller's expected round, so a late or duplicate
verifier reply commits nothing.

Redis restarts and failovers (gateway/redis_link.py, `RedisLink`): every operation that finds
Redis unreachable, timing out, loading its data (LOADING) or read-only (a demoted master) is
retried with exponential backoff (50 ms doubling to 1 s) for up to `reconnect_timeout` seconds;
only then StoreUnavailable (the gateway answers UNAVAILABLE). Retries are safe: reads and
`assign` / `touch` / `delete` are idempotent, and `create` and `commit_round` carry a random id
that makes a replay of the same call (its first try applied, the answer lost) succeed without
applying twice. A refused password fails at once
(StoreError); so does anything else Redis refuses.

The URL is `redis://[[user]:password@]host:port/db` (`rediss://` for TLS), or Sentinel:
`redis+sentinel://[[user]:password@]host:port[,host:port…]/service[/db]`, which asks the Sentinels
for the service's master and follows a failover (`redis_link.parse_sentinel_url`). Error messages
and logs never show the password (`redis_link._safe_url`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.exceptions

from gateway.redis_link import RedisLink, ScriptPipeline, StoreError
from gateway.redis_link import StoreUnavailable as StoreUnavailable  # the store's errors, raised by its link
from specmesh.core.stats import GenerationStats
from specmesh.rpc import outputs_log
from specmesh.rpc.tick_client import to_future

log = logging.getLogger("specmesh.gateway.session_store")

DEFAULT_TTL_SECONDS = 600.0
DEFAULT_LEASE_SECONDS = 3.0  # a dead gateway's sessions can be resumed elsewhere this long after
DEFAULT_RECONNECT_SECONDS = 30.0  # the gateway's --redis-reconnect-seconds
CLEANUP_RECONNECT_SECONDS = 2.0  # `delete` is cleanup (the TTL is the backstop): it waits less
SCHEMA_VERSION = "1"
_SESSION_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # no braces: they would break the hash tag


class SessionExists(StoreError):
    pass


class SessionNotFound(StoreError):
    """The session is not in Redis: never created, deleted, or expired (TTL)."""


class NotOwner(StoreError):
    """The session is run by another gateway: its lease is live (a take), or this gateway's lease
    was lost and another took the session over (a commit)."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds until the other gateway's lease runs out, if not renewed


@dataclass(frozen=True)
class SessionKeys:
    meta: str
    tokens: str
    replicas: str
    stats: str
    owner: str

    @classmethod
    def of(cls, session_id: str, prefix: str = "specmesh") -> SessionKeys:
        if not _SESSION_ID.fullmatch(session_id):
            raise ValueError(f"invalid session id {session_id!r}: use 1-128 of [A-Za-z0-9._:-]")
        # The {…} hash tag puts all of a session's keys in one Redis Cluster slot, which a
        # multi-key Lua script needs.
        base = f"{prefix}:{{{session_id}}}"
        return cls(f"{base}:meta", f"{base}:tokens", f"{base}:replicas", f"{base}:stats", f"{base}:owner")

    def all(self) -> list[str]:
        """The session's data keys (they share the session's TTL; the owner key has its own)."""
        return [self.meta, self.tokens, self.replicas, self.stats]

    def with_owner(self) -> list[str]:
        return [*self.all(), self.owner]


@dataclass
class Session:
    id: str
    tokens: list[int]  # committed: prompt + generated
    prompt_len: int
    round: int  # rounds committed so far; the next commit must name this number
    drafter: str
    verifier: str
    replica_lengths: dict[str, int]  # replica address -> committed tokens its KV cache holds
    sampling: dict[str, Any]
    speculation: dict[str, Any]
    max_new_tokens: int
    extra: dict[str, Any]  # anything else the gateway needs to continue (stop strings, ...)
    stats: GenerationStats = field(default_factory=GenerationStats)
    created_at: float = 0.0
    updated_at: float = 0.0
    finish_reason: str | None = None
    owner: str = ""  # this gateway's owner token after create / take ("" for a plain load)

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


# ---- Lua -----------------------------------------------------------------------------------------
# KEYS is always (meta, tokens, replicas, stats). Every script checks key types before its first
# write, so it either fails untouched or runs to the end.

_PRELUDE = """
local function wrong_type(pairs_)
  for i = 1, #pairs_, 2 do
    local t = redis.call('TYPE', pairs_[i])['ok']
    if t ~= 'none' and t ~= pairs_[i + 1] then
      return redis.error_reply('WRONGTYPE ' .. pairs_[i] .. ' holds a ' .. t .. ', not a ' .. pairs_[i + 1])
    end
  end
  return nil
end
-- unpack() has a stack limit of a few thousand values: push long token lists in slices
local function push(key, values, first, last)
  for i = first, last, 1000 do
    redis.call('RPUSH', key, unpack(values, i, math.min(i + 999, last)))
  end
end
-- a packed argument: values separated by single spaces (one argument, not one per value: each
-- argument costs the client a few microseconds to pack, and a commit has dozens)
local function words(packed)
  local out = {}
  for w in string.gmatch(packed, '%S+') do out[#out + 1] = w end
  return out
end
-- fields packed one per line into one argument (empty ones kept)
local function lines(packed)
  local out = {}
  for f in string.gmatch(packed .. '\\n', '([^\\n]*)\\n') do out[#out + 1] = f end
  return out
end
local function expire_all(ttl_ms)
  for i = 1, 4 do if KEYS[i] then redis.call('PEXPIRE', KEYS[i], ttl_ms) end end
end
"""

# KEYS: the four data keys and the lease key. ARGV: ttl_ms, create_id, owner token, lease_ms,
# n_meta_args, meta field/value pairs... (with create_id, epoch 1 and owner), the prompt's tokens
# packed (space-separated: a long prompt is one argument, not thousands).
# Returns 1 created, 2 this very create was already applied (a retry), 0 the id is taken.
_CREATE = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'create_id') == ARGV[2] then return 2 end
  return 0
end
-- leftovers of an earlier session with this id whose keys expired one by one
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
local n_meta = tonumber(ARGV[5])
redis.call('HSET', KEYS[1], unpack(ARGV, 6, 5 + n_meta))
local tokens = words(ARGV[6 + n_meta])
if #tokens > 0 then push(KEYS[2], tokens, 1, #tokens) end
expire_all(tonumber(ARGV[1]))
redis.call('SET', KEYS[5], ARGV[3], 'PX', ARGV[4])
return 1
"""
)

# KEYS: the four data keys and the lease key.
# a[1]: one line each (`lines`): expected_round, commit_id, ttl_ms, now, finish_reason
#       ('' = not finished), owner token ('' = not fenced), lease_ms, and four packed groups
#       (space-separated): new tokens, replica address / length pairs, int stat name / delta
#       pairs, float ones. One argument, not eleven: a tick commits dozens of sessions, and the
#       client packs each argument of each command in Python.
# Returns 1 committed, 2 this very commit was already applied (a client-side retry),
#         0 stale round or finished session (nothing written), -1 no such session,
#         -2 the owner token is not the current one (another gateway runs the session).
_COMMIT = (
    _PRELUDE
    + """
local a = lines(ARGV[1])
local round = redis.call('HGET', KEYS[1], 'round')
if not round then return -1 end
if round ~= a[1] then
  if redis.call('HGET', KEYS[1], 'last_commit') == a[2] then return 2 end
  return 0
end
if a[6] ~= '' and redis.call('HGET', KEYS[1], 'owner') ~= a[6] then return -2 end
if redis.call('HEXISTS', KEYS[1], 'finish_reason') == 1 then return 0 end
local err = wrong_type({KEYS[2], 'list', KEYS[3], 'hash', KEYS[4], 'hash'})
if err then return err end
local tokens = words(a[8])
if #tokens > 0 then push(KEYS[2], tokens, 1, #tokens) end
local replicas = words(a[9])
if #replicas > 0 then redis.call('HSET', KEYS[3], unpack(replicas)) end
local ints = words(a[10])
for j = 1, #ints, 2 do redis.call('HINCRBY', KEYS[4], ints[j], ints[j + 1]) end
local floats = words(a[11])
for j = 1, #floats, 2 do redis.call('HINCRBYFLOAT', KEYS[4], floats[j], floats[j + 1]) end
redis.call('HSET', KEYS[1], 'round', string.format('%d', tonumber(round) + 1),
           'updated_at', a[4], 'last_commit', a[2])
if a[5] ~= '' then redis.call('HSET', KEYS[1], 'finish_reason', a[5]) end
expire_all(tonumber(a[3]))
if a[6] ~= '' then redis.call('SET', KEYS[5], a[6], 'PX', a[7]) end
return 1
"""
)

# KEYS: the four data keys and the lease key. ARGV: gateway id, lease_ms.
# Returns {1, token} taken, {0, ms} another gateway's lease has ms left, {-1, 0} no such session.
_TAKE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {-1, 0} end
local left = redis.call('PTTL', KEYS[5])
if left > 0 then return {0, left} end
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
local token = ARGV[1] .. ':' .. epoch
redis.call('HSET', KEYS[1], 'owner', token)
redis.call('SET', KEYS[5], token, 'PX', ARGV[2])
return {1, token}
"""

# KEYS: meta, the lease key. ARGV: token, lease_ms ('' = release).
# Returns 1 done, 0 not the owner, 2 (a renewal) no lease to renew: released, or lost with a Redis
# restart; never set again here, or a renewal racing a handover's release would undo it.
_LEASE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then return 0 end
if ARGV[2] == '' then redis.call('DEL', KEYS[2]) return 1 end
if redis.call('PEXPIRE', KEYS[2], ARGV[2]) == 0 then return 2 end
return 1
"""

# ARGV: ttl_ms, n_meta_args, n_drop, n_replica_args, then the three groups.
_ASSIGN = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local err = wrong_type({KEYS[3], 'hash'})
if err then return err end
local i = 5
local n = tonumber(ARGV[2])
if n > 0 then redis.call('HSET', KEYS[1], unpack(ARGV, i, i + n - 1)) end
i = i + n
n = tonumber(ARGV[3])
if n > 0 then redis.call('HDEL', KEYS[3], unpack(ARGV, i, i + n - 1)) end
i = i + n
n = tonumber(ARGV[4])
if n > 0 then redis.call('HSET', KEYS[3], unpack(ARGV, i, i + n - 1)) end
expire_all(tonumber(ARGV[1]))
return 1
"""
)

# ARGV: ttl_ms
_TOUCH = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
expire_all(tonumber(ARGV[1]))
return 1
"""
)

# A replica's prefix summary (gateway/prefixes.py). KEYS: (meta, set); ARGV: incarnation, version,
# ttl_ms, then the members. Written only when newer than what is there: another incarnation (the
# replica restarted), or a higher version of the same one. Returns 1 written, 0 older.
_PREFIXES = """
local held = redis.call('HMGET', KEYS[1], 'incarnation', 'version')
if held[1] == ARGV[1] and tonumber(held[2] or '-1') >= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 1000 do redis.call('SADD', KEYS[2], unpack(ARGV, i, math.min(i + 999, #ARGV))) end
redis.call('HSET', KEYS[1], 'incarnation', ARGV[1], 'version', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if #ARGV >= 4 then redis.call('PEXPIRE', KEYS[2], ARGV[3]) end
return 1
"""
PREFIXES_TTL_SECONDS = 3600.0  # a replica's summary outlives it this long (its address may return)
PLACED_SECONDS = 60.0  # a session's placement counts as what its replica holds this long


def _flat(pairs: Mapping[str, Any]) -> list[str]:
    return [str(x) for kv in pairs.items() for x in kv]


def _packed(values: Iterable[Any]) -> str:
    """Values as one script argument, space-separated: the Lua side splits it (`words`)."""
    return " ".join(map(str, values))


def _float(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError(f"stats must be finite, got {x}")
    return repr(float(x))


def _tokens(tokens: Sequence[int]) -> list[int]:
    out = [int(t) for t in tokens]
    if any(t < 0 for t in out):
        raise ValueError("token ids must be >= 0")
    return out


class OutputsLog:
    """The mesh's log of finished outputs on the store's Redis, which the suffix drafters learn
    from (specmesh/rpc/outputs_log.py)."""

    def __init__(self, link: RedisLink, stream: str) -> None:
        self._link, self.stream = link, stream

    async def publish(self, tokens: Sequence[int]) -> None:
        """One finished session's output; cleanup, so it waits for Redis less than a commit."""
        budget = min(self._link.reconnect_timeout, CLEANUP_RECONNECT_SECONDS)
        send = lambda: outputs_log.publish(self._link.redis, tokens, self.stream)  # noqa: E731
        await self._link.call("publish", send, budget)


class SessionStore:
    """Async session store on one Redis, or on the master a Sentinel names (redis-py `redis.asyncio`).

    Socket timeouts are short (1 s): a Redis that does not answer is noticed quickly, and the call
    is retried with backoff for up to `reconnect_timeout` seconds (module docstring), so a Redis
    restart or a failover of a few seconds costs a request time, not its stream. A retried commit
    or create is recognised by its id, so it cannot apply twice.
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        ttl_seconds: float = DEFAULT_TTL_SECONDS,
        prefix: str = "specmesh",
        socket_timeout: float = 1.0,
        connect_timeout: float = 1.0,
        retries: int = 1,
        max_connections: int = 128,
        pool_timeout: float = 30.0,
        reconnect_timeout: float = DEFAULT_RECONNECT_SECONDS,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        gateway_id: str | None = None,
    ) -> None:
        """The connection's settings are RedisLink's (gateway/redis_link.py)."""
        if ttl_seconds <= 0:
            raise ValueError("ttl_seconds must be > 0")
        if lease_seconds <= 0:
            raise ValueError("lease_seconds must be > 0")
        self._link = RedisLink(
            url, socket_timeout=socket_timeout, connect_timeout=connect_timeout, retries=retries,
            max_connections=max_connections, pool_timeout=pool_timeout, reconnect_timeout=reconnect_timeout,
        )  # fmt: skip
        self.url, self.reconnect_timeout = url, reconnect_timeout
        self.ttl_seconds = ttl_seconds
        self.lease_seconds = lease_seconds
        if gateway_id is not None and (not gateway_id or gateway_id.split() != [gateway_id]):
            raise ValueError(f"gateway_id must be non-empty, without whitespace: {gateway_id!r}")
        self.gateway_id = gateway_id or uuid.uuid4().hex[:12]  # this gateway, in owner tokens
        self._commit_prefix, self._commit_count = f"{uuid.uuid4().hex}:", itertools.count()
        self.prefix = prefix
        self._redis, self._call = self._link.redis, self._link.call
        self._create = self._redis.register_script(_CREATE)
        self._commit = self._redis.register_script(_COMMIT)
        self._take = self._redis.register_script(_TAKE)
        self._lease = self._redis.register_script(_LEASE)
        self._assign = self._redis.register_script(_ASSIGN)
        self._touch = self._redis.register_script(_TOUCH)
        self._prefixes = self._redis.register_script(_PREFIXES)
        # every commit of one event-loop turn in one pipelined round trip
        self._commits = ScriptPipeline(self._link, self._commit, "commit_round")
        self.outputs = OutputsLog(self._link, f"{prefix}:{outputs_log.STREAM_NAME}")

    async def __aenter__(self) -> SessionStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._link.close()

    def keys(self, session_id: str) -> SessionKeys:
        return SessionKeys.of(session_id, self.prefix)

    @property
    def _ttl_ms(self) -> int:
        return max(1, int(self.ttl_seconds * 1000))

    @property
    def _lease_ms(self) -> int:
        return max(1, int(self.lease_seconds * 1000))

    async def ping(self) -> None:
        await self._call("PING", self._redis.ping)

    async def create(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        *,
        drafter: str = "",
        verifier: str = "",
        sampling: Mapping[str, Any] | None = None,
        speculation: Mapping[str, Any] | None = None,
        max_new_tokens: int = 0,
        extra: Mapping[str, Any] | None = None,
    ) -> Session:
        """Store a new session at round 0; SessionExists if the id is taken (by another create:
        a retry of this very call after a lost answer is recognised by its create_id)."""
        keys = self.keys(session_id)
        tokens = _tokens(prompt_tokens)
        now = time.time()
        create_id = uuid.uuid4().hex
        owner = f"{self.gateway_id}:1"
        meta = {
            "version": SCHEMA_VERSION,
            "epoch": 1,
            "owner": owner,
            "round": 0,
            "prompt_len": len(tokens),
            "drafter": drafter,
            "verifier": verifier,
            "sampling": json.dumps(dict(sampling or {})),
            "speculation": json.dumps(dict(speculation or {})),
            "max_new_tokens": int(max_new_tokens),
            "extra": json.dumps(dict(extra or {})),
            "created_at": repr(now),
            "updated_at": repr(now),
            "create_id": create_id,
        }
        meta_args = _flat(meta)
        args = [
            self._ttl_ms,
            create_id,
            owner,
            self._lease_ms,
            len(meta_args),
            *meta_args,
            _packed(tokens),
        ]
        created = await self._call("create", lambda: self._create(keys=keys.with_owner(), args=args))
        if not created:
            raise SessionExists(f"session {session_id!r} already exists")
        return Session(
            id=session_id,
            tokens=tokens,
            prompt_len=len(tokens),
            round=0,
            drafter=drafter,
            verifier=verifier,
            replica_lengths={},
            sampling=dict(sampling or {}),
            speculation=dict(speculation or {}),
            max_new_tokens=int(max_new_tokens),
            extra=dict(extra or {}),
            created_at=now,
            updated_at=now,
            owner=owner,
        )

    async def load(self, session_id: str) -> Session | None:
        """A consistent snapshot (one MULTI/EXEC) of the session, or None if it does not exist."""
        keys = self.keys(session_id)

        async def snapshot() -> list[Any]:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.hgetall(keys.meta)
                pipe.lrange(keys.tokens, 0, -1)
                pipe.hgetall(keys.replicas)
                pipe.hgetall(keys.stats)
                return await pipe.execute()

        meta, tokens, replicas, stats = await self._call("load", snapshot)
        if not meta:
            return None
        return Session(
            id=session_id,
            tokens=[int(t) for t in tokens],
            prompt_len=int(meta["prompt_len"]),
            round=int(meta["round"]),
            drafter=meta.get("drafter", ""),
            verifier=meta.get("verifier", ""),
            replica_lengths={addr: int(n) for addr, n in replicas.items()},
            sampling=json.loads(meta.get("sampling", "{}")),
            speculation=json.loads(meta.get("speculation", "{}")),
            max_new_tokens=int(meta.get("max_new_tokens", 0)),
            extra=json.loads(meta.get("extra", "{}")),
            stats=stats_from_hash(stats),
            created_at=float(meta.get("created_at", 0.0)),
            updated_at=float(meta.get("updated_at", 0.0)),
            finish_reason=meta.get("finish_reason"),
        )

    async def commit_round(
        self,
        session_id: str,
        expected_round: int,
        new_tokens: Sequence[int],
        stats_delta: GenerationStats | None = None,
        replica_lengths: Mapping[str, int] | None = None,
        *,
        finish_reason: str | None = None,
        owner: str = "",
    ) -> bool:
        """Append a round's tokens, add its stats, record replica cache lengths, advance the round.

        Atomic (one Lua script) and conditional: applies only if the stored round equals
        `expected_round` and the session is not finished; otherwise returns False and writes
        nothing. `finish_reason` marks the session finished in the same step. Raises
        SessionNotFound if the session expired or was deleted, StoreUnavailable if Redis stayed
        down past reconnect_timeout (then this call committed either everything or nothing, and a
        new commit for the same round tells which: it returns False if the earlier one went
        through). Within reconnect_timeout the call retries itself with the same commit id: a try
        that was applied but whose answer was lost makes the retry return True, writing nothing.
        owner: this gateway's owner token (fenced: NotOwner if it is not the current one, and the
        lease is renewed); "" commits without the check. Every commit of one event-loop turn goes
        to Redis in one pipelined round trip."""
        answer = asyncio.get_running_loop().create_future()
        done = functools.partial(to_future, answer)
        self.commit_round_then(session_id, expected_round, new_tokens, stats_delta, replica_lengths,
                               finish_reason=finish_reason, owner=owner, done=done)  # fmt: skip
        return await answer

    def commit_round_then(
        self,
        session_id: str,
        expected_round: int,
        new_tokens: Sequence[int],
        stats_delta: GenerationStats | None = None,
        replica_lengths: Mapping[str, int] | None = None,
        *,
        finish_reason: str | None = None,
        owner: str = "",
        done: Callable[[bool | Exception], None],
    ) -> None:
        """`commit_round` for the gateway's rounds: done(whether it committed, or the error
        commit_round raises), with its pipeline's other answers in one pass (`ScriptPipeline`)."""
        keys = self.keys(session_id)
        if finish_reason == "":
            raise ValueError("finish_reason must be None or a non-empty string")
        tokens = _tokens(new_tokens)
        delta = stats_delta or GenerationStats()
        replicas = _flat({addr: int(n) for addr, n in (replica_lengths or {}).items()})
        if any(not addr or addr.split() != [addr] for addr in replicas[::2]):
            raise ValueError(f"replica addresses must be non-empty, without whitespace: {replicas[::2]}")
        ints = _flat({k: int(v) for k, v in stats_int_fields(delta).items()})
        floats = _flat({k: _float(v) for k, v in stats_float_fields(delta).items()})
        # A fresh id per call: a retry of this call (redis-py's or _call's) resends the same id and
        # is recognised as a replay; a second call (a duplicate reply) has another id and is refused.
        # This store's random prefix and a count: unique without a uuid per commit.
        commit_id = f"{self._commit_prefix}{next(self._commit_count)}"
        if "\n" in owner or "\n" in (finish_reason or ""):
            raise ValueError("owner and finish_reason must be single-line")
        header = [int(expected_round), commit_id, self._ttl_ms, repr(time.time()), finish_reason or ""]
        fields = [
            *map(str, header),
            owner,
            str(self._lease_ms),
            *map(_packed, (tokens, replicas, ints, floats)),
        ]
        # bytes: redis-py passes them through without its per-argument type checks
        answered = functools.partial(_commit_answer, session_id, done)
        self._commits.call([k.encode() for k in keys.with_owner()], ["\n".join(fields).encode()], answered)

    async def take(self, session_id: str) -> Session:
        """Take a session over (a resume): a new owner token for this gateway, once no other
        gateway's lease is live; NotOwner (with how long that lease has left) while one is,
        SessionNotFound if it does not exist. -> the session, as load() gives it, with `owner`."""
        keys = self.keys(session_id)
        args = [self.gateway_id, self._lease_ms]
        taken, value = await self._call("take", lambda: self._take(keys=keys.with_owner(), args=args))
        if taken == -1:
            raise SessionNotFound(f"session {session_id!r} does not exist (expired, deleted or finished)")
        if taken == 0:
            left = int(value) / 1000.0
            raise NotOwner(
                f"session {session_id!r} is run by another gateway (its lease has {left:.1f}s left)", left
            )
        session = await self.load(session_id)
        if session is None:
            raise SessionNotFound(f"session {session_id!r} does not exist (expired, deleted or finished)")
        session.owner = str(value)
        return session

    async def renew(self, session_id: str, owner: str) -> bool:
        """Extend this gateway's lease; False if it is not the owner any more (True if there was no
        lease to extend: the next commit sets it again)."""
        keys = self.keys(session_id)
        key = [keys.meta, keys.owner]
        return bool(await self._call("renew", lambda: self._lease(keys=key, args=[owner, self._lease_ms])))

    async def renew_many(self, leases: Sequence[tuple[str, str]]) -> list[bool]:
        """`renew` of many sessions ((id, owner token) each) in one pipelined round trip; False
        where this gateway is not the owner any more."""
        if not leases:
            return []
        sha = self._lease.sha

        async def send() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for session_id, owner in leases:
                keys = self.keys(session_id)
                pipe.evalsha(sha, 2, keys.meta, keys.owner, owner, self._lease_ms)
            results = await pipe.execute(raise_on_error=False)
            for i, result in enumerate(results):  # the script is not loaded (a Redis restart)
                if isinstance(result, redis.exceptions.NoScriptError):
                    keys = self.keys(leases[i][0])
                    results[i] = await self._lease(
                        keys=[keys.meta, keys.owner], args=[leases[i][1], self._lease_ms]
                    )
            return results

        results = await self._call("renew", send)
        # an error for one session (not a lost lease) says nothing: take it as still ours
        return [True if isinstance(r, redis.exceptions.RedisError) else bool(r) for r in results]

    async def release(self, session_id: str, owner: str) -> bool:
        """Give the lease up (a handover: another gateway may take the session at once)."""
        keys = self.keys(session_id)
        key = [keys.meta, keys.owner]
        budget = min(self.reconnect_timeout, CLEANUP_RECONNECT_SECONDS)
        return bool(await self._call("release", lambda: self._lease(keys=key, args=[owner, ""]), budget))

    async def assign(
        self,
        session_id: str,
        *,
        drafter: str | None = None,
        verifier: str | None = None,
        replica_lengths: Mapping[str, int] | None = None,
        drop_replicas: Sequence[str] = (),
    ) -> None:
        """Failover / resync bookkeeping: change the assigned replicas and their cache lengths."""
        keys = self.keys(session_id)
        meta: dict[str, Any] = {"updated_at": repr(time.time())}
        if drafter is not None:
            meta["drafter"] = drafter
        if verifier is not None:
            meta["verifier"] = verifier
        meta_args = _flat(meta)
        drops = [str(a) for a in drop_replicas]
        replicas = _flat({addr: int(n) for addr, n in (replica_lengths or {}).items()})
        args = [self._ttl_ms, len(meta_args), len(drops), len(replicas), *meta_args, *drops, *replicas]
        result = await self._call("assign", lambda: self._assign(keys=keys.all(), args=args))
        if result == -1:
            raise SessionNotFound(f"session {session_id!r} does not exist (expired or deleted)")

    async def touch(self, session_id: str) -> bool:
        """Refresh the TTL without a commit (a long round); False if the session does not exist."""
        keys = self.keys(session_id).all()
        return bool(await self._call("touch", lambda: self._touch(keys=keys, args=[self._ttl_ms])))

    async def expire(self, session_id: str, seconds: float) -> bool:
        """Let the session's keys expire in `seconds` (a finished session kept for a late resume):
        `touch`'s script with a TTL of its own. False if the session does not exist."""
        keys, ms = self.keys(session_id).all(), max(1, int(seconds * 1000))
        budget = min(self.reconnect_timeout, CLEANUP_RECONNECT_SECONDS)
        return bool(await self._call("expire", lambda: self._touch(keys=keys, args=[ms]), budget))

    async def ttl(self, session_id: str) -> float | None:
        """Seconds until the session expires, None if it does not exist."""
        ms = await self._call("ttl", lambda: self._redis.pttl(self.keys(session_id).meta))
        return None if ms < 0 else ms / 1000.0

    # ---- replicas' prefix summaries (gateway/prefixes.py) ----------------------------------------

    async def put_prefixes(self, address: str, incarnation: str, version: int, hashes: Sequence[str]) -> bool:
        """Replace what `address` holds (its route hashes, hex) if this is newer; False if not."""
        keys, ttl = _prefix_keys(self.prefix, address)[:2], max(1, int(PREFIXES_TTL_SECONDS * 1000))
        args = [incarnation, version, ttl, *hashes]
        return bool(await self._call("put_prefixes", lambda: self._prefixes(keys=keys, args=args)))

    async def add_prefixes(self, address: str, hashes: Sequence[str]) -> None:
        """Sessions with these route hashes were placed on `address`: it holds them for the next
        PLACED_SECONDS, whatever summaries of the replica's are written meanwhile (one read before
        their prefill would not name them)."""
        key = _prefix_keys(self.prefix, address)[2]
        now = time.time()

        async def add() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.zadd(key, dict.fromkeys(hashes, now))
            pipe.zremrangebyscore(key, "-inf", now - PLACED_SECONDS)
            pipe.pexpire(key, int(PLACED_SECONDS * 1000))
            return await pipe.execute()

        if hashes:
            await self._call("add_prefixes", add)

    async def held_prefixes(self, addresses: Sequence[str], hashes: Sequence[str]) -> dict[str, int]:
        """For each replica, how many of `hashes` (a prompt's route hashes, in order) it holds, by
        its summary or a recent placement: the deepest one it has, + 1 (chained hashes: holding
        one, it holds those before it). One round trip for all replicas."""

        async def ask() -> list[Any]:
            pipe = self._redis.pipeline(transaction=False)
            for address in addresses:
                _, summary, placed = _prefix_keys(self.prefix, address)
                pipe.smismember(summary, list(hashes))
                pipe.zmscore(placed, list(hashes))
            return await pipe.execute()

        if not hashes or not addresses:
            return dict.fromkeys(addresses, 0)
        answers = await self._call("held_prefixes", ask)
        recent = time.time() - PLACED_SECONDS
        out = {}
        for k, address in enumerate(addresses):
            summary, placed = answers[2 * k], answers[2 * k + 1]
            held = [a or (b is not None and b >= recent) for a, b in zip(summary, placed, strict=True)]
            out[address] = max((i + 1 for i, h in enumerate(held) if h), default=0)
        return out

    async def delete(self, session_id: str) -> bool:
        """Remove every key of the session (one DEL, atomic); False if there was nothing. It is
        cleanup, so it waits for Redis at most CLEANUP_RECONNECT_SECONDS: the TTL is the backstop."""
        keys = self.keys(session_id).with_owner()
        budget = min(self.reconnect_timeout, CLEANUP_RECONNECT_SECONDS)
        return bool(await self._call("delete", lambda: self._redis.delete(*keys), budget))


def _prefix_keys(prefix: str, address: str) -> list[str]:
    """(meta, set, placements) of a replica's summary: `specmesh:replica:{<address>}:...`, apart
    from every session's `specmesh:{<id>}:...`; one hash tag, so the script's keys share a slot."""
    tag = f"{prefix}:replica:{{{address}}}"
    return [f"{tag}:prefixes-meta", f"{tag}:prefixes", f"{tag}:placed"]


def _commit_answer(session_id: str, done: Callable[[bool | Exception], None], result: Any) -> None:
    """The commit script's result (or the pipeline's error) -> committed or not, or the error it
    means."""
    if result == -1:
        result = SessionNotFound(f"session {session_id!r} does not exist (expired or deleted)")
    elif result == -2:
        result = NotOwner(f"session {session_id!r}: another gateway took it over")
    elif not isinstance(result, Exception):
        result = result in (1, 2)
    done(result)


# ---- GenerationStats as a Redis hash -----------------------------------------------------------

_INT_FIELDS = (
    "rounds", "draft_calls", "drafted_tokens", "accepted_tokens", "round_tokens", "cached_prompt_tokens",
)  # fmt: skip
_FLOAT_FIELDS = ("draft_seconds", "verify_seconds", "network_seconds", "total_seconds")
_DEPTH_PREFIX = "accepted_per_depth:"


def stats_int_fields(stats: GenerationStats) -> dict[str, int]:
    """Integer counters as hash fields; per-depth counts as `accepted_per_depth:<d>`."""
    out = {name: getattr(stats, name) for name in _INT_FIELDS}
    out.update({f"{_DEPTH_PREFIX}{d}": n for d, n in enumerate(stats.accepted_per_depth)})
    return out


def stats_float_fields(stats: GenerationStats) -> dict[str, float]:
    return {name: getattr(stats, name) for name in _FLOAT_FIELDS}


def stats_from_hash(values: Mapping[str, str]) -> GenerationStats:
    prefixed = {k.removeprefix(_DEPTH_PREFIX): v for k, v in values.items() if k.startswith(_DEPTH_PREFIX)}
    depths = {int(d): int(n) for d, n in prefixed.items()}
    per_depth = [depths.get(d, 0) for d in range(max(depths) + 1)] if depths else []
    return GenerationStats(
        **{name: int(values.get(name, 0)) for name in _INT_FIELDS},
        **{name: float(values.get(name, 0.0)) for name in _FLOAT_FIELDS},
        accepted_per_depth=per_depth,
    )
