"""A tick loop's two clocks (specmesh/rpc/tick_client.py): when a tick that could go goes
(`TickHold`), and when a queued or sent item gives up (`ItemTimers`); and `LoopBound`, the event
loop an object of the round path runs on, looked up once.

Both only call back into the loop: `TickHold` calls its `flush` when a tick may go, `ItemTimers`
calls its `give_up` with an item and why. Neither knows what a tick holds.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

FLUSH_TURNS = 4  # event-loop turns a tick waits at most for more sessions to queue their work
# Turns a tick waits after answers that tasks await came in, grown or not: a session that awaits
# its answer's future (a task in asyncio.wait, DSI's) runs two turns after it is set, and queues its
# next item then. Sent before, the tick would leave without those sessions, and they and the ones in
# the tick would then take turns (two half-full ticks instead of one full one) for the rest of the
# run. Answers handed to callbacks (a gateway round's) queue the next item at once: no wait.
SETTLE_TURNS = 3
# A try's patience is at least this many of the replica's recent tick round trips (`TickLoop.pace`):
# an item waits for the tick in flight, then for its own, and a forward may carry another's chunk.
# A replica that is slow because the whole host is (replicas sharing cores, a long prefill beside)
# would be as slow after a move, which starts the session's prefill over; one that stops answering
# adds no round trips, and its items still leave after the floor that the caller's `Timing` sets.
PACE_TRIPS = 4


class LoopBound:
    """An object of the round path, bound to the event loop it first runs on. Python 3.11's
    asyncio.get_running_loop() makes a getpid() system call on every call (its fork check): by
    py-spy a tenth of the gateway's main thread at 32 sessions, where system calls are dear (this
    sandbox's). The loop is looked up once per object instead."""

    @functools.cached_property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()


@dataclass(frozen=True)
class Timing:
    """How long an item may take. deadline: the loop's time by which it fails (DEADLINE_EXCEEDED);
    patience: every such period without an answer, spare() is asked whether a spare replica could
    take it, and if so it fails (per_try), so that the caller moves it there. timeout: a limited
    item's deadline is this long from when it is sent (within `deadline`, then the client's), and
    so is its patience: its wait in the queue is for this loop's own budget (the oldest prefill is
    fed first), which no other replica would shorten; a prefill queued behind three others is not
    late, and its replica is not hung."""

    deadline: float | None = None
    patience: float | None = None
    spare: Callable[[], bool] = lambda: False
    timeout: float | None = None


class TickHold(LoopBound):
    """When a tick that could go goes. Sent at once, a tick would leave without the sessions
    that wake in the same turn; so `schedule` waits for the event-loop turn in which no more work
    was queued (every session woken together has queued its item), at most FLUSH_TURNS, and at
    least SETTLE_TURNS after answers that tasks await (`settle`). Then, while sessions the loop
    expects (`expect`: they queue here as soon as another replica answers them) have not come, a
    tick that could go waits for them, at most `max_hold` from when it could first have gone
    (`holds`), so that sessions in step stay in one tick instead of splitting into groups that
    take turns (continuous batching's straggler wait)."""

    def __init__(self, flush: Callable[[], None], queued: Callable[[], int], max_hold: float) -> None:
        self._flush, self._queued = flush, queued  # the loop's: send what may go; its queue's length
        self.max_hold = max_hold
        self._turn_at: asyncio.Handle | None = None
        self._turns = 0
        self._queued_at_check = 0
        self._settle_turns = 0  # the least turns the next flush waits (SETTLE_TURNS after answers)
        self._expected: dict[str, None] = {}  # sessions a tick waits for, in order
        self._since: float | None = None  # when a tick that could go began to wait
        self._timer: asyncio.TimerHandle | None = None

    @property
    def expected(self) -> int:
        return len(self._expected)

    def schedule(self, now: bool = False, settle: bool = False) -> None:
        """Flush after this turn's sessions have queued (now: at the next turn)."""
        if self._turn_at is None:
            self._turns, self._queued_at_check = 0, self._queued()
            self._turn_at = self.loop.call_soon(self._turn)
        if settle:
            self._settle_turns = SETTLE_TURNS
        if now:
            self._turns = FLUSH_TURNS

    def _turn(self) -> None:
        self._turn_at = None
        grew = self._queued() != self._queued_at_check
        if (grew or self._turns < self._settle_turns) and self._turns < FLUSH_TURNS:
            self._turns, self._queued_at_check = self._turns + 1, self._queued()
            self._turn_at = self.loop.call_soon(self._turn)
            return
        self._settle_turns = 0
        self._flush()

    def expect(self, session_id: str) -> None:
        self._expected[session_id] = None

    def unexpect(self, session_id: str) -> bool:
        """It will not come after all; True when it was the last one expected (the caller then
        flushes what it holds: nobody else will)."""
        return self._expected.pop(session_id, 0) is None and not self._expected

    def arrived(self, session_id: str) -> None:
        """The session queued its item: the last one waited for flushes at the next turn."""
        if self.unexpect(session_id):
            self.schedule(now=True)

    def holds(self) -> bool:
        """Whether a tick that could go waits for expected sessions: at most `max_hold` from when
        it could first have gone. A timer flushes then."""
        if not self._expected:
            self._since = None
            return False
        loop = self.loop
        if self._since is None:
            self._since = loop.time()
        until = self._since + self.max_hold
        if loop.time() >= until:
            self._since = None
            self._expected.clear()  # whoever has not come by now goes in a later tick
            return False
        if self._timer is None:
            self._timer = loop.call_at(until, self._held)
        return True

    def _held(self) -> None:
        self._timer = None
        self.schedule(now=True)

    def sent(self) -> float:
        """A tick went: how long it was held (seconds); the next one holds afresh."""
        held = 0.0 if self._since is None else self.loop.time() - self._since
        self._since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        return held

    def close(self) -> None:
        for handle in (self._turn_at, self._timer):
            if handle is not None:
                handle.cancel()


class ItemTimers(LoopBound):
    """Every queued or sent item's deadline and patience (its per-try timeout, `Timing`), on one
    timer at the earliest of them. An item is given up (`give_up(item, why, per_try)`) past its
    deadline, or past its patience while its caller has a spare replica to move it to; without
    one, a slow replica is better than none and it waits another period.

    Items are the loop's; this reads `timing`, `limited` and `settled`, and keeps `trying`, `due`
    and `deadline` on them."""

    def __init__(self, give_up: Callable[[Any, str, bool], None], pace: Callable[[], float]) -> None:
        self._give_up, self._pace = give_up, pace  # pace(): the replica's recent tick round trip
        self._timed: set[Any] = set()  # items with a deadline or a patience, unanswered
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    def watch(self, work: Any) -> None:
        """A queued item's deadline and patience start now (a limited item's patience: `sent`)."""
        timing = work.timing
        assert timing is not None
        now = self.loop.time()
        patient = timing.patience is not None and not work.limited
        work.trying = now
        work.due = now + self.patience(timing) if patient else float("inf")
        work.deadline = timing.deadline if timing.deadline is not None else float("inf")
        self._timed.add(work)
        self._arm(min(work.due, work.deadline))

    def sent(self, limited: Iterable[Any]) -> None:
        """Limited items just sent: their patience and timeout start now (Timing)."""
        now = self.loop.time()
        for work in limited:
            timing = work.timing
            if timing is None or work.settled:
                continue
            if timing.patience is not None:
                work.trying, work.due = now, now + self.patience(timing)
            if timing.timeout is not None:
                work.deadline = min(work.deadline, now + timing.timeout)
            self._arm(min(work.due, work.deadline))

    def discard(self, work: Any) -> None:
        self._timed.discard(work)

    def patience(self, timing: Timing) -> float:
        """An item's per-try timeout: its caller's, or PACE_TRIPS of the replica's recent round
        trips if that is longer (PACE_TRIPS)."""
        return max(timing.patience or 0.0, PACE_TRIPS * self._pace())

    def _arm(self, at: float) -> None:
        if at == float("inf") or (self._timer is not None and self._timer_at <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_at = self.loop.call_at(at, self._expire), at

    def _expire(self) -> None:
        self._timer = None
        now = self.loop.time()
        for work in list(self._timed):
            timing = work.timing
            if work.settled:
                self._timed.discard(work)
            elif now >= work.deadline:
                self._give_up(work, "no answer within the round's timeout", False)
            elif now >= work.due:
                patience = self.patience(timing)
                if now < work.trying + patience:  # the replica's pace slowed meanwhile
                    work.due = work.trying + patience
                elif timing.spare():
                    self._give_up(work, f"no answer within the per-try timeout of {patience:.2f} s", True)
                else:  # a slow replica is better than none: wait another period
                    work.trying, work.due = now, now + patience
        self._arm(min((min(w.due, w.deadline) for w in self._timed), default=float("inf")))

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
