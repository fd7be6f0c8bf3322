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

The rounds are driven by the replicas' answers, as the serial rounds are: each call's answer is
applied where its tick's answer is read (`_answered`), which starts what can start next (the next
block's verification, the next draft) in the same pass over the tick's sessions, and commits what
the verdicts decided through the `Transcript` (one commit in flight; what is decided meanwhile
goes in the next). `step` only waits for the committed pieces. No task or future per call: a task
runs only on a slow path (a chunked prefill, a failover, a wait for a healthy replica, a stale
commit).

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

from gateway.env import GatewayError, Handout, Piece, SlowPaths
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


@dataclass(eq=False)
class _Call:
    """One Draft or Verify in flight (a key of `DsiRounds.calls`: compared by identity)."""

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
        max_depth: int | None = None,
    ) -> None:
        """client: the session as the replicas know it (DSI calls the tick loops itself).
        verify_cost: the verifier's start-up seconds per forward of n rows, to learn the gateway's
        `Learnt` forward scale from this session's verifications. max_depth: the deepest chain the
        replicas take; a draft's extra token (`DsiState.next_depth`) never goes past it."""
        self.env, self.plan, self.client = parts.env, parts.plan, parts.client
        self.transcript, self.placer = parts.transcript, parts.placer
        self.id = parts.client.id
        self.stop_error: BaseException | None = None  # why the rounds stopped before the end
        self.verify_cost = verify_cost
        self.lookahead, self.parallel, self.ahead = lookahead, parallel, ahead
        self.schedule = Schedule(lookahead, parallel, ahead, max_depth)
        self.guard_rounds = 0  # verifications that were guards, among the stats' rounds
        tokens = parts.transcript.tokens
        self.state = DsiState(tokens)
        # replica -> the tokens it surely holds (resumed: the committed ones it held, as stored)
        held = {address: tokens[:n] for address, n in parts.placer.lengths.items()}
        self.queued: list[Block] = []  # drafted, waiting for a verifier
        self.spent: dict[int, _Spent] = {}  # block id -> its cost so far
        self.max_in_flight = 0
        self.failures = 0  # replica failures since the last commit
        self.since = time.perf_counter()
        self.timeline: list[dict] = []  # what happened to each block, when (GatewayEnv.dsi_timeline)
        self._t0 = self.since
        self._started = False
        self.handout = Handout()  # the committed pieces, for `step`
        self._decided: list[int] = []  # tokens the verdicts decided, not yet committed
        self._decided_stats = GenerationStats()
        self._committing = False  # one commit in flight at a time, in order
        self._finishing = False  # the last commit is on its way: nothing more starts
        self._waiting = False  # a task waits for a healthy replica (`_wait_for_replica`)
        self.slow = SlowPaths(self.stop)
        self.replicas = _Replicas(held, self._answered, self._event)

    def _event(self, event: str, **fields: Any) -> None:
        if self.env.dsi_timeline is not None:
            self.timeline.append({"t": time.perf_counter() - self._t0, "event": event, **fields})

    def describe(self, msg: Any) -> None:
        msg.dsi_lookahead, msg.dsi_parallel, msg.dsi_max_in_flight, msg.dsi_ahead = (
            self.lookahead, self.parallel, self.max_in_flight, self.ahead,
        )  # fmt: skip

    def stop(self, error: BaseException) -> None:
        """No more rounds: `step` raises `error` once it has handed out what was committed."""
        if self.stop_error is not None:
            return
        self.stop_error = error
        self.replicas.cancel_all()
        self.handout.put(error)

    async def close(self) -> None:
        if self.stop_error is None:
            self.stop_error = GatewayError(grpc.StatusCode.CANCELLED, "the run ended")
        chunks = self.replicas.chunk_tasks()
        self.replicas.cancel_all()
        await self.slow.cancel(*chunks)
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
        """The next committed tokens (the rounds run on the replicas' answers meanwhile): past the
        round timeout (or the client's deadline) with nothing committed, DEADLINE_EXCEEDED."""
        if not self._started:
            self._started = True
            self._schedule()
        return await self.handout.get(self.placer.loop, self.placer.time_left)

    def _answered(self, call: _Call, outcome: Any) -> None:
        """A call's answer, where its tick's answer is read: applied, what can start starts, and
        what the verdicts decided is committed (after the commit in flight, if one is)."""
        if not self.replicas.taken(call) or self.stop_error is not None:
            return  # cancelled (a stale block, a restart), or the rounds are over
        try:
            if isinstance(outcome, BaseException):
                self._call_failed(call, outcome)
                return
            stats, decided = self._apply(call, outcome)
            if decided:
                self._decided += decided
                self._decided_stats += stats
                self._commit_decided()
            self._schedule()
        except Exception as exc:  # a bug, or a store error raised here: the run ends with it
            self.stop(exc)

    def _commit_decided(self) -> None:
        """Commit what the verdicts decided (one commit in flight at a time, in order)."""
        if self._committing or not self._decided or self.transcript.finished:
            return
        transcript = self.transcript
        emitted, self._decided = self._decided, []
        kept, finish = transcript.cut(emitted)
        now, began = time.perf_counter(), self.since
        # drafts and verifications overlap: the wall time is the commit's, not their sum
        stats = dataclasses.replace(self._decided_stats, total_seconds=now - self.since, network_seconds=0.0)
        self._decided_stats = GenerationStats()
        self.since, self.failures = now, 0
        # what each replica surely holds of the committed tokens (its speculation may differ)
        committed = transcript.tokens + kept
        lengths = self.replicas.lengths(committed)
        if finish is not None:  # nothing more starts; what is in flight is wasted
            self._finishing = True
            self.replicas.cancel_all()
        self._event("commit", tokens=len(kept))
        self._committing = True
        done = functools.partial(self._committed, kept, finish, stats, began, now)
        transcript.commit_then(kept, finish, stats, lengths, done)

    def _committed(
        self, kept: list[int], finish: str | None, stats: GenerationStats, began: float, start: float,
        outcome: bool | Exception,
    ) -> None:  # fmt: skip
        """A commit's answer, with the rest of its pipeline's (`ScriptPipeline`)."""
        self._committing = False
        if self.stop_error is not None:
            return
        try:
            ok = self.transcript.committed(outcome)
        except Exception as exc:  # Redis refused or stayed down, or the session is another's
            self.stop(exc)
            return
        self._event("committed", tokens=len(kept))
        if not ok:  # Redis is at another round: take its tokens, speculate afresh
            self.slow.spawn(self._resume_from_store())
            return
        self.handout.put(self.transcript.apply(kept, finish, stats, began, start))
        self._commit_decided()

    async def _resume_from_store(self) -> None:
        piece = await self.transcript.resume_from_store()
        self.replicas.cancel_all()
        self.state, self.queued, self._decided = DsiState(self.transcript.tokens), [], []
        self._decided_stats, self._finishing = GenerationStats(), self.transcript.finished
        self.handout.put(piece)
        self._schedule()

    def _schedule(self) -> None:
        """Start what can start (core.dsi.Schedule): verifications of queued blocks, a guard, the
        next draft. With work left but nothing startable (no healthy or free replica), a task waits
        for a replica."""
        if self.stop_error is not None or self._finishing:
            return
        plan = self.schedule
        for _ in range(plan.verifications(len(self.queued), self.replicas.in_flight(Role.VERIFIER))):
            address = self._free_verifier(self.state.prefix(self.queued[0]))
            if address is None:
                break
            self._verify(self.queued.pop(0), address)
        room = self.plan.max_new_tokens - (self.state.context_length - len(self.plan.prompt_ids))
        if plan.guard(self.state, self.replicas.in_flight(Role.VERIFIER), room):
            self._guard()
        depth = plan.draft(self.state, self.replicas.in_flight(Role.DRAFTER) > 0, room)
        if depth is not None:
            self._draft(min(depth, room))
        if not self.replicas.calls and (self.queued or room > 0) and not self._waiting:
            self._waiting = True
            self.slow.spawn(self._wait_for_replica())

    async def _wait_for_replica(self) -> None:
        pool = self.placer.pool(Role.VERIFIER if self.queued else Role.DRAFTER)
        try:
            await pool.wait_healthy(1, timeout=self.placer.time_left())
        except TimeoutError:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, f"no healthy {pool.name} replica") from None
        await asyncio.sleep(COOLDOWN_SECONDS)
        self._waiting = False
        self._schedule()

    def _free_verifier(self, prefix: list[int]) -> str | None:
        return self.replicas.free_verifier(self.env.verifiers.healthy(), prefix, self.placer.loop.time())

    # ---- calls ---------------------------------------------------------------------------------

    def _draft(self, depth: int) -> None:
        pool = self.placer.pool(Role.DRAFTER)
        try:  # the session's drafter while it is healthy (pool affinity), else another
            address = pool.pick(self.id, preferred=self.placer.addresses.get(Role.DRAFTER))
        except NoHealthyReplica:  # _schedule waits for one
            return
        if not self.replicas.cooled(address, self.placer.loop.time()):
            return  # still finishing our cancelled draft; a later _schedule comes back after the cooldown
        self.placer.use(Role.DRAFTER, address)
        context = self.state.context()
        position = self.replicas.position(address, context)
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
        self.replicas.send(
            loop,
            address,
            position,
            context,
            functools.partial(loop.draft, self.client.session, spec=spec, supersedable=True),
            call,
        )

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
        position = self.replicas.position(address, prefix)
        self.placer.touched.add((Role.VERIFIER, address))
        rows = len(prefix) - position + (tree.nodes if tree is not None else 0)
        call = _Call(Role.VERIFIER, address, prefix, self.state.version, rows=rows, **what)
        loop = self.env.verifiers.loop(address)
        verify = functools.partial(loop.verify, self.client.session, tree=tree)
        self.replicas.send(loop, address, position, prefix, verify, call)
        self.max_in_flight = max(self.max_in_flight, self.replicas.in_flight(Role.VERIFIER))
        return call

    # ---- answers -------------------------------------------------------------------------------

    def _call_failed(self, call: _Call, error: BaseException) -> None:
        """A failed call: resend everything, retry later, fail over (a task), or give up."""
        what = {"role": call.role.value, "replica": call.address, "block": _block_id(call)}
        if call.guard is not None:  # the blocks that assumed its token go with it
            res = self.state.abandon_guard(call.guard)
            self._drop(res.cancelled, res.restart)
        self._event("call_failed", **what, error=repr(error)[:200])
        if call.block is not None and call.version == self.state.version:
            self.queued.insert(0, call.block)  # verify it again, here or elsewhere
        if not isinstance(error, grpc.aio.AioRpcError | ItemError):
            raise error
        if needs_resync(error):
            self.replicas.forget(call.address)
        elif error.code() == grpc.StatusCode.ABORTED:
            self.replicas.cool(call.address, self.placer.loop.time() + COOLDOWN_SECONDS)
        else:
            self.failures += 1
            if self.failures > self.env.max_attempts:
                raise GatewayError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.failures} replica calls failed since the last commit; last: {call.role} "
                    f"{call.address}: {error.code().name}: {error.details()}",
                )
            self.replicas.forget(call.address)
            self.slow.spawn(self._fail_over(call, error))
            return
        self._schedule()

    def _apply(self, call: _Call, response: Any) -> tuple[GenerationStats, list[int]]:
        """An answer's effect on the state -> (stats of applied verdicts, tokens they decided)."""
        if call.role is Role.DRAFTER:
            self.replicas.holds(call.address, call.context)
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
        self.replicas.holds(call.address, call.context + list(verdict.accepted_tokens))
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
        self.replicas.cancel_where(
            lambda call: (
                (call.block is not None and call.block.id in gone) or (restart and call.role is Role.DRAFTER)
            )
        )

    async def _fail_over(self, call: _Call, error: Any) -> None:
        await self.placer.recover_from(call.role, call.address, error)
        if call.role is Role.DRAFTER:
            self.placer.addresses.pop(Role.DRAFTER, None)
        self._schedule()


class _Replicas:
    """A DSI session's calls in flight and what each replica surely holds of its tokens: where
    the next call goes (`free_verifier`, `position`), sending it into its replica's next tick
    (`send`: its answer goes to `answered`), cancelling it. DsiRounds decides what to call."""

    def __init__(
        self, held: dict[str, list[int]], answered: Callable[[_Call, Any], None], event: Callable[..., None]
    ) -> None:
        self.held = held  # replica -> the tokens it surely holds
        # each call in flight -> its tick loop and item, or the task of its chunked prefill
        self.calls: dict[_Call, tuple[Any, Any] | asyncio.Task] = {}
        self.cooling: dict[str, float] = {}  # replica -> when it may be asked again
        self._answered, self._event = answered, event

    def in_flight(self, role: Role) -> int:
        return sum(1 for call in self.calls if call.role is role)

    def free_verifier(self, healthy: list[str], prefix: list[int], now: float) -> str | None:
        """A healthy verifier with no call of this session in flight; the one that already holds
        most of `prefix` first, then the highest address. The fixed order packs sessions onto the
        same verifiers, so their items share forwards that are nearly flat in rows; a spare one
        may get nothing. Spreading by load instead measured worse (bench mesh's stack, DSI 4x4 on
        four verifiers, 8 sessions: about 985 -> 900 tok/s, twice the ticks at half the items)."""
        busy = {c.address for c in self.calls}
        free = [a for a in healthy if a not in busy and self.cooled(a, now)]
        return max(free, key=lambda a: (_shared(self.held.get(a, []), prefix), a), default=None)

    def position(self, address: str, context: list[int]) -> int:
        """What `address` holds of `context`, less the last token (new tokens must not be empty:
        the last one gives the root distribution)."""
        position = min(_shared(self.held.get(address, []), context), len(context) - 1)
        self.held[address] = context[:position]  # all it surely holds until it answers
        return position

    def holds(self, address: str, tokens: list[int]) -> None:
        """It answered: it holds these tokens (a draft's context, a verification's accepted path)."""
        self.held[address] = tokens

    def forget(self, address: str) -> None:
        """It may hold nothing of the session (a resync, a failure): the next call sends everything."""
        self.held.pop(address, None)

    def cool(self, address: str, until: float) -> None:
        """It still runs a call of ours that it refused to replace (ABORTED): not before `until`."""
        self.cooling[address] = until

    def cooled(self, address: str, now: float) -> bool:
        return self.cooling.get(address, 0.0) <= now

    def lengths(self, committed: list[int]) -> dict[str, int]:
        """What each replica surely holds of the committed tokens (its speculation may differ)."""
        return {address: _shared(tokens, committed) for address, tokens in self.held.items()}

    def taken(self, call: _Call) -> bool:
        """Its answer came: whether it was still in flight (not cancelled)."""
        return self.calls.pop(call, None) is not None

    def chunk_tasks(self) -> list[asyncio.Task]:
        return [handle for handle in self.calls.values() if isinstance(handle, asyncio.Task)]

    def send(
        self, loop: Any, address: str, position: int, context: list[int], submit: Callable[..., Any],
        call: _Call,
    ) -> None:  # fmt: skip
        """submit(position, new tokens, limited=..., done=...): into the loop's next tick, its
        answer to `answered` (a DSI session's every call but its prompt's), or, where it would
        feed more than a tick's budget, `_chunked` as a task."""
        if not loop.needs_prefill(position, len(context)):
            done = functools.partial(self._answered, call)
            self.calls[call] = (loop, submit(position, context[position:], limited=None, done=done))
            return
        task = asyncio.ensure_future(self._chunked(loop, address, position, context, submit))
        self.calls[call] = task
        task.add_done_callback(functools.partial(self._chunks_done, call))

    def _chunks_done(self, call: _Call, task: asyncio.Task) -> None:
        if not task.cancelled():
            self._answered(call, task.exception() or task.result())

    async def _chunked(
        self, loop: Any, address: str, position: int, context: list[int], submit: Callable[..., Any]
    ) -> Any:
        """Where it would feed more than a tick's budget (the prompt, a replica that lost the
        session): limited, again from where the replica is after each chunk (what it holds from
        then on)."""
        since = time.perf_counter()
        while True:
            limited = since if loop.needs_prefill(position, len(context)) else None
            answer = await submit(position, context[position:], limited=limited)
            if not isinstance(answer, Prefilled):
                return answer
            if answer.held <= position:
                raise ItemError(grpc.StatusCode.INTERNAL, f"{loop.name}: a limited call fed nothing")
            position = answer.held
            self.held[address] = context[:position]

    def cancel_all(self) -> None:
        self.cancel_where(lambda call: True)

    def cancel_where(self, stale: Callable[[_Call], bool]) -> None:
        for call in [c for c in self.calls if stale(c)]:
            self.cancel(call)

    def cancel(self, call: _Call) -> None:
        """Its replica stops it (the tick loop cancels the item; its answer is never applied)."""
        handle = self.calls.pop(call, None)
        if handle is None:
            return
        self._event("call_cancelled", role=call.role.value, replica=call.address, block=_block_id(call))
        if isinstance(handle, asyncio.Task):
            handle.cancel()
        else:
            loop, work = handle
            loop.cancel(work)


def _block_id(call: _Call) -> int | None:
    return None if call.block is None else call.block.id


def _shared(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
