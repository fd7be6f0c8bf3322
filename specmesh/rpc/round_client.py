"""Async client of the drafter and verifier services: one session's rounds over gRPC.

    result = await generate_remote("127.0.0.1:50061", "127.0.0.1:50062", prompt_ids, spec, params, 64)

`RoundClient.round(tokens, placement)` is THE round (Draft, then Verify with the tree as the
drafter sent it), shared by `RemoteSession` (tests, benchmarks) and the gateway
(gateway/rounds.py, which keeps the committed tokens in Redis and swaps replicas on failover). It
produces exactly the tokens of the in-process `SpeculativeEngine` for the same seed. The
`Placement` says which replicas run the round and how many committed tokens each holds; only the
rest is sent, and the result says what each holds afterwards. A replica that answers
FAILED_PRECONDITION with `specmesh-resync: 1` (restart, failover, eviction of its state) gets the
session's full token list with position 0, once per call. Other errors are raised as
`ReplicaFailure` naming the replica's role: choosing another replica is the caller's business.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
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
from specmesh.rpc.tls import ClientTls, aio_channel

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def open_channel(address: str, tls: ClientTls | None = None) -> grpc.aio.Channel:
    """A channel sized for trees with dense distributions over large vocabularies; TLS with `tls`."""
    return aio_channel(address, tls, options=CHANNEL_OPTIONS)


class RelayDrafterStub:
    """A Drafter stub whose Draft answers keep the tree as the drafter encoded it
    (DraftResponseRelay): the round client hands those bytes to the verifier undecoded."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = pb2_grpc.DrafterStub(channel)
        self.Draft = channel.unary_unary(
            "/specmesh.v1.Drafter/Draft",
            request_serializer=pb2.DraftRequest.SerializeToString,
            response_deserializer=pb2.DraftResponseRelay.FromString,
        )
        self.Release, self.Info = stub.Release, stub.Info


class RelayVerifierStub:
    """A Verifier stub whose Verify sends a VerifyRequestRelay (a relayed tree's bytes) as well as
    a VerifyRequest: the same message on the wire."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = pb2_grpc.VerifierStub(channel)
        self.Verify = channel.unary_unary(
            "/specmesh.v1.Verifier/Verify",
            request_serializer=_serialize,
            response_deserializer=pb2.VerifyResponse.FromString,
        )
        self.Release, self.Info = stub.Release, stub.Info


def _serialize(message: Any) -> bytes:
    return message.SerializeToString()


def needs_resync(error: grpc.aio.AioRpcError) -> bool:
    """The replica does not hold the session at the caller's position: resend everything."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    return any(key == wire.RESYNC_KEY and value == "1" for key, value in error.trailing_metadata() or ())


class Role(StrEnum):
    DRAFTER = "drafter"
    VERIFIER = "verifier"


@dataclass(frozen=True)
class Placement:
    """Where one round runs: the replicas, what each holds, and how long a call may take.

    held: committed tokens the caller believes each replica holds (0 or missing: nothing, it gets
    everything with position 0). drafter None: method "none" only. timeout: what the round may
    take in all. per_try(role, new tokens, levels drafted or nodes verified, plain steps): how long
    a call runs before the caller is asked, spare(role), whether to give it up for a spare replica
    (asked again after every such period; None: a call may take the whole timeout)."""

    verifier: pb2_grpc.VerifierStub | RelayVerifierStub
    drafter: pb2_grpc.DrafterStub | RelayDrafterStub | None = None
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
    """A Draft or Verify call failed for another reason than a resync; `role` says which replica,
    `held` what each replica holds as far as the round got (a Draft may have succeeded),
    `per_try` whether it ran out of its per-try timeout (not of the whole round's)."""

    def __init__(
        self, role: Role, error: grpc.aio.AioRpcError, held: Mapping[Role, int], per_try: bool = False
    ) -> None:
        super().__init__(f"{role}: {error.code().name}: {error.details()}")
        self.role = role
        self.error = error
        self.held = dict(held)
        self.per_try = per_try


class RoundClient:
    """One session's rounds: `round(tokens, placement)` drafts and verifies after the committed
    `tokens` on the replicas the placement names. The client keeps only what belongs to the
    session (id, sampling, tree family, adaptive policy); where it runs is the caller's."""

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
        its family and first depth. key: the session's secret, sent with every call (replicas
        serve the session only to callers that send it). pipeline: whether rounds pre-draft (None:
        never); the gateway shares one among its sessions, so that what one learnt holds for all.
        stop_token_ids: where a plain call of several steps stops. top_logprobs: every round returns
        its tokens' log-probabilities with this many alternatives (None: none). grammar: structured
        output, sent with every Draft and Verify."""
        self.id, self.params, self.spec, self.policy = session_id, params, spec, policy
        self.stop_token_ids, self.top_logprobs, self.grammar = list(stop_token_ids), top_logprobs, grammar
        self.metadata = wire.session_metadata(key)
        self.pipeline = pipeline or PipelinePolicy(Pipelining.OFF)
        self._ahead: _Ahead | None = None  # the next round's pre-draft, in flight or done

    async def round(self, tokens: Sequence[int], placement: Placement, plain_steps: int = 1) -> RoundResult:
        """Draft and verify after the committed `tokens`; commits nothing on the caller's side.

        plain_steps: where the round drafts nothing (method none, no adaptive policy), the verifier
        may decode up to that many tokens in this one call (VerifyRequest.plain_steps).

        Pipelined (specmesh.core.ahead): the tree may come from the pre-draft the previous round
        sent beside its Verify, if it assumed exactly these tokens; this round may send the next
        one. Stats: draft_seconds and verify_seconds are what the services report (tree build time,
        batched forward time), total_seconds the round's wall time; the rest is network."""
        start = time.perf_counter()
        spec = self.policy.next_spec() if self.policy else self.spec
        call = _Calls(placement, len(tokens), self.metadata)
        ahead, self._ahead = self._ahead, None
        drafted, hit, serial_draft = None, None, None
        if spec.method.drafts:
            if placement.drafter is None:
                raise ValueError(f"method {spec.method!r} needs a drafter")
            want = self.pipeline.wants()  # a pre-draft beside this round's Verify
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
                make_draft = functools.partial(self._draft_request, tokens, spec, want)
                drafted = await call(Role.DRAFTER, placement.drafter.Draft, make_draft, spec.depth)
                serial_draft = call.seconds[Role.DRAFTER]
            if drafted.likely_token_ids and want:
                self._ahead = self._pre_draft(tokens, spec, placement, drafted.likely_token_ids)
        # a relayed tree (DraftResponseRelay) goes on as the drafter's bytes, never decoded here
        tree = drafted.tree if drafted is not None else None
        steps = plain_steps if drafted is None and self.policy is None else 1
        make_verify = functools.partial(self._verify_request, tokens, tree, steps)
        nodes = drafted.tree_nodes if drafted is not None else 0
        try:
            verified = await call(Role.VERIFIER, placement.verifier.Verify, make_verify, nodes, steps)
        except BaseException:
            if self._ahead is not None:  # the round is redone from the committed tokens
                self._ahead.cancel()
                self._ahead = None
            raise
        self.pipeline.observe(
            verify=call.seconds[Role.VERIFIER],
            beside=self._ahead is not None,
            draft=serial_draft,
            levels=drafted.draft_calls if serial_draft is not None else 0,
            hit=hit,
        )
        verdict, plain = wire.verdict_from_proto(verified), list(verified.plain_token_ids)
        # it committed the accepted path (a plain call: the tokens before the last) itself
        call.held[Role.VERIFIER] += len(plain) + len(verdict.accepted_tokens)
        stats = GenerationStats.for_round(
            drafted_tokens=nodes,
            accepted_tokens=len(verdict.accepted_tokens),
            tree_depth=drafted.tree_depth if drafted is not None else 0,
            draft_calls=drafted.draft_calls if drafted is not None else 0,
            draft_seconds=drafted.draft_seconds if drafted is not None else 0.0,
            verify_seconds=verified.forward_seconds,
            total_seconds=time.perf_counter() - start,
            plain_steps=len(plain) + 1,
        )
        if self.policy:
            # batch_tokens 0: a replica that does not say; the policy then counts this session alone
            load = Load(verified.batch_size, verified.batch_tokens) if verified.batch_tokens else None
            self.policy.observe(spec, stats, load)
        logprobs = wire.logprobs_from_proto(verified.logprobs)
        return RoundResult(
            verdict, stats, dict(call.held), call.resyncs, dict(call.seconds), hit, plain, logprobs
        )

    def _draft_request(
        self, tokens: Sequence[int], spec: TreeSpec, guess_next: bool, position: int
    ) -> pb2.DraftRequest:
        return wire.draft_request(
            self.id, position, list(tokens[position:]), self.params, spec, guess_next=guess_next,
            grammar=self.grammar,
        )  # fmt: skip

    def _pre_draft(
        self, tokens: Sequence[int], spec: TreeSpec, placement: Placement, likely: Sequence[int]
    ) -> _Ahead:
        """Send the next round's Draft now, assuming its committed tokens will be `likely` more."""
        assert placement.drafter is not None
        request = wire.draft_request(
            self.id, len(tokens), list(likely), self.params, spec, guess_next=True, speculative=True,
            grammar=self.grammar,
        )  # fmt: skip
        call = placement.drafter.Draft(request, timeout=placement.timeout, metadata=self.metadata)
        return _Ahead(PreDraft(len(tokens), tuple(likely)), spec, asyncio.ensure_future(call))

    def close(self) -> None:
        """Drop a pre-draft in flight (the session ends)."""
        if self._ahead is not None:
            self._ahead.cancel()
            self._ahead = None

    def _verify_request(
        self, tokens: Sequence[int], tree: pb2.DraftTree | bytes | None, plain_steps: int, position: int
    ) -> pb2.VerifyRequest | pb2.VerifyRequestRelay:
        new, stops = list(tokens[position:]), self.stop_token_ids
        return wire.verify_request(
            self.id, position, new, self.params, tree, plain_steps, stops, self.top_logprobs, self.grammar
        )


@dataclass
class _Ahead:
    """A pre-draft in flight: what it assumes, its shape, its call."""

    pre: PreDraft
    spec: TreeSpec
    call: asyncio.Future

    async def take(self, tokens: Sequence[int], spec: TreeSpec, placement: Placement) -> Any:
        """Its DraftResponse if it applies to this round (the committed tokens it assumed, the
        same shape, the drafter still holding what it was sent on), else None, cancelled. A
        pre-draft that fails or runs past the per-try timeout is None too: the round's own Draft
        then meets the replica's trouble with the usual retries."""
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
        """Cancel the call (the drafter stops it at its next level; a real Draft supersedes it)."""
        self.call.cancel()
        self.call.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future) -> None:
    """Read a dropped call's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


class _Calls:
    """The replica calls of one round, tracking what each replica holds."""

    def __init__(self, placement: Placement, committed: int, metadata: tuple) -> None:
        self.held = {role: placement.held.get(role, 0) for role in Role}
        self.timeout, self.per_try, self.spare = placement.timeout, placement.per_try, placement.spare
        self.committed, self.resyncs = committed, 0
        self.metadata = metadata
        self.seconds: dict[Role, float] = {}

    async def __call__(
        self,
        role: Role,
        method: Callable[..., Awaitable[Any]],
        make: Callable[[int], Any],
        work: int,
        steps: int = 1,
    ) -> Any:
        """method(make(position)); on a resync answer, once more with position 0 (all tokens).
        work: the tree levels a Draft builds / the nodes a Verify checks, steps: the plain steps a
        Verify may decode (both for the per-try timeout).

        With nothing new for the replica (a round retried after its Verify failed), restart the
        session there: new_token_ids may not be empty, they produce the root distribution."""
        held = self.held[role]
        position = held if held < self.committed else 0
        start = time.perf_counter()
        try:
            try:
                response = await self._try(role, method, make(position), position, work, steps)
            except grpc.aio.AioRpcError as error:
                if position == 0 or not needs_resync(error):
                    raise
                self.resyncs += 1
                response = await self._try(role, method, make(0), 0, work, steps)
        except _GivenUp as given_up:
            raise ReplicaFailure(role, given_up.error, self.held, per_try=True) from None
        except grpc.aio.AioRpcError as error:
            raise ReplicaFailure(role, error, self.held) from error
        self.took(role, time.perf_counter() - start)
        return response

    def took(self, role: Role, seconds: float) -> None:
        """A call of `role` answered after `seconds` (a pre-draft's wait included): the replica now
        holds the round's committed tokens (a pre-draft's drafter fed them)."""
        self.held[role] = self.committed
        self.seconds[role] = seconds

    async def _try(
        self, role: Role, method: Callable[..., Any], request: Any, position: int, work: int, steps: int
    ) -> Any:
        """One call, with the round's timeout; every per-try period it runs past, the caller is
        asked whether a spare replica could take it (then it is cancelled: _GivenUp)."""
        call = method(request, timeout=self.timeout, metadata=self.metadata)
        if self.per_try is None:
            return await call
        period = self.per_try(role, self.committed - position, work, steps)
        task = asyncio.ensure_future(call)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=period)
                if done:
                    return task.result()
                if self.spare(role):
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    raise _GivenUp(period)
        finally:
            # Cancelled ourselves (the client left): cancel the call too. Left running, it could
            # reach the replica after the session's Release and make the session there anew.
            task.cancel()


class _GivenUp(Exception):
    """A call that ran past its per-try timeout while a spare replica was there."""

    def __init__(self, period: float) -> None:
        super().__init__(f"no answer within the per-try timeout of {period:.2f} s")
        self.error = grpc.aio.AioRpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata(), details=str(self)
        )


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
    """One whole generation against a drafter and a verifier, the committed tokens kept here."""

    def __init__(
        self,
        drafter: pb2_grpc.DrafterStub | None,
        verifier: pb2_grpc.VerifierStub,
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
        A failed replica call raises its grpc.aio.AioRpcError; the next step retries the round."""
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
        for stub in (self.drafter, self.verifier):
            if stub is not None:
                await release_session(stub, self.id, self.timeout)


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
    verifier_channel = open_channel(verifier_address)
    drafter_channel = open_channel(drafter_address) if drafter_address else None
    try:
        drafter = pb2_grpc.DrafterStub(drafter_channel) if drafter_channel else None
        verifier = pb2_grpc.VerifierStub(verifier_channel)
        session = RemoteSession(drafter, verifier, request, pipelining=pipelining)
        try:
            return await session.run()
        finally:
            await session.release()
    finally:
        await verifier_channel.close()
        if drafter_channel is not None:
            await drafter_channel.close()
