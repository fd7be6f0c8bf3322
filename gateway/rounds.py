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
CANCELLED by a stopping server, INTERNAL, UNKNOWN) takes that replica out of its pool and redoes
the round on another one, waiting (within the round timeout and the client's deadline) for one
to become healthy. The new replica is sent position 0 and all committed tokens (the resync
protocol); since every round's randomness derives from (seed, position), it produces the tokens
the old one would have. ABORTED (our own earlier, abandoned request is still running there) is
retried on the same replica. At most `max_attempts` tries per round.

Leaving the `async with` in any way (finished, error, the client cancelled) releases the
session on every replica it touched and deletes it from Redis, shielded from cancellation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.api import stats_to_proto
from gateway.metrics import GatewayMetrics
from gateway.pools import NoHealthyReplica, ReplicaPool
from gateway.requests import GenerationPlan
from gateway.session_store import SessionStore, StoreError
from gateway.text import TextStream
from specmesh.core.adaptive import PolicyMemory
from specmesh.core.rounds import keep_emitted
from specmesh.core.stats import GenerationStats
from specmesh.rpc.proto import pb2_grpc
from specmesh.rpc.round_client import (
    Placement,
    ReplicaFailure,
    Role,
    RoundClient,
    RoundResult,
    release_session,
)
from specmesh.rpc.tracing import tracer

log = logging.getLogger("specmesh.gateway.rounds")
_tracer = tracer("specmesh.gateway")

_FAILOVER = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
_STUBS = {Role.DRAFTER: pb2_grpc.DrafterStub, Role.VERIFIER: pb2_grpc.VerifierStub}
RELEASE_TIMEOUT = 2.0


class GatewayError(Exception):
    """A request that ends with this status code and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class GatewayEnv:
    """What every session of one gateway shares."""

    store: SessionStore
    drafters: ReplicaPool | None
    verifiers: ReplicaPool
    metrics: GatewayMetrics
    round_timeout: float
    max_attempts: int
    cleanups: set[asyncio.Task] = dataclasses.field(default_factory=set)  # outliving their request
    policies: PolicyMemory = dataclasses.field(default_factory=PolicyMemory)  # adaptive sessions' warm start
    dsi_acceptance: float = 0.7  # per-token acceptance of finished DSI sessions, decayed (the prior: 0.7)
    # DSI verifications' time over the verifier's start-up cost for their rows, decayed, with the
    # drafter working ahead (True) and not (False): their ratio is what drafting beside costs
    dsi_forward_scale: dict[bool, float] = dataclasses.field(default_factory=lambda: {True: 1.0, False: 1.0})

    def dsi_overlap_slowdown(self) -> float:
        return self.dsi_forward_scale[True] / self.dsi_forward_scale[False]

    def pool(self, role: Role) -> ReplicaPool:
        pool = self.drafters if role is Role.DRAFTER else self.verifiers
        assert pool is not None
        return pool


@dataclass(frozen=True)
class Piece:
    """One committed round as the client sees it."""

    token_ids: list[int]
    text: str
    finish_reason: str | None


class SessionRun:
    """One request's generation (module docstring). deadline: the client's, on the loop's clock."""

    def __init__(
        self,
        plan: GenerationPlan,
        env: GatewayEnv,
        text: TextStream,
        deadline: float | None,
        forward_cost: dict[int, float] | None = None,
    ) -> None:
        """forward_cost: the verifier's measured rows -> seconds, for an adaptive policy."""
        self.plan, self.env, self.text, self.deadline = plan, env, text, deadline
        self.id = uuid.uuid4().hex
        self.roles = (Role.DRAFTER, Role.VERIFIER) if plan.spec.method.drafts else (Role.VERIFIER,)
        policy = env.policies.new_policy(plan.spec, plan.params, forward_cost) if plan.adaptive else None
        self.client = RoundClient(self.id, plan.params, plan.spec, policy=policy)
        self.tokens = list(plan.prompt_ids)  # committed, as in Redis
        self.round = 0
        self.stats = GenerationStats()
        self.finish_reason: str | None = None
        self.addresses: dict[Role, str] = {}  # the replica serving the session now, per role
        self.lengths: dict[str, int] = {}  # replica address -> committed tokens it holds
        self.touched: set[tuple[Role, str]] = set()  # (role, address): where to release
        self.created = False

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
        try:
            await self._place()
            p = self.plan
            await self.env.store.create(
                self.id,
                p.prompt_ids,
                drafter=self.addresses.get(Role.DRAFTER, ""),
                verifier=self.addresses[Role.VERIFIER],
                sampling=dataclasses.asdict(p.params),
                speculation={**dataclasses.asdict(p.spec), "adaptive": p.adaptive},
                max_new_tokens=p.max_new_tokens,
                extra={"stop": list(p.stop), "stop_token_ids": list(p.stop_token_ids)},
            )
            self.created = True
        except BaseException:
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
        if self.client.policy is not None:
            self.env.policies.remember(self.client.policy, self.plan.params)
        releases = [
            release_session(_STUBS[role](self.env.pool(role).channel(addr)), self.id, RELEASE_TIMEOUT)
            for role, addr in sorted(self.touched)
        ]
        await asyncio.gather(*releases)
        for role in self.roles:
            self.env.pool(role).release(self.id)
        if self.created:
            try:
                await self.env.store.delete(self.id)
            except StoreError as exc:  # Redis down: the TTL removes the keys
                log.warning("could not delete a session", extra={"session": self.id, "error": str(exc)})

    # ---- rounds --------------------------------------------------------------------------------

    async def step(self) -> Piece:
        """One round, committed; retried on other replicas when one fails. Traced as a span
        "round" with the Draft and Verify calls and the commit under it."""
        with _tracer.start_as_current_span("round", attributes={"session": self.id, "round": self.round}):
            return await self._step()

    async def _step(self) -> Piece:
        for _ in range(self.env.max_attempts):
            result = await self._run_round()
            kept, finish = self._cut(result.tokens)
            lengths = {self.addresses[role]: result.held[role] for role in self.roles}
            piece = await self._commit(kept, finish, result.stats, lengths)
            if piece is not None:
                return piece
            # Stale: Redis is at another round (only possible if an earlier commit that seemed to
            # fail went through). Its tokens are the truth; the replicas resync to them.
            piece = await self._resume_from_store()
            if piece.token_ids or piece.finish_reason:
                return piece
        raise GatewayError(
            grpc.StatusCode.ABORTED, f"round {self.round} of session {self.id} never committed"
        )

    async def _commit(
        self, kept: list[int], finish: str | None, stats: GenerationStats, lengths: dict[str, int]
    ) -> Piece | None:
        """Commit one round's tokens to Redis: what the client gets, or None if Redis is at another
        round."""
        start = time.perf_counter()
        with _tracer.start_as_current_span("commit", attributes={"tokens": len(kept)}):
            committed = await self.env.store.commit_round(
                self.id, self.round, kept, stats, lengths, finish_reason=finish
            )
        if not committed:
            return None
        self.env.metrics.observe_round(stats, len(kept), time.perf_counter() - start)
        self.tokens += kept
        self.round += 1
        self.stats += stats
        self.finish_reason = finish
        return Piece(kept, self.text.push(kept, final=finish is not None), finish)

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
        new = session.tokens[len(self.tokens) :]
        self.tokens, self.round, self.stats = session.tokens, session.round, session.stats
        self.finish_reason = session.finish_reason
        return Piece(new, self.text.push(new, final=self.finished), self.finish_reason)

    async def _run_round(self) -> RoundResult:
        failure: ReplicaFailure | None = None
        for _ in range(self.env.max_attempts):
            placement = await self._place()
            try:
                result = await self.client.round(self.tokens, placement)
            except ReplicaFailure as exc:
                self._remember_lengths(exc.held)
                failure = exc
                await self._recover(exc)
            else:
                self._remember_lengths(result.held)
                return result
        raise GatewayError(
            grpc.StatusCode.UNAVAILABLE,
            f"round {self.round} failed {self.env.max_attempts} times; last error: {failure}",
        )

    def _remember_lengths(self, held: dict[Role, int]) -> None:
        for role, address in self.addresses.items():
            self.lengths[address] = held[role]

    async def _recover(self, failure: ReplicaFailure) -> None:
        """After a failed call: retry the same replica (ABORTED), fail over, or give up."""
        await self._recover_from(failure.role, self.addresses[failure.role], failure.error)

    async def _recover_from(self, role: Role, address: str, error: grpc.aio.AioRpcError) -> None:
        code = error.code()
        if code == grpc.StatusCode.ABORTED:
            await asyncio.sleep(0.05)
            return
        if code == grpc.StatusCode.INVALID_ARGUMENT:  # a replica limit, e.g. tree_spec.depth
            details = error.details() or ""
            raise GatewayError(code, details.replace("tree_spec", "speculation", 1)) from None
        if code not in _FAILOVER:
            raise GatewayError(code, f"{role} {address}: {error.details()}") from None
        self.env.pool(role).mark_failed(address, f"{code.name}: {error.details()}")
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
        stubs = {role: _STUBS[role](self.env.pool(role).channel(a)) for role, a in self.addresses.items()}
        return Placement(
            verifier=stubs[Role.VERIFIER],
            drafter=stubs.get(Role.DRAFTER),
            held={role: self.lengths.get(a, 0) for role, a in self.addresses.items()},
            timeout=self._time_left(),
        )

    async def _pick(self, role: Role) -> str:
        pool = self.env.pool(role)
        while True:
            try:
                return pool.pick(self.id, preferred=self.addresses.get(role))
            except NoHealthyReplica as exc:
                try:
                    await pool.wait_healthy(1, timeout=self._time_left())
                except TimeoutError:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    def _time_left(self) -> float:
        """Seconds a replica call (or a wait for one) may take: the round timeout, or less if the
        client's deadline comes first."""
        left = self.env.round_timeout
        if self.deadline is not None:
            left = min(left, self.deadline - asyncio.get_running_loop().time())
        if left <= 0:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline has passed")
        return left
