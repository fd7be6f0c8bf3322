"""What both model services are: a model backend's runner behind gRPC (drafter_service, verifier_service).

Threads: the asyncio loop (uvloop) answers RPCs and batches (specmesh.services.batching); ONE model
thread runs every runner call (forwards, commits, releases), so the runner never sees two
calls at once and the loop never blocks on the model. The drafter adds a pool of tree-builder
threads (build_tree is synchronous) that hand their level forwards to the same batcher.

Sessions: a replica serves at most one request per session at a time (a second gets ABORTED).
Positions are checked before anything changes; a replica that holds fewer committed tokens than
the caller's position (or none) answers FAILED_PRECONDITION with trailing metadata
`specmesh-resync: 1`; a position below what it holds rolls the session back to it first. A
request whose work fails after it may have changed the session makes the replica forget the
session, so the caller's next request resyncs instead of building on half a step.

Ownership: a caller may send a session key (metadata `specmesh-session-key`, the gateway sends a
random one per session); the session's first request records its hash, and every later request
and Release must carry the same key, else PERMISSION_DENIED (Release: `released` false), without
a word about the session. A session started without a key stays open to key-less callers (tests,
benchmarks); on a mesh, mTLS keeps other callers out.

Context: a request whose session would hold more committed tokens than the model's context
(max_position_embeddings, llama.cpp's training context) is refused before any forward.

Prefixes (--prefix-cache): a released session's KV stays as a kept prefix (at most
--kept-prefixes), and a session that starts takes the longest prefix of its tokens a live session
or a kept prefix holds, with its salt (specmesh.runtime.backend). An item with a feed limit (a
tick's `feed` column) that would feed more than that is partial: it feeds one chunk of a long
prompt and answers what the replica holds (`prefilled`). `Prefixes` tells a router what is held.

Errors, beyond specmesh.rpc.server's: resync -> FAILED_PRECONDITION; busy -> ABORTED; another
caller's session -> PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import hashlib
import logging
import secrets
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

import grpc
import torch
from transformers.utils import logging as hf_logging

from specmesh.core.prefix import BLOCK_TOKENS, ROUTE_EVERY
from specmesh.rpc import decoding, wire
from specmesh.rpc.proto import pb2
from specmesh.rpc.server import (
    RpcService,
    configure_logging,
    rpc,
    rpc_stream,
    serve,
)
from specmesh.rpc.ticks import ItemFailure, Opened, Prefilled, packed
from specmesh.runtime.backend import Backend, UnknownSessionError
from specmesh.runtime.costs import measure_forward_cost
from specmesh.runtime.grammar import GrammarMasks, SessionGrammars
from specmesh.runtime.models import LoadedModel, load_model
from specmesh.runtime.rounds import Cancelled, ForwardSteps
from specmesh.services.batching import BatchInfo, ForwardBatcher, More
from specmesh.services.config import ServiceConfig, parse_config
from specmesh.services.metrics import ServiceMetrics

log = logging.getLogger("specmesh.services")


class ResyncError(Exception):
    """The replica does not hold the session at the caller's position."""


class SessionBusyError(Exception):
    """The session already has a request in flight on this replica."""


class NotOwnerError(Exception):
    """The caller's session key is not the one the session was created with."""


class SessionClosedError(Exception):
    """A request for a session its caller has released here with its key: sent before the
    Release, it arrived after it (gRPC does not order two calls), and would make the session anew."""


GIL_SWITCH_SECONDS = 0.0001
CLOSED_SECONDS = 300.0  # how long a released keyed session stays closed: past any late call's deadline
CLOSED_MAX = 100_000  # closed sessions remembered at most (about 10 MB)


class Resume(Enum):
    """How a request takes up its session, from its `position` and what the replica holds."""

    RESTART = "restart"  # position 0: start over from the request's tokens
    CONTINUE = "continue"  # position = the committed tokens held: append to them
    ROLLBACK = "rollback"  # 0 < position < held: drop the tokens past position first (DSI, a
    # caller that speculated ahead), then append


# ---- sessions ----------------------------------------------------------------------------------


class SessionSlots:
    """At most one request per session at a time; Release of a busy session waits for it to end.

    Loop thread only."""

    def __init__(self, forget: Callable[[str], None]) -> None:
        self._forget = forget
        self._busy: set[str] = set()
        self._doomed: set[str] = set()

    def acquire(self, session_id: str) -> None:
        if session_id in self._busy:
            raise SessionBusyError(
                f"session_id: session {session_id!r} already has a request in flight on this replica"
            )
        self._busy.add(session_id)

    def free(self, session_id: str) -> None:
        self._busy.discard(session_id)
        if session_id in self._doomed:
            self._doomed.discard(session_id)
            self._forget(session_id)

    def release(self, session_id: str) -> None:
        if session_id in self._busy:
            self._doomed.add(session_id)
        else:
            self._forget(session_id)


def owner_hash(key: str) -> bytes:
    """What a replica keeps of a session key."""
    return hashlib.sha256(key.encode()).digest()


class Withdrawn(Exception):
    """A tick taken back before its first forward: nothing happened to its sessions."""


class TickRun:
    """One tick's run on this replica: its jobs (to cancel them), the batcher group it waits for,
    and what its forwards looked like."""

    def __init__(self, batcher: ForwardBatcher, jobs: list) -> None:
        self.batcher, self.jobs = batcher, jobs
        self.pending: asyncio.Future | None = None
        self.groups = 0  # forwards it has had
        self.withdrawn = self.abandoned = False
        self.size = self.tokens = 0
        self.forward_seconds = self.queue_seconds = 0.0

    def observe(self, batch: BatchInfo) -> None:
        self.groups += 1
        self.size, self.tokens = max(self.size, batch.size), max(self.tokens, batch.tokens)
        self.forward_seconds += batch.forward_seconds
        self.queue_seconds += batch.queue_seconds

    def cancel(self, job: Any) -> None:
        """Stop one job before its next forward; the whole tick is taken back if that was its
        last job and its first forward has not started."""
        job.cancelled = True
        if all(j.cancelled for j in self.jobs) and self.pending is not None and self.groups == 0:
            self.withdrawn = True
            self.batcher.withdraw(self.pending)

    def cancel_all(self) -> None:
        for job in self.jobs:
            self.cancel(job)

    @property
    def stats(self) -> dict[str, float]:
        return dict(
            batch_size=self.size, batch_tokens=self.tokens,
            forward_seconds=self.forward_seconds, queue_seconds=self.queue_seconds,
        )  # fmt: skip


class TickStream:
    """What one Ticks stream has told this replica: its handles' sessions, and the jobs of its
    ticks in flight (a `cancel` stops them)."""

    def __init__(self) -> None:
        self.sessions: dict[int, Opened | wire.WireError] = {}
        self.running: dict[int, tuple[TickRun, Any]] = {}  # handle -> (its tick, its job)
        self.waiting: set[int] = set()  # handles whose items are in flight but have no job yet
        self.cancelled: set[int] = set()  # those of them cancelled meanwhile: stopped at their start

    def open(self, handle: int, opened: Opened) -> None:
        self.sessions[handle] = opened

    def refuse(self, handle: int, error: wire.WireError) -> None:
        """An open that could not be read: the handle's items get its error."""
        self.sessions[handle] = error

    def session(self, handle: int) -> Opened:
        o = self.sessions.get(handle)
        if o is None:
            raise wire.WireError("handles", f"handle {handle} was never opened on this stream")
        if isinstance(o, wire.WireError):
            raise o
        return o

    def close(self, handle: int) -> Opened | None:
        o = self.sessions.pop(handle, None)
        return o if isinstance(o, Opened) else None

    def track(
        self, handles: Sequence[int], where: Sequence[int]
    ) -> Callable[[Sequence[tuple[int, Any]], TickRun], None]:
        """The `on_start` of a tick's items: item k's job runs for handle handles[where[k]], so
        that a `cancel` of that handle stops it, also one that came before the job started (while
        the item waited for a grammar, or for the step run ahead of it)."""
        self.waiting.update(handles[k] for k in where)

        def running(jobs: Sequence[tuple[int, Any]], tick: TickRun) -> None:
            for k, job in jobs:
                handle = handles[where[k]]
                self.waiting.discard(handle)
                self.running[handle] = (tick, job)
                if handle in self.cancelled:
                    self.cancelled.discard(handle)
                    tick.cancel(job)

        return running

    def answered(self, handle: int) -> None:
        """The handle's item is answered: a later `cancel` is not for it."""
        self.running.pop(handle, None)
        self.waiting.discard(handle)
        self.cancelled.discard(handle)

    def cancel(self, handle: int) -> None:
        running = self.running.get(handle)
        if running is not None:
            running[0].cancel(running[1])
        elif handle in self.waiting:
            self.cancelled.add(handle)


@dataclass
class _Done:
    value: Any


def _advance(ticked: ForwardSteps, results: list) -> Any:
    """On the model thread, right after a forward: the protocol's next steps (More), or _Done."""
    try:
        return More(ticked.send(results))
    except StopIteration as done:
        return _Done(done.value)


# ---- the service ------------------------------------------------------------------------------


async def drive(
    batcher: ForwardBatcher, tick: TickRun, ticked: ForwardSteps, before: dict[str, Callable[[], None]]
) -> list:
    """Run a step protocol (specmesh.runtime.rounds) through the batcher: each forward's group
    of steps is queued, and the protocol resumes on the model thread right after it. The tick
    is a participant while it runs, so that concurrent ticks' forwards wait for each other."""
    try:  # the first steps: cheap, on the loop (the sessions' resets run later)
        steps = next(ticked)
    except StopIteration as done:
        # every job was cancelled before its first forward (the cancel came while the items
        # waited for a grammar or for a superseded draft): no forward, their outcomes say so
        return done.value
    batcher.join()
    try:
        while True:
            finish = functools.partial(_advance, ticked)
            tick.pending = batcher.enqueue(steps, before=before, finish=finish)
            before = {}
            try:
                more, batch = await tick.pending
            except asyncio.CancelledError:
                if tick.withdrawn:  # taken back before its first forward: nothing ran
                    raise Withdrawn from None
                raise
            finally:
                tick.pending = None
            tick.observe(batch)
            if isinstance(more, _Done):
                return more.value
            steps = more.steps
    finally:
        batcher.leave()


class ModelService(RpcService):
    """What both model services share: the runner and its thread, the batcher, session slots and
    positions, metrics, Release and Info. Subclasses set `service_name`, their tick's message
    (`tick_method`, and its codec `tick_message`: specmesh.rpc.ticks) and add their RPC."""

    tick_method: ClassVar[str]
    tick_message: ClassVar[Any]  # DraftTickMessage or VerifyTickMessage

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        self.config, self.model, self.metrics = config, model, metrics
        self.runner = model.open_runner(
            config.max_cache_tokens or None, threads=config.torch_threads, deterministic=config.deterministic
        )
        self.vocab_size = self.runner.vocab_size
        if config.prefix_cache and model.backend is not Backend.NGRAM:  # no KV, nothing to keep
            self.runner.enable_prefix_cache(config.kept_prefixes)
        self.incarnation = secrets.token_hex(8)  # Prefixes: this process's versions
        self.limits = config.limits
        self.loop = asyncio.get_running_loop()
        self.model_thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        self.batcher = ForwardBatcher(
            self.runner,
            self.model_thread,
            config.batch_limits,
            metrics,
            config.forward_floor,
        )
        self.slots = SessionSlots(self.forget)
        self._releasing: collections.Counter[str] = collections.Counter()  # releases not yet run
        self._owners: dict[str, bytes] = {}  # session -> hash of the key it was created with
        # session -> (its key's hash, until when): released with that key, closed to it
        self._closed: collections.OrderedDict[str, tuple[bytes, float]] = collections.OrderedDict()
        self.forward_cost: dict[int, float] = {}  # rows -> seconds, measured by `start`
        self.grammars = SessionGrammars(model.tokenizer, self.vocab_size)  # structured output
        self._used: dict[str, float] = {}  # session -> when a request last began (monotonic)
        self._sweeper: asyncio.Task | None = None

    async def start(self) -> None:
        """Before serving: measure what a forward costs by its rows (reported in Info)."""
        measured = await self.loop.run_in_executor(self.model_thread, measure_forward_cost, self.runner)
        floor = self.config.forward_floor  # what the batcher makes every forward take
        self.forward_cost = {rows: max(seconds, floor(rows)) for rows, seconds in measured.items()}
        log.info("forward cost measured", extra={"seconds_by_rows": self.forward_cost})
        if self.config.session_idle_seconds:
            self._sweeper = asyncio.create_task(self._sweep_idle(self.config.session_idle_seconds))

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        await asyncio.to_thread(self.model_thread.shutdown)

    def drop_own_work(self, session_id: str) -> None:
        """Stop the work the service began on its own for the session, not for a request (the
        verifier's run-ahead), before its next forward: the session is being released (extend)."""

    async def _sweep_idle(self, idle: float) -> None:
        """Release sessions no request touched for `idle` seconds: a gateway that died releases
        nothing, and a session nobody resumed would hold its KV until evicted (or for ever)."""
        while True:
            await asyncio.sleep(min(idle / 4, 30.0))
            now = time.monotonic()
            for session_id, used in list(self._used.items()):
                if now - used > idle:
                    log.info("releasing an idle session", extra={"session": session_id, "idle_s": now - used})
                    self.metrics.idle_releases.inc()
                    self.drop_own_work(session_id)
                    self.slots.release(session_id)

    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]:
        if isinstance(exc, ResyncError | UnknownSessionError):
            details = str(exc) if isinstance(exc, ResyncError) else f"session_id: unknown session {session!r}"
            return grpc.StatusCode.FAILED_PRECONDITION, details, ((wire.RESYNC_KEY, "1"),)
        if isinstance(exc, SessionBusyError):
            return grpc.StatusCode.ABORTED, str(exc), ()
        if isinstance(exc, NotOwnerError):
            return grpc.StatusCode.PERMISSION_DENIED, str(exc), ()
        if isinstance(exc, SessionClosedError):
            return grpc.StatusCode.FAILED_PRECONDITION, str(exc), ()  # no resync: the session is over
        return super().status(method, session, exc)

    # ---- sessions ------------------------------------------------------------------------------

    def begin(self, r: wire.RoundInput, owner: bytes) -> Resume:
        """Check the caller's key (`owner`: its hash) and the context, reserve the session for one
        request and check the caller's position: how the request starts (`Resume`)."""
        session_id, position = r.session_id, r.position
        self.check_owner(session_id, owner)
        if self._is_closed(session_id, owner):
            raise SessionClosedError(f"session_id: session {session_id!r} was released on this replica")
        context_length = self.runner.max_context  # None: the model does not say
        if context_length is not None and r.committed_length > context_length:
            raise wire.WireError(
                "new_token_ids",
                f"position + new tokens = {r.committed_length}, above the model's context of "
                f"{context_length} tokens",
            )
        self.slots.acquire(session_id)
        try:
            resume = self._check_position(session_id, position)
        except BaseException:
            self.slots.free(session_id)
            raise
        self._owners[session_id] = owner
        self._used[session_id] = time.monotonic()
        return resume

    def check_owner(self, session_id: str, owner: bytes) -> None:
        """NotOwnerError if the session was created with another key."""
        if self._owners.get(session_id, owner) != owner:
            raise NotOwnerError("session_id: this caller's session key does not open that session")

    def _owner(self, session_id: str, context: grpc.aio.ServicerContext) -> bytes:
        """The hash of a call's session key; NotOwnerError if the session has another."""
        owner = owner_hash(wire.session_key(context.invocation_metadata()))
        self.check_owner(session_id, owner)
        return owner

    def end(self, session_id: str, resume: Resume, failed: bool, abandoned: bool) -> None:
        """An item's work has really ended (a forward in flight may change its session until then):
        free the session; forget it if the work failed (the caller resyncs; its KV is not kept), or
        if this item (re)started the session and its caller went away (the caller's Release may have
        arrived before the item began, found nothing to release, and will not come again)."""
        if failed or (resume is Resume.RESTART and abandoned):
            self.forget(session_id, keep=not failed)
        self.slots.free(session_id)

    def failure(self, method: str, session: str, exc: BaseException) -> ItemFailure:
        """An item's error as a call would have had it (`status`)."""
        if isinstance(exc, Cancelled | asyncio.CancelledError):
            return ItemFailure(grpc.StatusCode.CANCELLED.value[0], "cancelled")
        code, details, trailers = self.status(method, session, exc)  # type: ignore[arg-type]
        return ItemFailure(code.value[0], details, any(k == wire.RESYNC_KEY for k, _ in trailers))

    # ---- ticks ---------------------------------------------------------------------------------

    async def drive(self, tick: TickRun, ticked: ForwardSteps, before: dict[str, Callable[[], None]]) -> list:
        return await drive(self.batcher, tick, ticked, before)

    async def run_tick(self, tick: TickRun, work: Callable[[], Any]) -> Any:
        """Run a tick's work to its end even if its caller goes away (then its jobs stop before
        their next forward): a forward in flight changes sessions until it is done."""
        task = asyncio.ensure_future(work())
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            tick.abandoned = True
            tick.cancel_all()
            with contextlib.suppress(BaseException):
                await task
            raise

    @rpc_stream
    async def Ticks(self, requests: Any, context: grpc.aio.ServicerContext) -> Any:
        """The stream a caller's tick loop keeps open to this replica (see the proto)."""
        stream = TickStream()
        results: asyncio.Queue = asyncio.Queue()
        running: set[asyncio.Task] = set()

        async def read() -> None:
            try:
                async for message in requests:
                    if isinstance(message, decoding.Undecodable):
                        raise message.error
                    task = asyncio.ensure_future(self.stream_tick(stream, message))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda t: results.put_nowait(t))
                await asyncio.gather(*running, return_exceptions=True)
            finally:
                results.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                done = await results.get()
                if done is None:
                    break
                if not done.cancelled() and done.exception() is None:
                    yield done.result()
                elif not done.cancelled():
                    raise done.exception()
            await reader  # a bad message's error ends the stream with its status
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            await asyncio.gather(reader, *running, return_exceptions=True)

    async def stream_tick(self, stream: TickStream, message: Any) -> Any:
        """One tick of a stream: open its sessions, cancel and release what it says, run its items
        (the service's `answer_tick`), answer its result."""
        start = time.perf_counter()
        tick = self.tick_message.from_proto(message, self.vocab_size, self.limits)
        items = tick.items
        log.debug("tick received", extra={"tick": tick.id, "items": len(items)})
        for handle, opened in tick.opens:
            if isinstance(opened, wire.WireError):
                stream.refuse(handle, opened)
            else:
                stream.open(handle, opened)
        for handle in items.cancel.tolist():
            stream.cancel(handle)
        for handle in items.release.tolist():
            o = stream.close(handle)
            if o is not None:
                self.release_with_key(o.session_id, owner_hash(o.key), bool(o.key))
        result = await self.answer_tick(stream, tick)
        self.answered(self.tick_method, "", grpc.StatusCode.OK, start)
        log.debug("tick done", extra={"tick": tick.id})
        return result.to_proto()

    def release_with_key(self, session_id: str, owner: bytes, keyed: bool) -> bool:
        """Release (the RPC, or a stream's `release`): False if the caller does not own the
        session or the replica did not hold it."""
        try:
            self.check_owner(session_id, owner)
        except NotOwnerError:
            return False
        if keyed:
            self._close(session_id, owner)
        held = self.holds(session_id)
        self.drop_own_work(session_id)
        self.slots.release(session_id)
        return held

    async def answer_tick(self, stream: TickStream, tick: Any) -> Any:
        """A service's tick (its `tick_message`): its result (DraftResultMessage or
        VerifyResultMessage)."""
        raise NotImplementedError

    def prefilled(self, session_id: str, position: int) -> Prefilled:
        """A partial item's answer (chunked prefill): what the replica holds of its session now, and
        what it took from a prefix if the item started it. Loop thread, its work done."""
        held = self.runner.committed_length(session_id) or 0
        cached = self.runner.reused_tokens(session_id) if position == 0 else 0
        self.metrics.prefill_tokens.inc(max(0, held - max(position, cached)))
        return Prefilled(held, cached)

    def prefix_version(self) -> int:
        """The version of what `Prefixes` answers (0: no prefix cache)."""
        index = getattr(self.runner, "prefix", None)
        return index.version if index is not None else 0

    def _close(self, session_id: str, owner: bytes) -> None:
        """Remember that the caller with this key released the session. Keyed callers (the
        gateway) never use a session id again after its Release; key-less ones (tests,
        benchmarks) may, and stay exposed to a stale call that arrives after their Release."""
        now = time.monotonic()
        self._closed[session_id] = (owner, now + CLOSED_SECONDS)
        self._closed.move_to_end(session_id)
        while self._closed and (len(self._closed) > CLOSED_MAX or next(iter(self._closed.values()))[1] < now):
            self._closed.popitem(last=False)

    def _is_closed(self, session_id: str, owner: bytes) -> bool:
        closed = self._closed.get(session_id)
        return closed is not None and closed[0] == owner and closed[1] >= time.monotonic()

    def holds(self, session_id: str) -> bool:
        """Whether the replica holds the session (not released). Loop thread, while the session
        has no work in flight."""
        return session_id not in self._releasing and self.runner.committed_length(session_id) is not None

    def _check_position(self, session_id: str, position: int) -> Resume:
        # Reading the runner from the loop is safe: this session has no work in flight.
        held = None if session_id in self._releasing else self.runner.committed_length(session_id)
        if position == 0:
            return Resume.RESTART
        if held is None:
            raise ResyncError(
                f"session_id: this replica does not hold session {session_id!r}; "
                "resend all its committed tokens with position 0"
            )
        if position > held:
            raise ResyncError(
                f"position: {position} is past what this replica holds of session {session_id!r}; "
                "resend all its committed tokens with position 0"
            )
        return Resume.CONTINUE if position == held else Resume.ROLLBACK

    def reset(self, session_id: str, resume: Resume, position: int) -> Callable[[], None] | None:
        """What must run on the model thread before the request's first forward, if anything (a
        restart releases what the session held, kept as a prefix: the restart takes it back as far
        as its tokens agree, so a resync or a retry feeds only what is new)."""
        if resume is Resume.RESTART:
            return functools.partial(self.runner.release, session_id)
        if resume is Resume.ROLLBACK:
            return functools.partial(self.runner.truncate, session_id, position)
        return None

    def forget(self, session_id: str, keep: bool = True) -> None:
        """Drop the session here; until the model thread has released it, it counts as unknown.
        keep: its KV may stay as a kept prefix."""
        self.forget_local(session_id)
        self._releasing[session_id] += 1
        job = self.model_thread.submit(self._release, session_id, keep)
        job.add_done_callback(lambda _: self.loop.call_soon_threadsafe(self._released, session_id))

    def forget_local(self, session_id: str) -> None:
        """Drop what the service itself keeps about the session (extend, calling super)."""
        self._owners.pop(session_id, None)
        self._used.pop(session_id, None)
        self.grammars.drop(session_id)

    async def grammar_masks(self, r: wire.RoundInput) -> GrammarMasks | None:
        """The session's grammar matcher (None: no grammar), compiled off the event loop the first
        time (a JSON schema takes milliseconds, the model's llguidance tokenizer ~1 s once); a
        grammar that does not compile is the request's error, before the session is touched."""
        if r.grammar is None:
            return None
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, self.grammars.get, r.session_id, r.grammar)
        except ValueError as exc:
            raise wire.WireError("grammar.text", str(exc).removeprefix("grammar: ")) from None

    def _release(self, session_id: str, keep: bool = True) -> None:
        self.runner.release(session_id, keep)
        self.metrics.observe_runner(self.runner)

    def _released(self, session_id: str) -> None:
        self._releasing[session_id] -= 1
        if self._releasing[session_id] <= 0:
            del self._releasing[session_id]

    # ---- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Release(
        self, request: pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> pb2.ReleaseResponse:
        session_id = wire.session_id_from_proto(request.session_id)
        key = wire.session_key(context.invocation_metadata())
        return pb2.ReleaseResponse(released=self.release_with_key(session_id, owner_hash(key), bool(key)))

    @rpc
    async def Prefixes(
        self, request: pb2.PrefixesRequest, context: grpc.aio.ServicerContext
    ) -> pb2.PrefixesResponse:
        # under the runner's lock, off the model thread's queue: it waits for one forward at most
        version, hashes = await asyncio.to_thread(self.runner.prefix_summary)
        return pb2.PrefixesResponse(
            incarnation=self.incarnation, version=version, hashes=packed(hashes, "<u8"),
            block_tokens=BLOCK_TOKENS, route_every=ROUTE_EVERY,
        )  # fmt: skip

    @rpc
    async def Info(self, request: pb2.InfoRequest, context: grpc.aio.ServicerContext) -> pb2.InfoResponse:
        c = self.config
        return pb2.InfoResponse(
            model_id=self.model.source,
            vocab_size=self.vocab_size,
            tokenizer_fingerprint=self.model.tokenizer_fingerprint,
            dtype=self.model.weights or str(self.model.dtype).removeprefix("torch."),
            device=str(self.model.device),
            max_sessions=0,
            max_cache_tokens=c.max_cache_tokens,
            max_tree_nodes=c.max_tree_nodes,
            max_depth=c.max_depth,
            max_branching=c.max_branching,
            max_beam_width=c.max_beam_width,
            max_batch_size=c.max_batch_size,
            max_batch_tokens=c.max_batch_tokens,
            max_message_bytes=c.max_message_bytes,
            forward_cost=[pb2.ForwardCost(rows=r, seconds=t) for r, t in sorted(self.forward_cost.items())],
            backend=self.model.backend,
        )


# ---- running it --------------------------------------------------------------------------------


def main(
    service_cls: type[ModelService], prog: str, defaults: Mapping[str, Any], argv: list[str] | None = None
) -> None:
    """`python -m drafter_service` / `python -m verifier_service`."""
    import uvloop

    config = parse_config(prog, argv, defaults)
    configure_logging(config.log_level)
    # The event loop and the model thread hand every tick's forwards back and forth: a thread
    # waiting for the GIL would wait up to the default 5 ms switch interval for the other to let go.
    # 0.1 ms, not 0.5: a plain run's next step, dispatched while the loop builds the answers, began
    # 0.69 ms (median) after its dispatch at 0.5 ms and 0.34 ms at 0.1 (docs/decisions.md, "Run-ahead").
    sys.setswitchinterval(GIL_SWITCH_SECONDS)
    uvloop.run(_serve_model(config, service_cls))


async def _serve_model(config: ServiceConfig, service_cls: type[ModelService]) -> None:
    if config.torch_threads > 0:
        torch.set_num_threads(config.torch_threads)
    hf_logging.disable_progress_bar()  # keep stderr to JSON lines
    device = config.device or None
    model = load_model(config.model, dtype=config.dtype, device=device, backend=config.backend)
    if model.backend is not Backend.TORCH:
        # torch only does the verification math here; its own OpenMP team beside llama.cpp's
        # would oversubscribe the cores and make every llama.cpp barrier wait longer
        torch.set_num_threads(1)
    service = service_cls(config, model, ServiceMetrics(model.source))  # model_name: Info's model_id
    await service.start()
    details = {"model": config.model, "backend": model.backend, "weights": model.weights}
    details["device"] = str(model.device)
    await serve(service, config, config.max_message_bytes, details)
