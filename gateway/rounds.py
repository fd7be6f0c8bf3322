"""A session's serial rounds (`SerialRounds`): one `RoundClient` round after another, each
committed to Redis, driven by the rounds' answers.

Rounds run back to back, driven by their answers (callbacks, not a coroutine per round): the
next round is queued on its replica's tick loop right where this one's verdict is read, and this
one's commit goes to Redis beside it (docs/decisions.md). What the client gets are the committed
rounds, in order, through `step`. The chain's state is one `Stage`. A failure takes the slow
path: a task that recovers (failover through the `Placer`, a stale commit) and launches the round
again.

    rounds = SerialRounds(RunParts(env, plan, client, transcript, placer))
    while not transcript.finished:
        piece = await rounds.step()          # one committed round

Each round runs `RoundClient.start` (specmesh/rpc/round_client.py, the one round implementation)
on the committed tokens with the placer's `Placement`, and commits through the `Transcript`.
Only a committed round is handed out, so the client sees exactly the tokens in Redis.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from enum import Enum
from typing import Any

import grpc
from opentelemetry import trace

from gateway.env import GatewayEnv, GatewayError, Handout, Piece, SlowPaths
from gateway.placement import Placer
from gateway.requests import GenerationPlan
from gateway.transcript import Transcript
from specmesh.rpc.round_client import Placement, ReplicaFailure, RoundClient, RoundResult
from specmesh.rpc.tracing import tracer, tracing_on

_tracer = tracer("specmesh.gateway")


def _in(span: Any) -> Any:
    """The tracing context of `span` (child spans go under it)."""
    return trace.set_span_in_context(span)


def _end_span(span: Any, error: BaseException | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.record_exception(error)
    span.end()


class Stage(Enum):
    """Where the chain of rounds is, between its callbacks."""

    OPEN = "open"  # no commit in flight: a round's verdict settles at once
    COMMITTING = "committing"  # a commit in flight, the next round running beside it
    HELD = "held"  # ... and that round's verdict came first: it waits for the commit
    STOPPED = "stopped"  # no more rounds: whatever still answers is dropped


@dataclasses.dataclass(frozen=True)
class RunParts:
    """What a session's rounds work with, whichever way they go (serial or DSI): the gateway's
    shared state, the plan, the session as the replicas know it, its committed transcript and
    its placer (gateway/session.py builds them)."""

    env: GatewayEnv
    plan: GenerationPlan
    client: RoundClient
    transcript: Transcript
    placer: Placer


@dataclasses.dataclass(frozen=True)
class _Verdict:
    """A round's verdict as it waits for its turn to settle."""

    began: float
    span: Any
    result: RoundResult


class SerialRounds:
    """One session's rounds, one after another (module docstring)."""

    def __init__(self, parts: RunParts) -> None:
        self.env, self.plan, self.client = parts.env, parts.plan, parts.client
        self.transcript, self.placer = parts.transcript, parts.placer
        self.stage = Stage.OPEN
        self._held: _Verdict | None = None  # Stage.HELD: the verdict waiting for the commit
        self.handout = Handout()  # committed rounds (or the error), for `step`
        self._started = False
        self.slow = SlowPaths(self.stop)
        self.stop_error: BaseException | None = None  # why the rounds stopped before the end
        self._failures = 0  # failed tries of the current round
        self._stale_commits = 0

    async def step(self) -> Piece:
        """The next committed round; its failure is raised here. Traced (when tracing is on) as a
        span "round" with its draft, verification and commit under it."""
        if not self._started:
            if self.stop_error is not None:
                raise self.stop_error
            self._started = True
            self._launch(self.transcript.tokens)
        return await self.handout.get(self.placer.loop)

    def stop(self, error: BaseException) -> None:
        """No more rounds: the client gets `error` from `step` (after what was committed)."""
        if self.stage is Stage.STOPPED:
            return
        self.stage, self.stop_error, self._held = Stage.STOPPED, error, None
        self.client.cancel()
        self.handout.put(error)

    def describe(self, stats: Any) -> None:
        """Serial rounds add nothing to the public GenerationStats."""

    async def close(self) -> None:
        """The run ends: nothing it started reaches a replica any more (before its releases)."""
        self.stage = Stage.STOPPED
        self.client.cancel()
        await self.slow.cancel()

    # ---- the chain -------------------------------------------------------------------------------

    def _launch(self, tokens: list[int], began: float | None = None) -> None:
        """Start the round after `tokens` (committed, or this round's tokens not yet committed) on
        the session's replicas: at once while they are healthy, else once placed anew."""
        placement = self.placer.now()
        if placement is None:
            self.slow.spawn(self._place_and_launch(tokens, began))
            return
        self._begin(tokens, placement, began)

    async def _place_and_launch(self, tokens: list[int], began: float | None) -> None:
        self._begin(tokens, await self.placer.place(self.transcript.tokens, recorded=True), began)

    def _begin(self, tokens: list[int], placement: Placement, began: float | None) -> None:
        if self.stage is Stage.STOPPED:
            return
        self.env.retries.round_started()
        began = time.perf_counter() if began is None else began
        span = None
        if tracing_on():
            attributes = {"session": self.client.id, "round": self.transcript.round}
            span = _tracer.start_span("round", attributes=attributes)
        done = functools.partial(self._round_done, tokens, began, span)
        left = self.transcript.left(tokens)
        self.client.start(tokens, placement, self._plain_steps(tokens), done, span=span, max_tokens=left)

    def _round_done(self, tokens: list[int], began: float, span: Any, outcome: Any) -> None:
        """A round's verdict (or failure), on the event loop where its verification was read."""
        if self.stage is Stage.STOPPED:
            _end_span(span)
            return
        if isinstance(outcome, ReplicaFailure):
            self.placer.remember(outcome.held)
            _end_span(span, outcome)
            self.slow.spawn(self._retry(tokens, began, outcome))
            return
        if isinstance(outcome, BaseException):
            _end_span(span, outcome)
            self.stop(outcome)
            return
        self.placer.remember(outcome.held)
        self._failures = 0
        if self.stage is Stage.COMMITTING:  # it ran beside the last round's commit: its turn comes after
            self.stage, self._held = Stage.HELD, _Verdict(began, span, outcome)
            return
        self._settle(_Verdict(began, span, outcome))

    def _settle(self, verdict: _Verdict) -> None:
        """A verdict after the committed tokens: cut it, queue the next round (it need not wait for
        Redis, docs/decisions.md), commit this one."""
        result, transcript = verdict.result, self.transcript
        kept, finish = transcript.cut(result.tokens)
        lengths = {self.placer.addresses[role]: result.held[role] for role in self.placer.roles}
        if (
            transcript.round == 0 and result.cached
        ):  # the prompt's: what the target took from its prefix cache
            result.stats.cached_prompt_tokens = result.cached
        if finish is None:
            self._launch([*transcript.tokens, *kept])
        else:
            self.client.finished()
        self.stage = Stage.COMMITTING
        start = time.perf_counter()
        commit_span = None
        if verdict.span is not None:
            commit_span = _tracer.start_span(
                "commit", context=_in(verdict.span), attributes={"tokens": len(kept)}
            )
        done = functools.partial(self._committed, kept, finish, verdict, start, commit_span)
        transcript.commit_then(kept, finish, result.stats, lengths, done)

    def _committed(
        self, kept: list[int], finish: str | None, verdict: _Verdict, start: float, span: Any,
        committed: bool | Exception,
    ) -> None:  # fmt: skip
        """A commit's answer, handed over with the rest of its pipeline's (one pass over a tick's
        sessions, `ScriptPipeline`)."""
        _end_span(span)
        _end_span(verdict.span)
        if self.stage is Stage.STOPPED:
            return
        held, self._held = self._held, None
        self.stage = Stage.OPEN
        try:
            ok = self.transcript.committed(committed)
        except BaseException as exc:  # Redis refused or stayed down, or the session is another's
            self.stop(exc)
            return
        if not ok:
            self.slow.spawn(self._stale(kept, verdict.result))
            return
        self._stale_commits = 0
        piece = self.transcript.apply(
            kept, finish, verdict.result.stats, verdict.began, start, verdict.result
        )
        self.handout.put(piece)
        if held is not None:
            self._settle(held)

    # ---- the slow path ---------------------------------------------------------------------------

    async def _stale(self, kept: list[int], result: RoundResult) -> None:
        """A commit found another round in Redis (only possible if an earlier commit that seemed to
        fail went through). Its tokens are the truth: hand out what we lacked, and go on from
        them (the replicas resync to them)."""
        self.client.cancel()  # the round beside the commit ran after tokens Redis does not have
        self._stale_commits += 1
        if self._stale_commits > self.env.max_attempts:
            raise GatewayError(
                grpc.StatusCode.ABORTED,
                f"round {self.transcript.round} of session {self.client.id} never committed",
            )
        piece = await self.transcript.resume_from_store()
        if piece.token_ids == kept:  # the commit that seemed to fail was this round's
            piece = dataclasses.replace(piece, logprobs=result.logprobs[: len(kept)])
        if piece.token_ids or piece.finish_reason:
            self.handout.put(piece)
        if not self.transcript.finished:
            self._launch(self.transcript.tokens)

    async def _retry(self, tokens: list[int], began: float, failure: ReplicaFailure) -> None:
        """A replica failed the round: retry it (the same replica after ABORTED, else another one),
        as far as max_attempts and the retry budget allow."""
        self._failures += 1
        if self._failures >= self.env.max_attempts:
            raise GatewayError(
                grpc.StatusCode.UNAVAILABLE,
                f"round {self.transcript.round} failed {self.env.max_attempts} times; last error: {failure}",
            )
        await self.placer.recover(failure)
        self._begin(tokens, await self.placer.place(self.transcript.tokens, recorded=True), began)

    def _plain_steps(self, tokens: list[int]) -> int:
        """Tokens a plain round after `tokens` may decode in one Verify call: one for the first round
        (the prompt's: its token is the time to first token), then --plain-steps, within
        max_new_tokens (steps: n-gram rides may emit more; the call is bounded by max_tokens).
        Rounds that draft, or an adaptive policy's, decode one round anyway."""
        if len(tokens) == len(self.plan.prompt_ids):
            return 1
        return min(self.env.plain_steps, self.transcript.left(tokens))
