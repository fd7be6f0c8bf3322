"""The small pieces of a model service on their own (specmesh/services/model_service.py): session
slots (`SessionSlots`), a tick's run and its withdrawal from a real ForwardBatcher over the model-less
TokenRunner (`TickRun`), what a Ticks stream knows of its handles and how a `cancel` reaches their
jobs (`TickStream`), `owner_hash` and `Resume`. The services end to end are tests/test_services.py's."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from specmesh.core.drafting import TreeSpec
from specmesh.core.sampling import SamplingParams
from specmesh.rpc import wire
from specmesh.rpc.ticks import Opened
from specmesh.runtime.backend import Step
from specmesh.runtime.rounds import Cancelled, DraftJob, VerifyJob, draft_steps
from specmesh.runtime.token_runner import TokenRunner
from specmesh.services.batching import BatchInfo, ForwardBatcher
from specmesh.services.config import BatchLimits
from specmesh.services.metrics import ServiceMetrics
from specmesh.services.model_service import (
    Resume,
    SessionBusyError,
    SessionSlots,
    TickRun,
    TickStream,
    drive,
    owner_hash,
)

VOCAB = 64


def verify_job(session_id: str) -> VerifyJob:
    return VerifyJob(session_id, [1], None, SamplingParams(), seed=0, committed_length=1)


def draft_job(session_id: str) -> DraftJob:
    return DraftJob(session_id, [1], TreeSpec(), SamplingParams(), seed=0, committed_length=1)


def on_batcher(test: Callable[[ForwardBatcher, TokenRunner], Awaitable[None]]) -> None:
    """Run `test` on a fresh loop with a batcher built as ModelService builds it (one model thread),
    over a TokenRunner: real forwards that compute nothing. A 60 s max wait: a group held back by
    a participant stays queued for the whole test."""

    async def go() -> None:
        runner, thread = TokenRunner(VOCAB), ThreadPoolExecutor(1, thread_name_prefix="model")
        try:
            await test(
                ForwardBatcher(runner, thread, BatchLimits(8, 64, 60.0), ServiceMetrics("tiny")), runner
            )
        finally:
            thread.shutdown()

    asyncio.run(go())


# ---- SessionSlots ------------------------------------------------------------------------------


def test_a_second_request_for_a_busy_session_is_refused_until_the_first_ends() -> None:
    forgotten: list[str] = []
    slots = SessionSlots(forgotten.append)
    slots.acquire("a")
    slots.acquire("b")  # another session is not held up
    with pytest.raises(SessionBusyError, match=r"^session_id: session 'a' already has a request"):
        slots.acquire("a")
    slots.free("a")
    slots.acquire("a")  # free again once the first request ended
    assert forgotten == []  # freeing is not forgetting


def test_release_of_an_idle_session_forgets_it_at_once() -> None:
    forgotten: list[str] = []
    slots = SessionSlots(forgotten.append)
    slots.release("never-seen")
    slots.acquire("a")
    slots.free("a")
    slots.release("a")
    assert forgotten == ["never-seen", "a"]


def test_release_of_a_busy_session_forgets_it_only_when_its_request_ends_and_once() -> None:
    forgotten: list[str] = []
    slots = SessionSlots(forgotten.append)
    slots.acquire("a")
    slots.release("a")
    slots.release("a")  # a second Release meanwhile: still one forget
    assert forgotten == []  # its request still runs on the session
    with pytest.raises(SessionBusyError):
        slots.acquire("a")  # still busy until its request ends
    slots.free("a")
    assert forgotten == ["a"]
    slots.acquire("a")  # the session made anew is not doomed by the old Release
    slots.free("a")
    assert forgotten == ["a"]


# ---- TickRun -----------------------------------------------------------------------------------


def test_a_tick_is_withdrawn_when_its_last_job_is_cancelled_before_its_first_forward() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        a, b = verify_job("a"), verify_job("b")
        tick = TickRun(batcher, [a, b])
        batcher.join()
        batcher.join()  # another participant's group is expected: this one waits in the queue
        tick.pending = pending = batcher.enqueue([Step("a", [1]), Step("b", [2])])
        tick.cancel(a)
        assert a.cancelled and not tick.withdrawn and not pending.done()  # b still wants it
        tick.cancel(b)
        assert b.cancelled and tick.withdrawn and pending.cancelled()
        batcher.leave()
        batcher.leave()  # the batcher would dispatch now: nothing is left to run
        await batcher.enqueue([Step("c", [1])])  # a later forward: the withdrawn group is not in it
        assert runner.stats["forwards"] == 1 and runner.committed_length("a") is None

    on_batcher(test)


def test_a_tick_is_not_withdrawn_once_a_forward_ran_and_its_next_group_still_runs() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        a, b = verify_job("a"), verify_job("b")
        tick = TickRun(batcher, [a, b])
        tick.pending = batcher.enqueue([Step("a", [1, 2]), Step("b", [3])])  # alone: dispatched at once
        _, info = await tick.pending
        tick.observe(info)
        batcher.join()
        batcher.join()
        tick.pending = pending = batcher.enqueue([Step("a", [4]), Step("b", [5])])
        tick.cancel_all()
        # the sessions changed already: taking the rest back would leave them half a step on
        assert a.cancelled and b.cancelled and not tick.withdrawn and not pending.done()
        batcher.leave()
        batcher.leave()
        await pending
        assert runner.stats["forwards"] == 2 and runner.committed_length("a") == 3

    on_batcher(test)


def test_a_forward_already_dispatched_is_not_taken_back_by_a_cancel() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        job = draft_job("a")
        tick = TickRun(batcher, [job])
        tick.pending = pending = batcher.enqueue([Step("a", [1, 2])])  # no participant: on the model thread
        tick.cancel_all()
        assert job.cancelled and not pending.cancelled()
        results, _ = await pending  # its forward ran and answers
        assert len(results) == 1 and runner.committed_length("a") == 2

    on_batcher(test)


def test_cancel_all_stops_every_job_and_withdraws_nothing_without_a_queued_group() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        jobs = [draft_job("a"), draft_job("b")]
        tick = TickRun(batcher, jobs)  # pending None: between forwards, or not begun
        tick.cancel_all()
        assert [j.cancelled for j in jobs] == [True, True] and not tick.withdrawn

    on_batcher(test)


def test_observe_counts_forwards_keeps_the_largest_batch_and_sums_the_seconds() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        tick = TickRun(batcher, [verify_job("a")])
        assert tick.stats == dict(batch_size=0, batch_tokens=0, forward_seconds=0.0, queue_seconds=0.0)
        tick.observe(BatchInfo(size=2, tokens=9, queue_seconds=0.25, forward_seconds=1.0))
        tick.observe(BatchInfo(size=5, tokens=4, queue_seconds=0.5, forward_seconds=2.0))
        assert tick.groups == 2
        assert tick.stats == dict(batch_size=5, batch_tokens=9, forward_seconds=3.0, queue_seconds=0.75)

    on_batcher(test)


# ---- TickStream --------------------------------------------------------------------------------


def test_a_streams_handles_open_refuse_and_close() -> None:
    stream, opened = TickStream(), Opened("s", "key", SamplingParams())
    bad = wire.WireError("open.session_id", "must not be empty")
    stream.open(1, opened)
    stream.refuse(2, bad)
    assert stream.session(1) is opened
    with pytest.raises(wire.WireError) as refused:
        stream.session(2)
    assert refused.value is bad  # the open's own error, for each of the handle's items
    with pytest.raises(wire.WireError, match=r"^handles: handle 3 was never opened"):
        stream.session(3)
    assert stream.close(1) is opened and stream.close(1) is None
    assert stream.close(2) is None  # a refused handle has no session to release
    with pytest.raises(wire.WireError, match="never opened"):
        stream.session(2)


def test_a_cancel_stops_the_job_of_its_handle_only() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        stream = TickStream()
        handles = [10, 11, 12]
        start = stream.track(handles, where=[0, 2])  # item 1 (handle 11) failed before it ran
        first, second = verify_job("a"), verify_job("c")
        start([(0, first), (1, second)], TickRun(batcher, [first, second]))  # k indexes `where`
        stream.cancel(11)
        assert not first.cancelled and not second.cancelled
        stream.cancel(12)
        assert second.cancelled and not first.cancelled

    on_batcher(test)


def test_a_cancel_that_comes_while_the_item_waits_stops_its_job_when_it_starts() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        stream = TickStream()
        start = stream.track([5, 6], where=[0, 1])
        stream.cancel(5)  # no job yet: it waits for a grammar, or for the step run ahead of it
        waiting, other = draft_job("a"), draft_job("b")
        start([(0, waiting), (1, other)], TickRun(batcher, [waiting, other]))
        assert waiting.cancelled and not other.cancelled
        stream.answered(5)
        stream.answered(6)
        again = draft_job("a")  # the handle's next item is not cancelled by the old cancel
        stream.track([5], where=[0])([(0, again)], TickRun(batcher, [again]))
        assert not again.cancelled

    on_batcher(test)


def test_a_cancel_after_the_answer_or_before_any_item_is_dropped() -> None:
    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        stream = TickStream()
        stream.cancel(5)  # nothing in flight for the handle: not kept for a later item
        done = verify_job("a")
        stream.track([5], where=[0])([(0, done)], TickRun(batcher, [done]))
        assert not done.cancelled
        stream.answered(5)
        stream.cancel(5)  # its item is answered: the cancel is for neither it nor the next item
        following = verify_job("a")
        stream.track([5], where=[0])([(0, following)], TickRun(batcher, [following]))
        assert not done.cancelled and not following.cancelled
        stream.answered(5)
        # an item answered (failed) before its job started: a cancel that waited for it, or one
        # that comes after its answer, is not for the handle's next item
        for early in (True, False):
            stream.track([5], where=[0])
            if early:
                stream.cancel(5)
            stream.answered(5)
            if not early:
                stream.cancel(5)
            later = verify_job("a")
            stream.track([5], where=[0])([(0, later)], TickRun(batcher, [later]))
            assert not later.cancelled, early
            stream.answered(5)

    on_batcher(test)


# ---- owner_hash, Resume ------------------------------------------------------------------------


def test_owner_hash_keeps_the_keys_sha256_not_the_key() -> None:
    assert owner_hash("secret") == hashlib.sha256(b"secret").digest()
    assert owner_hash("secret") != owner_hash("secret2") and b"secret" not in owner_hash("secret")
    assert owner_hash("") == hashlib.sha256(b"").digest()  # a key-less session's hash, as Release sends


def test_resume_has_the_three_ways_a_request_takes_up_its_session() -> None:
    assert {r.value: r for r in Resume} == {
        "restart": Resume.RESTART,
        "continue": Resume.CONTINUE,
        "rollback": Resume.ROLLBACK,
    }


# ---- drive -------------------------------------------------------------------------------------


def test_a_tick_whose_jobs_were_all_cancelled_before_it_began_ends_without_a_forward() -> None:
    """A stream's cancel that comes while a drafter tick's items wait (for a grammar, or for a
    superseded draft to stop) cancels their jobs before `drive` starts; the draft protocol then
    ends before its first forward. `drive` raised "coroutine raised StopIteration" there, which
    ended the whole Ticks stream; now the jobs end Cancelled and the tick leaves no participant."""

    async def test(batcher: ForwardBatcher, runner: TokenRunner) -> None:
        jobs = [draft_job("a"), draft_job("b")]
        tick = TickRun(batcher, jobs)
        tick.cancel_all()
        outcomes = await drive(batcher, tick, draft_steps(jobs), {})
        assert [type(o.error) for o in outcomes] == [Cancelled, Cancelled]
        assert tick.groups == 0 and runner.committed_tokens("a") is None
        # a participant left behind would hold the next tick's forward for the max wait (60 s)
        batcher.join()
        async with asyncio.timeout(5):
            await batcher.enqueue([Step("c", new_tokens=[1])])
        batcher.leave()
        assert runner.committed_tokens("c") == [1]

    on_batcher(test)
