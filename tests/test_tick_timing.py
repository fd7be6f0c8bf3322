"""A tick loop's two clocks on their own (specmesh/rpc/tick_timing.py), on a real event loop:
when a tick that could go goes (TickHold), and when an item gives up (ItemTimers). The whole
loop, against real replicas: tests/test_services.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

import pytest

from specmesh.rpc.tick_timing import FLUSH_TURNS, SETTLE_TURNS, ItemTimers, LoopBound, TickHold, Timing


def on_a_loop(test: Callable[[], Coroutine]) -> Callable[[], None]:
    """The test, run on an event loop of its own."""
    return lambda: asyncio.run(test())


class _Loop:
    """What a TickHold calls back: a queue's length, and each flush with the turn it came in."""

    def __init__(self, max_hold: float = 0.05) -> None:
        self.queued, self.flushes, self.turn = 0, [], 0
        self.hold = TickHold(lambda: self.flushes.append(self.turn), lambda: self.queued, max_hold)

    async def run(self, turns: int, grow: int = 0) -> None:
        """`turns` event-loop turns; the queue grows by one in each of the first `grow`."""
        for t in range(turns):
            self.turn = t
            if t < grow:
                self.queued += 1
            await asyncio.sleep(0)


@on_a_loop
async def test_a_tick_goes_after_the_turn_in_which_nothing_more_was_queued() -> None:
    loop = _Loop()
    loop.hold.schedule()
    await loop.run(8)
    assert loop.flushes == [0]  # nothing grew: the first turn

    loop = _Loop()
    loop.hold.schedule()
    await loop.run(8, grow=2)
    assert loop.flushes == [2]  # it waited out the two turns in which sessions queued


@on_a_loop
async def test_a_queue_that_keeps_growing_waits_at_most_flush_turns() -> None:
    loop = _Loop()
    loop.hold.schedule()
    await loop.run(12, grow=12)
    assert loop.flushes == [FLUSH_TURNS]  # rechecked FLUSH_TURNS times after the first


@on_a_loop
async def test_after_awaited_answers_a_tick_settles_for_their_tasks_and_now_goes_at_once() -> None:
    loop = _Loop()
    loop.hold.schedule(settle=True)
    await loop.run(8)
    assert loop.flushes == [SETTLE_TURNS]  # turns for an awaiting task to wake and queue
    loop = _Loop()
    loop.hold.schedule(now=True)
    await loop.run(8, grow=8)
    assert loop.flushes == [0]


@on_a_loop
async def test_a_tick_that_could_go_holds_for_expected_sessions_at_most_max_hold() -> None:
    loop = _Loop(max_hold=0.05)
    loop.hold.expect("a")
    assert loop.hold.holds()  # a tick that could go waits for "a"
    await asyncio.sleep(0.08)  # "a" never came: the hold's timer flushed
    assert loop.flushes
    assert not loop.hold.holds()  # and the hold is over: whoever had not come goes later
    assert loop.hold.expected == 0


@on_a_loop
async def test_the_last_expected_session_to_arrive_flushes_at_the_next_turn() -> None:
    loop = _Loop(max_hold=10.0)
    loop.hold.expect("a")
    loop.hold.expect("b")
    assert loop.hold.holds()
    loop.hold.arrived("a")
    await loop.run(3)
    assert loop.flushes == []  # still waiting for "b"
    loop.hold.arrived("b")
    await loop.run(3, grow=3)
    assert loop.flushes == [0]  # now: not even the growing queue delays it
    assert 0.0 <= loop.hold.sent() < 1.0 and not loop.hold.holds()
    assert not loop.hold.unexpect("c")  # never expected
    loop.hold.expect("d")
    assert loop.hold.unexpect("d")  # the last one: the caller flushes if it has work
    loop.hold.close()


@dataclass(eq=False)
class _Item:
    timing: Timing
    limited: bool = False
    settled: bool = False
    trying: float = 0.0
    due: float = 0.0
    deadline: float = 0.0
    gave_up: list = field(default_factory=list)


def _timers(pace: float = 0.0) -> tuple[ItemTimers, list]:
    given: list = []

    def give_up(item: _Item, why: str, per_try: bool) -> None:
        item.settled = True
        given.append((item, why, per_try))

    return ItemTimers(give_up, lambda: pace), given


@on_a_loop
async def test_an_item_past_its_deadline_gives_up_and_not_as_a_try() -> None:
    timers, given = _timers()
    item = _Item(Timing(deadline=asyncio.get_running_loop().time() + 0.03))
    timers.watch(item)
    await asyncio.sleep(0.06)
    assert [(why, per_try) for _, why, per_try in given] == [("no answer within the round's timeout", False)]


@on_a_loop
async def test_past_its_patience_an_item_moves_only_when_a_spare_replica_is_there() -> None:
    spare = False
    timers, given = _timers()
    item = _Item(Timing(patience=0.02, spare=lambda: spare))
    timers.watch(item)
    await asyncio.sleep(0.05)
    assert given == [] and item.due > item.trying  # no spare: it waits another period
    spare = True
    await asyncio.sleep(0.05)
    assert len(given) == 1 and given[0][2] and "per-try timeout of 0.02 s" in given[0][1]


@on_a_loop
async def test_a_slow_replica_s_pace_lengthens_the_patience() -> None:
    timers, given = _timers(pace=0.05)  # 4 round trips: 0.2 s
    assert timers.patience(Timing(patience=0.02)) == 0.2
    item = _Item(Timing(patience=0.02, spare=lambda: True))
    timers.watch(item)
    await asyncio.sleep(0.06)
    assert given == []
    timers.close()


@on_a_loop
async def test_a_limited_item_s_patience_and_timeout_run_from_its_send() -> None:
    timers, given = _timers()
    item = _Item(Timing(patience=0.02, spare=lambda: True, timeout=0.5), limited=True)
    timers.watch(item)
    await asyncio.sleep(0.05)
    assert given == []  # queued for this loop's own budget: not late
    timers.sent([item])
    assert item.deadline <= asyncio.get_running_loop().time() + 0.5
    await asyncio.sleep(0.05)
    assert len(given) == 1 and given[0][2]


def test_a_loop_bound_object_keeps_the_loop_it_first_ran_on() -> None:
    """`LoopBound.loop` is looked up once (3.11's get_running_loop makes a system call each time),
    so it must be the loop the object runs on, per object: one made in another run gets its own."""

    class Clock(LoopBound):
        pass

    async def first_look(clock: Clock) -> tuple[asyncio.AbstractEventLoop, asyncio.AbstractEventLoop]:
        return clock.loop, asyncio.get_running_loop()

    a, b = Clock(), Clock()
    bound, running = asyncio.run(first_look(a))
    assert bound is running
    again, other = asyncio.run(first_look(b))
    assert again is other and again is not bound
    with pytest.raises(RuntimeError):  # outside a running loop nothing is bound
        _ = Clock().loop
