"""What speculation a request gets (gateway/speculation.py), on the gateway's own objects: flags
parsed by `parse_config`, a GatewayEnv built from them as GatewayService builds it (its pools not
started, or started on real health servers where the count of healthy verifiers matters), plans
whose speculation is read by the gateway's parser. `plan_speculation`: the default's
FamilyPolicy and an adaptive plan's depth policy; `dsi_shape`: a DSI request's shape;
`servable`: whether this gateway's replicas can serve a plan."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.api import gateway_pb2
from gateway.config import GatewayConfig, parse_config
from gateway.env import GatewayEnv, GatewayError
from gateway.metrics import GatewayMetrics
from gateway.model import ServedModel
from gateway.pools import ReplicaPool
from gateway.requests import AUTO_SPEC, GenerationPlan, ModelLimits, speculation
from gateway.session_store import SessionStore
from gateway.speculation import (
    ADAPTIVE_PRIOR,
    DSI_MAX_LOOKAHEAD,
    NONE_SPEC,
    dsi_shape,
    plan_speculation,
    servable,
)
from specmesh.core.adaptive import MAX_LOOKUP, AdaptivePolicy, FamilyPolicy, ForwardCost
from specmesh.core.dsi import Learnt, Shape
from specmesh.core.grammar import Grammar
from specmesh.core.sampling import SamplingParams
from specmesh.rpc.tick_client import Role
from tests.test_pools import servers

# a GPU-like verifier: 20 ms a forward, rows nearly free
FLAT = {rows: 0.020 + 0.0002 * (rows - 1) for rows in (*range(1, 9), 16)}
PROMPT = list(range(10, 40))  # nothing repeats: prompt_hit_rate 0
COPYING = [1, 2, 3, 4, 5] * 8  # every position past the first quarter repeats: prompt_hit_rate 1
DEAD = "127.0.0.1:1"  # an address no pool here ever probes


def config(*argv: str) -> GatewayConfig:
    base = ["--verifiers", DEAD, "--call-overhead-ms", "2", "--plain-steps", "4", "--dsi-max-parallel", "4"]
    return parse_config([*base, *argv])


def gateway_env(c: GatewayConfig, dsi: Learnt | None = None) -> GatewayEnv:
    """GatewayService's env (gateway/server.py): pools of the flags' replicas, not started."""
    drafters = ReplicaPool(c.drafters, name="drafter", role=Role.DRAFTER) if c.drafters else None
    ngram = (
        ReplicaPool(c.ngram_drafters, name="ngram-drafter", role=Role.DRAFTER) if c.ngram_drafters else None
    )
    verifiers = ReplicaPool(c.verifiers, name="verifier", role=Role.VERIFIER)
    env = GatewayEnv(
        SessionStore(c.redis_url), drafters, verifiers, GatewayMetrics("test"), c.round_timeout,
        c.max_attempts, ngram_drafters=ngram, plain_steps=c.plain_steps,
    )  # fmt: skip
    env.dsi = dsi or env.dsi
    return env


def model(draft: dict[int, float]) -> ServedModel:
    limits = ModelLimits(vocab_size=100, eos_token_id=None, max_context=0, max_new_tokens_limit=64,
                         default_max_new_tokens=16)  # fmt: skip
    return ServedModel("tiny", None, limits, dict(FLAT), draft)


def plan(prompt: list[int] = PROMPT, grammar: Grammar | None = None, **fields: object) -> GenerationPlan:
    """A request's plan; no fields: a request with no speculation field (the default)."""
    spec = speculation(gateway_pb2.Speculation(**fields))
    return GenerationPlan(list(prompt), 16, (), (), SamplingParams(seed=1), grammar=grammar, **spec)


# ---- plan_speculation --------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["none", "chain", "mcsd"])
def test_a_plan_that_is_not_adaptive_runs_as_asked_without_a_policy(method: str) -> None:
    asked, c = plan(method=method), config("--drafters", DEAD)
    assert plan_speculation(asked, model({1: 0.001}), gateway_env(c), c) == (asked, None)


# at a 0.7 acceptance, 2 ms a call, a chain beats plain steps (~50 tokens/s) by 3 % up to a
# draft level of ~9.5 ms on this verifier
@pytest.mark.parametrize("draft, chained", [(0.008, True), (0.010, False)])
def test_the_default_keeps_the_draft_models_chain_only_where_it_beats_plain_steps(draft, chained) -> None:
    c = config("--drafters", DEAD)
    got, family = plan_speculation(plan(), model({1: draft}), gateway_env(c), c)
    assert isinstance(family, FamilyPolicy) and (family.chain is not None) is chained
    assert (got.spec, got.adaptive, got.auto) == (AUTO_SPEC if chained else NONE_SPEC, False, True)
    if chained:
        chain = family.chain
        assert (chain.base, chain.prior_alpha, chain.draft_cost, chain.call_overhead) == (
            AUTO_SPEC, ADAPTIVE_PRIOR, draft, 0.002,
        )  # fmt: skip


def test_the_default_gets_no_chain_without_drafters_however_cheap_the_draft() -> None:
    got, family = plan_speculation(plan(), model({1: 0.0001}), gateway_env(config()), config())
    assert isinstance(family, FamilyPolicy) and family.chain is None
    assert (got.spec, got.adaptive, got.auto) == (NONE_SPEC, False, True)


@pytest.mark.parametrize(
    "max_depth, grammar, rides",
    [
        ("3", None, 3),
        (str(MAX_LOOKUP), None, MAX_LOOKUP),
        ("16", None, MAX_LOOKUP),
        ("16", Grammar("x", 30), 0),
    ],
)
def test_rides_go_no_deeper_than_max_depth_or_six_and_not_at_all_under_a_grammar(
    max_depth, grammar, rides
) -> None:
    c = config("--max-depth", max_depth)
    _, family = plan_speculation(plan(grammar=grammar), model({}), gateway_env(c), c)
    assert family.max_lookup == rides


@pytest.mark.parametrize("steps, share", [("4", 0.002), ("1", 0.008)])
def test_the_call_overhead_is_shared_by_a_calls_plain_steps_and_charged_whole_to_a_chain(
    steps, share
) -> None:
    c = config("--drafters", DEAD, "--call-overhead-ms", "8", "--plain-steps", steps)
    _, family = plan_speculation(plan(), model({1: 0.001}), gateway_env(c), c)
    assert family.call_share == pytest.approx(share)
    assert family.chain is not None and family.chain.call_overhead == pytest.approx(0.008)


def test_the_default_takes_the_prompt_in_before_its_first_round_and_counts_rides_after_it() -> None:
    _, family = plan_speculation(plan(COPYING), model({}), gateway_env(config()), config())
    assert family.estimate.index.tokens == COPYING and family.estimate.start == len(COPYING)


@pytest.mark.parametrize("prompt, prior", [(COPYING, 1.0), (PROMPT, 0.0)])
def test_an_adaptive_ngram_plan_assumes_its_prompts_hit_rate_and_free_drafts(prompt, prior) -> None:
    asked = plan(prompt, method="ngram", adaptive=True)
    got, policy = plan_speculation(asked, model({1: 0.004}), gateway_env(config()), config())
    assert got is asked and isinstance(policy, AdaptivePolicy) and policy.base == asked.spec
    assert (policy.prior_alpha, policy.draft_cost, policy.call_overhead) == (prior, 0.0, 0.002)


def test_an_adaptive_suffix_plan_assumes_the_fixed_prior_and_free_drafts() -> None:
    """Suffix drafts are lookups too: no draft forward charged (a drafter's cost would be)."""
    asked = plan(COPYING, method="suffix", adaptive=True)
    got, policy = plan_speculation(asked, model({1: 0.004}), gateway_env(config()), config())
    assert got is asked and isinstance(policy, AdaptivePolicy) and policy.base == asked.spec
    assert (policy.prior_alpha, policy.draft_cost, policy.call_overhead) == (ADAPTIVE_PRIOR, 0.0, 0.002)


# an unmeasured drafter (no Info answered): half a target forward, 0.5 * FLAT[1]
@pytest.mark.parametrize("method", ["chain", "mcsd", "rsd_s"])
@pytest.mark.parametrize("draft, level", [({1: 0.004, 2: 0.9}, 0.004), ({}, 0.010)])
def test_an_adaptive_model_drafted_plan_assumes_the_fixed_prior_and_a_draft_level(
    method, draft, level
) -> None:
    asked = plan(COPYING, method=method, adaptive=True)  # a copying prompt: no n-gram prior here
    c = config("--drafters", DEAD)
    got, policy = plan_speculation(asked, model(draft), gateway_env(c), c)
    assert got is asked and isinstance(policy, AdaptivePolicy) and policy.base == asked.spec
    assert (policy.prior_alpha, policy.draft_cost) == (ADAPTIVE_PRIOR, pytest.approx(level))
    assert policy.reproducible


# ---- dsi_shape ---------------------------------------------------------------------------------

VERIFY = ForwardCost(FLAT, decay=0.0).shape  # as GatewayService._dsi_run passes it
CHEAP = {1: 0.001}  # a drafter 20x faster than the verifier


def shape(env: GatewayEnv, draft: dict[int, float] = CHEAP, max_parallel: int = 4, **fields: int) -> Shape:
    return asyncio.run(dsi_shape(plan(dsi=True, **fields).dsi, VERIFY, draft, env, max_parallel))


def test_a_parallel_above_the_limit_is_refused_and_one_at_it_with_a_lookahead_is_taken_as_asked() -> None:
    with pytest.raises(GatewayError) as refused:
        shape(gateway_env(config()), max_parallel=2, parallel=3, depth=5)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.field == "speculation.parallel" and "--dsi-max-parallel" in str(refused.value)
    # nothing predicted, whatever the healthy verifiers (none here)
    assert shape(gateway_env(config()), max_parallel=2, parallel=2, depth=5) == Shape(5, 2, 0.0, ahead=True)


def test_the_gateway_plans_no_more_verifications_than_healthy_verifiers_and_its_limit() -> None:
    # 2 in flight beat 1 at these costs (lookahead 3 on 2 verifiers vs 4 on 1): only the count caps it
    async def chosen(healthy: int, max_parallel: int) -> int:
        live = await servers(healthy)
        env = gateway_env(config("--verifiers", ",".join(s.address for s in live) or DEAD))
        try:
            if live:
                await env.verifiers.start()
            settings = plan(dsi=True).dsi
            return (await dsi_shape(settings, VERIFY, CHEAP, env, max_parallel)).parallel
        finally:
            await env.verifiers.close()
            for s in live:
                await s.stop()

    assert asyncio.run(chosen(2, 4)) == 2
    assert asyncio.run(chosen(2, 1)) == 1
    assert asyncio.run(chosen(0, 4)) == 1  # none healthy yet: still one


def test_drafting_ahead_is_charged_its_learnt_slowdown_unless_the_request_sets_parallel() -> None:
    fast = shape(gateway_env(config()))
    assert (fast.lookahead, fast.parallel, fast.ahead) == (4, 1, True)
    slow = Learnt()
    slow.learn_forward(True, 1, seconds=1.25, expected=1.0)  # a forward beside drafting: +25 %
    assert shape(gateway_env(config(), slow)).ahead is False  # SI's schedule wins
    assert shape(gateway_env(config(), slow), parallel=1).ahead is True  # the paper's DSI, as asked


def test_an_unmeasured_drafter_is_taken_for_half_a_verification() -> None:
    env = gateway_env(config())
    unknown = shape(env, draft={})
    assert unknown == shape(env, draft={1: 0.5 * VERIFY(1)}) and unknown.lookahead == 1
    assert shape(env, draft=CHEAP).lookahead == 4


def test_the_gateway_chooses_a_lookahead_of_at_most_eight_but_takes_a_longer_one_asked() -> None:
    env = gateway_env(config(), Learnt(acceptance=0.99))  # would draft further if it could
    assert shape(env, draft={1: 0.0005}).lookahead == DSI_MAX_LOOKAHEAD == 8
    assert shape(env, draft={1: 0.0005}, depth=12).lookahead == 12


def test_the_lookahead_the_gateway_chooses_is_no_deeper_than_max_depth() -> None:
    env = gateway_env(config(), Learnt(acceptance=0.99))  # would choose 8
    settings = plan(dsi=True).dsi
    chosen = asyncio.run(dsi_shape(settings, VERIFY, {1: 0.0005}, env, 4, max_depth=3))
    assert chosen.lookahead == 3


# ---- servable ----------------------------------------------------------------------------------

NO_DRAFTERS, MODEL_ONLY = config(), config("--drafters", DEAD)
NGRAM_ONLY, BOTH = config("--ngram-drafters", DEAD), config("--drafters", DEAD, "--ngram-drafters", DEAD)


@pytest.mark.parametrize("method", ["none", "ngram", "chain", "mcsd", "rsd_c", "rsd_s", "mtad"])
@pytest.mark.parametrize(
    "c", [NO_DRAFTERS, MODEL_ONLY, NGRAM_ONLY, BOTH], ids=["none", "model", "ngram", "both"]
)
def test_a_method_is_servable_only_where_its_kind_of_drafter_is(method: str, c: GatewayConfig) -> None:
    asked = plan(method=method)
    if method == "none" or (c.ngram_drafters if method == "ngram" else c.drafters):
        assert servable(asked, gateway_env(c)) is asked
        return
    with pytest.raises(GatewayError) as refused:
        servable(asked, gateway_env(c))
    flag = "--ngram-drafters" if method == "ngram" else "--drafters"
    assert (refused.value.code, refused.value.field) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "speculation.method",
    )
    assert str(refused.value).startswith("speculation.method: ") and f"({flag})" in str(refused.value)


def test_the_default_is_servable_without_drafters_as_plain_decoding() -> None:
    # docs/gateway.md: without drafters the default is plain decoding (with rides); servable
    # refused it (a chain) before plan_speculation could say so, from 816d925 until this test
    env = gateway_env(NO_DRAFTERS)
    got, _ = plan_speculation(servable(plan(), env), model({}), env, NO_DRAFTERS)
    assert got.spec == NONE_SPEC
