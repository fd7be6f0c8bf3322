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
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from specmesh.core.adaptive import AdaptivePolicy, Load
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
from specmesh.rpc.tick_client import Drafted, ItemError, Role, TickLoop, Timing, Verified
from specmesh.rpc.ticks import Opened
from specmesh.rpc.tls import ClientTls, aio_channel

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

    @property
    def tokens(self) -> list[int]:
        """Accepted tokens plus the recovered or bonus token (after a plain call's earlier steps),
        before any stop / length cut."""
        return [*self.plain, *self.verdict.emitted_tokens]


class ReplicaFailure(Exception):
    """A draft or verification failed for another reason than a resync; `role` says which
    replica, `held` what each replica holds as far as the round got (a draft may have succeeded),
    `per_try` whether it ran out of its per-try timeout (not of the whole round's)."""

    def __init__(self, role: Role, error: Any, held: Mapping[Role, int], per_try: bool = False) -> None:
        super().__init__(f"{role}: {error.code().name}: {error.details()}")
        self.role = role
        self.error = error
        self.held = dict(held)
        self.per_try = per_try


class RoundClient:
    """One session's rounds: `round(tokens, placement)` drafts and verifies after the committed
    `tokens` on the replicas the placement names. The client keeps only what belongs to the
    session (its settings as the replicas get them, tree family, adaptive policy); where it runs is
    the caller's."""

    def __init__(
        self,
        session_id: str,
        params: SamplingParams,
        spec: TreeSpec,
        *,
        policy: AdaptivePolicy | None = None,
        key: str = "",
        pipeline: PipelinePolicy | None = None,
        stop_token_ids: Sequence[int] = (),
        top_logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> None:
        """params: with the session's seed fixed. policy: adaptive speculation; `spec` is then only
        its family and first depth. key: the session's secret (replicas serve the session only to
        callers that know it). pipeline: whether rounds pre-draft (None: never); the gateway shares
        one among its sessions, so that what one learnt holds for all. stop_token_ids: where a
        plain call of several steps stops. top_logprobs: every round returns its tokens'
        log-probabilities with this many alternatives (None: none). grammar: structured output."""
        self.id, self.params, self.spec, self.policy = session_id, params, spec, policy
        self.session = Opened(session_id, key, params, frozenset(stop_token_ids), top_logprobs, grammar)
        self.pipeline = pipeline or PipelinePolicy(Pipelining.OFF)
        self._ahead: _Ahead | None = None  # the next round's pre-draft, in flight or done
        self._expected_by: TickLoop | None = None  # the drafter loop told to expect the next round

    async def round(self, tokens: Sequence[int], placement: Placement, plain_steps: int = 1) -> RoundResult:
        """Draft and verify after the committed `tokens`; commits nothing on the caller's side.

        plain_steps: where the round drafts nothing (method none, no adaptive policy), the verifier
        may decode up to that many tokens in this one call.

        Pipelined (specmesh.core.ahead): the tree may come from the pre-draft the previous round
        sent beside its verification, if it assumed exactly these tokens; this round may send the
        next one. Stats: draft_seconds and verify_seconds are what the services report (the draft
        tick's time, the batched forwards' time), total_seconds the round's wall time."""
        start = time.perf_counter()
        spec = self.policy.next_spec() if self.policy else self.spec
        call = _Calls(placement, len(tokens))
        ahead, self._ahead = self._ahead, None
        drafted: Drafted | None = None
        hit, serial_draft = None, None
        session = self.session
        if spec.method.drafts:
            drafter = placement.drafter
            if drafter is None:
                raise ValueError(f"method {spec.method!r} needs a drafter")
            want = self.pipeline.wants()  # a pre-draft beside this round's verification
            if ahead is not None:
                try:
                    drafted = await ahead.take(tokens, spec, placement)
                except BaseException:  # the round was cancelled: so is its pre-draft
                    ahead.cancel()
                    raise
                hit = drafted is not None
            if drafted is not None:
                call.took(Role.DRAFTER, time.perf_counter() - start)  # the wait for the pre-draft
            else:

                def make_draft(position: int, timing: Timing) -> asyncio.Future:
                    return drafter.draft(  # its verification comes next: `then`
                        session, position, tokens[position:], spec, guess_next=want, timing=timing,
                        then=placement.verifier,
                    )  # fmt: skip

                try:
                    drafted = await call(Role.DRAFTER, make_draft, spec.depth)
                except BaseException:
                    placement.verifier.unexpect(self.id)  # no verification will follow
                    raise
                serial_draft = call.seconds[Role.DRAFTER]
            if drafted.likely and want:
                self._ahead = self._pre_draft(tokens, spec, drafter, drafted.likely)
        tree = drafted.tree if drafted is not None else None  # the drafter's columns, relayed
        steps = plain_steps if drafted is None and self.policy is None else 1
        verifier = placement.verifier

        def make_verify(position: int, timing: Timing) -> asyncio.Future:
            then = placement.drafter if spec.method.drafts and self._ahead is None else None
            self._expected_by = then  # its next draft comes next (unless pre-drafted already)
            return verifier.verify(
                session, position, tokens[position:], tree, steps, timing=timing, then=then
            )

        nodes = drafted.tree_nodes if drafted is not None else 0
        try:
            verified: Verified = await call(Role.VERIFIER, make_verify, nodes, steps)
        except BaseException:
            if self._ahead is not None:  # the round is redone from the committed tokens
                self._ahead.cancel()
                self._ahead = None
            self.finished()  # the next round's draft is not on its way
            raise
        self.pipeline.observe(
            verify=call.seconds[Role.VERIFIER],
            beside=self._ahead is not None,
            draft=serial_draft,
            levels=drafted.forwards if serial_draft is not None and drafted is not None else 0,
            hit=hit,
        )
        verdict, plain = verified.verdict, verified.plain_tokens
        # it committed the accepted path (a plain call: the tokens before the last) itself
        call.held[Role.VERIFIER] += len(plain) + len(verdict.accepted_tokens)
        stats = GenerationStats.for_round(
            drafted_tokens=nodes,
            accepted_tokens=len(verdict.accepted_tokens),
            tree_depth=drafted.tree_depth if drafted is not None else 0,
            draft_calls=drafted.forwards if drafted is not None else 0,
            draft_seconds=drafted.seconds if drafted is not None else 0.0,
            verify_seconds=verified.forward_seconds,
            total_seconds=time.perf_counter() - start,
            plain_steps=len(plain) + 1,
        )
        if self.policy:
            # batch_tokens 0: a replica that does not say; the policy then counts this session alone
            load = Load(verified.batch_size, verified.batch_tokens) if verified.batch_tokens else None
            self.policy.observe(spec, stats, load)
        return RoundResult(
            verdict, stats, dict(call.held), call.resyncs, dict(call.seconds), hit, plain, verified.logprobs
        )

    def _pre_draft(
        self, tokens: Sequence[int], spec: TreeSpec, drafter: TickLoop, likely: Sequence[int]
    ) -> _Ahead:
        """Queue the next round's draft now, assuming its committed tokens will be `likely` more."""
        future = drafter.draft(self.session, len(tokens), likely, spec, guess_next=True, speculative=True)
        return _Ahead(PreDraft(len(tokens), tuple(likely)), spec, future)

    def close(self) -> None:
        """Drop a pre-draft in flight (the session ends), and any tick loop's wait for it."""
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None
        self.finished()

    def finished(self) -> None:
        """The session drafts no more: the drafter's tick loop does not wait for it."""
        if self._expected_by is not None:
            self._expected_by.unexpect(self.id)
            self._expected_by = None


@dataclass
class _Ahead:
    """A pre-draft in flight: what it assumes, its shape, its future."""

    pre: PreDraft
    spec: TreeSpec
    call: asyncio.Future

    async def take(self, tokens: Sequence[int], spec: TreeSpec, placement: Placement) -> Drafted | None:
        """Its answer if it applies to this round (the committed tokens it assumed, the same
        shape, the drafter still holding what it was sent on), else None, cancelled. A pre-draft
        that fails or runs past the per-try timeout is None too: the round's own draft then meets
        the replica's trouble with the usual retries."""
        held = placement.held.get(Role.DRAFTER, 0)
        if spec != self.spec or held != self.pre.base or not self.pre.applies(tokens):
            self.cancel()
            return None
        period = placement.per_try(Role.DRAFTER, 1, spec.depth, 1) if placement.per_try else None
        done, _ = await asyncio.wait({self.call}, timeout=period)
        if not done or self.call.cancelled() or self.call.exception() is not None:
            self.cancel()
            return None
        response = self.call.result()
        return None if response.superseded else response

    def cancel(self) -> None:
        """Cancel it (the drafter stops it at its next level; a real draft supersedes it)."""
        self.call.cancel()
        self.call.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future) -> None:
    """Read a dropped call's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class _Calls:
    """The replica calls of one round, tracking what each replica holds."""

    def __init__(self, placement: Placement, committed: int) -> None:
        self.held = {role: placement.held.get(role, 0) for role in Role}
        self.timeout, self.per_try, self.spare = placement.timeout, placement.per_try, placement.spare
        self.committed, self.resyncs = committed, 0
        self.seconds: dict[Role, float] = {}
        self.deadline = None if self.timeout is None else asyncio.get_running_loop().time() + self.timeout

    async def __call__(
        self, role: Role, make: Callable[[int, Timing], asyncio.Future], work: int, steps: int = 1
    ) -> Any:
        """make(position, timing); on a resync answer, once more with position 0 (all tokens).
        work: the tree levels a draft builds / the nodes a verification checks, steps: the plain
        steps it may decode (both for the per-try timeout, which the tick loop keeps).

        With nothing new for the replica (a round retried after its verification failed),
        restart the session there: new tokens may not be empty, they produce the root distribution."""
        held = self.held[role]
        position = held if held < self.committed else 0
        start = time.perf_counter()
        try:
            try:
                response = await self._try(make, role, position, work, steps)
            except (ItemError, grpc.aio.AioRpcError) as error:
                if position == 0 or not needs_resync(error):
                    raise
                self.resyncs += 1
                response = await self._try(make, role, 0, work, steps)
        except (ItemError, grpc.aio.AioRpcError) as error:
            raise ReplicaFailure(role, error, self.held, per_try=getattr(error, "per_try", False)) from error
        self.took(role, time.perf_counter() - start)
        return response

    def took(self, role: Role, seconds: float) -> None:
        """A call of `role` answered after `seconds` (a pre-draft's wait included): the replica now
        holds the round's committed tokens (a pre-draft's drafter fed them)."""
        self.held[role] = self.committed
        self.seconds[role] = seconds

    async def _try(
        self, make: Callable[[int, Timing], asyncio.Future], role: Role, position: int, work: int, steps: int
    ) -> Any:
        """One call, within the round's deadline and per-try timeout (the tick loop fails it
        when they run out)."""
        patience = self.per_try(role, self.committed - position, work, steps) if self.per_try else None
        call = make(position, Timing(self.deadline, patience, lambda: self.spare(role)))
        try:
            return await call
        finally:
            # Cancelled ourselves (the client left): the item goes too. Left running, it could reach
            # the replica after the session's release and make it anew there.
            if not call.done():
                call.cancel()


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
