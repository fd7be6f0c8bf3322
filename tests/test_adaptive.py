"""Adaptive speculation: the depth policy, its losslessness, and the engine running it."""

from __future__ import annotations

import functools
import itertools
import random
from collections import Counter

import pytest
import torch

from specmesh.core.adaptive import (
    MAX_LOOKUP,
    AdaptivePolicy,
    FamilyPolicy,
    ForwardCost,
    Load,
    PolicyMemory,
    expected_tokens,
    family_spec,
    lookup_rate,
)
from specmesh.core.drafting import TreeSpec, build_tree
from specmesh.core.methods import Method
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationStats
from specmesh.core.verification import autoregressive_step, verify_tree
from specmesh.runtime.costs import PROBE_ROWS, measure_forward_cost
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.runner import ModelRunner, Step
from tests.stats import chi_square_pvalue
from tests.test_engine import PROMPT, hf_greedy, tiny_pair
from tests.test_lossless import DRAFT, P_VALUE_THRESHOLD, SAMPLES, TARGET, exact_two_token_distribution


def round_stats(
    spec: TreeSpec, accepted: int, level: float, verify0: float, per_node: float
) -> GenerationStats:
    depth = spec.depth if spec.method != "none" else 0
    nodes = spec.max_nodes
    verify = verify0 + per_node * nodes
    return GenerationStats.for_round(
        drafted_tokens=nodes,
        accepted_tokens=accepted,
        tree_depth=depth,
        draft_seconds=level * depth,
        verify_seconds=verify,
        total_seconds=level * depth + verify + 0.001,
    )


def line_cost(verify0: float, per_node: float) -> dict[int, float]:
    """A start-up measurement (rows -> seconds) where a forward of 1 + n rows costs verify0 + per_node·n."""
    return {rows: verify0 + per_node * (rows - 1) for rows in PROBE_ROWS}


def simulate(
    policy: AdaptivePolicy,
    acceptance: float,
    level: float,
    per_node: float,
    rounds: int,
    sessions: int = 1,
) -> list[int]:
    """Depths the policy picks when each drafted level is accepted with `acceptance`, while
    `sessions` sessions (this one and others like it) share each target forward."""
    rng, depths = random.Random(0), []
    for _ in range(rounds):
        spec = policy.next_spec()
        depth = spec.depth if spec.method != "none" else 0
        accepted = 0
        while accepted < depth and rng.random() < acceptance:
            accepted += 1
        rows = sessions * (1 + spec.max_nodes)
        stats = round_stats(spec, accepted, level, 0.12 + per_node * (rows - 1 - spec.max_nodes), per_node)
        policy.observe(spec, stats, Load(sessions, rows))
        depths.append(depth)
    return depths


def test_expected_tokens_and_family_shapes() -> None:
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    mcsd = TreeSpec("mcsd", depth=3, branching=(4, 2, 1))
    assert family_spec(mcsd, 2).branching == (4, 2)
    assert family_spec(mcsd, 5).branching == (4, 2, 1, 1, 1)
    assert family_spec(TreeSpec("rsd_s", depth=3, beam_width=2), 6) == TreeSpec(
        "rsd_s", depth=6, beam_width=2
    )
    assert family_spec(TreeSpec("chain", depth=3), 0).method == "none"
    with pytest.raises(ValueError, match="method 'none'"):
        AdaptivePolicy(TreeSpec("none"))


def test_forward_cost_interpolates_the_measurement_and_follows_the_load() -> None:
    cost = ForwardCost({1: 0.04, 2: 0.06, 4: 0.10, 8: 0.17}, decay=0.5)
    assert cost(1) == pytest.approx(0.04) and cost(0.5) == pytest.approx(0.04)
    assert cost(3) == pytest.approx(0.08)
    assert cost(10) == pytest.approx(0.17 + 2 * 0.07 / 4)  # the last slope, extended
    cost.observe(4, 0.20)  # the machine got twice as slow
    assert cost(2) == pytest.approx(0.12)
    flat = ForwardCost({}, decay=0.5)  # nothing measured: every row free, the level observed
    assert flat(16) == 0.0
    flat.observe(5, 0.3)
    assert flat(1) == flat(16) == pytest.approx(0.3)


def test_easy_text_and_cheap_drafts_go_deep() -> None:
    depths = simulate(
        AdaptivePolicy(TreeSpec("chain", depth=3), line_cost(0.12, 0.001)), 0.95, 0.02, 0.001, 60
    )
    assert depths[0] == 3  # the first round uses the requested depth
    assert sum(depths[-20:]) / 20 >= 6  # then deeper than asked


def test_hard_text_turns_speculation_off_but_keeps_probing() -> None:
    policy = AdaptivePolicy(TreeSpec("chain", depth=3), line_cost(0.12, 0.001), probe_every=8, probe_depth=2)
    depths = simulate(policy, 0.1, 0.05, 0.001, 80)
    tail = depths[20:]
    assert tail.count(0) >= 0.8 * len(tail)  # off most of the time
    assert 2 in tail  # probe rounds re-measure acceptance
    probes = [i for i, d in enumerate(depths) if d == 2]
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert len(gaps) >= 2 and gaps[-1] > 1.5 * gaps[0]  # ever rarer while speculation does not pay


def test_dear_tree_nodes_shrink_the_tree() -> None:
    """A target whose every row costs (a CPU) gets shallower trees: same acceptance."""
    base = TreeSpec("rsd_s", depth=3, beam_width=4)
    cheap = simulate(AdaptivePolicy(base, line_cost(0.12, 0.001)), 0.8, 0.02, 0.001, 60)
    dear = simulate(AdaptivePolicy(base, line_cost(0.12, 0.08)), 0.8, 0.02, 0.08, 60)
    assert sum(dear[-20:]) < sum(cheap[-20:])
    assert dear[-20:].count(0) >= 10  # 4 nodes per level at 80 ms each never pay off


def test_a_node_costs_the_whole_batch() -> None:
    """Same machine, same acceptance: alone a session drafts deep; with 8 sessions in every target
    forward each node delays all 8, so the trees shrink. The policy sees the load only through
    what the verifier reports (Load), the cost curve is the same start-up measurement."""
    base, cost = TreeSpec("chain", depth=3), line_cost(0.10, 0.01)
    alone = simulate(AdaptivePolicy(base, cost), 0.8, 0.02, 0.01, 60)
    batched = simulate(AdaptivePolicy(base, cost), 0.8, 0.02, 0.01, 60, sessions=8)
    assert sum(batched[-20:]) < sum(alone[-20:])


def test_a_measured_cpu_curve_turns_speculation_off_from_the_second_round() -> None:
    """llama.cpp's Q4_K_M 1.5B target on 2 cores (36 ms for 1 row, ~25 ms per extra row) and a
    0.5B draft at 19 ms a level: even at 80 % acceptance a chain costs more than it gives."""
    cpu = {1: 0.036, 2: 0.063, 4: 0.097, 8: 0.169, 16: 0.192}
    policy = AdaptivePolicy(TreeSpec("chain", depth=3), cpu, prior_alpha=0.8)
    chain = TreeSpec("chain", depth=3)
    policy.observe(chain, round_stats(chain, 2, 0.019, 0.5, 0.0))  # the prefill round: not learnt from
    policy.observe(chain, round_stats(chain, 3, 0.019, 0.097 - 3 * 0.025, 0.025))
    assert policy.choose_depth() == 0


def test_adaptive_rounds_keep_the_target_distribution() -> None:
    """One policy carried across all generations, so depths depend on every earlier outcome, with
    costs that make it switch between 0 (autoregressive), shallow and deep rounds: the emitted
    pairs still follow q(x1) q(x2 | x1) exactly."""
    params = SamplingParams(temperature=1.0)
    policy = AdaptivePolicy(
        TreeSpec("rsd_s", depth=2, beam_width=2),
        line_cost(0.1, 0.01),
        max_depth=3,
        probe_every=3,
        decay=0.5,
        acceptance_decay=0.5,
    )
    g = torch.Generator().manual_seed(0)
    counts, depths = Counter(), Counter()
    for _ in range(SAMPLES):
        out: list[int] = []
        while len(out) < 2:
            context = tuple(out)
            spec = policy.next_spec()
            depths[spec.depth if spec.method != "none" else 0] += 1
            if spec.method == "none":
                verdict = autoregressive_step(TARGET.logits([context])[0], params, g)
            else:
                tree = build_tree(spec, DRAFT.next_logits(context), params, g)
                paths = [context] + [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
                verdict = verify_tree(tree, TARGET.logits(paths), params, g)
            policy.observe(spec, round_stats(spec, len(verdict.accepted_tokens), 0.02, 0.1, 0.01))
            out += verdict.emitted_tokens
        counts[tuple(out[:2])] += 1
    assert len(depths) == 4 and min(depths.values()) > SAMPLES // 50, depths  # the policy really moves
    p_value = chi_square_pvalue(counts, exact_two_token_distribution(params))
    assert p_value > P_VALUE_THRESHOLD, f"p = {p_value:.3g}, depths {depths}"


SCRIPT = [0, 3, 0, 0, 1, 5, 2, 0, 4, 4, 1, 0, 6, 3]  # autoregressive and drafting rounds mixed


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("base", [TreeSpec("chain", depth=2), TreeSpec("rsd_s", depth=2, beam_width=2)])
def test_switching_depths_and_autoregressive_rounds_keeps_the_greedy_decode(
    arch: str, base: TreeSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine with a policy whose depths are scripted: the drafter catches up after
    autoregressive rounds, trees of every depth are verified, and the output stays exact."""
    script = iter(SCRIPT * 4)
    monkeypatch.setattr(AdaptivePolicy, "choose_depth", lambda self: next(script))
    draft, target = tiny_pair(arch)
    result = SpeculativeEngine(draft, target).generate(PROMPT, base, SamplingParams(0.0), 40, adaptive=True)
    assert result.token_ids == hf_greedy(target, PROMPT, 40)
    rounds = result.stats.rounds
    assert result.stats.draft_calls == sum((SCRIPT * 4)[:rounds])  # every scripted depth was drafted
    assert result.stats.accepted_tokens > 0 and rounds > len(SCRIPT) // 2


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_engines_adaptive_mode_keeps_the_greedy_decode(arch: str) -> None:
    draft, target = tiny_pair(arch)
    engine = SpeculativeEngine(draft, target)
    for _ in range(2):  # the second session starts from what the first one learned
        result = engine.generate(PROMPT, TreeSpec("chain", depth=2), SamplingParams(0.0), 32, adaptive=True)
        assert result.token_ids == hf_greedy(target, PROMPT, 32)


def test_depths_stay_within_the_replicas_node_limit() -> None:
    base = TreeSpec("mcsd", depth=3, branching=(4, 4, 2))  # 52 nodes: accepted by the replicas
    policy = AdaptivePolicy(base)
    assert policy.depths == [0, 1, 2, 3]  # depth 4 would be 84 nodes
    depths = simulate(policy, 0.99, 0.001, 0.0, 30)
    assert max(depths) == 3 and depths[-1] == 3
    assert AdaptivePolicy(TreeSpec("chain", depth=12)).depths[-1] == 12  # a deeper request is kept


def test_memory_keeps_families_apart_and_warm_starts() -> None:
    memory, greedy = PolicyMemory(), SamplingParams(0.0)
    a, b = TreeSpec("mcsd", depth=3, branching=(4, 2, 1)), TreeSpec("mcsd", depth=3, branching=(4, 4, 2))
    learned = memory.new_policy(a, greedy, line_cost(0.12, 0.001))
    simulate(learned, 0.95, 0.02, 0.001, 20)
    memory.remember(learned, greedy)
    assert memory.new_policy(a, greedy).tried == learned.tried
    assert memory.new_policy(a, greedy).draft_level == learned.draft_level
    assert memory.new_policy(a, greedy).verify == learned.verify  # the cost curve too
    assert memory.new_policy(b, greedy).draft_level is None  # another family starts cold
    assert memory.new_policy(a, SamplingParams(1.0)).draft_level is None  # other sampling too


def test_the_catch_up_after_autoregressive_rounds_is_not_a_draft_cost() -> None:
    policy = AdaptivePolicy(TreeSpec("chain", depth=2))
    chain, off = TreeSpec("chain", depth=2), TreeSpec("none")
    for spec in (chain, chain, chain):
        policy.observe(spec, round_stats(spec, 1, 0.02, 0.1, 0.0))
    assert policy.draft_level == pytest.approx(0.02)
    policy.observe(off, round_stats(off, 0, 0.02, 0.1, 0.0))
    catch_up = GenerationStats.for_round(
        drafted_tokens=2,
        accepted_tokens=1,
        tree_depth=2,
        draft_seconds=2.0,
        verify_seconds=0.1,
        total_seconds=2.1,
    )
    policy.observe(chain, catch_up)  # a slow first draft after the autoregressive round
    assert policy.draft_level == pytest.approx(0.02)


def test_measuring_the_forward_cost_leaves_the_runner_as_it_was() -> None:
    _, target = tiny_pair("llama")
    runner = ModelRunner(target)
    runner.forward([Step("user", new_tokens=list(PROMPT))])
    cost = measure_forward_cost(runner, rows=(1, 4, 9), repeats=1)
    assert sorted(cost) == [1, 4, 9] and all(t > 0 for t in cost.values())
    assert runner.sessions() == ["user"] and runner.committed_tokens("user") == list(PROMPT)


# ---- reproducible mode (the gateway's) ---------------------------------------------------------

CPU = {1: 0.031, 2: 0.047, 4: 0.077, 8: 0.185, 16: 0.187}  # llama.cpp, the 1.5B target on 2 cores
FLAT = {1: 0.030, 2: 0.0301, 4: 0.0302, 8: 0.0305, 16: 0.031}  # a GPU-like target
NGRAM, CHAIN = TreeSpec("ngram", depth=4), TreeSpec("chain", depth=3)


def _tokens(n: int, seed: int) -> list[int]:
    return random.Random(seed).choices(range(100, 5000), k=n)


def _family(forward: dict, draft: float | None, prompt: list[int]) -> FamilyPolicy:
    chain = None if draft is None else AdaptivePolicy(CHAIN, forward, draft_cost=draft, call_overhead=0.002)
    return FamilyPolicy(forward, 0.002, 4, len(prompt), chain)


@pytest.mark.parametrize(
    ("forward", "draft", "fresh", "copying"),
    [
        # a draft token at 0.65 of a target token: the draft model never pays (never probed);
        # n-gram rides do where the answer copies
        (CPU, 0.020, Method.NONE, "ride"),
        (FLAT, 0.003, Method.CHAIN, "ride"),  # rows nearly free, a 10x cheaper drafter
        (FLAT, None, Method.NONE, "ride"),  # no draft model
    ],
)
def test_the_default_family_follows_the_costs_and_the_tokens(forward, draft, fresh, copying) -> None:
    """Per round, both ways within one session: fresh text, then an answer copying a passage of
    its prompt (n-gram rides, no drafter call), then fresh text again."""
    passage = _tokens(300, 0)
    prompt = [*_tokens(40, 1), *passage]
    policy = _family(forward, draft, prompt)
    answer = _tokens(100, 2)
    plans = [policy.plan([*prompt, *answer])]
    answer += passage[:120]
    plans.append(policy.plan([*prompt, *answer]))
    answer += _tokens(150, 3)
    plans.append(policy.plan([*prompt, *answer]))
    assert plans[1].spec.method is Method.NONE and plans[1].plain_run and plans[1].lookup_depth >= 1
    for plan in (plans[0], plans[2]):
        # a step without a proposal costs nothing more: where rows are nearly free, rides stay on
        # for the rare match (as deep as any: a row costs nothing); where they cost, none
        assert plan.spec.method is fresh and plan.lookup_depth <= plans[1].lookup_depth
        assert plan.lookup_depth == 0 or forward is FLAT
    assert (policy.chain is None) == (fresh is Method.NONE)


def test_rides_go_deeper_where_rows_are_cheap() -> None:
    """The same copying text: a deeper ride where a forward is nearly flat in rows than where
    every row costs (this CPU's llama.cpp curve)."""
    passage = _tokens(300, 0)
    prompt = [*_tokens(40, 1), *passage]
    answer = [*_tokens(30, 2), *passage[:100]]
    depths = [_family(forward, None, prompt).plan([*prompt, *answer]).lookup_depth for forward in (CPU, FLAT)]
    assert 1 <= depths[0] < depths[1]


# The 1.5B target here with logits on every row (a ride's), 512 tokens of context: a cliff at 8 rows
RIDE_ROWS = {1: 0.035, 2: 0.065, 3: 0.088, 4: 0.110, 5: 0.1375, 6: 0.159, 7: 0.182, 8: 0.262, 16: 0.313}


def test_the_probe_reads_every_row_count_a_ride_takes() -> None:
    """Measured at PROBE_ROWS, that curve lets a long copy ride as deep as rides go. Read at 1, 2,
    4, 8 and 16 rows only (the probe until issue 38's eighth pass), the line from 4 rows to the
    cliff puts 5-7 rows 10-23 % too high, and the same copy rides 3 tokens."""
    passage = _tokens(300, 0)
    prompt = [*_tokens(40, 1), *passage]
    answer = [*_tokens(30, 2), *passage[:100]]

    def depth(rows: tuple[int, ...]) -> int:
        policy = _family({r: RIDE_ROWS[r] for r in rows}, None, prompt)
        return policy.plan([*prompt, *answer]).lookup_depth

    assert depth(PROBE_ROWS) == MAX_LOOKUP
    assert depth((1, 2, 4, 8, 16)) == 3


@pytest.mark.parametrize(
    ("vocabulary", "fresh", "copied", "weakest", "beaten"),
    [
        # chat-like text (every position matches a short suffix, the guess nearly always wrong)
        # between copied stretches: only longer matches ride, which beats riding every match
        (20, 16, 16, 2, 1),
        # fresh text from a tiny vocabulary (its 3-token suffixes recur, wrong) between long
        # copies: the match measured past the n-gram tells a copy that has run from them
        (4, 12, 20, 4, 3),
    ],
)
def test_rides_take_only_the_matches_worth_their_rows(vocabulary, fresh, copied, weakest, beaten) -> None:
    """On the CPU curve the plan rides matches of at least `weakest` tokens, and that beats
    riding those of `beaten` tokens and more."""
    rng = random.Random(vocabulary)
    passage = _tokens(400, 8)
    prompt = [*_tokens(40, 9), *passage]
    answer: list[int] = []
    for i in range(0, 10 * copied, copied):
        answer += [rng.randrange(100, 100 + vocabulary) for _ in range(fresh)] + passage[i : i + copied]
    policy = _family(CPU, None, prompt)
    plan = policy.plan([*prompt, *answer])
    assert plan.lookup_depth >= 1 and plan.lookup_min_ngram >= weakest
    rate = functools.partial(
        lookup_rate, policy.estimate.classes(), verify=policy.verify, call_share=policy.call_share
    )
    assert rate(min_ngram=plan.lookup_min_ngram, depth=plan.lookup_depth) > rate(
        min_ngram=beaten, depth=plan.lookup_depth
    )


def test_the_family_choice_is_a_function_of_the_tokens() -> None:
    """A policy built afresh (a resumed session) and fed the same tokens plans the same round."""
    passage = _tokens(200, 4)
    prompt = [*_tokens(40, 5), *passage]
    answer = [*_tokens(20, 6), *passage[:30]]
    first = _family(CPU, 0.020, prompt)
    for end in range(len(prompt), len(prompt) + len(answer), 7):
        first.plan([*prompt, *answer[: end - len(prompt)]])
    again = _family(CPU, 0.020, prompt)
    assert again.plan([*prompt, *answer]) == first.plan([*prompt, *answer])


def test_the_reproducible_policy_reads_no_clock() -> None:
    """Two sessions whose rounds take wildly different times (load) but accept alike choose the
    same depths; and the first round is chosen from the fixed costs alone."""
    runs = []
    for level, per_node in ((0.001, 0.0005), (0.2, 0.05)):
        policy = AdaptivePolicy(CHAIN, FLAT, draft_cost=0.003, call_overhead=0.002)
        runs.append(simulate(policy, 0.6, level, per_node, 40))
    assert runs[0] == runs[1]
    assert runs[0][0] >= 1  # on from the first round: the fixed costs say it pays
