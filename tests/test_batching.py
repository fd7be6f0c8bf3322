"""The ForwardBatcher's rules on their own (specmesh/services/batching.py): which queued step groups
make one runner forward and in which order, the limits (--max-batch-size, --max-batch-tokens,
--max-wait-ms), participants (join / leave), withdraw, and the `before` / `finish` callbacks on the
model thread. On a real event loop and model thread, with the n-gram backend's TokenRunner (it
computes nothing: a step's result has one row per fed position, which says which step it was)."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh.runtime.backend import Step, UnknownSessionError
from specmesh.runtime.token_runner import TokenRunner
from specmesh.services.batching import BatchInfo, ForwardBatcher, More
from specmesh.services.config import BatchLimits, ForwardFloor
from specmesh.services.metrics import ServiceMetrics


class Recorder(TokenRunner):
    """The TokenRunner, also noting the sessions of every forward it is called with."""

    def __init__(self) -> None:
        super().__init__(vocab_size=32)
        self.calls: list[list[str]] = []

    def forward(self, steps: list[Step]):
        self.calls.append([st.session_id for st in steps])
        return super().forward(steps)


class Gate:
    """A `before` hook that holds the model thread in a forward until opened: groups enqueued
    meanwhile queue behind it, as under load."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def hold(self) -> None:
        assert self.event.wait(5), "the gate was never opened"

    def open(self) -> None:
        self.event.set()


def step(session: str, nodes: int = 0, token: int = 1) -> Step:
    """A session's step of one new token and a chain of `nodes` nodes: 1 + nodes rows."""
    return Step(session, [token], [2] * nodes, list(range(-1, nodes - 1)))


def rows(results: list) -> list[int]:
    return [r.shape[0] for r in results]


def run(body, size: int = 64, tokens: int = 1024, wait: float = 60.0, floor=ForwardFloor()) -> None:  # noqa: B008
    """body(batcher, runner, model_thread) on a fresh loop. The default wait is long: a group that
    waits for it makes the test time out (5 s), so that waiting at all is what fails."""

    async def go() -> None:
        thread = ThreadPoolExecutor(1, thread_name_prefix="model")
        try:
            runner, limits = Recorder(), BatchLimits(size, tokens, wait)
            batcher = ForwardBatcher(runner, thread, limits, ServiceMetrics("t"), floor)
            async with asyncio.timeout(5):
                await body(batcher, runner, thread)
        finally:
            thread.shutdown()

    asyncio.run(go())


def test_a_lone_group_runs_at_once_when_no_participant_is_expected() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        results, info = await b.enqueue([step("a", 1), step("b", 2)])
        assert runner.calls == [["a", "b"]]
        assert rows(results) == [2, 3]  # each step's own rows, in the group's order
        assert (info.size, info.tokens) == (2, 5) and info.queue_seconds < 1  # not the 60 s window
        assert runner.committed_tokens("a") == [1]

    run(body)


def test_groups_queued_during_a_forward_make_the_next_forward_in_arrival_order() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()
        first = b.enqueue([step("a")], before={"a": gate.hold})  # the model is busy with it
        second = b.enqueue([step("b", 1), step("c", 2)])
        third = b.enqueue([step("d", 3)])
        gate.open()
        (ra, ia), (rb, ib), (rd, id_) = await asyncio.gather(first, second, third)
        assert runner.calls == [["a"], ["b", "c", "d"]]
        assert (rows(ra), rows(rb), rows(rd)) == ([1], [2, 3], [4])  # each caller gets its own steps
        assert ia.size == 1 and ib == BatchInfo(3, 9, ib.queue_seconds, ib.forward_seconds) and id_.size == 3

    run(body)


def test_a_group_that_does_not_fit_waits_and_no_later_group_jumps_ahead_of_it() -> None:
    """Size 3: after b1 b2, c1 c2 do not fit; d would, but goes after c (arrival order)."""

    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()
        first = b.enqueue([step("a")], before={"a": gate.hold})
        groups = [b.enqueue([step("b1"), step("b2")]), b.enqueue([step("c1"), step("c2")])]
        groups.append(b.enqueue([step("d")]))
        gate.open()
        await first
        infos = [info for _, info in await asyncio.gather(*groups)]
        assert runner.calls == [["a"], ["b1", "b2"], ["c1", "c2", "d"]]
        assert [i.size for i in infos] == [2, 3, 3]

    run(body, size=3)


def test_the_token_limit_cuts_batches_between_groups() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()
        first = b.enqueue([step("a")], before={"a": gate.hold})
        groups = [b.enqueue([step("b", 2)]), b.enqueue([step("c", 2)]), b.enqueue([step("d")])]
        gate.open()
        await first
        infos = [info for _, info in await asyncio.gather(*groups)]
        assert runner.calls == [["a"], ["b"], ["c", "d"]]  # 3 + 3 rows > 5; 3 + 1 fit
        assert [(i.size, i.tokens) for i in infos] == [(1, 3), (2, 4), (2, 4)]

    run(body, tokens=5)


@pytest.mark.parametrize(
    ("size", "tokens", "nodes", "forwards"),
    [
        (2, 1024, [0, 0, 0, 0, 0], [["s0", "s1"], ["s2", "s3"], ["s4"]]),
        # rows 3 1 6 2 within 4 tokens: a step over the limit runs alone, not refused
        (64, 4, [2, 0, 5, 1], [["s0", "s1"], ["s2"], ["s3"]]),
    ],
)
def test_a_group_over_the_limits_runs_whole_as_several_forwards(size, tokens, nodes, forwards) -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        results, info = await b.enqueue([step(f"s{i}", n) for i, n in enumerate(nodes)])
        assert runner.calls == forwards
        assert rows(results) == [n + 1 for n in nodes]  # all its results, in its order
        assert info.size == max(map(len, forwards))  # the largest of its forwards

    run(body, size=size, tokens=tokens)


def test_a_group_waits_for_a_participant_that_has_not_asked_yet() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        b.join()
        b.join()
        first = b.enqueue([step("a")])
        await asyncio.sleep(0.05)  # time enough for a batcher that does not wait to run it
        assert not first.done() and runner.calls == []
        second = b.enqueue([step("b")])
        await asyncio.gather(first, second)
        assert runner.calls == [["a", "b"]]

    run(body)


def test_a_full_batch_does_not_wait_for_participants() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        for _ in range(3):
            b.join()
        await b.enqueue([step("a"), step("b")])
        assert runner.calls == [["a", "b"]]

    run(body, size=2)


def test_max_wait_bounds_the_wait_for_a_participant_that_does_not_come() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        b.join()
        b.join()
        _, info = await b.enqueue([step("a")])
        assert runner.calls == [["a"]]
        assert info.queue_seconds >= 0.1 - 1e-6  # it waited the whole window, not less

    run(body, wait=0.1)


def test_a_leaving_participant_releases_the_group_waiting_for_it() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        b.join()
        b.join()
        first = b.enqueue([step("a")])
        await asyncio.sleep(0.05)
        assert not first.done()
        b.leave()  # the other tick ended: nothing to wait for (the 60 s window would time out)
        await first
        assert runner.calls == [["a"]]

    run(body)


def test_the_wait_for_participants_restarts_when_the_model_becomes_idle() -> None:
    """b queued during a's forward, which outlasts the window: b still gets a whole window after
    it, counted from the end of that forward, not from when b came."""

    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        loop, gate = asyncio.get_running_loop(), Gate()
        first = b.enqueue([step("a")], before={"a": gate.hold})  # no participant yet: it runs
        b.join()
        b.join()
        second = b.enqueue([step("b")])
        queued = loop.time()  # >= b's queued_at
        await asyncio.sleep(0.2)
        opened = loop.time()  # a's forward ends after this
        gate.open()
        await first
        _, info = await second
        assert runner.calls == [["a"], ["b"]]
        assert info.queue_seconds >= opened - queued + 0.1 - 1e-6

    run(body, wait=0.1)


def test_a_withdrawn_group_never_reaches_the_model_and_a_started_one_cannot_be_withdrawn() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate, hooked = Gate(), []
        first = b.enqueue([step("a")], before={"a": gate.hold})
        second = b.enqueue([step("b")], before={"b": lambda: hooked.append("b")})
        third = b.enqueue([step("c")])
        b.withdraw(second)
        b.withdraw(first)  # its forward has started: taking it back does nothing
        gate.open()
        (ra, _), (rc, _) = await asyncio.gather(first, third)
        assert second.cancelled() and hooked == []
        assert runner.calls == [["a"], ["c"]] and runner.committed_tokens("b") is None
        assert rows(ra) == rows(rc) == [1]

    run(body)


def test_before_runs_on_the_model_thread_before_the_forward_and_a_failing_one_fails_its_step_alone() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        seen = []

        def note() -> None:  # a's session is not fed yet when its hook runs
            seen.append((threading.get_ident(), runner.committed_tokens("a")))

        def boom() -> None:
            raise ValueError("b cannot start")

        results, info = await b.enqueue([step("a"), step("b"), step("c", 1)], before={"a": note, "b": boom})
        assert seen == [(seen[0][0], None)] and seen[0][0] != threading.get_ident()
        assert runner.calls == [["a", "c"]] and info.size == 2  # b stayed out of the forward
        assert rows([results[0], results[2]]) == [1, 2] and isinstance(results[1], ValueError)
        assert "b" not in runner.sessions()

    run(body)


def test_finish_runs_on_the_model_thread_after_its_forward_and_its_value_is_what_the_caller_gets() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()

        def finish(results: list) -> tuple:
            return threading.get_ident(), rows(results), runner.committed_tokens("b")

        def boom(results: list) -> None:
            raise ValueError("c's verification failed")

        first = b.enqueue([step("a")], before={"a": gate.hold})
        second = b.enqueue([step("b", 1)], finish=finish)
        third = b.enqueue([step("c")], finish=boom)
        fourth = b.enqueue([step("d")])
        gate.open()
        await first
        (thread, got, fed), _ = await second
        assert thread != threading.get_ident() and got == [2] and fed == [1]  # after its forward
        with pytest.raises(ValueError, match="verification failed"):
            await third
        assert rows((await fourth)[0]) == [1]  # the same forward's other groups are unharmed
        assert runner.calls == [["a"], ["b", "c", "d"]]

    run(body)


def test_a_lone_tick_goes_on_with_its_next_forwards_on_the_model_thread() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        fed = iter([2, 3])

        def finish(results: list):
            token = next(fed, None)
            return "done" if token is None else More([step("a", token=token)])

        b.join()  # the tick itself: the only participant
        result, info = await b.enqueue([step("a")], finish=finish)
        b.leave()
        assert result == "done"  # the loop never saw the two More
        assert runner.calls == [["a"]] * 3 and runner.committed_tokens("a") == [1, 2, 3]
        assert info.size == 1

    run(body)


@pytest.mark.parametrize("other", ["queued group", "participant"])
def test_finish_asking_for_more_goes_back_to_the_loop_when_another_tick_is_there(other: str) -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()
        more = More([step("a", token=2)])
        first = b.enqueue([step("a")], before={"a": gate.hold}, finish=lambda _: more)
        if other == "queued group":
            others = [b.enqueue([step("b")])]
        else:  # a tick that is still sampling its level: it will ask soon
            b.join()
            b.join()
            others = []
        gate.open()
        result, _ = await first
        assert result is more  # its next step is the caller's, to merge with the other tick's
        await asyncio.gather(*others)
        assert runner.calls == [["a"], ["b"]] if others else [["a"]]  # a's next step did not run

    run(body)


def test_a_failed_batched_forward_runs_its_steps_one_by_one() -> None:
    """A step of an unknown session fails the runner's whole call: each step then runs alone, and
    only that step gets the error, as its result (the group's future does not fail)."""

    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        gate = Gate()
        first = b.enqueue([step("x")], before={"x": gate.hold})
        second = b.enqueue([step("a"), Step("ghost"), step("c", 1)])
        third = b.enqueue([step("d")])
        gate.open()
        await first
        (results, _), (rd, _) = await asyncio.gather(second, third)
        assert runner.calls == [["x"], ["a", "ghost", "c", "d"], ["a"], ["ghost"], ["c"], ["d"]]
        assert isinstance(results[1], UnknownSessionError)
        assert rows([results[0], results[2]]) == [1, 2] and rows(rd) == [1]

    run(body)


def test_a_group_the_stopped_model_thread_never_ran_fails() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, thread: ThreadPoolExecutor) -> None:
        gate = Gate()
        thread.submit(gate.hold)  # the model thread is busy; the group's forward queues behind
        pending = b.enqueue([step("a")])
        thread.shutdown(wait=False, cancel_futures=True)
        gate.open()
        with pytest.raises(RuntimeError, match="model thread stopped"):
            await pending
        assert runner.calls == []

    run(body)


def test_the_forward_floor_makes_a_forward_last_at_least_its_cost() -> None:
    async def body(b: ForwardBatcher, runner: Recorder, _) -> None:
        _, info = await b.enqueue([step("a", 2), step("b")])
        assert info.forward_seconds >= 0.02 + 0.01 * 4 - 1e-4  # 4 rows; a lower bound only

    run(body, floor=ForwardFloor(fixed=0.02, per_row=0.01))
