"""The public API's generated code (proto/specmesh/v1/gateway.proto) and what the gateway builds
from core types: GenerationStats -> specmesh.v1.GenerationStats, TokenLogprob -> its message."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specmesh.core.logprobs import TokenLogprob
from specmesh.core.stats import GenerationStats
from specmesh.rpc.proto import load

gateway_pb2, gateway_pb2_grpc = load("gateway")
# GenerateStream's initial metadata: the session's id, sent as soon as the session exists, so that
# a client cut off before its first chunk can resume it (gateway/client.py)
SESSION_ID_METADATA = "specmesh-session-id"


def stats_to_proto(stats: GenerationStats, *, prompt_tokens: int = 0, generated_tokens: int = 0) -> Any:
    """A `specmesh.v1.GenerationStats` message (the public API's stats)."""
    return gateway_pb2.GenerationStats(
        target_calls=stats.target_calls,
        drafted_tokens=stats.drafted_tokens,
        accepted_tokens=stats.accepted_tokens,
        block_efficiency=stats.block_efficiency,
        acceptance_per_depth=stats.acceptance_per_depth,
        draft_seconds=stats.draft_seconds,
        verify_seconds=stats.verify_seconds,
        network_seconds=stats.network_seconds,
        rounds=stats.rounds,
        draft_calls=stats.draft_calls,
        total_seconds=stats.total_seconds,
        prompt_tokens=prompt_tokens,
        generated_tokens=generated_tokens,
        cached_prompt_tokens=min(stats.cached_prompt_tokens, prompt_tokens),
    )


def logprobs_to_proto(logprobs: Sequence[TokenLogprob]) -> list[Any]:
    """`specmesh.v1.TokenLogprob` messages (the public API's logprobs)."""
    top = gateway_pb2.TopLogprob
    return [
        gateway_pb2.TokenLogprob(
            token_id=t.token, logprob=t.logprob, top=[top(token_id=a, logprob=v) for a, v in t.top]
        )
        for t in logprobs
    ]
