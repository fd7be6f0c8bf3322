"""Async client of the drafter and verifier services: one session's rounds over gRPC.

    result = await generate_remote("127.0.0.1:50061", "127.0.0.1:50062", prompt_ids, spec, params, 64)

`RemoteSession.step()` runs one round (Draft, then Verify with the tree as the drafter sent it)
and returns the emitted tokens; it produces exactly the tokens of the in-process
`SpeculativeEngine` for the same seed. The session tracks how many committed tokens each replica
holds and sends only the rest. A replica that answers FAILED_PRECONDITION with
`specmesh-resync: 1` (restart, failover, eviction of its state) gets the session's full token list
with position 0, once per call. Other errors propagate: choosing another replica is the
gateway's business (it can swap `drafter` / `verifier` between rounds).
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from typing import Any

import grpc
import torch

from specmesh import wire
from specmesh.drafting import TreeSpec
from specmesh.engine import Request
from specmesh.proto import pb2, pb2_grpc
from specmesh.sampling import SamplingParams
from specmesh.stats import GenerationResult, GenerationStats
from specmesh.tree import tree_depths

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


class RemoteSession:
    """One generation against a drafter and a verifier (drafter None: method "none" only)."""

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
        self.drafter, self.verifier, self.request, self.timeout = drafter, verifier, request, timeout
        self.id = session_id or uuid.uuid4().hex
        self.params: SamplingParams = replace(request.params, seed=seed)
        self.tokens = [int(t) for t in request.prompt_ids]  # committed: prompt + generated
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self.stats = GenerationStats()
        self.resyncs = 0
        self._held = {"drafter": 0, "verifier": 0}  # committed tokens each replica holds

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def result(self) -> GenerationResult:
        return GenerationResult(list(self.generated), self.finish_reason or "length", self.stats)

    async def step(self) -> list[int]:
        """One round; returns the tokens it emitted (cut at max_new_tokens or a stop token).

        Stats: draft_seconds and verify_seconds are what the services report (tree build time,
        batched forward time), total_seconds the round's wall time; the rest is network."""
        start = time.perf_counter()
        drafted = None
        if self.request.spec.method != "none":
            drafted = await self._call("drafter", self.drafter.Draft, self._draft_request)
        tree = drafted.tree if drafted is not None else None
        verified = await self._call(
            "verifier", self.verifier.Verify, lambda at: self._verify_request(at, tree)
        )
        verdict = wire.verdict_from_proto(verified)
        self._held["verifier"] += len(verdict.accepted_tokens)  # it committed the accepted path itself
        self.stats += GenerationStats.for_round(
            drafted_tokens=len(tree.tokens) if tree is not None else 0,
            accepted_tokens=len(verdict.accepted_tokens),
            tree_depth=int(tree_depths(torch.tensor(tree.parents)).max()) if tree is not None else 0,
            draft_calls=drafted.draft_calls if drafted is not None else 0,
            draft_seconds=drafted.draft_seconds if drafted is not None else 0.0,
            verify_seconds=verified.forward_seconds,
            total_seconds=time.perf_counter() - start,
        )
        return self._emit(verdict.emitted_tokens)

    async def run(self) -> GenerationResult:
        while not self.done:
            await self.step()
        return self.result()

    async def release(self) -> None:
        """Free the session's KV on both replicas (best effort: a replica may be gone)."""
        for stub in (self.drafter, self.verifier):
            if stub is None:
                continue
            with contextlib.suppress(grpc.aio.AioRpcError):
                await stub.Release(pb2.ReleaseRequest(session_id=self.id), timeout=self.timeout)

    def _draft_request(self, position: int) -> pb2.DraftRequest:
        return wire.draft_request(self.id, position, self.tokens[position:], self.params, self.request.spec)

    def _verify_request(self, position: int, tree: pb2.DraftTree | None) -> pb2.VerifyRequest:
        return wire.verify_request(self.id, position, self.tokens[position:], self.params, tree)

    async def _call(
        self, replica: str, method: Callable[..., Awaitable[Any]], make: Callable[[int], Any]
    ) -> Any:
        """method(make(position)); on a resync answer, once more with position 0 (all tokens).

        With nothing new for the replica (a round retried after its Verify failed), restart the
        session there: new_token_ids may not be empty, they produce the root distribution."""
        position = self._held[replica] if self._held[replica] < len(self.tokens) else 0
        try:
            response = await method(make(position), timeout=self.timeout)
        except grpc.aio.AioRpcError as error:
            if position == 0 or not needs_resync(error):
                raise
            self.resyncs += 1
            response = await method(make(0), timeout=self.timeout)
        self._held[replica] = len(self.tokens)
        return response

    def _emit(self, tokens: list[int]) -> list[int]:
        stop = set(self.request.stop_token_ids)
        emitted = []
        for token in tokens:
            emitted.append(token)
            if token in stop:
                self.finish_reason = "stop"
            elif len(self.generated) + len(emitted) >= self.request.max_new_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        self.tokens += emitted
        self.generated += emitted
        return emitted


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
