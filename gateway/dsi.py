"""DSI mode (docs/gateway.md, "DSI"): one session's drafting and verification overlapped across
verifier replicas; the bookkeeping is specmesh.core.dsi.DsiState.

    async with SessionRun(plan, env, text, deadline, dsi=DsiShape(lookahead=4, parallel=2)) as run:
        while not run.transcript.finished:
            piece = await run.step()                 # the next committed tokens

`DsiRounds` are a SessionRun's rounds in DSI mode: the lifecycle (the session in Redis, release
on every replica touched, cleanup when the client goes away), the placer and the transcript are
the serial rounds' (gateway/session.py); only the rounds differ. The drafter drafts chains of `lookahead`
tokens one after the other after the session's context (committed tokens plus unresolved blocks)
while at most `parallel` blocks are unresolved beyond the one being verified longest (`ahead`), or
only when every block is resolved (not `ahead`: SI's schedule, which the gateway picks where its
simulation says working ahead does not pay). Each block
goes to a free healthy verifier replica (one request per session per replica) with the tokens
that replica lacks; a replica that holds speculation a rejection threw away is sent a `position`
below what it holds and rolls back to it. Verdicts are applied in draft order; what they commit
goes to Redis with the same atomic round commit as every round, then to the client. A rejection
cancels the younger blocks' verifications and the draft in progress (the cancellation reaches the
replicas over gRPC).

Failover: a replica call that fails at the transport level takes the replica out of its pool (the
`Placer`'s rule, as for serial rounds) and its block is verified elsewhere, or the draft redone
on another drafter. Randomness derives from (seed, position) as in every round, so at temperature
0 the output is the target's greedy decode whatever the timing; at T > 0 it has the target's
distribution, but which bonus tokens are kept depends on timing, so a seed does not fix the text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gateway.env import GatewayError, Piece
from gateway.pools import NoHealthyReplica
from gateway.rounds import RunParts
from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import Block, DsiState, Outcome, Schedule
from specmesh.core.methods import Method
from specmesh.core.stats import GenerationStats
from specmesh.rpc.round_client import Role, needs_resync
from specmesh.rpc.tick_client import ItemError
from specmesh.rpc.ticks import Prefilled

COOLDOWN_SECONDS = 0.02  # a replica that answered ABORTED still runs our cancelled call


@dataclass
class _Call:
    """One Draft or Verify in flight."""

    role: Role
    address: str
    context: list[int]  # Draft: the context drafted after; Verify: the block's prefix
    version: int  # the DsiState version it was started under
    block: Block | None = None  # Verify of a block
    rows: int = 0  # Verify only: the forward's query rows (new prefix tokens and drafts)
    guard: int | None = None  # a guard's Verify (no drafts): the position it may decide


@dataclass
class _Spent:
    """What a block cost, until its verdict is applied."""

    draft_calls: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0


class DsiRounds:
    """A session's rounds in DSI mode (module docstring)."""

    def __init__(
        self,
        parts: RunParts,
        *,
        lookahead: int,
        parallel: int,
        ahead: bool = True,
        verify_cost: Callable[[int], float] | None = None,
    ) -> None:
        """client: the session as the replicas know it (DSI calls the tick loops itself).
        verify_cost: the verifier's start-up seconds per forward of n rows, to learn the gateway's
        `Learnt` forward scale from this session's verifications."""
        self.env, self.plan, self.client = parts.env, parts.plan, parts.client
        self.transcript, self.placer = parts.transcript, parts.placer
        self.id = parts.client.id
        self.stop_error: BaseException | None = None  # handed over (SIGTERM)
        self.verify_cost = verify_cost
        self.lookahead, self.parallel, self.ahead = lookahead, parallel, ahead
        self.schedule = Schedule(lookahead, parallel, ahead)
        self.guard_rounds = 0  # verifications that were guards, among the stats' rounds
        tokens = parts.transcript.tokens
        self.state = DsiState(tokens)
        # replica -> the tokens it surely holds (resumed: the committed ones it held, as stored)
        self.held = {address: tokens[:n] for address, n in parts.placer.lengths.items()}
        self.calls: dict[asyncio.Future, _Call] = {}
        self.queued: list[Block] = []  # drafted, waiting for a verifier
        self.spent: dict[int, _Spent] = {}  # block id -> its cost so far
        self.cooling: dict[str, float] = {}  # replica -> when it may be asked again
        self.max_in_flight = 0
        self.failures = 0  # replica failures since the last commit
        self.since = time.perf_counter()
        self.timeline: list[dict] = []  # what happened to each block, when (GatewayEnv.dsi_timeline)
        self._t0 = self.since

    def _event(self, event: str, **fields: Any) -> None:
        if self.env.dsi_timeline is not None:
            self.timeline.append({"t": time.perf_counter() - self._t0, "event": event, **fields})

    def describe(self, msg: Any) -> None:
        msg.dsi_lookahead, msg.dsi_parallel, msg.dsi_max_in_flight, msg.dsi_ahead = (
            self.lookahead, self.parallel, self.max_in_flight, self.ahead,
        )  # fmt: skip

    def stop(self, error: BaseException) -> None:
        """Handed over: the next `step` raises `error`."""
        self.stop_error = error

    async def close(self) -> None:
        self._cancel_all()
        await asyncio.gather(*self.calls, return_exceptions=True)
        self.calls.clear()
        if self.env.dsi_timeline is not None:
            self._write_timeline(self.env.dsi_timeline)
        stats = self.transcript.stats
        if stats.rounds > self.guard_rounds:  # what the next session's choice of shape starts from
            mean = stats.accepted_tokens / (stats.rounds - self.guard_rounds)
            self.env.dsi.learn_acceptance(mean, self.lookahead)

    def _write_timeline(self, folder: Path) -> None:
        record = {
            "session": self.id,
            "lookahead": self.lookahead,
            "parallel": self.parallel,
            "ahead": self.ahead,
            "events": self.timeline,
        }
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{self.id}.json").write_text(json.dumps(record))

    # ---- the loop ------------------------------------------------------------------------------

    async def step(self) -> Piece:
        """Run drafts and verifications until verdicts commit tokens; commit them."""
        while True:
            if self.stop_error is not None:  # handed over (SIGTERM)
                raise self.stop_error
            await self._schedule()
            if not self.calls:  # every token is committed or speculated: cannot happen unfinished
                raise GatewayError(grpc.StatusCode.INTERNAL, f"DSI session {self.id} has nothing left to run")
            done, _ = await asyncio.wait(
                self.calls, timeout=self.placer.time_left(), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "no replica answered in time")
            stats, emitted = GenerationStats(), []
            for future in done:
                delta, tokens = await self._settle(future)
                stats, emitted = stats + delta, emitted + tokens
            if emitted:
                await self._schedule(wait=False)  # the next verification and draft need not wait for Redis
                return await self._commit_tokens(emitted, stats)

    async def _commit_tokens(self, emitted: list[int], stats: GenerationStats) -> Piece:
        transcript = self.transcript
        kept, finish = transcript.cut(emitted)
        now, began = time.perf_counter(), self.since
        # drafts and verifications overlap: the wall time is the commit's, not their sum
        stats = dataclasses.replace(stats, total_seconds=now - self.since, network_seconds=0.0)
        self.since, self.failures = now, 0
        # what each replica surely holds of the committed tokens (its speculation may differ)
        committed = transcript.tokens + kept
        lengths = {address: _shared(tokens, committed) for address, tokens in self.held.items()}
        self._event("commit", tokens=len(kept))
        piece = await transcript.commit(kept, finish, stats, lengths, began)
        self._event("committed", tokens=len(kept))
        if piece is None:  # Redis is at another round: take its tokens, speculate afresh
            piece = await transcript.resume_from_store()
            self._restart()
        if transcript.finished:
            self._cancel_all()
        return piece

    def _restart(self) -> None:
        self._cancel_all()
        self.state, self.queued = DsiState(self.transcript.tokens), []

    def _cancel_all(self) -> None:
        for future in self.calls:
            future.cancel()

    async def _schedule(self, wait: bool = True) -> None:
        """Start what can start (core.dsi.Schedule): verifications of queued blocks, a guard, the
        next draft. With work left but nothing startable (no healthy or free replica), wait for a
        replica (if `wait`)."""
        plan = self.schedule
        while True:
            for _ in range(plan.verifications(len(self.queued), self._in_flight(Role.VERIFIER))):
                address = self._free_verifier(self.state.prefix(self.queued[0]))
                if address is None:
                    break
                self._verify(self.queued.pop(0), address)
            room = self.plan.max_new_tokens - (self.state.context_length - len(self.plan.prompt_ids))
            if plan.guard(self.state, self._in_flight(Role.VERIFIER), room):
                self._guard()
            depth = plan.draft(self.state, self._in_flight(Role.DRAFTER) > 0, room)
            if depth is not None:
                self._draft(min(depth, room))
            if self.calls or not (self.queued or room > 0) or not wait:
                return
            pool = self.placer.pool(Role.VERIFIER if self.queued else Role.DRAFTER)
            try:
                await pool.wait_healthy(1, timeout=self.placer.time_left())
            except TimeoutError:
                raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.name} replica") from None
            await asyncio.sleep(COOLDOWN_SECONDS)

    def _in_flight(self, role: Role) -> int:
        return sum(1 for call in self.calls.values() if call.role is role)

    def _free_verifier(self, prefix: list[int]) -> str | None:
        """A healthy verifier with no call of this session in flight; the one that already holds
        most of `prefix` first, then the highest address. The fixed order packs sessions onto the
        same verifiers, so their items share forwards that are nearly flat in rows; a spare one
        may get nothing. Spreading by load instead measured worse (bench mesh's stack, DSI 4x4 on
        four verifiers, 8 sessions: about 985 -> 900 tok/s, twice the ticks at half the items)."""
        now = asyncio.get_running_loop().time()
        busy = {c.address for c in self.calls.values()}
        free = [a for a in self.env.verifiers.healthy() if a not in busy and self.cooling.get(a, 0.0) <= now]
        return max(free, key=lambda a: (_shared(self.held.get(a, []), prefix), a), default=None)

    # ---- calls ---------------------------------------------------------------------------------

    def _position(self, address: str, context: list[int]) -> int:
        """What `address` holds of `context`, less the last token (new tokens must not be empty:
        the last one gives the root distribution)."""
        position = min(_shared(self.held.get(address, []), context), len(context) - 1)
        self.held[address] = context[:position]  # all it surely holds until it answers
        return position

    def _draft(self, depth: int) -> None:
        pool = self.placer.pool(Role.DRAFTER)
        try:  # the session's drafter while it is healthy (pool affinity), else another
            address = pool.pick(self.id, preferred=self.placer.addresses.get(Role.DRAFTER))
        except NoHealthyReplica:  # _schedule waits for one
            return
        if self.cooling.get(address, 0.0) > asyncio.get_running_loop().time():
            return  # still finishing our cancelled draft; _schedule comes back after the cooldown
        self.placer.use(Role.DRAFTER, address)
        context = self.state.context()
        position = self._position(address, context)
        spec = TreeSpec(Method.CHAIN, depth=depth)
        call = _Call(Role.DRAFTER, address, context, self.state.version)
        self._event(
            "draft",
            replica=address,
            version=self.state.version,
            start=len(context),
            fed=len(context) - position,
        )
        # supersedable: after a rejection the next draft stops this one at its next level instead
        # of being refused while it runs on
        loop = pool.loop(address)
        draft = functools.partial(loop.draft, self.client.session, spec=spec, supersedable=True)
        self._start(self._after_prefill(loop, address, position, context, draft), call)

    def _guard(self) -> None:
        """A target-only forward on the committed tokens, while no block is unresolved (and a
        second verifier is left for the block being drafted): it decides the next position
        (specmesh.core.dsi)."""
        address = self._free_verifier(self.state.committed)
        if address is None or (at := self.state.start_guard()) is None:
            return
        call = self._send_verify(address, list(self.state.committed), None, guard=at)
        self._event("guard", position=at, replica=address, rows=call.rows)

    def _verify(self, block: Block, address: str) -> None:
        self.state.mark_sent(block)
        tree = block.draft
        if block.skip:  # its first tokens were decided while it was drafted: verify the rest
            tree = tree.chain_suffix(block.skip)
        call = self._send_verify(address, self.state.prefix(block), tree, block=block)
        self._event("verify", block=block.id, replica=address, rows=call.rows)

    def _send_verify(self, address: str, prefix: list[int], tree: Any, **what: Any) -> _Call:
        """Verify `tree` (None: a target-only forward) after `prefix` on `address`."""
        position = self._position(address, prefix)
        self.placer.touched.add((Role.VERIFIER, address))
        rows = len(prefix) - position + (tree.nodes if tree is not None else 0)
        call = _Call(Role.VERIFIER, address, prefix, self.state.version, rows=rows, **what)
        loop = self.env.verifiers.loop(address)
        verify = functools.partial(loop.verify, self.client.session, tree=tree)
        self._start(self._after_prefill(loop, address, position, prefix, verify), call)
        self.max_in_flight = max(self.max_in_flight, self._in_flight(Role.VERIFIER))
        return call

    def _after_prefill(
        self, loop: Any, address: str, position: int, context: list[int], call: Callable[..., Any]
    ) -> Any:
        """call(position, new tokens, limited=...): the tick loop's future where it fits a tick's
        budget (a DSI session's every call but its prompt's: no task of its own, which cost the
        gateway ~0.08 ms a round at 32 sessions), else `_chunked`."""
        if not loop.needs_prefill(position, len(context)):
            return call(position, context[position:], limited=None)
        return self._chunked(loop, address, position, context, call)

    async def _chunked(
        self, loop: Any, address: str, position: int, context: list[int], call: Callable[..., Any]
    ) -> Any:
        """Where it would feed more than a tick's budget (the prompt, a replica that lost the
        session): limited, again from where the replica is after each chunk (what it holds from
        then on)."""
        since = time.perf_counter()
        while True:
            limited = since if loop.needs_prefill(position, len(context)) else None
            answer = await call(position, context[position:], limited=limited)
            if not isinstance(answer, Prefilled):
                return answer
            if answer.held <= position:
                raise ItemError(grpc.StatusCode.INTERNAL, f"{loop.name}: a limited call fed nothing")
            position = answer.held
            self.held[address] = context[:position]

    def _start(self, call: Any, what: _Call) -> None:
        self.calls[asyncio.ensure_future(call)] = what

    async def _settle(self, future: asyncio.Future) -> tuple[GenerationStats, list[int]]:
        """A finished call: its effect on the state -> (stats of applied verdicts, tokens committed)."""
        call = self.calls.pop(future)
        if future.cancelled() or future.exception() is not None:
            what = {"role": call.role.value, "replica": call.address, "block": _block_id(call)}
            if call.guard is not None:  # the blocks that assumed its token go with it
                res = self.state.abandon_guard(call.guard)
                self._drop(res.cancelled, res.restart)
            if future.cancelled():
                self._event("call_cancelled", **what)
                return GenerationStats(), []
            error = future.exception()
            assert error is not None
            self._event("call_failed", **what, error=repr(error)[:200])
            await self._failed(call, error)
            return GenerationStats(), []
        response = future.result()
        if call.role is Role.DRAFTER:
            self.held[call.address] = call.context
            tokens = response.tree.tokens if response.tree is not None else []
            block = self.state.add(tokens, call.version, response.tree, len(call.context))
            self._event(
                "drafted",
                replica=call.address,
                block=None if block is None else block.id,
                skip=0 if block is None else block.skip,
                tokens=tokens,
                version=call.version,
                draft_seconds=response.seconds,
            )
            if block is not None:
                self.queued.append(block)
                self.spent[block.id] = _Spent(response.forwards, response.seconds)
            return GenerationStats(), []
        verdict = response.verdict
        self.held[call.address] = call.context + list(verdict.accepted_tokens)
        self._learn_forward_scale(response.forward_seconds, call.rows)
        stats = GenerationStats()
        if call.guard is not None:
            res = self.state.finish_guard(call.guard, verdict.next_token)
            self._event(
                "guarded", position=call.guard, replica=call.address, token=verdict.next_token,
                decided=bool(res.emitted),
            )  # fmt: skip
            if res.emitted:  # a target-only round
                self.guard_rounds += 1
                stats += GenerationStats.for_round(
                    drafted_tokens=0, accepted_tokens=0, tree_depth=0, verify_seconds=response.forward_seconds
                )
        else:
            block = call.block
            assert block is not None
            if block.id in self.spent:
                self.spent[block.id].verify_seconds += response.forward_seconds
            res = self.state.finish(block.id, Outcome(len(verdict.accepted_tokens), verdict.next_token))
            self._event(
                "verdict",
                block=block.id,
                replica=call.address,
                accepted=len(verdict.accepted_tokens),
                forward_seconds=response.forward_seconds,
            )
        for b, out in res.resolved:
            self._event("resolved", block=b.id, accepted=out.accepted)
        for b in res.cancelled:
            self._event("cancelled", block=b.id)
        self._drop(res.cancelled, res.restart)
        for b, out in res.resolved:
            spent = self.spent.pop(b.id, _Spent())
            stats += GenerationStats.for_round(
                drafted_tokens=len(b.tokens),
                accepted_tokens=out.accepted,
                tree_depth=len(b.tokens),
                draft_calls=spent.draft_calls,
                draft_seconds=spent.draft_seconds,
                verify_seconds=spent.verify_seconds,
            )
        return stats, res.emitted

    def _learn_forward_scale(self, seconds: float, rows: int) -> None:
        if self.verify_cost is not None:
            self.env.dsi.learn_forward(self.ahead, self.parallel, seconds, self.verify_cost(rows))

    def _drop(self, cancelled: list[Block], restart: bool) -> None:
        """Cancel the calls of thrown-away speculation (their replicas keep what they surely held)."""
        gone = {b.id for b in cancelled}
        # as they stand now: a bonus may have decided a queued block's first token (DsiState._cascade)
        self.queued = [c for b in self.queued if (c := self.state.current(b)) is not None]
        for b in cancelled:
            self.spent.pop(b.id, None)
        for future, call in self.calls.items():
            stale = call.block is not None and call.block.id in gone
            if stale or (restart and call.role is Role.DRAFTER):
                future.cancel()

    async def _failed(self, call: _Call, error: BaseException) -> None:
        """A failed call: resend everything, retry later, fail over, or give up."""
        if call.block is not None and call.version == self.state.version:
            self.queued.insert(0, call.block)  # verify it again, here or elsewhere
        if not isinstance(error, grpc.aio.AioRpcError | ItemError):
            raise error
        if needs_resync(error):
            self.held.pop(call.address, None)
            return
        if error.code() == grpc.StatusCode.ABORTED:
            self.cooling[call.address] = asyncio.get_running_loop().time() + COOLDOWN_SECONDS
            return
        self.failures += 1
        if self.failures > self.env.max_attempts:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.failures} replica calls failed since the last commit; last: {call.role} "
                f"{call.address}: {error.code().name}: {error.details()}",
            )
        self.held.pop(call.address, None)
        await self.placer.recover_from(call.role, call.address, error)
        if call.role is Role.DRAFTER:
            self.placer.addresses.pop(Role.DRAFTER, None)


def _block_id(call: _Call) -> int | None:
    return None if call.block is None else call.block.id


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
