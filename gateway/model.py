"""The model a gateway serves, learnt from a verifier (`learn_model`): its id, tokenizer, the
limits requests are checked against, and the replicas' measured forward costs, which size the
prefill chunk and the per-try timeouts."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import grpc

from gateway.config import GatewayConfig
from gateway.env import GatewayEnv
from gateway.requests import ModelLimits
from gateway.retries import TryTimeouts
from specmesh.rpc.flags import Limits
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.round_client import Role
from specmesh.runtime.tokenizers import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger("specmesh.gateway")


@dataclass(frozen=True)
class ServedModel:
    name: str  # the verifier's model id (InfoResponse.model_id)
    tokenizer: Any
    limits: ModelLimits
    forward_cost: dict[int, float]  # the verifier's, rows -> seconds (InfoResponse.forward_cost)
    draft_cost: dict[int, float]  # a drafter's, likewise (empty: no drafter answered)


async def learn_model(env: GatewayEnv, config: GatewayConfig) -> ServedModel:
    """Info from a healthy verifier; the tokenizer; the limits requests are checked against."""
    address = (await env.verifiers.wait_healthy(1))[0]
    stub = pb2_grpc.VerifierStub(env.verifiers.channel(address))
    info = await stub.Info(pb2.InfoRequest(), timeout=config.round_timeout)
    source = config.tokenizer or info.model_id
    tokenizer, context = await asyncio.to_thread(load_tokenizer, source)
    if tokenizer_fingerprint(tokenizer) != info.tokenizer_fingerprint:
        raise RuntimeError(
            f"the tokenizer of {source!r} is not the one verifier {address} uses ({info.model_id!r})"
        )
    c = config
    limits = ModelLimits(
        vocab_size=info.vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        max_context=c.max_context or context or 0,
        max_new_tokens_limit=c.max_new_tokens_limit,
        default_max_new_tokens=c.default_max_new_tokens,
        tree=Limits(**{f.name: getattr(c, f.name) for f in dataclasses.fields(Limits)}),
        max_stop_sequences=c.max_stop_sequences,
        max_stop_length=c.max_stop_length,
        max_prompt_bytes=c.max_prompt_bytes,
    )
    forward_cost = {c.rows: c.seconds for c in info.forward_cost}
    draft_cost = await _draft_cost(env, config.round_timeout)
    env.forward_costs = {Role.VERIFIER: forward_cost, Role.DRAFTER: draft_cost}
    env.verifiers.prefill_chunk(c.chunk(forward_cost))
    if env.drafters is not None:  # a drafter that did not answer: the verifier's chunk
        env.drafters.prefill_chunk(c.chunk(draft_cost or forward_cost))
    chunks = {Role.VERIFIER: env.verifiers.max_tick_tokens}
    if env.drafters is not None:
        chunks[Role.DRAFTER] = env.drafters.max_tick_tokens
    for role, tokens in chunks.items():
        env.metrics.prefill_chunk.labels(role).set(tokens)
    log.info("prefill chunk", extra={role.value: tokens for role, tokens in chunks.items()})
    if c.try_timeout_factor > 0:
        floor, factor = c.try_timeout_floor, c.try_timeout_factor
        env.try_timeouts = TryTimeouts(floor, factor, draft_cost, forward_cost)
    return ServedModel(info.model_id, tokenizer, limits, forward_cost, draft_cost)


async def _draft_cost(env: GatewayEnv, timeout: float) -> dict[int, float]:
    """A drafter's measured forward cost, for DSI's choice of shape; {} if none answers now."""
    pool = env.drafters
    if pool is None or not pool.healthy():
        return {}
    stub = pb2_grpc.DrafterStub(pool.channel(pool.healthy()[0]))
    try:
        info = await stub.Info(pb2.InfoRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return {}
    return {c.rows: c.seconds for c in info.forward_cost}
