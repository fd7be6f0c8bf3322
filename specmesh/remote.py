"""Async client of the drafter and verifier services: one session's rounds over gRPC.

    result = await generate_remote("127.0.0.1:50061", "127.0.0.1:50062", prompt_ids, spec, params, 64)

`RoundClient.round(tokens)` is THE round (Draft, then Verify with the tree as the drafter sent
it), shared by `RemoteSession` (tests, benchmarks) and the gateway (gateway/rounds.py, which
keeps the committed tokens in Redis and swaps replicas on failover). It produces exactly the
tokens of the in-process `SpeculativeEngine` for the same seed. The client tracks how many
committed tokens each replica holds and sends only the rest. A replica that answers
FAILED_PRECONDITION with `specmesh-resync: 1` (restart, failover, eviction of its state) gets the
session's full token list with position 0, once per call. Other errors are raised as
`ReplicaFailure` naming the replica's role: choosing another replica is the caller's business (it
can swap `drafter` / `verifier` and their `held` count between rounds).
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
import torch

from specmesh import wire
from specmesh.adaptive import AdaptivePolicy
from specmesh.drafting import TreeSpec
from specmesh.engine import Request, keep_emitted
from specmesh.proto import pb2, pb2_grpc
from specmesh.sampling import SamplingParams
from specmesh.stats import GenerationResult, GenerationStats
from specmesh.tree import tree_depths
from specmesh.verification import Verdict

CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)


def open_channel(address: str) -> grpc.aio.Channel:
    """An insecure channel sized for trees with dense distributions over large vocabularies."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def needs_resync(error: grpc.aio.AioRpcError) -> bool:
    """The replica does not hold the session at the caller's position: resend everything."""
    if error.code() != grpc.StatusCode.FAILED_PRECONDITION:
        return False
    return any(key == wire.RESYNC_KEY and value == "1" for key, value in error.trailing_metadata() or ())


class ReplicaFailure(Exception):
    """A Draft or Verify call failed for another reason than a resync; `role` says which replica."""

    def __init__(self, role: str, error: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{role}: {error.code().name}: {error.details()}")
        self.role = role
        self.error = error


@dataclass(frozen=True)
class RoundResult:
    verdict: Verdict
    stats: GenerationStats  # this round's delta

    @property
    def tokens(self) -> list[int]:
        """Accepted tokens plus the recovered or bonus token, before any stop / length cut."""
        return self.verdict.emitted_tokens


class RoundClient:
    """One session's rounds against a drafter and a verifier (drafter None: method "none" only).

    `held[role]` is the number of committed tokens the caller believes that replica holds; a
    caller that swaps a replica sets it to what it knows of the new one (0 if nothing)."""

    def __init__(
        self,
        session_id: str,
        params: SamplingParams,
        spec: TreeSpec,
        drafter: pb2_grpc.DrafterStub | None,
        verifier: pb2_grpc.VerifierStub | None,
        *,
        timeout: float | None = 60.0,
        policy: AdaptivePolicy | None = None,
    ) -> None:
        """policy: adaptive speculation; `spec` is then only its family and first depth."""
        self.id, self.params, self.spec = session_id, params, spec
        self.drafter, self.verifier, self.timeout = drafter, verifier, timeout
        self.policy = policy
        self.held = {"drafter": 0, "verifier": 0}
        self.resyncs = 0

    async def round(self, tokens: Sequence[int]) -> RoundResult:
        """Draft and verify after the committed `tokens`; commits nothing on the caller's side.

        Stats: draft_seconds and verify_seconds are what the services report (tree build time,
        batched forward time), total_seconds the round's wall time; the rest is network."""
        start = time.perf_counter()
        spec = self.policy.next_spec() if self.policy else self.spec
        drafted = None
        if spec.method != "none":
            if self.drafter is None:
                raise ValueError(f"method {spec.method!r} needs a drafter")
            make_draft = functools.partial(self._draft_request, tokens, spec)
            drafted = await self._call("drafter", self.drafter.Draft, make_draft, len(tokens))
        tree = drafted.tree if drafted is not None else None
        make_verify = functools.partial(self._verify_request, tokens, tree)
        verified = await self._call("verifier", self.verifier.Verify, make_verify, len(tokens))
        verdict = wire.verdict_from_proto(verified)
        self.held["verifier"] += len(verdict.accepted_tokens)  # it committed the accepted path itself
        stats = GenerationStats.for_round(
            drafted_tokens=len(tree.tokens) if tree is not None else 0,
            accepted_tokens=len(verdict.accepted_tokens),
            tree_depth=int(tree_depths(torch.tensor(tree.parents)).max()) if tree is not None else 0,
            draft_calls=drafted.draft_calls if drafted is not None else 0,
            draft_seconds=drafted.draft_seconds if drafted is not None else 0.0,
            verify_seconds=verified.forward_seconds,
            total_seconds=time.perf_counter() - start,
        )
        if self.policy:
            self.policy.observe(spec, stats)
        return RoundResult(verdict, stats)

    def _draft_request(self, tokens: Sequence[int], spec: TreeSpec, position: int) -> pb2.DraftRequest:
        return wire.draft_request(self.id, position, list(tokens[position:]), self.params, spec)

    def _verify_request(
        self, tokens: Sequence[int], tree: pb2.DraftTree | None, position: int
    ) -> pb2.VerifyRequest:
        return wire.verify_request(self.id, position, list(tokens[position:]), self.params, tree)

    async def release(self) -> None:
        """Free the session's KV on both current replicas (best effort: a replica may be gone)."""
        for stub in (self.drafter, self.verifier):
            if stub is not None:
                await release_session(stub, self.id, self.timeout)

    async def _call(
        self, role: str, method: Callable[..., Awaitable[Any]], make: Callable[[int], Any], committed: int
    ) -> Any:
        """method(make(position)); on a resync answer, once more with position 0 (all tokens).

        With nothing new for the replica (a round retried after its Verify failed), restart the
        session there: new_token_ids may not be empty, they produce the root distribution."""
        position = self.held[role] if self.held[role] < committed else 0
        try:
            try:
                response = await method(make(position), timeout=self.timeout)
            except grpc.aio.AioRpcError as error:
                if position == 0 or not needs_resync(error):
                    raise
                self.resyncs += 1
                response = await method(make(0), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            raise ReplicaFailure(role, error) from error
        self.held[role] = committed
        return response


async def release_session(
    stub: pb2_grpc.DrafterStub | pb2_grpc.VerifierStub, session_id: str, timeout: float | None
) -> bool:
    """Release on one replica; False if it did not hold the session or could not be reached."""
    try:
        reply = await stub.Release(pb2.ReleaseRequest(session_id=session_id), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.released


class RemoteSession(RoundClient):
    """One whole generation against a drafter and a verifier, the committed tokens kept here."""

    def __init__(
        self,
        drafter: pb2_grpc.DrafterStub | None,
        verifier: pb2_grpc.VerifierStub,
        request: Request,
        *,
        session_id: str | None = None,
        timeout: float | None = 60.0,
    ) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if drafter is None and request.spec.method != "none":
            raise ValueError(f"method {request.spec.method!r} needs a drafter")
        seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
        params = replace(request.params, seed=seed)
        super().__init__(
            session_id or uuid.uuid4().hex,
            params,
            request.spec,
            drafter,
            verifier,
            timeout=timeout,
            policy=AdaptivePolicy(request.spec) if request.adaptive else None,
        )
        self.request = request
        self.tokens = [int(t) for t in request.prompt_ids]  # committed: prompt + generated
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.generated), self.finish_reason or "length", self.stats)

    async def step(self) -> list[int]:
        """One round; returns the tokens it emitted (cut at max_new_tokens or a stop token).
        A failed replica call raises its grpc.aio.AioRpcError; the next step retries the round."""
        try:
            result = await self.round(self.tokens)
        except ReplicaFailure as failure:
            raise failure.error from None
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


async def generate_remote(
    drafter_address: str | None,
    verifier_address: str,
    prompt_ids: Sequence[int],
    spec: TreeSpec,
    params: SamplingParams,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
) -> GenerationResult:
    """One whole generation over gRPC; the session is released on both replicas afterwards."""
    request = Request(prompt_ids, spec, params, max_new_tokens, tuple(stop_token_ids))
    verifier_channel = open_channel(verifier_address)
    drafter_channel = open_channel(drafter_address) if drafter_address else None
    try:
        drafter = pb2_grpc.DrafterStub(drafter_channel) if drafter_channel else None
        session = RemoteSession(drafter, pb2_grpc.VerifierStub(verifier_channel), request)
        try:
            return await session.run()
        finally:
            await session.release()
    finally:
        await verifier_channel.close()
        if drafter_channel is not None:
            await drafter_channel.close()
