"""Adaptive speculation: the depth policy, its losslessness, and the engine running it."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from specmesh.adaptive import AdaptivePolicy, expected_tokens, family_spec
from specmesh.drafting import TreeSpec, build_tree
from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.stats import GenerationStats
from specmesh.verification import autoregressive_step, verify_tree
from tests.stats import chi_square_pvalue
from tests.test_engine import PROMPT, hf_greedy, tiny_pair
from tests.test_lossless import DRAFT, P_VALUE_THRESHOLD, SAMPLES, TARGET, VOCAB, exact_two_token_distribution


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


def simulate(
    policy: AdaptivePolicy, acceptance: float, level: float, per_node: float, rounds: int
) -> list[int]:
    """Depths the policy picks when each drafted level is accepted with `acceptance`."""
    rng, depths = random.Random(0), []
    for _ in range(rounds):
        spec = policy.next_spec()
        depth = spec.depth if spec.method != "none" else 0
        accepted = 0
        while accepted < depth and rng.random() < acceptance:
            accepted += 1
        policy.observe(spec, round_stats(spec, accepted, level, 0.12, per_node))
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


def test_easy_text_and_cheap_drafts_go_deep() -> None:
    depths = simulate(AdaptivePolicy(TreeSpec("chain", depth=3)), 0.95, 0.02, 0.001, 60)
    assert depths[0] == 3  # the first round uses the requested depth
    assert sum(depths[-20:]) / 20 >= 6  # then deeper than asked


def test_hard_text_turns_speculation_off_but_keeps_probing() -> None:
    policy = AdaptivePolicy(TreeSpec("chain", depth=3), probe_every=8, probe_depth=2)
    depths = simulate(policy, 0.1, 0.05, 0.001, 80)
    tail = depths[20:]
    assert tail.count(0) >= 0.8 * len(tail)  # off most of the time
    assert 2 in tail  # probe rounds re-measure acceptance


def test_dear_tree_nodes_shrink_the_tree() -> None:
    """A verifier batching many sessions makes every node dear: same acceptance, shallower."""
    cheap = simulate(AdaptivePolicy(TreeSpec("rsd_s", depth=3, beam_width=4)), 0.8, 0.02, 0.001, 60)
    dear = simulate(AdaptivePolicy(TreeSpec("rsd_s", depth=3, beam_width=4)), 0.8, 0.02, 0.08, 60)
    assert sum(dear[-20:]) < sum(cheap[-20:])
    assert dear[-20:].count(0) >= 10  # 4 nodes per level at 80 ms each never pay off


def test_adaptive_rounds_keep_the_target_distribution() -> None:
    """One policy carried across all generations, so depths depend on every earlier outcome, with
    costs that make it switch between 0 (autoregressive), shallow and deep rounds: the emitted
    pairs still follow q(x1) q(x2 | x1) exactly."""
    params = SamplingParams(temperature=1.0)
    policy = AdaptivePolicy(
        TreeSpec("rsd_s", depth=2, beam_width=2), max_depth=3, probe_every=3, decay=0.5, acceptance_decay=0.5
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
    assert VOCAB == 8


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("base", [TreeSpec("chain", depth=2), TreeSpec("rsd_s", depth=2, beam_width=2)])
def test_adaptive_greedy_equals_the_targets_greedy_decode(arch: str, base: TreeSpec) -> None:
    draft, target = tiny_pair(arch)
    engine = SpeculativeEngine(draft, target)
    result = engine.generate(PROMPT, base, SamplingParams(0.0), 32, adaptive=True)
    assert result.token_ids == hf_greedy(target, PROMPT, 32)
    # tiny models draft as slowly as they verify, so the policy may switch drafting off; it drafted
    assert result.stats.draft_calls > 0
