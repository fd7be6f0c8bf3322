"""One session's rounds over the replicas' tick loops (specmesh.rpc.tick_client).

    result = await generate_remote("127.0.0.1:50061", "127.0.0.1:50062", prompt_ids, spec, params, 64)

`RoundClient.round(tokens, placement)` is THE round (a draft, then a verification of the tree as
the drafter sent it), shared by `RemoteSession` (tests, benchmarks) and the gateway
(gateway/rounds.py, which keeps the committed tokens in Redis and swaps replicas on failover). It
produces exactly the tokens of the in-process `SpeculativeEngine` for the same seed. Each call goes
into its replica's next tick with every other session's (`TickLoop`); the `Placement` says which
replicas run the round and how many committed tokens each holds; only the rest is sent, and the
result says what each holds afterwards. A replica that answers FAILED_PRECONDITION with the resync
flag (restart, failover, eviction of its state) gets the session's full token list with position 0,
once per call. Other errors are raised as `ReplicaFailure` naming the replica's role: choosing
another replica is the caller's business.

Chunked prefill: a call that would feed more tokens than its tick loop's budget
(`TickLoop.max_tick_tokens`: a long prompt, a resync, a replica that never held the session) goes
`limited`: in each tick it feeds what the budget gives it, beside the other sessions' work, and
answers what the replica holds (`Prefilled`) until the rest fits, then runs whole. A prompt whose
prefix the replica holds often fits at once. Each chunk has a deadline of its own (the
placement's timeout from its send, within the client's deadline: a prefill that waits for the
budget behind others' is not late), and what the replica holds after each is the
round's `held`: a failed chunk is retried from there, and a restart (position 0) takes back what
the replica kept of it.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc
from opentelemetry import trace

from specmesh.core.adaptive import AdaptivePolicy, Load, RoundPlan, RoundPolicy
from specmesh.core.ahead import PipelinePolicy, PreDraft
from specmesh.core.drafting import TreeSpec
from specmesh.core.grammar import Grammar
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.rounds import Pipelining, Request, keep_emitted, session_seed
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationResult, GenerationStats
from specmesh.core.verification import Verdict
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.tick_client import ROLES, Drafted, ItemError, Role, TickLoop, Timing, Verified, to_future
from specmesh.rpc.tick_timing import LoopBound
from specmesh.rpc.ticks import Opened, Prefilled
from specmesh.rpc.tls import ClientTls, aio_channel
from specmesh.rpc.tracing import tracer

_tracer = tracer("specmesh.gateway")

__all__ = ["Placement", "RemoteSession", "ReplicaFailure", "Role", "RoundClient", "RoundResult"]

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def open_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """A channel sized for trees with dense distributions over large vocabularies; TLS with `tls`."""
    return aio_channel(address, tls, options=CHANNEL_OPTIONS)


def needs_resync(error: Any) -> bool:
    """The replica does not hold the session at the caller's position: resend everything."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    return any(key == wire.RESYNC_KEY and value == "1" for key, value in error.trailing_metadata() or ())


@dataclass(frozen=True)
class Placement:
    """Where one round runs: the replicas' tick loops, what each holds, and how long a call may take.

    held: committed tokens the caller believes each replica holds (0 or missing: nothing, it gets
    everything with position 0). drafter None: method "none" only. timeout: what the round may
    take in all. per_try(role, new tokens, levels drafted or nodes verified, plain steps): how long
    a call runs before the caller is asked, spare(role), whether to give it up for a spare replica
    (asked again after every such period; None: a call may take the whole timeout)."""

    verifier: TickLoop
    drafter: TickLoop | None = None
    held: Mapping[Role, int] = field(default_factory=dict)
    timeout: float | None = 60.0
    per_try: Callable[[Role, int, int, int], float] | None = None
    spare: Callable[[Role], bool] = lambda role: False
    deadline: float | None = None  # the client's, on the loop's clock: no chunk's deadline passes it


@dataclass(frozen=True)
class RoundResult:
    verdict: Verdict
    stats: GenerationStats  # this round's delta
    held: dict[Role, int]  # committed tokens each replica holds after the round
    resyncs: int  # replicas that answered "resync" and were sent everything
    call_seconds: dict[Role, float] = field(default_factory=dict)  # what the round waited for each role
    pre_draft_hit: bool | None = None  # a pre-draft was judged: it applied (True) or was dropped
    plain: list[int] = field(default_factory=list)  # plain steps: the tokens decoded before the verdict's
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `tokens`, when the session asks
    cached: int = 0  # the verifier started the session this round: tokens it took from a prefix

    @property
    def tokens(self) -> list[int]:
        """Accepted tokens plus the recovered or bonus token (after a plain call's earlier steps),
        before any stop / length cut."""
        return [*self.plain, *self.verdict.emitted_tokens]


class ReplicaFailure(Exception):
    """A draft or verification failed for another reason than a resync; `role` says which
    replica, `held` what each replica holds as far as the round got (a draft may have succeeded),
    `per_try` whether it ran out of its per-try timeout (not of the whole round's)."""

    def __init__(
        self, role: Role, error: Any, held: Mapping[Role, int], per_try: bool = False, rows: int = 0
    ) -> None:
        """rows: the tokens and tree nodes the failed call fed (its forward's size)."""
        super().__init__(f"{role}: {error.code().name}: {error.details()}")
        self.role = role
        self.error = error
        self.held = dict(held)
        self.per_try = per_try
        self.rows = rows


class RoundClient(LoopBound):
    """One session's rounds: `start(tokens, placement, ...)` drafts and verifies after the
    committed `tokens` on the replicas the placement names (`round` awaits it). The client keeps
    only what belongs to the session (its settings as the replicas get them, tree family, adaptive
    policy, the next round's pre-draft); where it runs is the caller's."""

    def __init__(
        self,
        session_id: str,
        params: SamplingParams,
        spec: TreeSpec,
        *,
        policy: RoundPolicy | None = None,
        key: str = "",
        pipeline: PipelinePolicy | None = None,
        stop_token_ids: Sequence[int] = (),
        top_logprobs: int | None = None,
        grammar: Grammar | None = None,
        salt: bytes = b"",
        private: bool = False,
    ) -> None:
        """params: with the session's seed fixed. policy: adaptive speculation; `spec` is then only
        its family and first depth. key: the session's secret (replicas serve the session only to
        callers that know it). pipeline: whether rounds pre-draft (None: never); the gateway shares
        one among its sessions, so that what one learnt holds for all. stop_token_ids: where a
        plain call of several steps stops. top_logprobs: every round returns its tokens'
        log-probabilities with this many alternatives (None: none). grammar: structured output.
        salt: the replicas' prefix cache namespace of the session (TickSession.prefix_salt).
        private: its output never teaches other sessions' drafts (TickSession.private)."""
        self.id, self.params, self.spec, self.policy = session_id, params, spec, policy
        self.session = Opened(
            session_id, key, params, frozenset(stop_token_ids), top_logprobs, grammar, salt, private
        )
        self.pipeline = pipeline or PipelinePolicy(Pipelining.OFF)
        # what the last round handed over (`_ended`): the next round's pre-draft, in flight or
        # done, and the drafter loop told to expect the next round
        self._pre_draft: _PreDraftCall | None = None
        self._expected_by: TickLoop | None = None
        self._current: _Round | None = None

    def start(
        self,
        tokens: Sequence[int],
        placement: Placement,
        plain_steps: int,
        done: Callable[[RoundResult | BaseException], None],
        *,
        span: Any = None,
        max_tokens: int = 0,
    ) -> None:
        """Draft and verify after the committed `tokens`; commits nothing on the caller's side.
        done(outcome): the RoundResult, or the error (ReplicaFailure: a replica's), called on the
        event loop right where the verification's answer is read, so that the caller can queue
        the next round at once. Cancel with `cancel`.

        plain_steps: where the round drafts nothing (method none, or the default's plain rounds:
        RoundPlan.plain_run), the verifier may take up to that many steps in this one call, and
        emit at most max_tokens tokens (0: no bound; n-gram rides emit several per step).

        Pipelined (specmesh.core.ahead): the tree may come from the pre-draft the previous round
        sent beside its verification, if it assumed exactly these tokens; this round may send the
        next one. Stats: draft_seconds and verify_seconds are what the services report (the draft
        tick's time, the batched forwards' time), total_seconds the round's wall time. span: the
        round's tracing span; its draft and verification are spans under it (each the session's
        item of a tick: a tick serves many requests, so no request's trace holds the tick)."""
        pre_draft, self._pre_draft = self._pre_draft, None
        ended = functools.partial(self._ended, done)
        self._current = _Round(self, tokens, placement, plain_steps, ended, span, max_tokens, pre_draft)
        self._current.begin()

    def _ended(
        self, done: Callable[[RoundResult | BaseException], None], round_: _Round, outcome: Any
    ) -> None:
        """A round's end: take what it hands over to the next (before its caller, who may start
        that one from `done`)."""
        if self._current is round_:
            self._current = None
        self._pre_draft, self._expected_by = round_.next_pre_draft, round_.expected_by
        done(outcome)

    async def round(self, tokens: Sequence[int], placement: Placement, plain_steps: int = 1) -> RoundResult:
        """`start`, awaited: the RoundResult, or the error raised."""
        future = self.loop.create_future()
        self.start(tokens, placement, plain_steps, functools.partial(to_future, future))
        try:
            return await future
        except asyncio.CancelledError:
            self.cancel()
            raise

    def cancel(self) -> None:
        """Stop the round in flight (its replica items are cancelled there) and the pre-draft."""
        if self._current is not None:
            self._current.cancel()
            self._current = None
        if self._pre_draft is not None:
            self._pre_draft.cancel()
            self._pre_draft = None
        self.finished()

    def close(self) -> None:
        """The session ends: nothing in flight goes on, no tick loop waits for it."""
        self.cancel()
        self.finished()

    def finished(self) -> None:
        """The session drafts no more: the drafter's tick loop does not wait for it."""
        if self._expected_by is not None:
            self._expected_by.unexpect(self.id)
            self._expected_by = None


def _send_pre_draft(
    session: Opened, tokens: Sequence[int], spec: TreeSpec, drafter: TickLoop, likely: Sequence[int]
) -> _PreDraftCall:
    """Queue the next round's draft now, assuming its committed tokens will be `likely` more."""
    call = _PreDraftCall(PreDraft(len(tokens), tuple(likely)), spec, drafter)
    call.work = drafter.draft(
        session, len(tokens), likely, spec, guess_next=True, speculative=True, done=call.answered
    )
    return call


class _Round:
    """One round's state between its callbacks: a draft (or the pre-draft's tree), then its
    verification, each call retried once with everything after a resync answer.

    It reads its client's settings and hands the next round what it started for it as values:
    `pre_draft` (the pre-draft the last round sent) comes in, and at its end (`done(self,
    outcome)`) `next_pre_draft` and `expected_by` go out."""

    def __init__(
        self,
        client: RoundClient,
        tokens: Sequence[int],
        placement: Placement,
        plain_steps: int,
        done: Callable[[_Round, Any], None],
        span: Any = None,
        max_tokens: int = 0,
        pre_draft: _PreDraftCall | None = None,
    ) -> None:
        self.client, self.tokens, self.placement, self.done, self.span = client, tokens, placement, done, span
        self.plain_steps, self.max_tokens = plain_steps, max_tokens
        self.start = time.perf_counter()
        self.committed = len(tokens)
        self.held = {role: placement.held.get(role, 0) for role in ROLES}
        self.cached = dict.fromkeys(ROLES, 0)
        self.seconds: dict[Role, float] = {}
        self.resyncs = 0
        self.deadline = self._fresh_deadline()
        plan = client.policy.plan(tokens) if client.policy else RoundPlan(client.spec, plain_run=True)
        self.spec, self.plan = plan.spec, plan
        self.want = False  # a pre-draft beside this round's verification
        self.hit: bool | None = None
        self.serial_draft: float | None = None
        self.drafted: Drafted | None = None
        self.work: tuple[TickLoop, Any] | None = None  # the item in flight
        self.pre_draft = pre_draft  # the last round's, until judged; then the one it waits for
        self.next_pre_draft: _PreDraftCall | None = None  # sent beside its verification
        self.expected_by: TickLoop | None = None  # the drafter loop told to expect the next round
        self.over = False

    def begin(self) -> None:
        spec, pre_draft = self.spec, self.pre_draft
        if not spec.method.drafts:
            self._drop_pre_draft()
            self._verify(None)
            return
        if self.placement.drafter is None:
            self._drop_pre_draft()
            self._end(ValueError(f"method {spec.method!r} needs a drafter"))
            return
        self.want = self.client.pipeline.wants()
        if pre_draft is not None:
            if pre_draft.applies(self.tokens, spec, self.held.get(Role.DRAFTER, 0)):
                per_try = self.placement.per_try
                patience = per_try(Role.DRAFTER, 1, spec.depth, 1) if per_try else None
                pre_draft.wait(self._pre_drafted, patience)
                return
            self._drop_pre_draft()
            self.hit = False
        self._draft()

    def _drop_pre_draft(self) -> None:
        if self.pre_draft is not None:
            self.pre_draft.cancel()
            self.pre_draft = None

    def _pre_drafted(self, drafted: Drafted | None) -> None:
        """The pre-draft's tree (None: it failed, was superseded or ran past its per-try timeout:
        the round drafts itself, meeting the replica's trouble with the usual retries)."""
        self.pre_draft = None
        if self.over:
            return
        self.hit = drafted is not None
        if drafted is None:
            self._draft()
            return
        self._took(Role.DRAFTER, time.perf_counter() - self.start)  # the wait for the pre-draft
        self._drafted(drafted)

    def _draft(self) -> None:
        drafter, verifier, session, spec, tokens = (
            self.placement.drafter, self.placement.verifier, self.client.session, self.spec, self.tokens,
        )  # fmt: skip
        assert drafter is not None

        def submit(position: int, timing: Timing, done: Callable, limited: float | None) -> Any:
            return drafter.draft(  # its verification comes next: `then`
                session, position, tokens[position:], spec, guess_next=self.want, timing=timing,
                then=verifier, done=done, limited=limited,
            )  # fmt: skip

        self._call(Role.DRAFTER, drafter, submit, spec.depth, 1, self._drafted_serially, name="draft")

    def _drafted_serially(self, drafted: Drafted) -> None:
        self.serial_draft = self.seconds[Role.DRAFTER]
        self._drafted(drafted)

    def _drafted(self, drafted: Drafted) -> None:
        self.drafted = drafted
        if drafted.likely and self.want:
            drafter = self.placement.drafter
            assert drafter is not None
            self.next_pre_draft = _send_pre_draft(
                self.client.session, self.tokens, self.spec, drafter, drafted.likely
            )
        self._verify(drafted.tree)  # the drafter's columns, relayed

    def _verify(self, tree: Any) -> None:
        placement, session, tokens = self.placement, self.client.session, self.tokens
        plain = self.drafted is None
        steps = self.plain_steps if plain and self.plan.plain_run else 1
        lookup = self.plan.lookup_depth if plain else 0
        rides = dict(
            lookup_depth=lookup, lookup_min_ngram=self.plan.lookup_min_ngram if lookup else 0,
            suffix_rides=plain and self.plan.suffix_rides,
        )  # fmt: skip
        max_tokens = self.max_tokens if plain else 0
        verifier = placement.verifier
        # its next round drafts (unless pre-drafted already): the drafter's loop expects it
        then = placement.drafter if self.spec.method.drafts and self.next_pre_draft is None else None
        self.expected_by = then

        def submit(position: int, timing: Timing, done: Callable, limited: float | None) -> Any:
            return verifier.verify(
                session, position, tokens[position:], tree, steps, timing=timing, then=then, done=done,
                max_tokens=max_tokens, limited=limited, **rides,
            )  # fmt: skip

        nodes = self.drafted.tree_nodes if self.drafted is not None else 0
        self._call(Role.VERIFIER, verifier, submit, nodes, steps, self._verified, name="verify")

    def _verified(self, verified: Verified) -> None:
        client, drafted = self.client, self.drafted
        client.pipeline.observe(
            verify=self.seconds[Role.VERIFIER],
            beside=self.next_pre_draft is not None,
            draft=self.serial_draft,
            levels=drafted.forwards if self.serial_draft is not None and drafted is not None else 0,
            hit=self.hit,
        )
        verdict, plain = verified.verdict, verified.plain_tokens
        # it committed the accepted path (a plain call: the tokens before the last) itself
        self.held[Role.VERIFIER] += len(plain) + len(verdict.accepted_tokens)
        # a plain call's n-gram rides count as its drafts; its steps are its tokens less those
        ride_nodes, ride_accepted = verified.rides if drafted is None else (0, 0)
        nodes = drafted.tree_nodes if drafted is not None else ride_nodes
        steps = 1 if drafted is not None else len(plain) + len(verdict.accepted_tokens) + 1 - ride_accepted
        stats = GenerationStats.for_round(
            drafted_tokens=nodes,
            accepted_tokens=len(verdict.accepted_tokens) if drafted is not None else ride_accepted,
            tree_depth=drafted.tree_depth if drafted is not None else 0,
            draft_calls=drafted.forwards if drafted is not None else 0,
            draft_seconds=drafted.seconds if drafted is not None else 0.0,
            verify_seconds=verified.forward_seconds,
            total_seconds=time.perf_counter() - self.start,
            plain_steps=steps,
        )
        if client.policy:
            # batch_tokens 0: a replica that does not say; the policy then counts this session alone
            load = Load(verified.batch_size, verified.batch_tokens) if verified.batch_tokens else None
            client.policy.observe(self.spec, stats, load)
        self._end(
            RoundResult(
                verdict,
                stats,
                dict(self.held),
                self.resyncs,
                dict(self.seconds),
                self.hit,
                plain,
                verified.logprobs,
                self.cached[Role.VERIFIER],
            )
        )

    def _fresh_deadline(self) -> float | None:
        """A call's deadline from now: the placement's timeout, within the client's deadline."""
        timeout, client = self.placement.timeout, self.placement.deadline
        if timeout is None:
            return client
        at = self.client.loop.time() + timeout
        return at if client is None else min(at, client)

    def _call(
        self,
        role: Role,
        loop: TickLoop,
        submit: Callable[[int, Timing, Callable, float | None], Any],
        work: int,
        steps: int,
        then: Callable[[Any], None],
        position: int | None = None,
        started: float | None = None,
        name: str = "",
    ) -> None:
        """submit(position, timing, done, limited); on a resync answer, once more with position 0
        (all tokens); after a chunk of a limited call (`Prefilled`), again from where the replica
        is. work: the tree levels a draft builds / the nodes a verification checks, steps: the plain
        steps it may decode (both for the per-try timeout, which the tick loop keeps).

        With nothing new for the replica (a round retried after its verification failed),
        restart the session there: new tokens may not be empty, they produce the root distribution."""
        if position is None:
            held = self.held[role]
            position = held if held < self.committed else 0
        started = time.perf_counter() if started is None else started
        fed = self.committed - position
        limited = started if loop.needs_prefill(position, self.committed) else None
        deadline, timeout = self.deadline, None
        if limited is not None:  # chunked prefill: each chunk's call has a deadline from its send
            self.deadline = self._fresh_deadline()  # (the round's next call's, from here)
            deadline, timeout = self.placement.deadline, self.placement.timeout
            fed = loop.max_tick_tokens
        per_try, spare = self.placement.per_try, self.placement.spare
        patience = per_try(role, fed, work, steps) if per_try is not None else None
        timing = Timing(deadline, patience, lambda: spare(role), timeout)
        span = None
        if self.span is not None:
            parent = trace.set_span_in_context(self.span)
            span = _tracer.start_span(
                name, context=parent, attributes={"replica": loop.name, "position": position}
            )

        def answered(outcome: Any) -> None:
            self.work = None
            if span is not None:
                if isinstance(outcome, BaseException):
                    span.record_exception(outcome)
                span.end()
            if self.over:
                return
            if isinstance(outcome, Prefilled):  # it fed a chunk: the rest from where the replica is
                if outcome.held <= position:  # no progress: never loop on a replica that feeds nothing
                    error = ItemError(grpc.StatusCode.INTERNAL, f"{loop.name}: a limited call fed nothing")
                    self._failed(role, ReplicaFailure(role, error, self.held, rows=fed))
                    return
                self.held[role] = outcome.held
                if position == 0:
                    self.cached[role] = outcome.cached
                self.deadline = self._fresh_deadline()
                self._call(role, loop, submit, work, steps, then, outcome.held, started, name)
                return
            if isinstance(outcome, ItemError | grpc.aio.AioRpcError):
                if position != 0 and needs_resync(outcome):
                    self.resyncs += 1
                    self._call(role, loop, submit, work, steps, then, position=0, started=started, name=name)
                    return
                per_try_out = getattr(outcome, "per_try", False)
                self._failed(role, ReplicaFailure(role, outcome, self.held, per_try_out, fed + work))
            elif isinstance(outcome, BaseException):
                self._failed(role, outcome)
            else:
                if position == 0:
                    self.cached[role] = outcome.cached
                self._took(role, time.perf_counter() - started)
                then(outcome)

        self.work = (loop, submit(position, timing, answered, limited))

    def _took(self, role: Role, seconds: float) -> None:
        """A call of `role` answered after `seconds` (a pre-draft's wait included): the replica now
        holds the round's committed tokens (a pre-draft's drafter fed them)."""
        self.held[role] = self.committed
        self.seconds[role] = seconds

    def _failed(self, role: Role, error: BaseException) -> None:
        if role is Role.DRAFTER:
            self.placement.verifier.unexpect(self.client.id)  # no verification will follow
        else:  # the round is redone from the committed tokens: its pre-draft goes
            self._drop_next()
        self._end(error)

    def _drop_next(self) -> None:
        """What it started for the next round goes: the pre-draft, and the drafter's wait for
        the next round's draft (not on its way)."""
        if self.next_pre_draft is not None:
            self.next_pre_draft.cancel()
            self.next_pre_draft = None
        if self.expected_by is not None:
            self.expected_by.unexpect(self.client.id)
            self.expected_by = None

    def cancel(self) -> None:
        if self.over:
            return
        self.over = True
        if self.work is not None:
            loop, work = self.work
            loop.cancel(work)
            self.work = None
        self._drop_pre_draft()
        self._drop_next()

    def _end(self, outcome: Any) -> None:
        if self.over:
            return
        self.over = True
        self.done(self, outcome)


class _PreDraftCall:
    """A pre-draft in flight: what it assumes, its shape, its answer once in."""

    _PENDING = object()

    def __init__(self, pre: PreDraft, spec: TreeSpec, loop: TickLoop) -> None:
        self.pre, self.spec, self.loop = pre, spec, loop
        self.work: Any = None
        self.answer: Any = self._PENDING  # Drafted, or None (failed or superseded)
        self._waiter: Callable[[Drafted | None], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def answered(self, outcome: Any) -> None:
        if isinstance(outcome, BaseException) or outcome.superseded:
            outcome = None
        self.answer = outcome
        self._wake(outcome)

    def applies(self, tokens: Sequence[int], spec: TreeSpec, held: int) -> bool:
        """It assumed these committed tokens, drafted this shape, and the drafter still holds what
        it was sent on."""
        return spec == self.spec and held == self.pre.base and self.pre.applies(tokens)

    def wait(self, then: Callable[[Drafted | None], None], patience: float | None) -> None:
        """then(its Drafted) once it is in; None if it failed, or is not in after `patience`."""
        if self.answer is not self._PENDING:
            then(self.answer)
            return
        self._waiter = then
        if patience is not None:
            self._timer = asyncio.get_running_loop().call_later(patience, self._late)

    def _late(self) -> None:
        """Past its patience: the round drafts itself. The waiter is taken before `cancel` clears
        it (the other order woke nobody, and the round waited for good: the routing benchmark's
        hangs, a busy drafter's pre-draft late by its per-try timeout)."""
        self._timer = None
        waiter, self._waiter = self._waiter, None
        self.cancel()
        if waiter is not None:
            waiter(None)

    def _wake(self, answer: Drafted | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiter, self._waiter = self._waiter, None
        if waiter is not None:
            waiter(answer)

    def cancel(self) -> None:
        """Cancel it (the drafter stops it at its next level; a real draft supersedes it)."""
        if self.work is not None:
            self.loop.cancel(self.work)
        self._waiter = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


async def release_session(
    stub: pb2_grpc.DrafterStub | pb2_grpc.VerifierStub, session_id: str, timeout: float | None, key: str = ""
) -> bool | None:
    """Release on one replica; False if it did not hold the session, None if it could not be
    reached (it may still hold the session)."""
    request = pb2.ReleaseRequest(session_id=session_id)
    try:
        reply = await stub.Release(request, timeout=timeout, metadata=wire.session_metadata(key))
    except grpc.aio.AioRpcError:
        return None
    return reply.released


class RemoteSession:
    """One whole generation against a drafter and a verifier (their tick loops), the committed
    tokens kept here."""

    def __init__(
        self,
        drafter: TickLoop | None,
        verifier: TickLoop,
        request: Request,
        *,
        session_id: str | None = None,
        timeout: float | None = 60.0,
        pipelining: Pipelining = Pipelining.OFF,
    ) -> None:
        if drafter is None and request.spec.method.drafts:
            raise ValueError(f"method {request.spec.method!r} needs a drafter")
        params = replace(request.params, seed=session_seed(request.params))
        policy = AdaptivePolicy(request.spec) if request.adaptive else None
        self.client = RoundClient(
            session_id or uuid.uuid4().hex,
            params,
            request.spec,
            policy=policy,
            pipeline=PipelinePolicy(pipelining),
            stop_token_ids=request.stop_token_ids,
        )
        self.drafter, self.verifier, self.timeout = drafter, verifier, timeout
        self.held: dict[Role, int] = {}
        self.resyncs = 0
        self.pre_drafts: collections.Counter[bool | None] = collections.Counter()  # rounds by pre-draft hit
        self.request = request
        self.tokens = [int(t) for t in request.prompt_ids]  # committed: prompt + generated
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats()

    @property
    def id(self) -> str:
        return self.client.id

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.generated), self.finish_reason or "length", self.stats)

    async def step(self) -> list[int]:
        """One round; returns the tokens it emitted (cut at max_new_tokens or a stop token).
        A failed replica call raises its error (ItemError or the stream's); the next step retries
        the round."""
        placement = Placement(self.verifier, self.drafter, self.held, self.timeout)
        try:
            result = await self.client.round(self.tokens, placement)
        except ReplicaFailure as failure:
            self.held = failure.held
            raise failure.error from None
        self.held, self.resyncs = result.held, self.resyncs + result.resyncs
        self.pre_drafts[result.pre_draft_hit] += 1
        self.stats += result.stats
        r = self.request
        emitted, self.finish_reason = keep_emitted(
            result.tokens, len(self.generated), r.max_new_tokens, r.stop_token_ids
        )
        self.tokens += emitted
        self.generated += emitted
        return emitted

    async def run(self) -> GenerationResult:
        while not self.done:
            await self.step()
        return self.result()

    async def release(self) -> None:
        """Free the session's KV on both replicas (best effort: a replica may be gone)."""
        self.client.close()
        for loop in (self.drafter, self.verifier):
            if loop is not None:
                loop.release(self.id)
        await asyncio.sleep(0)  # the release goes out with the loops' next message


class Replicas:
    """A drafter and a verifier by address, each behind its own tick loop (tests, benchmarks)."""

    def __init__(self, drafter_address: str | None, verifier_address: str) -> None:
        self._channels = [open_channel(verifier_address)]
        self.verifier = TickLoop(self._channels[0], Role.VERIFIER, verifier_address)
        self.drafter = None
        if drafter_address:
            self._channels.append(open_channel(drafter_address))
            self.drafter = TickLoop(self._channels[1], Role.DRAFTER, drafter_address)

    async def __aenter__(self) -> Replicas:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.05)  # releases queued by the sessions go out first
        for loop in (self.drafter, self.verifier):
            if loop is not None:
                await loop.close()
        await asyncio.gather(*(c.close() for c in self._channels))


async def generate_remote(
    drafter_address: str | None,
    verifier_address: str,
    prompt_ids: Sequence[int],
    spec: TreeSpec,
    params: SamplingParams,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    pipelining: Pipelining = Pipelining.OFF,
) -> GenerationResult:
    """One whole generation over gRPC; the session is released on both replicas afterwards."""
    request = Request(prompt_ids, spec, params, max_new_tokens, tuple(stop_token_ids))
    async with Replicas(drafter_address, verifier_address) as replicas:
        session = RemoteSession(replicas.drafter, replicas.verifier, request, pipelining=pipelining)
        try:
            return await session.run()
        finally:
            await session.release()
