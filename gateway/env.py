"""What every session of one gateway shares (`GatewayEnv`), what a request fails with
(`GatewayError`), what a client gets of a committed round (`Piece`), and the sessions' leases,
renewed together (`Leases`)."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from gateway.metrics import GatewayMetrics
from gateway.pools import ReplicaPool
from gateway.prefixes import PrefixRouting
from gateway.retries import RetryBudget, TryTimeouts
from gateway.session_store import SessionStore, StoreError
from specmesh.core.ahead import PipelinePolicy
from specmesh.core.dsi import Learnt
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.methods import Method
from specmesh.rpc.round_client import Role


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
    suffix_rides: bool = False  # the default's plain steps ride the mesh's suffix trees (--suffix-rides)
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

    @property
    def learns(self) -> bool:
        """Whether finished outputs go to the outputs log: something drafts from it (suffix drafts
        on the model-free drafters, the verifiers' suffix rides)."""
        return self.ngram_drafters is not None or self.suffix_rides

    def pool(self, role: Role, method: Method) -> ReplicaPool:
        """The replicas of a role; a session of a model-free method (ngram, suffix) drafts on the
        model-free drafters."""
        if role is Role.VERIFIER:
            return self.verifiers
        pool = self.ngram_drafters if method.model_free else self.drafters
        assert pool is not None
        return pool


class Leased(Protocol):
    """A running session whose lease its gateway renews."""

    id: str
    owner: str  # the gateway's owner token of it (gateway/session_store.py, "Ownership")

    def lose(self) -> None:
        """Another gateway took it over."""


class Leases:
    """The ownership leases of a gateway's running sessions, renewed together: one pipelined
    Redis round trip every third of a lease for all of them (commits renew a session's too; a
    round may be long). A session another gateway took over is told (`lose`)."""

    def __init__(self, store: SessionStore) -> None:
        self.store = store
        self._runs: dict[str, Leased] = {}
        self._task: asyncio.Task | None = None

    def add(self, run: Leased) -> None:
        self._runs[run.id] = run
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._renew())

    def discard(self, run: Leased) -> None:
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


class Handout:
    """Committed pieces on their way to the client's stream, in order, as the rounds' answers
    commit them; an error ends them (`get` raises it after the pieces before it). One waiter at a
    time: the run's `step`."""

    def __init__(self) -> None:
        self._pieces: collections.deque[Piece | BaseException] = collections.deque()
        self._waiter: asyncio.Future | None = None

    def put(self, piece: Piece | BaseException) -> None:
        self._pieces.append(piece)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self, loop: asyncio.AbstractEventLoop, timeout: Callable[[], float] | None = None) -> Piece:
        """The next piece; timeout(): the seconds it may take (it may raise GatewayError), past
        them DEADLINE_EXCEEDED."""
        while not self._pieces:
            self._waiter = loop.create_future()
            late = None if timeout is None else loop.call_later(timeout(), self._late, self._waiter)
            try:
                await self._waiter
            finally:
                if late is not None:
                    late.cancel()
                self._waiter = None
        piece = self._pieces.popleft()
        if isinstance(piece, BaseException):
            raise piece
        return piece

    @staticmethod
    def _late(waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(
                GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "no replica answered in time")
            )


class SlowPaths:
    """A run's slow paths as tasks (placing a session anew, a failover, a stale commit, a wait for
    a healthy replica): the rounds' fast path runs on the replicas' answers, these await. An
    error in one ends the run (`stop(error)`)."""

    def __init__(self, stop: Callable[[BaseException], None]) -> None:
        self._stop = stop
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._stop(task.exception())  # type: ignore[arg-type]

    async def cancel(self, *others: asyncio.Task) -> None:
        """Cancel them (and `others`), and wait until they are gone."""
        tasks, self._tasks = [*self._tasks, *others], set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
