"""Run-ahead: a plain run's next step, run while the answer of its call travels (docs/services.md,
"Run-ahead: the next plain step while the answer travels"; docs/decisions.md, "Run-ahead").

When a tick's plain runs (calls of 2+ steps) end, their sessions' next steps start as one run
before the answers are built, so the model decodes while the answers travel and the callers
decide their next rounds. The next call of such a session takes its step if it goes on from it
(specmesh.core.ahead.goes_on, the rule pipelined pre-drafts share); any other call rolls it back
as any speculation (Resume.ROLLBACK).

A step ahead is running while `RunAhead` holds it; what became of it when the next call came is
one `AheadState`, which the `specmesh:verifier_ahead_steps` counter reports (taken, discarded).
A step taken back before any call came (`drop`) is only cancelled.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from specmesh.core.ahead import goes_on
from specmesh.core.rides import RideSizer
from specmesh.rpc import wire
from specmesh.runtime.rounds import Cancelled, VerifyJob, VerifyOutcome, next_plain_job, verify_steps
from specmesh.services.model_service import ModelService, NotOwnerError, SessionBusyError, TickRun, Withdrawn


class AheadState(Enum):
    """What became of a step ahead when the session's next call came (`RunAhead.take`)."""

    TAKEN = "taken"  # the next call went on from it: the call's first step
    DISCARDED = "discarded"  # the next call did not go on from it, or had no room for its tokens
    LOST = "lost"  # its run failed, or it was withdrawn before its forward: the call begins afresh

    @property
    def counted(self) -> bool:
        """Reported by the counter: what became of a step the next call found."""
        return self in (AheadState.TAKEN, AheadState.DISCARDED)


@dataclass
class StepAhead:
    """A session's step run ahead: the call it expects next (its plain_steps and max_tokens
    aside), its job, and the run (one for a tick's sessions) that holds its outcome."""

    expects: wire.VerifyInput
    job: VerifyJob
    tick: TickRun
    run: asyncio.Future  # -> the run's outcomes, one per job
    index: int  # this job's among them


Taken = tuple[StepAhead, VerifyOutcome]  # a step the call goes on from, and its outcome


class RunAhead:
    """The verifier's steps ahead, by session. Loop thread only."""

    def __init__(self, service: ModelService, rides: RideSizer, counter: Any) -> None:
        self._service, self._rides = service, rides
        self._counter = counter  # specmesh:verifier_ahead_steps, by outcome
        self._steps: dict[str, StepAhead] = {}

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._steps

    async def start(self, calls: Sequence[tuple[wire.VerifyInput, VerifyJob, VerifyOutcome]]) -> None:
        """Start the next step of every call (call, its job, its outcome) whose plain run goes
        on, one run for all of them; returns once the run's first turn has queued its forward."""
        service, runner = self._service, self._service.runner
        aheads = []
        for v, job, outcome in calls:
            step = next_plain_job(job, outcome)
            if step is None or not service.holds(v.session_id):  # ended, or released meanwhile
                continue
            if runner.committed_length(v.session_id) != step.committed_length - 1:
                continue  # the session is not where this call left it (a second call for it)
            try:  # held while it runs: a stray second call for the session gets ABORTED, as always
                service.slots.acquire(v.session_id)
            except SessionBusyError:
                continue
            expects = replace(v, position=step.committed_length - 1, new_tokens=list(step.new_tokens))
            aheads.append((expects, step))
        if not aheads:
            return
        jobs = [step for _, step in aheads]
        tick = TickRun(service.batcher, jobs)
        before = {job.session_id: functools.partial(_still_wanted, job) for job in jobs}
        ticked = verify_steps(jobs, runner.commit, self._rides)
        # no caller to go away (run_tick's concern): its own task, whose first turn queues the
        # forward; yielding once lets that turn come before the answers are built (~1-3 ms of the
        # model's time a call, measured in docs/decisions.md, "Run-ahead")
        run = asyncio.ensure_future(service.drive(tick, ticked, before))
        run.add_done_callback(functools.partial(self._done, jobs))  # before any taker resumes
        for i, (expects, job) in enumerate(aheads):
            self._steps[job.session_id] = StepAhead(expects, job, tick, run, i)
        await asyncio.sleep(0)

    def _done(self, jobs: Sequence[VerifyJob], run: asyncio.Future) -> None:
        """Free the run's sessions (a Release that came meanwhile happens now); its failure is
        the next call's to handle (`take`), not the loop's to log."""
        if not run.cancelled():
            run.exception()
        for job in jobs:
            self._service.slots.free(job.session_id)

    async def take_many(self, calls: Sequence[tuple[wire.VerifyInput, bytes]]) -> list[Taken | None]:
        """`take` for each (call, its caller's key hash); only sessions with a step ahead wait."""
        taken: list[Taken | None] = [None] * len(calls)
        waits = [(k, self.take(v, owner)) for k, (v, owner) in enumerate(calls) if v.session_id in self]
        for (k, _), took in zip(waits, await asyncio.gather(*(w for _, w in waits)), strict=True):
            taken[k] = took
        return taken

    async def take(self, v: wire.VerifyInput, owner: bytes) -> Taken | None:
        """The step run ahead of call v and its outcome, if v goes on from it. Else None: the
        call begins as if nothing ran ahead. A call of another caller leaves the step alone."""
        prior = self._steps.get(v.session_id)
        if prior is None:
            return None
        try:
            self._service.check_owner(v.session_id, owner)
        except NotOwnerError:
            return None
        del self._steps[v.session_id]
        wanted = goes_on(prior.expects, v)
        if not wanted:
            prior.tick.cancel(prior.job)  # not started yet: it never will
        # else it runs even if the call came before its forward started: the call's first step
        # then rides as the step it expected, whatever the timing (a seed's stats are the tokens')
        first = await self._outcome(prior, v.session_id)
        state = _settled(v, wanted, first)
        if state.counted:
            self._counter.labels(state.value).inc()
        return (prior, first) if first is not None and state is AheadState.TAKEN else None

    async def _outcome(self, prior: StepAhead, session_id: str) -> VerifyOutcome | None:
        """The step's outcome, or None if it did not run to one (what it left of the session is
        then unknown, and forgotten, unless it was only cancelled)."""
        try:
            first = (await asyncio.shield(prior.run))[prior.index]
        except Withdrawn:
            return None
        except Exception:  # the run failed
            self._service.forget(session_id, keep=False)
            return None
        if first.error is not None:
            if not isinstance(first.error, Cancelled):
                self._service.forget(session_id, keep=False)
            return None
        return first

    def drop(self, session_id: str) -> None:
        """The session's step ahead, taken back (released, or gone to another caller)."""
        prior = self._steps.pop(session_id, None)
        if prior is not None:
            prior.tick.cancel(prior.job)

    async def close(self) -> None:
        runs = {id(prior.run): prior.run for prior in self._steps.values()}
        for session_id in list(self._steps):
            self.drop(session_id)
        await asyncio.gather(*runs.values(), return_exceptions=True)


def after_step(v: wire.VerifyInput, first: VerifyOutcome, job: VerifyJob) -> tuple[wire.VerifyInput, bool]:
    """Call v as it stands after the step run ahead of it (`job`, its outcome `first`): fed first's
    last token where the runner now is, with the rest of its steps and max_tokens; and whether
    that step ended the call (its steps, its max_tokens, or the run: a stop token, no room)."""
    assert first.verdict is not None
    steps = v.plain_steps - first.steps
    left = v.max_tokens - first.emitted if v.max_tokens else None
    done = steps < 1 or left == 0 or next_plain_job(job, first) is None
    rest = replace(
        v, position=v.position + first.emitted, new_tokens=[first.verdict.next_token],
        plain_steps=max(steps, 1), max_tokens=left or 0,
    )  # fmt: skip
    return rest, done


def _settled(v: wire.VerifyInput, wanted: bool, first: VerifyOutcome | None) -> AheadState:
    """What became of a step ahead that call v found: v `wanted` it (goes_on) and it ran to
    `first` (None: it did not)."""
    if first is None:
        return AheadState.LOST
    room = not v.max_tokens or first.emitted <= v.max_tokens  # for the step's tokens
    return AheadState.TAKEN if wanted and room else AheadState.DISCARDED


def _still_wanted(job: VerifyJob) -> None:
    """A step's `before`, on the model thread: a step taken back (its call went elsewhere, or
    the session was released) stays out of the forward."""
    if job.cancelled:
        raise Cancelled("taken back before its forward")
