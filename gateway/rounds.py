"""One generation through the gateway: its session in Redis, its rounds, failover and cleanup.

    async with SessionRun(plan, env, text, deadline) as run:   # creates the session in Redis
        while not run.finished:
            piece = await run.step()                           # one committed round

Each step picks a drafter and a verifier (session affinity: the replica the session is on, while
it is healthy), runs one `RoundClient.round` (specmesh/rpc/round_client.py, the one round
implementation) on the committed tokens with that `Placement`, cuts the result at a stop token,
max_new_tokens or a stop sequence, and commits it with `commit_round(expected_round=…)`. Only a
committed round is handed out, so the client sees exactly the tokens in Redis.

Failover: a replica call that fails at the transport level (UNAVAILABLE, DEADLINE_EXCEEDED,
CANCELLED by a stopping server, UNKNOWN), or takes longer than its per-try timeout while a spare
replica is healthy (gateway/retries.py), takes that replica out of its pool and redoes the round
on another one, waiting (within the round timeout and the client's deadline) for one to become
healthy, as far as the retry budget allows. The new replica is sent position 0 and all committed
tokens (the resync protocol); since every round's randomness derives from (seed, position), it
produces the tokens the old one would have. ABORTED (our own earlier, abandoned request is still
running there) is retried on the same replica. At most `max_attempts` tries per round. Any other
answer (INVALID_ARGUMENT, INTERNAL, PERMISSION_DENIED, ...) is the request's own: the client
gets it, no replica is blamed.

Leaving the `async with` in any way (finished, error, the client cancelled) releases the
session on every replica it touched and deletes it from Redis, shielded from cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import grpc
from opentelemetry import trace

from gateway.api import stats_to_proto
from gateway.metrics import GatewayMetrics
from gateway.pools import NoHealthyReplica, ReplicaPool
from gateway.prefixes import PrefixRouting
from gateway.requests import GenerationPlan, stored_plan
from gateway.retries import RetryBudget, TryTimeouts, forward_seconds
from gateway.session_store import NotOwner, Session, SessionExists, SessionStore, StoreError
from gateway.text import TextStream
from specmesh.core.adaptive import RoundPolicy
from specmesh.core.ahead import PipelinePolicy
from specmesh.core.dsi import Learnt
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.methods import Method
from specmesh.core.rounds import keep_emitted
from specmesh.core.stats import GenerationStats
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2_grpc
from specmesh.rpc.round_client import (
    Placement,
    ReplicaFailure,
    Role,
    RoundClient,
    RoundResult,
    release_session,
)
from specmesh.rpc.tracing import tracer, tracing_on

log = logging.getLogger("specmesh.gateway.rounds")
_tracer = tracer("specmesh.gateway")


def _in(span: Any) -> Any:
    """The tracing context of `span` (child spans go under it)."""
    return trace.set_span_in_context(span)


def _end_span(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
    span.end()


# What a replica's transport or host does, never a request's own fault: only these move a
# session to another replica. Our replicas answer UNKNOWN for nothing (a failing handler is
# INTERNAL), so it comes from the transport. INTERNAL, INVALID_ARGUMENT and the rest are the
# request's: the client gets them and no replica is blamed.
_FAILOVER = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
_STUBS = {Role.DRAFTER: pb2_grpc.DrafterStub, Role.VERIFIER: pb2_grpc.VerifierStub}
RELEASE_TIMEOUT = 2.0
FINISHED_LINGER_LEASES = 5  # a session finished during a handover stays this many leases for a resume
# seconds: a call that times out this close to the client's deadline ran out of the client's time,
# not of the replica's: no replica is blamed
CLIENT_DEADLINE_SLACK = 0.05


class GatewayError(Exception):
    """A request that ends with this status code and message; `field`: the request's field it
    names (the message starts with it), for fronts that name fields their own way."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code, self.field = code, field


@dataclass
class GatewayEnv:
    """What every session of one gateway shares."""

    store: SessionStore
    drafters: ReplicaPool | None
    verifiers: ReplicaPool
    metrics: GatewayMetrics
    round_timeout: float
    max_attempts: int
    try_timeouts: TryTimeouts | None = None  # None: a call may take the whole round timeout
    retries: RetryBudget = dataclasses.field(default_factory=RetryBudget)
    cleanups: set[asyncio.Task] = dataclasses.field(default_factory=set)  # outliving their request
    deferred: set[asyncio.Task] = dataclasses.field(default_factory=set)  # releases retried later
    # whether rounds pre-draft (specmesh.core.ahead): one policy for every session of the gateway,
    # so that the cost of finding out (a slowdown on shared hardware, a low hit rate) is paid once
    pipeline: PipelinePolicy = dataclasses.field(default_factory=PipelinePolicy)
    dsi: Learnt = dataclasses.field(default_factory=Learnt)  # what finished DSI sessions taught
    dsi_timeline: Path | None = None  # a folder: each DSI session writes its blocks' timeline there
    ngram_drafters: ReplicaPool | None = None  # model-free drafters (drafter_service --backend ngram)
    routing: dict[str, PrefixRouting] = dataclasses.field(default_factory=dict)  # pool name -> its
    plain_steps: int = 1  # plain decoding: tokens per Verify call after the first (--plain-steps)
    # what a forward costs by its rows, per role (the replicas' start-up measurement, Info)
    forward_costs: dict[Role, dict[int, float]] = dataclasses.field(default_factory=dict)
    leases: Leases = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.leases = Leases(self.store)

    def defer(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` in the background, past its request (cancelled when the gateway closes)."""
        task = asyncio.ensure_future(work)
        self.deferred.add(task)
        task.add_done_callback(self.deferred.discard)

    def pool(self, role: Role, method: Method) -> ReplicaPool:
        """The replicas of a role; a session of method ngram drafts on the model-free drafters."""
        if role is Role.VERIFIER:
            return self.verifiers
        pool = self.ngram_drafters if method is Method.NGRAM else self.drafters
        assert pool is not None
        return pool


class Ending(StrEnum):
    """What a run's cleanup does with its session: one state, set by what happened to the run."""

    DONE = "done"  # finished, failed or its client left: released on every replica, deleted
    KEPT = "kept"  # the gateway stops: the session, its replicas' KV and (released) lease stay
    LOST = "lost"  # another gateway took it over: everything is left to that one


class Leases:
    """The ownership leases of a gateway's running sessions, renewed together: one pipelined
    Redis round trip every third of a lease for all of them (commits renew a session's too; a
    round may be long). A session another gateway took over is told (`SessionRun.lose`)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._runs: dict[str, SessionRun] = {}
        self._task: asyncio.Task | None = None

    def add(self, run: SessionRun) -> None:
        self._runs[run.id] = run
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._renew())

    def discard(self, run: SessionRun) -> None:
        if self._runs.get(run.id) is run:
            del self._runs[run.id]

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _renew(self) -> None:
        while self._runs:
            await asyncio.sleep(self.store.lease_seconds / 3)
            runs = list(self._runs.values())
            try:
                renewed = await self.store.renew_many([(run.id, run.owner) for run in runs])
            except StoreError:  # Redis down: the next commit (or renewal) tells
                continue
            for run, ok in zip(runs, renewed, strict=True):
                if not ok:
                    run.lose()


@dataclass(frozen=True)
class Piece:
    """One committed round as the client sees it."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # of token_ids, if asked


class SessionRun:
    """One request's generation (module docstring). deadline: the client's, on the loop's clock."""

    def __init__(
        self,
        plan: GenerationPlan,
        env: GatewayEnv,
        text: TextStream,
        deadline: float | None,
        policy: RoundPolicy | None = None,
        resumed: Session | None = None,
    ) -> None:
        """policy: an adaptive plan's depth controller, or the default's FamilyPolicy (the gateway
        builds either, reproducible).
        resumed: a session taken over from Redis (`SessionStore.take`): the run goes on from its
        committed tokens, as the gateway that started it would have."""
        self.plan, self.env, self.text, self.deadline = plan, env, text, deadline
        self.id = resumed.id if resumed else uuid.uuid4().hex
        # the replicas serve this session only to callers with its key: kept in Redis for a resume
        self.key = resumed.extra["key"] if resumed else secrets.token_hex(16)
        self.roles = (Role.DRAFTER, Role.VERIFIER) if plan.spec.method.drafts else (Role.VERIFIER,)
        self.client = RoundClient(
            self.id, plan.params, plan.spec, policy=policy, key=self.key, pipeline=env.pipeline,
            stop_token_ids=plan.stop_token_ids, top_logprobs=plan.top_logprobs, grammar=plan.grammar,
            salt=plan.prefix_salt,
        )  # fmt: skip
        self.tokens = list(plan.prompt_ids)  # committed, as in Redis
        self.round = 0
        self.stats = GenerationStats()
        self.finish_reason: str | None = None
        self.addresses: dict[Role, str] = {}  # the replica serving the session now, per role
        self.lengths: dict[str, int] = {}  # replica address -> committed tokens it holds
        self.touched: set[tuple[Role, str]] = set()  # (role, address): where to release
        self.created = False
        self.owner = ""  # this gateway's owner token (gateway/session_store.py, "Ownership")
        self.ending = Ending.DONE  # what its cleanup does with the session
        self._pieces: asyncio.Queue | None = None  # committed rounds (or the error), for `step`
        self._committing = False  # a commit is in flight
        self._verdict: tuple | None = None  # the verdict of the round beside it, waiting for it
        self._tasks: set[asyncio.Task] = set()  # the slow path (`_spawn`)
        self._stopped = False
        self.stop_error: BaseException | None = None  # why the rounds stopped before the end
        self._failures = 0  # failed tries of the current round
        self._stale_commits = 0
        self.resumed = resumed
        if resumed is not None:
            self.tokens, self.round, self.stats = list(resumed.tokens), resumed.round, resumed.stats
            self.finish_reason, self.owner, self.created = resumed.finish_reason, resumed.owner, True
            self.lengths = dict(resumed.replica_lengths)  # where the pool picks them again

    def pool(self, role: Role) -> ReplicaPool:
        return self.env.pool(role, self.plan.spec.method)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.plan.prompt_ids)

    def stats_message(self) -> Any:
        """The public specmesh.v1.GenerationStats of the run so far."""
        prompt_tokens = len(self.plan.prompt_ids)
        return stats_to_proto(self.stats, prompt_tokens=prompt_tokens, generated_tokens=self.generated)

    # ---- lifecycle -----------------------------------------------------------------------------

    async def __aenter__(self) -> SessionRun:
        self.env.metrics.running.inc()
        creating = False
        try:
            await self._place()
            if self.resumed is None:
                creating = True
                stored = stored_plan(self.plan)
                stored["extra"]["key"] = self.key
                session = await self.env.store.create(
                    self.id,
                    self.plan.prompt_ids,
                    drafter=self.addresses.get(Role.DRAFTER, ""),
                    verifier=self.addresses[Role.VERIFIER],
                    **stored,
                )
                self.owner, self.created = session.owner, True
            self.env.leases.add(self)
        except BaseException as exc:
            # Cancelled (the client's deadline) or failed mid-create, Redis may have run the create
            # all the same: delete the keys anyway (about 1 in 40 such requests leaked them until
            # their TTL). Absent keys delete as nothing; SessionExists means they are another's.
            self.created = creating and not isinstance(exc, SessionExists)
            await self.__aexit__()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Clean up even if the request was cancelled (then in the background if need be)."""
        task = asyncio.ensure_future(self._cleanup())
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            self.env.cleanups.add(task)
            task.add_done_callback(self.env.cleanups.discard)
            raise

    async def _cleanup(self) -> None:
        self.env.metrics.running.dec()
        self.env.leases.discard(self)
        await self._drop_rounds()  # before the releases: its calls must not reach a replica after them
        self.client.close()
        if self.ending is not Ending.DONE:
            await self._leave()
            return
        # on the tick stream each replica has open (a paused one reads it once it is back); where
        # that stream is gone, with a Release call, retried while the replica is unreachable
        unsent = [
            (role, a) for role, a in sorted(self.touched) if not self.pool(role).loop(a).release(self.id)
        ]
        stubs = [_STUBS[role](self.pool(role).channel(addr)) for role, addr in unsent]
        released = await asyncio.gather(
            *(release_session(s, self.id, RELEASE_TIMEOUT, self.key) for s in stubs)
        )
        for (role, address), stub, outcome in zip(unsent, stubs, released, strict=True):
            if outcome is None:  # unreachable (paused, partitioned): it may still hold the KV
                self.env.defer(self._release_later(role, address, stub))
        for role in self.roles:
            self.pool(role).release(self.id)
        if self.created:
            try:
                await self.env.store.delete(self.id)
            except StoreError as exc:  # Redis down: the TTL removes the keys
                log.warning("could not delete a session", extra={"session": self.id, "error": str(exc)})

    async def _leave(self) -> None:
        """Another gateway goes on (or will) with this session, its keys and its replicas' KV."""
        for role in self.roles:
            self.pool(role).release(self.id)
        if self.ending is Ending.LOST:
            return  # the lease is another's
        if self.finished:
            # It finished while the gateway shuts down: its last chunk may not reach the client,
            # which then resumes elsewhere. Keep the keys a little while instead of deleting them.
            with contextlib.suppress(StoreError):
                await self.env.store.expire(self.id, FINISHED_LINGER_LEASES * self.env.store.lease_seconds)
        with contextlib.suppress(StoreError):
            await self.env.store.release(self.id, self.owner)

    def keep(self) -> None:
        """The gateway is stopping (SIGTERM): however the run ends, its session stays for a resume
        elsewhere (a run the stopping server cancels before its handover, too)."""
        if self.ending is Ending.DONE:
            self.ending = Ending.KEPT

    def hand_over(self) -> None:
        """Stop here and let another gateway go on (a rollout): the client's stream ends with
        UNAVAILABLE once it has what was committed; the lease is released at cleanup, the session
        and the replicas' KV stay for the resume."""
        self.keep()
        self._stop(
            GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"the gateway is shutting down: resume session {self.id} on another "
                "(GenerateRequest.resume), from the tokens you have",
            )
        )

    def lose(self) -> None:
        """Another gateway took the session over (its lease): leave everything to that one."""
        if self.ending is not Ending.LOST:
            log.warning("lost the session to another gateway", extra={"session": self.id})
        self.ending = Ending.LOST

    # ---- rounds --------------------------------------------------------------------------------
    # Rounds run back to back, driven by their answers (callbacks, not a coroutine per round): the
    # next round is queued on its replica's tick loop right where this one's verdict is read, and
    # this one's commit goes to Redis beside it. What the client gets are the committed rounds,
    # in order, through `step`. A failure takes the slow path: a task that recovers (failover,
    # a stale commit) and launches the round again.

    async def step(self) -> Piece:
        """The next committed round; its failure is raised here. Traced (when tracing is on) as a
        span "round" with its draft, verification and commit under it."""
        if self._pieces is None:
            if self.stop_error is not None:
                raise self.stop_error
            self._pieces = asyncio.Queue()
            self._launch(self.tokens)
        piece = await self._pieces.get()
        if isinstance(piece, BaseException):
            raise piece
        return piece

    def _launch(self, tokens: list[int], began: float | None = None) -> None:
        """Start the round after `tokens` (committed, or this round's tokens not yet committed) on
        the session's replicas: at once while they are healthy, else once placed anew."""
        placement = self._placement_now()
        if placement is None:
            self._spawn(self._place_and_launch(tokens, began))
            return
        self._begin(tokens, placement, began)

    async def _place_and_launch(self, tokens: list[int], began: float | None) -> None:
        self._begin(tokens, await self._place(), began)

    def _begin(self, tokens: list[int], placement: Placement, began: float | None) -> None:
        if self._stopped:
            return
        self.env.retries.round_started()
        began = time.perf_counter() if began is None else began
        span = (
            _tracer.start_span("round", attributes={"session": self.id, "round": self.round})
            if tracing_on()
            else None
        )
        done = functools.partial(self._round_done, tokens, began, span)
        self.client.start(
            tokens, placement, self._plain_steps(tokens), done, span=span, max_tokens=self._left(tokens)
        )

    def _round_done(self, tokens: list[int], began: float, span: Any, outcome: Any) -> None:
        """A round's verdict (or failure), on the event loop where its verification was read."""
        if self._stopped:
            _end_span(span)
            return
        if isinstance(outcome, ReplicaFailure):
            self._remember_lengths(outcome.held)
            _end_span(span, outcome)
            self._spawn(self._retry(tokens, began, outcome))
            return
        if isinstance(outcome, BaseException):
            _end_span(span, outcome)
            self._stop(outcome)
            return
        self._remember_lengths(outcome.held)
        self._failures = 0
        if self._committing:  # it ran beside the last round's commit: its turn comes after
            self._verdict = (began, span, outcome)
            return
        self._settle(began, span, outcome)

    def _settle(self, began: float, span: Any, result: RoundResult) -> None:
        """A verdict after the committed tokens: cut it, queue the next round (it need not wait for
        Redis, docs/decisions.md), commit this one."""
        kept, finish = self._cut(result.tokens)
        lengths = {self.addresses[role]: result.held[role] for role in self.roles}
        if self.round == 0 and result.cached:  # the prompt's: what the target took from its prefix cache
            result.stats.cached_prompt_tokens = result.cached
        if finish is None:
            self._launch([*self.tokens, *kept])
        else:
            self.client.finished()
        self._committing = True
        start = time.perf_counter()
        commit_span = (
            _tracer.start_span("commit", context=_in(span), attributes={"tokens": len(kept)})
            if span
            else None
        )
        committed = self.env.store.commit_round_future(
            self.id, self.round, kept, result.stats, lengths, finish_reason=finish, owner=self.owner
        )
        committed.add_done_callback(
            functools.partial(self._committed, kept, finish, began, start, result, (span, commit_span))
        )

    def _committed(
        self,
        kept: list[int],
        finish: str | None,
        began: float,
        start: float,
        result: RoundResult,
        spans: tuple[Any, Any],
        committed: asyncio.Future,
    ) -> None:
        for s in reversed(spans):
            _end_span(s)
        if self._stopped:
            return
        self._committing = False
        try:
            ok = committed.result()
        except NotOwner as exc:
            self.lose()
            self._stop(GatewayError(grpc.StatusCode.ABORTED, str(exc)))
            return
        except BaseException as exc:  # Redis refused or stayed down: the request ends with it
            self._stop(exc)
            return
        if not ok:
            self._spawn(self._stale(kept, result))
            return
        self._stale_commits = 0
        self._pieces.put_nowait(self._apply(kept, finish, result.stats, began, start, result))  # type: ignore[union-attr]
        verdict, self._verdict = self._verdict, None
        if verdict is not None:
            self._settle(*verdict)

    def _apply(
        self,
        kept: list[int],
        finish: str | None,
        stats: GenerationStats,
        began: float,
        start: float,
        result: RoundResult | None = None,
    ) -> Piece:
        """A committed round: the run's state moves on; -> what the client gets. began: when the
        round started, start: when its commit did (perf_counter), result: its calls, for the
        round's metrics."""
        end = time.perf_counter()
        calls = {f"{role}_call": t for role, t in (result.call_seconds if result else {}).items()}
        self.env.metrics.observe_round(
            stats, len(kept), {"commit": end - start, "round": end - began, **calls}
        )
        if result is not None and result.pre_draft_hit is not None:
            self.env.metrics.pre_drafts.labels("hit" if result.pre_draft_hit else "miss").inc()
        self.tokens += kept
        self.round += 1
        self.stats += stats
        self.finish_reason = finish
        logprobs = result.logprobs[: len(kept)] if result is not None else []
        return Piece(kept, self.text.push(kept, final=finish is not None), finish, logprobs)

    async def _commit(
        self,
        kept: list[int],
        finish: str | None,
        stats: GenerationStats,
        lengths: dict[str, int],
        began: float,
    ) -> Piece | None:
        """Commit one round's tokens to Redis (DSI's commits): what the client gets, or None if
        Redis is at another round."""
        start = time.perf_counter()
        try:
            committed = await self.env.store.commit_round(
                self.id, self.round, kept, stats, lengths, finish_reason=finish, owner=self.owner
            )
        except NotOwner as exc:
            self.lose()
            raise GatewayError(grpc.StatusCode.ABORTED, str(exc)) from None
        return self._apply(kept, finish, stats, began, start) if committed else None

    async def _stale(self, kept: list[int], result: RoundResult) -> None:
        """A commit found another round in Redis (only possible if an earlier commit that seemed to
        fail went through). Its tokens are the truth: hand out what we lacked, and go on from
        them (the replicas resync to them)."""
        self.client.cancel()  # the round beside the commit ran after tokens Redis does not have
        self._verdict = None
        self._stale_commits += 1
        if self._stale_commits > self.env.max_attempts:
            raise GatewayError(
                grpc.StatusCode.ABORTED, f"round {self.round} of session {self.id} never committed"
            )
        piece = await self._resume_from_store()
        if piece.token_ids == kept:  # the commit that seemed to fail was this round's
            piece = dataclasses.replace(piece, logprobs=result.logprobs[: len(kept)])
        if piece.token_ids or piece.finish_reason:
            self._pieces.put_nowait(piece)  # type: ignore[union-attr]
        if not self.finished:
            self._launch(self.tokens)

    async def _retry(self, tokens: list[int], began: float, failure: ReplicaFailure) -> None:
        """A replica failed the round: retry it (the same replica after ABORTED, else another one),
        as far as max_attempts and the retry budget allow."""
        self._failures += 1
        if self._failures >= self.env.max_attempts:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"round {self.round} failed {self.env.max_attempts} times; last error: {failure}",
            )
        await self._recover(failure)
        self._begin(tokens, await self._place(), began)

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """The slow path, as a task: its error ends the run (raised by `step`)."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._stop(task.exception())  # type: ignore[arg-type]

    def _stop(self, error: BaseException) -> None:
        """No more rounds: the client gets `error` from `step` (after what was committed)."""
        if self._stopped:
            return
        self._stopped, self.stop_error = True, error
        self.client.cancel()
        if self._pieces is not None:
            self._pieces.put_nowait(error)

    async def _drop_rounds(self) -> None:
        """The run ends: nothing it started reaches a replica any more (before its releases)."""
        self._stopped = True
        self.client.cancel()
        tasks, self._tasks = list(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _cut(self, tokens: list[int]) -> tuple[list[int], str | None]:
        """What of a round's tokens the session keeps, and whether it finished."""
        p = self.plan
        kept, finish = keep_emitted(tokens, self.generated, p.max_new_tokens, p.stop_token_ids)
        stop_at = self.text.stop_cut(kept)
        if stop_at is not None:
            return kept[:stop_at], "stop"
        return kept, finish

    async def _resume_from_store(self) -> Piece:
        """A commit found another round number: take Redis's state, hand out what we lacked."""
        session = await self.env.store.load(self.id)
        if session is None:
            raise GatewayError(grpc.StatusCode.ABORTED, f"session {self.id} expired or was deleted")
        if session.round < self.round or session.tokens[: len(self.tokens)] != self.tokens:
            # Redis lost rounds this run committed and streamed (it came back from an older AOF,
            # or a failover promoted a replica that lacked them): resuming from it would send the
            # client tokens it already has. End here; the client has exactly what was committed.
            raise GatewayError(
                grpc.StatusCode.ABORTED,
                f"session {self.id}: the session store lost committed rounds (Redis is at round "
                f"{session.round}, this gateway committed {self.round})",
            )
        new = session.tokens[len(self.tokens) :]
        self.tokens, self.round, self.stats = session.tokens, session.round, session.stats
        self.finish_reason = session.finish_reason
        return Piece(new, self.text.push(new, final=self.finished), self.finish_reason)

    def _plain_steps(self, tokens: list[int]) -> int:
        """Tokens a plain round after `tokens` may decode in one Verify call: one for the first round
        (the prompt's: its token is the time to first token), then --plain-steps, within
        max_new_tokens (steps: n-gram rides may emit more; the call is bounded by max_tokens).
        Rounds that draft, or an adaptive policy's, decode one round anyway."""
        if len(tokens) == len(self.plan.prompt_ids):
            return 1
        return min(self.env.plain_steps, self._left(tokens))

    def _left(self, tokens: list[int]) -> int:
        """Tokens of max_new_tokens still to come after `tokens` (at least 1: a round emits one)."""
        return max(1, self.plan.max_new_tokens - (len(tokens) - len(self.plan.prompt_ids)))

    async def _release_later(self, role: Role, address: str, stub: Any) -> None:
        """Release on a replica that could not be reached at the end: once it is healthy again
        (a restarted one has forgotten the session anyway), for as long as the session's TTL."""
        pool, deadline = self.pool(role), time.monotonic() + self.env.store.ttl_seconds
        while time.monotonic() < deadline:
            if address not in pool.addresses():
                return  # the replica is gone
            if (
                pool.is_healthy(address)
                and await release_session(stub, self.id, RELEASE_TIMEOUT, self.key) is not None
            ):
                return
            await asyncio.sleep(pool.health_interval)

    def _remember_lengths(self, held: dict[Role, int]) -> None:
        for role, address in self.addresses.items():
            self.lengths[address] = held[role]

    async def _recover(self, failure: ReplicaFailure) -> None:
        """After a failed call: retry the same replica (ABORTED), fail over, or give up."""
        address = self.addresses[failure.role]
        await self._recover_from(failure.role, address, failure.error, failure.per_try, failure.rows)

    async def _recover_from(
        self, role: Role, address: str, error: grpc.aio.AioRpcError, per_try: bool = False, rows: int = 0
    ) -> None:
        """per_try: the call ran out of its per-try timeout; the replica is only slow, perhaps.
        rows: the tokens and nodes the call fed (a call that timed out on more work than the round
        timeout fits is not retried: it would time out anywhere)."""
        code = error.code()
        if code == grpc.StatusCode.ABORTED:
            await asyncio.sleep(0.05)
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # a replica limit, e.g. tree_spec.depth
            details = (error.details() or "").replace("tree_spec", "speculation", 1)
            raise GatewayError(code, details, wire.field_of(details)) from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._client_deadline_reached():
            # the client's deadline, not the replica: marking it failed ejected a lone verifier and
            # the next clients got UNAVAILABLE (tests/test_gateway.py, tiny deadlines)
            raise GatewayError(code, "the client's deadline has passed") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and not per_try:
            cost = forward_seconds(self.env.forward_costs.get(role, {}), rows)
            if cost > self.env.round_timeout:
                raise GatewayError(
                    code,
                    f"{role}: a call of {rows} tokens takes about {cost:.1f} s on {address} by its measured "
                    f"cost, more than the round timeout of {self.env.round_timeout:g} s: it cannot fit, so "
                    "it is not retried (--prefill-chunk feeds long prompts in ticks of that many tokens; "
                    "0 turns chunking off)",
                ) from None
        if code not in _FAILOVER:
            raise GatewayError(code, f"{role}: {error.details()}") from None
        if not self.env.retries.try_spend():
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"{role} call failed ({code.name}) and the gateway's retry budget is spent",
            ) from None
        reason = "slower than its per-try timeout" if per_try else f"{code.name}: {error.details()}"
        self.pool(role).mark_failed(address, reason)
        self.lengths.pop(address, None)  # whatever it held may be gone; a comeback starts at 0
        self.env.metrics.failovers.labels(role).inc()
        log.warning(
            "replica call failed; moving the session",
            extra={"session": self.id, "role": role, "replica": address, "code": code.name},
        )

    # ---- placement -----------------------------------------------------------------------------

    async def _place(self) -> Placement:
        """The session's replicas for the next round, moved off unhealthy ones."""
        moved = False
        for role in self.roles:
            address = await self._pick(role)
            if address == self.addresses.get(role):
                continue
            moved = True
            self.addresses[role] = address
            self.touched.add((role, address))
        if moved and self.created:
            await self.env.store.assign(
                self.id, drafter=self.addresses.get(Role.DRAFTER), verifier=self.addresses[Role.VERIFIER]
            )
        return self._placement()

    def _placement_now(self) -> Placement | None:
        """The placement as it stands, if every replica of the session is still healthy (the
        usual round: nothing to await); None: place anew (`_place`)."""
        for role in self.roles:
            address = self.addresses.get(role)
            if address is None or not self.pool(role).is_healthy(address):
                return None
        return self._placement()

    def _placement(self) -> Placement:
        loops = {role: self.pool(role).loop(a) for role, a in self.addresses.items()}
        return Placement(
            verifier=loops[Role.VERIFIER],
            drafter=loops.get(Role.DRAFTER),
            held={role: self.lengths.get(a, 0) for role, a in self.addresses.items()},
            timeout=self._time_left(),
            per_try=self._per_try if self.env.try_timeouts is not None else None,
            spare=self._has_spare,
            deadline=self.deadline,
        )

    def _has_spare(self, role: Role) -> bool:
        """Whether a healthy replica other than the session's could take its call (without one, a
        slow call is waited for: a slow replica is better than none)."""
        return any(a != self.addresses.get(role) for a in self.pool(role).healthy())

    def _per_try(self, role: Role, new_tokens: int, work: int, plain_steps: int) -> float:
        """A call's per-try timeout (gateway/retries.py)."""
        timeouts = self.env.try_timeouts
        assert timeouts is not None
        if role is Role.DRAFTER:
            return timeouts.draft(new_tokens, work)
        return timeouts.verify(new_tokens, work, plain_steps)

    async def _pick(self, role: Role) -> str:
        pool = self.pool(role)
        preferred = self.addresses.get(role)
        routing = self.env.routing.get(pool.name)
        hashes: list[str] = []
        if routing is not None and (preferred is None or not pool.is_healthy(preferred)):
            # no replica yet (new, resumed) or moved off a failed one: where its prefix is
            held_by, hashes = await routing.choose(self.tokens, self.plan.prefix_salt)
            preferred = held_by or preferred
        while True:
            try:
                address = pool.pick(self.id, preferred=preferred)
                if routing is not None and hashes:
                    await routing.placed(address, hashes)
                return address
            except NoHealthyReplica as exc:
                try:
                    await pool.wait_healthy(1, timeout=self._time_left())
                except TimeoutError:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    def _client_deadline_reached(self) -> bool:
        """Whether the client's deadline is (all but) past: a call's deadline exceeded then is the
        client's (gRPC's clock and the loop's may differ by a little), with no time to fail over."""
        if self.deadline is None:
            return False
        return self.deadline - asyncio.get_running_loop().time() < CLIENT_DEADLINE_SLACK

    def _time_left(self) -> float:
        """Seconds a replica call (or a wait for one) may take: the round timeout, or less if the
        client's deadline comes first."""
        left = self.env.round_timeout
        if self.deadline is not None:
            left = min(left, self.deadline - asyncio.get_running_loop().time())
        if left <= 0:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline has passed")
        return left
