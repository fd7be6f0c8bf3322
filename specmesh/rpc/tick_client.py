"""A caller's tick loop to one replica: every session's draft or verification queued while the
replica works goes out in the next tick, as one message on a long-lived `Ticks` stream, and comes
back as one message (proto/specmesh/v1, "ticks"; docs/services.md).

    loop = TickLoop(channel, Role.VERIFIER, "127.0.0.1:50062")
    verified = await loop.verify(session, position, new_tokens, tree, plain_steps)

One loop per replica and caller: the gateway keeps one per replica of its pools, a RemoteSession
its own. A tick is sent as soon as the replica has none in flight and the event loop has nothing
else to run (every session that woke in this turn has queued its work), so sessions that run in
step share one message and one forward. Sessions are opened on the stream once (their key, sampling
and settings), then named by a handle; a tick carries only positions, new tokens and trees, in
columns. A drafted tree stays the drafter's columns (`TreeRef`) until a verify tick relays it:
never decoded here (a gateway-only install has no torch).

A session's start goes at once, in a tick of its own beside the ones in flight, when one of them
holds a plain run of several steps (`_urgent_room`: the replica ends the run after its step for
it; that tick takes no room), a limited one only while no other prefill is in flight or queued
before it. Beside any other tick it would take a forward of its own; it goes in the next tick.
A start or a prefill chunk is urgent (`_urgent`): a tick that carries one asks one plain step of
every plain run in it (`_plain_steps`), and the replica ends the plain runs already running after
their step, so that the new session's first token, or the next chunk, waits for no run of 4
steps, and each running stream gets a token per chunk forward, as vLLM's chunked-prefill steps
give each running request one token beside the prefill chunk. A prefill's later chunks go with
the running sessions' next steps, in the next tick (`_starts` says why).

Chunked prefill: a draft or verification queued `limited` (its caller's choice: it would feed
more than a tick's budget, `needs_prefill`) may feed a chunk only. A tick gives its limited items
what its token budget (`max_tick_tokens`) leaves after the other items' tokens (at least a quarter
of it), the oldest first, as each one's feed limit; an item whose tokens past the prefix its
replica holds fit in it runs whole, one that does not feeds that many and answers what the replica
holds (`Prefilled`), and its caller queues it again from there. A limited item the budget leaves
nothing waits for the next tick.

Failures: an item's own error is an `ItemError` (shaped like grpc.aio.AioRpcError: code(),
details(), trailing_metadata(), so a resync answer reads the same); a stream that fails fails every
item in flight with its error, and the next tick opens a new stream. Cancelling an item's future
takes it out of the queue, or, once sent, tells the replica to stop it before its next forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import grpc
import numpy as np

from specmesh.core.drafting import TreeSpec
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.ticks import Ragged, TreeColumns
from specmesh.core.verification import Verdict
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2
from specmesh.rpc.tick_timing import ItemTimers, LoopBound, TickHold, Timing
from specmesh.rpc.ticks import (
    GUESS_NEXT,
    SPECULATIVE,
    SUPERSEDABLE,
    DraftAnswer,
    DraftResultMessage,
    DraftTickMessage,
    ItemFailure,
    Opened,
    TickItems,
    VerifyAnswer,
    VerifyResultMessage,
    VerifyTickMessage,
)

log = logging.getLogger("specmesh.rpc.tick_client")

PACE_WEIGHT = 0.2  # the newest round trip's weight in `pace` (an exponential moving average)


class Role(StrEnum):
    DRAFTER = "drafter"
    VERIFIER = "verifier"


ROLES = tuple(Role)  # iterating an Enum class builds a generator each time: hot paths use this


class ItemError(Exception):
    """One item's failure, with AioRpcError's reading methods (a resync answer reads the same).
    per_try: it ran past its per-try timeout while a spare replica was there (`Timing`)."""

    def __init__(
        self, code: grpc.StatusCode, details: str, resync: bool = False, per_try: bool = False
    ) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self.resync, self.per_try = code, details, resync, per_try

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple:
        return ((wire.RESYNC_KEY, "1"),) if self.resync else ()


_CODES = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True)
class TreeRef:
    """A drafted tree as its drafter sent it: item `index` of a tick result's columns."""

    columns: TreeColumns
    index: int

    @property
    def nodes(self) -> int:
        return int(self.columns.tokens.offsets[self.index + 1] - self.columns.tokens.offsets[self.index])

    @property
    def tokens(self) -> list[int]:
        return self.columns.tokens.item(self.index).tolist()

    @property
    def depth(self) -> int:
        start, end = self.columns.tokens.offsets[self.index : self.index + 2]
        parents = self.columns.parents[start:end].tolist()
        depth: list[int] = []
        for p in parents:
            depth.append(1 if p < 0 else depth[p] + 1)
        return max(depth, default=0)

    def chain_suffix(self, skip: int) -> TreeRef:
        """A chain without its first `skip` nodes (core.tree.chain_suffix, on the columns):
        node i + skip becomes node i, the rows kept whole."""
        c, i = self.columns.take([self.index]), 0
        n = self.nodes
        if not 0 < skip < n:
            raise ValueError(f"skip must be in [1, {n - 1}], got {skip}")
        if not np.array_equal(c.parents, np.arange(-1, n - 1)):
            raise ValueError("chain_suffix takes a chain")
        suffix = TreeColumns(
            tokens=Ragged(np.array([0, n - skip], np.int64), c.tokens.values[skip:]),
            parents=np.arange(-1, n - skip - 1, dtype=np.int32),
            modes=c.modes,
            thresholds=c.thresholds,
            prob_rows=c.prob_rows[skip:],
            item_rows=c.item_rows,
            row_ids=c.row_ids,
            row_probs=c.row_probs,
            vocab_size=c.vocab_size,
        )
        return TreeRef(suffix, i)


@dataclass
class Drafted:
    """A draft's answer."""

    tree: TreeRef | None  # None: an n-gram drafter found no match (the round is a plain step)
    likely: list[int] = field(default_factory=list)  # guess_next: the likely path, then the guess
    forwards: int = 0
    seconds: float = 0.0  # the tick's time on the drafter
    superseded: bool = False
    cached: int = 0  # a draft that started its session: tokens its KV took from a prefix

    @property
    def tree_nodes(self) -> int:
        return self.tree.nodes if self.tree is not None else 0

    @property
    def tree_depth(self) -> int:
        return self.tree.depth if self.tree is not None else 0


@dataclass
class Verified:
    """A verification's answer: the tokens it emitted (plain steps first) and how."""

    tokens: list[int]
    plain: int
    accepted_nodes: list[int]
    bonus: bool
    logprobs: list[TokenLogprob] = field(default_factory=list)
    rides: tuple[int, int] = (0, 0)  # plain steps' n-gram rides: nodes checked, accepted
    batch_size: int = 0
    batch_tokens: int = 0
    forward_seconds: float = 0.0
    queue_seconds: float = 0.0
    cached: int = 0  # a verification that started its session: tokens its KV took from a prefix

    @property
    def verdict(self) -> Verdict:
        emitted = self.tokens[self.plain :]
        accepted = emitted[:-1]
        return Verdict(accepted, list(self.accepted_nodes), emitted[-1], self.bonus)

    @property
    def plain_tokens(self) -> list[int]:
        return self.tokens[: self.plain]


Done = Callable[[Any], None]  # an item's answer, or the exception it failed with


@dataclass(eq=False)
class _Work:
    session: Opened
    position: int
    new_tokens: list[int]
    done: Done  # called once, on the event loop, as soon as the item's tick answers
    spec: TreeSpec | None = None  # a draft
    flags: int = 0
    tree: TreeRef | None = None  # a verification
    plain_steps: int = 1
    lookup_depth: int = 0  # plain steps: the deepest n-gram ride (VerifyRequest.lookup_depth)
    lookup_min_ngram: int = 0  # ... of matches at least this long (VerifyRequest.lookup_min_ngram)
    max_tokens: int = 0  # plain steps: tokens the call may emit at most (VerifyRequest.max_tokens)
    suffix_rides: bool = False  # plain steps: suffix trees may ride (VerifyRequest.suffix_rides)
    limited: bool = False  # it may feed only what the tick's budget gives it (chunked prefill)
    feed: int = 0  # limited: what the tick it went in gave it
    since: float = 0.0  # limited: when its session's prefill began (the oldest is fed first)
    handle: int = 0
    timing: Timing | None = None
    due: float = 0.0  # when its patience runs out next
    deadline: float = float("inf")  # when it fails (Timing)
    trying: float = 0.0  # when its current period of patience began
    then: TickLoop | None = None  # where the session goes next: told to expect it once this is sent
    settled: bool = False  # answered, failed or cancelled: `done` was called (or never will be)
    awaited: bool = False  # answered through a future that a task awaits (not a callback)


class TickLoop(LoopBound):
    """One caller's ticks to one replica (module docstring)."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        role: Role,
        name: str = "",
        max_in_flight: int = 1,
        on_tick: Callable[[int], None] | None = None,
        max_hold: float = 0.25,
        max_tick_tokens: int = 0,
        on_result: Callable[[int, float], None] | None = None,
    ) -> None:
        """on_tick(items): told of every tick sent (the gateway's metrics); max_hold: the longest a
        tick waits for sessions it expects (`expect`); max_tick_tokens: a tick's token budget for
        limited items (0: none, a limited item feeds all it has); on_result(prefix version, KV usage):
        told of what the replica says of itself in every result."""
        self.role, self.name, self._on_tick = role, name, on_tick
        self.max_tick_tokens, self._on_result = max_tick_tokens, on_result
        service = "Drafter" if role is Role.DRAFTER else "Verifier"
        message, result = (
            (pb2.DraftTick, pb2.DraftTickResult)
            if role is Role.DRAFTER
            else (pb2.VerifyTick, pb2.VerifyTickResult)
        )
        self._method = channel.stream_stream(
            f"/specmesh.v1.{service}/Ticks",
            request_serializer=message.SerializeToString,
            response_deserializer=result.FromString,
        )
        self._message = message
        self.max_in_flight = max_in_flight
        self._queue: list[_Work] = []
        self._in_flight: dict[int, list[_Work]] = {}
        self._ids = itertools.count(1)
        self._call: Any = None
        self._reader: asyncio.Task | None = None
        self._writer: asyncio.Task | None = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._handles: dict[str, int] = {}  # session -> its handle on the current stream
        self._opened: dict[str, Opened] = {}  # what the current stream was told of each session
        self._handle_ids = itertools.count(1)
        self._cancel: list[int] = []
        self._release: list[int] = []
        self._closed = False
        self._hold = TickHold(self._flush, lambda: len(self._queue), max_hold)  # when a tick goes
        self._timers = ItemTimers(self._give_up, lambda: self.pace)  # when an item gives up
        self._sent_at: dict[int, float] = {}  # tick id -> when it was sent (ticks with items)
        self._beside: set[int] = set()  # the tick of session starts in flight beside the others (one)
        self.pace = 0.0  # seconds from a tick's send to its answer, averaged (PACE_WEIGHT)
        self.ticks = 0  # sent, for tests and metrics

    # ---- the caller's side ---------------------------------------------------------------------

    def draft(
        self, session: Opened, position: int, new_tokens: Sequence[int], spec: TreeSpec, *,
        guess_next: bool = False, speculative: bool = False, supersedable: bool = False,
        timing: Timing | None = None, then: TickLoop | None = None, done: Done | None = None,
        limited: float | None = None,
    ) -> Any:  # fmt: skip
        """A draft in the next tick -> a future of Drafted (or ItemError / the stream's error); with
        `done`, that is called instead (on the event loop, as soon as the tick answers: the next
        step can be queued before any coroutine runs) and the item is returned (`cancel`). then:
        the loop the session goes to next (its verifier's), told to expect it (`expect`) once the
        draft is sent. limited: the time its session's prefill began, for an item that may feed
        only a chunk (module docstring; its answer may then be `Prefilled`); None: a whole one."""
        flags = (GUESS_NEXT if guess_next else 0) | (SPECULATIVE if speculative else 0)
        flags |= SUPERSEDABLE if supersedable else 0
        work = _Work(session, position, list(new_tokens), done or _no_answer, spec=spec, flags=flags)
        work.timing, work.then = timing, then
        work.limited, work.since = limited is not None, limited or 0.0
        return self._put(work, done is None)

    def verify(
        self, session: Opened, position: int, new_tokens: Sequence[int], tree: TreeRef | None,
        plain_steps: int = 1, timing: Timing | None = None, then: TickLoop | None = None,
        done: Done | None = None, lookup_depth: int = 0, lookup_min_ngram: int = 0, max_tokens: int = 0,
        limited: float | None = None, suffix_rides: bool = False,
    ) -> Any:  # fmt: skip
        """A verification -> a future of Verified (or, with `done`, as `draft`); tree None: plain
        decoding of up to `plain_steps` steps and `max_tokens` tokens (0: no bound), n-gram
        proposals of up to `lookup_depth` tokens that match at least `lookup_min_ngram` riding in
        them, and with `suffix_rides` suffix trees of the mesh's outputs too. then, limited: as
        `draft`'s (its drafter's, next round)."""
        work = _Work(
            session, position, list(new_tokens), done or _no_answer, tree=tree, plain_steps=plain_steps,
            lookup_depth=lookup_depth, lookup_min_ngram=lookup_min_ngram, max_tokens=max_tokens,
            suffix_rides=suffix_rides,
        )  # fmt: skip
        work.timing, work.then = timing, then
        work.limited, work.since = limited is not None, limited or 0.0
        return self._put(work, done is None)

    def needs_prefill(self, position: int, committed: int) -> bool:
        """Whether a call from `position` to `committed` tokens feeds more than one tick's budget
        (then it goes `limited`, and may take several ticks)."""
        return bool(self.max_tick_tokens) and committed - position > self.max_tick_tokens

    def cancel(self, work: Any) -> None:
        """The caller drops an item: out of the queue, or the replica stops it. Its `done` is not
        called."""
        if work.settled:
            return
        work.settled = True
        self._timers.discard(work)
        if work in self._queue:
            self._queue.remove(work)
            return
        if any(work in items for items in self._in_flight.values()):
            self._cancel.append(work.handle)
            self._hold.schedule(now=True)

    def release(self, session_id: str) -> bool:
        """The session is over: the replica releases it (as Release) with the next message. False
        when the stream that named it is gone (the caller then releases it some other way)."""
        handle = self._handles.pop(session_id, None)
        self._opened.pop(session_id, None)
        if handle is None or self._call is None:
            return False
        self._release.append(handle)
        self._hold.schedule()
        return True

    async def close(self) -> None:
        self._closed = True
        self._hold.close()
        self._timers.close()
        self._fail_all(ItemError(grpc.StatusCode.CANCELLED, f"{self.name}: the tick loop closed"))
        await self._end_stream()

    # ---- queueing ------------------------------------------------------------------------------

    def _put(self, work: _Work, future: bool) -> Any:
        if future:  # the future's outcome is the item's; cancelling the future cancels the item
            f = self.loop.create_future()
            work.done, work.awaited = functools.partial(to_future, f), True
            f.add_done_callback(lambda f, w=work: self.cancel(w) if f.cancelled() else None)
        if self._closed:
            self._finish(
                work, ItemError(grpc.StatusCode.UNAVAILABLE, f"{self.name}: the tick loop is closed")
            )
            return f if future else work
        self._queue.append(work)
        self._hold.arrived(work.session.session_id)
        if work.timing is not None:
            self._timers.watch(work)
        self._hold.schedule()
        return f if future else work

    def _finish(self, work: _Work, outcome: Any) -> None:
        """Settle an item: its `done` gets its answer or its error (once)."""
        if work.settled:
            return
        work.settled = True
        self._timers.discard(work)
        try:
            work.done(outcome)
        except Exception:  # the caller's bug must not stop the loop for every other session
            log.exception("an item's answer could not be handed over", extra={"replica": self.name})

    def expect(self, session_id: str) -> None:
        """The session will queue work here as soon as another replica answers it: a tick that
        could go waits for it (at most `max_hold`), so that sessions in step stay in one tick
        instead of splitting into groups that take turns (continuous batching's straggler wait)."""
        self._hold.expect(session_id)

    def unexpect(self, session_id: str) -> None:
        """It will not come after all (it finished, or its round failed)."""
        if self._hold.unexpect(session_id) and self._queue:
            self._hold.schedule(now=True)

    def _give_up(self, work: _Work, why: str, per_try: bool) -> None:
        """Fail an item that ran out of time (ItemTimers): out of the queue, or cancelled on the
        replica."""
        if work in self._queue:
            self._queue.remove(work)
        elif any(work in items for items in self._in_flight.values()):
            self._cancel.append(work.handle)
            self._hold.schedule(now=True)
        self._finish(work, ItemError(grpc.StatusCode.DEADLINE_EXCEEDED, why, per_try=per_try))

    def _flush(self) -> None:
        """Send a tick when the replica has room and no expected session is still held for
        (TickHold calls this once the turn's sessions have queued)."""
        if self._closed:
            return
        control = bool(self._cancel or self._release)
        room = self._queue and self._rounds_in_flight() < self.max_in_flight
        if room and not control and self._hold.holds():
            return
        if room or control or self._urgent_room():
            self._send()

    def _rounds_in_flight(self) -> int:
        """Ticks in flight, but the one beside them: it takes no room."""
        return len(self._in_flight) - len(self._beside)

    def _urgent_room(self) -> bool:
        """Whether a tick of session starts may go beside the ticks in flight (`_starts`): one, and
        only beside a plain run of several steps, which the replica ends after its current step
        for it. Beside a tick of one forward it would take a forward of its own (docs/decisions.md,
        "Urgent items and one step")."""
        if self._beside or not any(self._starts(w) for w in self._queue):
            return False
        return any(steps > 1 for items in self._in_flight.values() for steps in _plain_steps(items))

    def _starts(self, work: _Work) -> bool:
        """A session's start (position 0: its first token, or a resync) may go in a tick of its own
        beside the ones in flight (`_urgent_room` says beside which): the replica's next forward
        takes both ticks' steps. A limited one (a prompt longer than the budget, maybe all cached
        but a few tokens: a conversation's next turn) only while no other prefill is in flight or
        queued before it, so prefills go oldest first; a prefill's later chunks never go beside
        (docs/decisions.md, "A prompt's first chunk goes beside only while no other prefill is
        ahead of it" and "A chunk ends the plain runs in flight after their step")."""
        if work.position != 0:
            return False
        if not work.limited:
            return True
        ahead = (w for items in self._in_flight.values() for w in items)
        return not any(w.limited for w in ahead) and not any(
            w.limited and w.since < work.since for w in self._queue
        )

    def _send(self) -> None:
        beside = False
        if self._rounds_in_flight() < self.max_in_flight:
            work, self._queue = _budgeted(self.max_tick_tokens, self._queue)
        elif self._urgent_room():  # beside the ticks in flight: the replica's next forward takes it too
            work, _ = _budgeted(self.max_tick_tokens, [w for w in self._queue if self._starts(w)])
            sent = set(map(id, work))
            self._queue = [w for w in self._queue if id(w) not in sent]
            beside = True
        else:
            work = []
        held = self._hold.sent()
        self._ensure_stream()
        tick_id = next(self._ids)
        try:
            message = self._tick(tick_id, work)
        except Exception as exc:  # a bug in building the tick: its items fail, the loop goes on
            log.exception("could not build a tick", extra={"replica": self.name})
            for w in work:
                self._finish(w, exc)
            return
        if work:
            self._in_flight[tick_id] = work
            self._sent_at[tick_id] = self.loop.time()
            if beside:
                self._beside.add(tick_id)
            for w in work:  # only what is sent is surely coming back: a queued item may wait on us
                if w.then is not None:
                    w.then.expect(w.session.session_id)
            self._timers.sent([w for w in work if w.limited])
            log.debug(
                "tick",
                extra={
                    "replica": self.name,
                    "items": len(work),
                    "tick": tick_id,
                    "expected": self._hold.expected,
                    "held_ms": round(held * 1000, 1),
                },
            )
            if self._on_tick is not None:
                self._on_tick(len(work))
        self.ticks += 1
        self._outbox.put_nowait(message)

    def _ensure_stream(self) -> None:
        if self._call is not None:
            return
        self._call = self._method()
        self._handles, self._opened = {}, {}
        self._outbox = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read(self._call))
        self._writer = asyncio.ensure_future(self._write(self._call, self._outbox))

    async def _write(self, call: Any, outbox: asyncio.Queue) -> None:
        """The stream's one writer: messages in the order they were made."""
        try:
            while True:
                await call.write(await outbox.get())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            error = exc if _said_by_the_replica(exc) else ItemError(
                grpc.StatusCode.UNAVAILABLE, f"{self.name}: the tick stream is closed ({exc!r})"
            )  # fmt: skip
            self._stream_failed(call, error)

    # ---- building a tick -----------------------------------------------------------------------

    def _tick(self, tick_id: int, work: list[_Work]) -> Any:
        opens: list[tuple[int, Any]] = []
        for w in work:
            sid = w.session.session_id
            handle = self._handles.get(sid)
            if handle is None or self._opened.get(sid) is not w.session:
                handle = self._handles.setdefault(sid, next(self._handle_ids))
                self._opened[sid] = w.session
                opens.append((handle, w.session))
            w.handle = handle
        message = _message(self.role, tick_id, opens, work, self._cancel, self._release)
        self._cancel, self._release = [], []
        return message

    # ---- results -------------------------------------------------------------------------------

    async def _read(self, call: Any) -> None:
        try:
            while True:
                message = await call.read()
                if message is grpc.aio.EOF:
                    raise ItemError(
                        grpc.StatusCode.UNAVAILABLE, f"{self.name}: the replica ended the tick stream"
                    )
                work = self._in_flight.pop(message.id, None)
                self._beside.discard(message.id)
                if work is not None:
                    trip = self.loop.time() - self._sent_at.pop(message.id)
                    self.pace += PACE_WEIGHT * (trip - self.pace) if self.pace else trip
                    log.debug(
                        "tick answered", extra={"replica": self.name, "tick": message.id, "items": len(work)}
                    )
                    self._resolve(message, work)
                if self._queue or self._cancel or self._release:
                    self._hold.schedule(settle=work is not None and any(w.awaited for w in work))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._stream_failed(call, exc)

    def _resolve(self, message: Any, work: list[_Work]) -> None:
        n = len(work)
        try:
            if self.role is Role.DRAFTER:
                drafts = DraftResultMessage.from_proto(message, n)
                outcomes, version, usage = _drafted(drafts), drafts.prefix_version, drafts.kv_usage
            else:
                verdicts = VerifyResultMessage.from_proto(message, n)
                outcomes, version, usage = _verified(verdicts), verdicts.prefix_version, verdicts.kv_usage
        except Exception as exc:  # an answer we cannot read fails its items, as a broken stream would
            outcomes = [exc] * n
        else:
            if self._on_result is not None:
                self._on_result(version, usage)
        for w, outcome in zip(work, outcomes, strict=True):
            if w.settled:
                continue
            if isinstance(outcome, ItemFailure):
                code = _CODES.get(outcome.code, grpc.StatusCode.UNKNOWN)
                if code is grpc.StatusCode.CANCELLED and w.flags & (SPECULATIVE | SUPERSEDABLE):
                    self._finish(w, Drafted(None, superseded=True))
                else:
                    self._finish(w, ItemError(code, outcome.message, outcome.resync))
            else:  # an answer, what a chunk left held (Prefilled), or why the result is unreadable
                self._finish(w, outcome)

    def _stream_failed(self, call: Any, error: BaseException) -> None:
        """The stream broke: every item sent on it fails with its error; the next tick opens anew."""
        if call is not self._call:
            return
        self._call = None
        for task in (self._reader, self._writer):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self._reader = self._writer = None
        with contextlib.suppress(Exception):
            call.cancel()
        if not isinstance(error, grpc.aio.AioRpcError | ItemError):
            error = ItemError(grpc.StatusCode.UNAVAILABLE, f"{self.name}: tick stream failed: {error!r}")
        in_flight, self._in_flight = self._in_flight, {}
        self._sent_at, self._cancel, self._release, self._beside = {}, [], [], set()
        for work in in_flight.values():
            for w in work:
                self._finish(w, error)
        if self._queue:
            self._hold.schedule()

    def _fail_all(self, error: BaseException) -> None:
        everything = [*self._queue, *(w for work in self._in_flight.values() for w in work)]
        self._queue, self._in_flight, self._sent_at, self._beside = [], {}, {}, set()
        for w in everything:
            self._finish(w, error)

    async def _end_stream(self) -> None:
        call, tasks = self._call, [t for t in (self._reader, self._writer) if t is not None]
        self._call = self._reader = self._writer = None
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if call is not None:
            call.cancel()


def _budgeted(budget: int, queue: list[_Work]) -> tuple[list[_Work], list[_Work]]:
    """(what the next tick takes, what waits): every whole item; the limited items, oldest
    first, while the token budget lasts (what the whole items leave, at least a quarter); each
    one's `feed` is what it gets. budget 0: a limited item feeds all it has."""
    fills = [w for w in queue if w.limited]
    if not fills:
        return queue, []
    if not budget:
        for w in fills:
            w.feed = len(w.new_tokens)
        return queue, []
    rounds = [w for w in queue if not w.limited]
    rows = sum(len(w.new_tokens) + (w.tree.nodes if w.tree is not None else 0) for w in rounds)
    left = max(budget - rows, budget // 4, 1)
    taken, waiting = [], []
    for w in sorted(fills, key=lambda w: w.since):
        if left > 0:
            w.feed = min(left, len(w.new_tokens))
            left -= w.feed
            taken.append(w)
        else:
            waiting.append(w)
    return rounds + taken, waiting


def _message(
    role: Role, tick_id: int, opens: list[tuple[int, Any]], work: list[_Work], cancel: list[int],
    release: list[int],
) -> Any:  # fmt: skip
    """The tick's proto, through its codec (specmesh/rpc/ticks.py); the items' handles are set."""
    items = TickItems.of(
        [w.handle for w in work], [w.position for w in work], [w.new_tokens for w in work],
        [w.feed if w.limited else 0 for w in work], cancel, release,
    )  # fmt: skip
    if role is Role.DRAFTER:
        specs: dict[TreeSpec, int] = {}
        index = [specs.setdefault(w.spec, len(specs)) for w in work]  # type: ignore[arg-type]
        flags = np.asarray([w.flags for w in work], np.uint8)
        return DraftTickMessage(tick_id, opens, items, list(specs), np.asarray(index), flags).to_proto()
    return VerifyTickMessage(
        tick_id, opens, items, _relay([w.tree for w in work]),
        plain_steps=np.asarray(_plain_steps(work), np.uint8),
        lookup_depth=np.asarray([w.lookup_depth for w in work], np.uint8),
        lookup_min_ngram=np.asarray([w.lookup_min_ngram for w in work], np.uint8),
        max_tokens=np.asarray([w.max_tokens for w in work], np.uint32),
        suffix_rides=np.asarray([w.suffix_rides for w in work], np.uint8),
    ).to_proto()  # fmt: skip


def _said_by_the_replica(exc: BaseException) -> bool:
    """A write's failure that carries the replica's own status. grpcio's aio client reports a write
    to a stream its core has closed (the replica died, or ended the stream) as INTERNAL "Internal
    error from Core", in place of the status the stream ended with (grpc/grpc#36066): a transport
    failure, as a stream that broke under a read is, so the session fails over."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return False
    return not (exc.code() == grpc.StatusCode.INTERNAL and exc.details() == "Internal error from Core")


def _no_answer(outcome: Any) -> None:
    """The `done` of an item whose answer goes to a future (set by `_put`)."""


def to_future(future: asyncio.Future, outcome: Any) -> None:
    """A `Done` that hands the answer (or the exception) to `future`, unless it is already done."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


def _relay(trees: list[TreeRef | None]) -> TreeColumns:
    """The verify tick's trees: each drafter result's columns sliced once for all of its items."""
    parts: list[TreeColumns] = []
    run: list[int] = []
    run_columns: TreeColumns | None = None
    plain = 0
    for ref in trees:
        if ref is None:
            if run:
                parts.append(run_columns.take(run))  # type: ignore[union-attr]
                run, run_columns = [], None
            plain += 1
            continue
        if plain:
            parts.append(TreeColumns.none(plain, ref.columns.vocab_size))
            plain = 0
        if run and ref.columns is not run_columns:
            parts.append(run_columns.take(run))  # type: ignore[union-attr]
            run = []
        run_columns = ref.columns
        run.append(ref.index)
    if run:
        parts.append(run_columns.take(run))  # type: ignore[union-attr]
    if plain:
        parts.append(TreeColumns.none(plain, max((p.vocab_size for p in parts), default=0)))
    return TreeColumns.concat(parts) if parts else TreeColumns.none(0)


def _drafted(result: DraftResultMessage) -> list[Any]:
    """Each item's Drafted (its tree a reference into the result's columns), or its other outcome."""
    sizes = result.trees.tokens.lengths().tolist()
    return [
        Drafted(
            TreeRef(result.trees, i) if sizes[i] else None,
            o.likely,
            o.forwards,
            result.seconds,
            cached=o.cached,
        )
        if isinstance(o, DraftAnswer)
        else o
        for i, o in enumerate(result.outcomes)
    ]


def _verified(result: VerifyResultMessage) -> list[Any]:
    """Each item's Verified, with the tick's forward statistics, or its other outcome."""
    stats = dict(
        batch_size=result.batch_size, batch_tokens=result.batch_tokens,
        forward_seconds=result.forward_seconds, queue_seconds=result.queue_seconds,
    )  # fmt: skip
    return [
        Verified(o.tokens, o.plain, o.accepted_nodes, o.bonus, o.logprobs, o.rides, **stats, cached=o.cached)
        if isinstance(o, VerifyAnswer)
        else o
        for o in result.outcomes
    ]


def _urgent(work: _Work) -> bool:
    """A session's start (`TickLoop._starts`) or a chunk of a prefill: its tick asks one plain step of each
    plain run (`_plain_steps`), and on the replica it ends the plain runs in flight after their
    step (verifier_service's `_yield_runs`)."""
    return work.position == 0 or work.limited


def _plain_steps(work: list[_Work]) -> list[int]:
    """Each item's plain steps in this tick: as asked, but one each in a tick that starts a session
    (position 0) or feeds a chunk of a prefill (limited): a tick answers once all its items are
    done, so a session's first token (or the next chunk of a long prompt) waits for the plain runs
    beside it. One step each, as vLLM's chunked-prefill steps do: a decode token per running
    request beside the prefill chunk."""
    first = any(_urgent(w) for w in work)
    return [1 if first else min(w.plain_steps, 255) for w in work]
