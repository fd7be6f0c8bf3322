"""What speculation a request gets: the default's per-round choice (`FamilyPolicy`), an adaptive
plan's depth policy, a DSI request's shape, and whether this gateway's replicas can serve it at
all. Free functions of the plan, the served model's measured costs and the gateway's settings."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable

import grpc

from gateway.config import GatewayConfig
from gateway.env import GatewayEnv, GatewayError
from gateway.model import ServedModel
from gateway.requests import AUTO_SPEC, DsiSettings, GenerationPlan
from specmesh.core.adaptive import MAX_LOOKUP, AdaptivePolicy, FamilyPolicy, RoundPolicy
from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import Shape, choose_shape
from specmesh.core.methods import Method
from specmesh.core.ngram import prompt_hit_rate

DSI_MAX_LOOKAHEAD = 8  # the longest lookahead the gateway chooses by itself
DSI_UNKNOWN_DRAFT_SHARE = 0.5  # a drafter's cost relative to the target's, before one is measured
ADAPTIVE_PRIOR = 0.7  # the draft model's acceptance per level assumed before a session's first round
NONE_SPEC = TreeSpec(Method.NONE)


def plan_speculation(
    plan: GenerationPlan, model: ServedModel, env: GatewayEnv, config: GatewayConfig
) -> tuple[GenerationPlan, RoundPolicy | None]:
    """A request with no speculation field: a FamilyPolicy, which picks every round (plain
    steps with n-gram rides in the verifier, or the draft model's chain); an adaptive plan: its
    depth policy. Both reproducible (specmesh.core.adaptive): fixed start-up costs, the
    session's tokens and its own rounds. Runs in the parse thread."""
    overhead = config.call_overhead_ms / 1000.0
    draft_level = {
        Method.NGRAM: 0.0,  # a lookup: no forward
        Method.SUFFIX: 0.0,
        Method.CHAIN: model.draft_cost.get(1, DSI_UNKNOWN_DRAFT_SHARE * model.forward_cost.get(1, 0.0)),
    }

    ngram_hits = functools.cache(lambda: prompt_hit_rate(plan.prompt_ids))  # once, if asked

    def prior(method: Method) -> float:
        return ngram_hits() if method is Method.NGRAM else ADAPTIVE_PRIOR

    if plan.auto:
        chain = None
        if env.drafters is not None:
            chain = AdaptivePolicy(
                AUTO_SPEC, model.forward_cost, prior_alpha=ADAPTIVE_PRIOR,
                draft_cost=draft_level[Method.CHAIN], call_overhead=overhead,
            )  # fmt: skip
        free = plan.grammar is None  # a grammar masks a tree's paths: no rides (VerifyRequest.lookup_depth)
        family = FamilyPolicy(
            model.forward_cost, overhead, env.plain_steps, len(plan.prompt_ids), chain,
            max_lookup=min(MAX_LOOKUP, config.max_depth) if free else 0,
            suffix_rides=free and config.suffix_rides,
        )  # fmt: skip
        family.estimate.sync(plan.prompt_ids)  # here in the parse thread, not on the event loop
        # a drafter role only where the draft model's rounds may ever pay (FamilyPolicy)
        spec = AUTO_SPEC if family.chain is not None else NONE_SPEC
        return dataclasses.replace(plan, spec=spec, adaptive=False), family
    if not plan.adaptive:
        return plan, None
    method = plan.spec.method
    policy = AdaptivePolicy(
        plan.spec, model.forward_cost, prior_alpha=prior(method),
        draft_cost=draft_level.get(method, draft_level[Method.CHAIN]), call_overhead=overhead,
    )  # fmt: skip
    return plan, policy


async def dsi_shape(
    settings: DsiSettings, verify: Callable[[int], float], draft_cost: dict[int, float], env: GatewayEnv,
    max_parallel: int, max_depth: int = DSI_MAX_LOOKAHEAD,
) -> Shape:  # fmt: skip
    """A DSI request's lookahead and parallel verifications; what it leaves unset (0) is what
    the DSI simulation predicts fastest for the replicas' measured forward costs and the
    acceptance of earlier DSI sessions (specmesh.core.dsi.choose_shape). With `parallel` unset
    SI's schedule (no drafting ahead) is a candidate, and drafting ahead is charged the
    slowdown earlier DSI verifications of that many in flight measured: DSI then never plans
    to be slower than SI. A `parallel` the request sets is run as the paper's DSI, drafting ahead.
    A lookahead it chooses is at most `max_depth` (--max-depth: the deepest chain replicas take)."""
    limit = max_parallel
    if settings.parallel > limit:
        raise GatewayError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"speculation.parallel: {settings.parallel} is above the gateway's limit of {limit} "
            "(--dsi-max-parallel)",
            "speculation.parallel",
        )
    available = max(1, min(limit, len(env.verifiers.healthy())))
    parallels = [settings.parallel] if settings.parallel else range(1, available + 1)
    longest = min(DSI_MAX_LOOKAHEAD, max_depth)
    lookaheads = [settings.lookahead] if settings.lookahead else range(1, longest + 1)
    sequential = not settings.parallel
    if settings.parallel and settings.lookahead:
        return Shape(settings.lookahead, settings.parallel, seconds_per_token=0.0)  # nothing predicted
    draft = draft_cost.get(1, DSI_UNKNOWN_DRAFT_SHARE * verify(1))
    slowdown = {p: env.dsi.overlap_slowdown(p) for p in parallels}  # read here, not in the thread
    return await asyncio.to_thread(
        choose_shape, env.dsi.acceptance, draft, verify, parallels, lookaheads,
        sequential=sequential, overlap_slowdown=slowdown.__getitem__,
    )  # fmt: skip


def servable(plan: GenerationPlan, env: GatewayEnv) -> GenerationPlan:
    """The plan this gateway can run: without drafters, its own default is plain decoding
    (`plan_speculation` decides the default's rounds from the drafters it has)."""
    if plan.auto:
        return plan
    if plan.spec.method.model_free and env.ngram_drafters is None:
        raise GatewayError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"speculation.method: {plan.spec.method!r} needs model-free drafters; this gateway has none "
            "(--ngram-drafters)",
            "speculation.method",
        )
    if plan.spec.method.needs_model and env.drafters is None:
        raise GatewayError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"speculation.method: {plan.spec.method!r} needs drafters; this gateway has none "
            "(--drafters), use method 'none'",
            "speculation.method",
        )
    return plan
