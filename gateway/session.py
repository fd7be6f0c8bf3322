"""One generation through the gateway: its session in Redis from creation to cleanup
(`SessionRun`), and the pieces it is composed of.

    async with SessionRun(plan, env, text, deadline) as run:   # creates the session in Redis
        while not run.transcript.finished:
            piece = await run.step()                           # one committed round

A run composes:
- a `Placer` (gateway/placement.py): the session's replicas, failover, the retry budget;
- a `Transcript` (gateway/transcript.py): its committed tokens and the one commit path;
- its rounds: `SerialRounds` (gateway/rounds.py) or, for a DSI request, `DsiRounds`
  (gateway/dsi.py), both over the same placer and transcript;
- a `RoundClient` (specmesh/rpc/round_client.py): the session as the replicas know it.

What is left here is the lifecycle: create or take the session, its lease (`GatewayEnv.leases`),
what its end does (`Ending`), and the cleanup. Leaving the `async with` in any way (finished,
error, the client cancelled) releases the session on every replica it touched and deletes it from
Redis, shielded from cancellation; unless the gateway is stopping (`keep`, `hand_over`) or another
gateway took the session over (`lose`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

import grpc

from gateway.api import stats_to_proto
from gateway.dsi import DsiRounds
from gateway.env import GatewayEnv, GatewayError, Piece
from gateway.placement import Placer
from gateway.requests import GenerationPlan, stored_plan
from gateway.rounds import RunParts, SerialRounds
from gateway.session_store import Session, SessionExists, StoreError
from gateway.text import TextStream
from gateway.transcript import Transcript
from specmesh.core.adaptive import RoundPolicy
from specmesh.rpc.proto import pb2_grpc
from specmesh.rpc.round_client import Role, RoundClient, release_session

log = logging.getLogger("specmesh.gateway.session")

_STUBS = {Role.DRAFTER: pb2_grpc.DrafterStub, Role.VERIFIER: pb2_grpc.VerifierStub}
RELEASE_TIMEOUT = 2.0
FINISHED_LINGER_LEASES = 5  # a session finished during a handover stays this many leases for a resume


class Ending(StrEnum):
    """What a run's cleanup does with its session: one state, set by what happened to the run."""

    DONE = "done"  # finished, failed or its client left: released on every replica, deleted
    KEPT = "kept"  # the gateway stops: the session, its replicas' KV and (released) lease stay
    LOST = "lost"  # another gateway took it over: everything is left to that one


class Rounds(Protocol):
    """How a run's rounds go: serial (SerialRounds) or DSI (DsiRounds)."""

    async def step(self) -> Piece:
        """The next committed tokens."""

    def stop(self, error: BaseException) -> None:
        """No more rounds: `step` raises `error` (after what was committed)."""

    async def close(self) -> None:
        """Nothing started reaches a replica any more (before the releases)."""

    def describe(self, stats: Any) -> None:
        """Add the rounds' own fields to the public GenerationStats message."""


@dataclass(frozen=True)
class DsiShape:
    """A DSI run's shape (specmesh.core.dsi.choose_shape) and the verifier's cost by rows."""

    lookahead: int
    parallel: int
    ahead: bool = True
    verify_cost: Callable[[int], float] | None = None  # rows -> seconds, to learn the forward scale
    max_depth: int | None = None  # the deepest chain a replica takes (the served model's tree limit)


class SessionRun:
    """One request's generation (module docstring). deadline: the client's, on the loop's clock.
    policy: an adaptive plan's depth controller, or the default's FamilyPolicy (the gateway builds
    either, reproducible). resumed: a session taken over from Redis (`SessionStore.take`): the run
    goes on from its committed tokens, as the gateway that started it would have. dsi: the shape of
    a DSI run (else serial rounds)."""

    def __init__(
        self,
        plan: GenerationPlan,
        env: GatewayEnv,
        text: TextStream,
        deadline: float | None,
        policy: RoundPolicy | None = None,
        resumed: Session | None = None,
        dsi: DsiShape | None = None,
    ) -> None:
        self.plan, self.env = plan, env
        self.id = resumed.id if resumed else uuid.uuid4().hex
        # the replicas serve this session only to callers with its key: kept in Redis for a resume
        self.key = resumed.extra["key"] if resumed else secrets.token_hex(16)
        self.client = RoundClient(
            self.id, plan.params, plan.spec, policy=policy, key=self.key, pipeline=env.pipeline,
            stop_token_ids=plan.stop_token_ids, top_logprobs=plan.top_logprobs, grammar=plan.grammar,
            salt=plan.prefix_salt, private=plan.private,
        )  # fmt: skip
        self.transcript = Transcript(self.id, plan, env, text, resumed, lost=self.lose)
        self.placer = Placer(env, self.id, plan, deadline, resumed.replica_lengths if resumed else None)
        self.created = resumed is not None
        self.resumed = resumed
        self.ending = Ending.DONE  # what its cleanup does with the session
        parts = RunParts(env, plan, self.client, self.transcript, self.placer)
        self.rounds: Rounds
        if dsi is None:
            self.rounds = SerialRounds(parts)
        else:
            self.rounds = DsiRounds(
                parts,
                lookahead=dsi.lookahead,
                parallel=dsi.parallel,
                ahead=dsi.ahead,
                verify_cost=dsi.verify_cost,
                max_depth=dsi.max_depth,
            )

    @property
    def owner(self) -> str:
        """The gateway's owner token of the session (`Leased`): its transcript's, which commits
        are fenced with."""
        return self.transcript.owner

    def stats_message(self) -> Any:
        """The public specmesh.v1.GenerationStats of the run so far."""
        t = self.transcript
        msg = stats_to_proto(t.stats, prompt_tokens=len(self.plan.prompt_ids), generated_tokens=t.generated)
        self.rounds.describe(msg)
        return msg

    async def step(self) -> Piece:
        """The next committed tokens; the rounds' failure is raised here."""
        return await self.rounds.step()

    # ---- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> SessionRun:
        self.env.metrics.running.inc()
        creating = False
        try:
            await self.placer.place(self.transcript.tokens, recorded=self.created)
            if self.resumed is None:
                creating = True
                stored = stored_plan(self.plan)
                stored["extra"]["key"] = self.key
                session = await self.env.store.create(
                    self.id,
                    self.plan.prompt_ids,
                    drafter=self.placer.addresses.get(Role.DRAFTER, ""),
                    verifier=self.placer.addresses[Role.VERIFIER],
                    **stored,
                )
                self.transcript.owner, self.created = session.owner, True
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
        await self.rounds.close()  # before the releases: its calls must not reach a replica after them
        self.client.close()
        if self.ending is not Ending.DONE:
            await self._leave()
            return
        # on the tick stream each replica has open (a paused one reads it once it is back); where
        # that stream is gone, with a Release call, retried while the replica is unreachable
        placer = self.placer
        unsent = [
            (role, a) for role, a in sorted(placer.touched) if not placer.pool(role).loop(a).release(self.id)
        ]
        stubs = [_STUBS[role](placer.pool(role).channel(addr)) for role, addr in unsent]
        released = await asyncio.gather(
            *(release_session(s, self.id, RELEASE_TIMEOUT, self.key) for s in stubs)
        )
        for (role, address), stub, outcome in zip(unsent, stubs, released, strict=True):
            if outcome is None:  # unreachable (paused, partitioned): it may still hold the KV
                self.env.defer(self._release_later(role, address, stub))
        for role in placer.roles:
            placer.pool(role).release(self.id)
        if self.env.learns and self.transcript.finished and not self.plan.private:
            self.env.defer(self._publish())  # what suffix drafts and rides learn from
        if self.created:
            try:
                await self.env.store.delete(self.id)
            except StoreError as exc:  # Redis down: the TTL removes the keys
                log.warning("could not delete a session", extra={"session": self.id, "error": str(exc)})

    async def _publish(self) -> None:
        generated = self.transcript.tokens[len(self.plan.prompt_ids) :]
        if generated:
            try:
                await self.env.store.outputs.publish(generated)
            except StoreError as exc:  # Redis down: the drafters miss one output
                log.warning("could not publish an output", extra={"session": self.id, "error": str(exc)})

    async def _leave(self) -> None:
        """Another gateway goes on (or will) with this session, its keys and its replicas' KV."""
        for role in self.placer.roles:
            self.placer.pool(role).release(self.id)
        if self.ending is Ending.LOST:
            return  # the lease is another's
        if self.transcript.finished:
            # It finished while the gateway shuts down: its last chunk may not reach the client,
            # which then resumes elsewhere. Keep the keys a little while instead of deleting them.
            with contextlib.suppress(StoreError):
                await self.env.store.expire(self.id, FINISHED_LINGER_LEASES * self.env.store.lease_seconds)
        with contextlib.suppress(StoreError):
            await self.env.store.release(self.id, self.owner)

    async def _release_later(self, role: Role, address: str, stub: Any) -> None:
        """Release on a replica that could not be reached at the end: once it is healthy again
        (a restarted one has forgotten the session anyway), for as long as the session's TTL."""
        pool, deadline = self.placer.pool(role), time.monotonic() + self.env.store.ttl_seconds
        while time.monotonic() < deadline:
            if address not in pool.addresses():
                return  # the replica is gone
            if (
                pool.is_healthy(address)
                and await release_session(stub, self.id, RELEASE_TIMEOUT, self.key) is not None
            ):
                return
            await asyncio.sleep(pool.health_interval)

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
        self.rounds.stop(
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
