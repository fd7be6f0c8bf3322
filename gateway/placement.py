"""Where one session runs: its replica per role, what each holds, and moving it off a replica
that failed (`Placer`).

Session affinity: a round goes to the replicas the session is on while they are healthy; a new or
resumed session, or one moved off a failed replica, goes where its prefix is cached (prefix
routing), else where the pool picks. A replica call that fails at the transport level
(UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED by a stopping server, UNKNOWN), or takes longer than
its per-try timeout while a spare replica is healthy (gateway/retries.py), takes that replica out
of its pool, as far as the gateway's retry budget allows; the round is then placed anew. ABORTED
(our own earlier, abandoned request is still running there) is retried on the same replica. Any
other answer (INVALID_ARGUMENT, INTERNAL, PERMISSION_DENIED, ...) is the request's own: the
client gets it, no replica is blamed.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from gateway.env import GatewayEnv, GatewayError
from gateway.pools import NoHealthyReplica, ReplicaPool
from gateway.requests import GenerationPlan
from gateway.retries import forward_seconds
from specmesh.rpc import wire
from specmesh.rpc.round_client import Placement, ReplicaFailure, Role
from specmesh.rpc.tick_timing import LoopBound

log = logging.getLogger("specmesh.gateway.placement")

# What a replica's transport or host does, never a request's own fault: only these move a
# session to another replica. Our replicas answer UNKNOWN for nothing (a failing handler is
# INTERNAL), so it comes from the transport.
_FAILOVER = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
}
# seconds: a call that times out this close to the client's deadline ran out of the client's time,
# not of the replica's: no replica is blamed
CLIENT_DEADLINE_SLACK = 0.05


class Placer(LoopBound):
    """One session's replicas (module docstring). deadline: the client's, on the loop's clock.
    lengths: replica address -> the committed tokens it holds (a resumed session's, as stored)."""

    def __init__(
        self,
        env: GatewayEnv,
        session_id: str,
        plan: GenerationPlan,
        deadline: float | None,
        lengths: dict[str, int] | None = None,
    ) -> None:
        self.env, self.id, self.deadline = env, session_id, deadline
        self.method, self.salt = plan.spec.method, plan.prefix_salt
        self.roles = (Role.DRAFTER, Role.VERIFIER) if plan.spec.method.drafts else (Role.VERIFIER,)
        self.addresses: dict[Role, str] = {}  # the replica serving the session now, per role
        self.lengths: dict[str, int] = dict(lengths or {})  # replica address -> committed tokens it holds
        self.touched: set[tuple[Role, str]] = set()  # (role, address): where to release

    def pool(self, role: Role) -> ReplicaPool:
        return self.env.pool(role, self.method)

    def use(self, role: Role, address: str) -> None:
        """The session's call of `role` goes to `address` (DSI picks its own)."""
        self.addresses[role] = address
        self.touched.add((role, address))

    async def place(self, tokens: list[int], recorded: bool) -> Placement:
        """The session's replicas for the round after `tokens`, moved off unhealthy ones;
        recorded: the session is in Redis, which then learns where it moved."""
        moved = False
        for role in self.roles:
            address = await self._pick(role, tokens)
            if address == self.addresses.get(role):
                continue
            moved = True
            self.use(role, address)
        if moved and recorded:
            await self.env.store.assign(
                self.id, drafter=self.addresses.get(Role.DRAFTER), verifier=self.addresses[Role.VERIFIER]
            )
        return self.placement()

    def now(self) -> Placement | None:
        """The placement as it stands, if every replica of the session is still healthy (the
        usual round: nothing to await); None: place anew (`place`)."""
        for role in self.roles:
            address = self.addresses.get(role)
            if address is None or not self.pool(role).is_healthy(address):
                return None
        return self.placement()

    def placement(self) -> Placement:
        loops = {role: self.pool(role).loop(a) for role, a in self.addresses.items()}
        return Placement(
            verifier=loops[Role.VERIFIER],
            drafter=loops.get(Role.DRAFTER),
            held={role: self.lengths.get(a, 0) for role, a in self.addresses.items()},
            timeout=self.time_left(),
            per_try=self._per_try if self.env.try_timeouts is not None else None,
            spare=self._has_spare,
            deadline=self.deadline,
        )

    def remember(self, held: dict[Role, int]) -> None:
        """What each replica of the session holds after a round (or as far as it got)."""
        for role, address in self.addresses.items():
            self.lengths[address] = held[role]

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

    async def _pick(self, role: Role, tokens: list[int]) -> str:
        pool = self.pool(role)
        preferred = self.addresses.get(role)
        routing = self.env.routing.get(pool.name)
        hashes: list[str] = []
        if routing is not None and (preferred is None or not pool.is_healthy(preferred)):
            # no replica yet (new, resumed) or moved off a failed one: where its prefix is
            held_by, hashes = await routing.choose(tokens, self.salt)
            preferred = held_by or preferred
        while True:
            try:
                address = pool.pick(self.id, preferred=preferred)
                if routing is not None and hashes:
                    await routing.placed(address, hashes)
                return address
            except NoHealthyReplica as exc:
                try:
                    await pool.wait_healthy(1, timeout=self.time_left())
                except TimeoutError:
                    raise GatewayError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

    # ---- after a failed call ---------------------------------------------------------------------

    async def recover(self, failure: ReplicaFailure) -> None:
        """After a failed round call: retry the same replica (ABORTED), fail over, or give up."""
        address = self.addresses[failure.role]
        await self.recover_from(failure.role, address, failure.error, failure.per_try, failure.rows)

    async def recover_from(
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
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and self.client_deadline_reached():
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

    # ---- time --------------------------------------------------------------------------------------

    def client_deadline_reached(self) -> bool:
        """Whether the client's deadline is (all but) past: a call's deadline exceeded then is the
        client's (gRPC's clock and the loop's may differ by a little), with no time to fail over."""
        if self.deadline is None:
            return False
        return self.deadline - self.loop.time() < CLIENT_DEADLINE_SLACK

    def time_left(self) -> float:
        """Seconds a replica call (or a wait for one) may take: the round timeout, or less if the
        client's deadline comes first."""
        left = self.env.round_timeout
        if self.deadline is not None:
            left = min(left, self.deadline - self.loop.time())
        if left <= 0:
            raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline has passed")
        return left
