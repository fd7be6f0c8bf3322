"""The benchmark suite's pure parts: the papers' shapes, α, perplexity, the goals table."""

from __future__ import annotations

import math

import pytest
import torch

from specmesh.bench.measure import alpha
from specmesh.bench.suite import (
    DEFAULT_LABEL,
    EXP2,
    _default_ratios,
    default_goals,
    exp1_specs,
    exp2_specs,
    goals,
    mcsd_specs,
    perplexity,
)
from specmesh.core.stats import GenerationStats
from tests.tiny import tiny_lm


@pytest.mark.parametrize("depth", [2, 3, 4, 5])
def test_exp1_shapes_have_the_fixed_depth(depth: int) -> None:
    specs = dict(exp1_specs(depth))
    assert {s.depth for s in specs.values()} == {depth}
    assert specs[f"rsd_c {'-'.join(['2'] * depth)}"].max_nodes == 2 ** (depth + 1) - 2  # the largest tree
    assert max(s.max_nodes for s in specs.values()) == 2 ** (depth + 1) - 2


@pytest.mark.parametrize("budget", list(EXP2))
def test_exp2_shapes_spend_exactly_the_node_budget(budget: int) -> None:
    assert [s.max_nodes for _, s in exp2_specs(budget)] == [budget] * 4


def test_mcsd_configs_stay_within_32_leaves() -> None:
    for _, k, spec in mcsd_specs():
        assert math.prod(spec.branching) <= 32 and k == spec.branching[0]


def test_alpha_is_levels_passed_over_levels_examined() -> None:
    stats = GenerationStats()
    for accepted in (3, 0, 1):  # depth-3 chains: levels examined 3, 1, 2; passed 3, 0, 1
        stats += GenerationStats.for_round(drafted_tokens=3, accepted_tokens=accepted, tree_depth=3)
    assert alpha(stats) == pytest.approx(4 / 6)
    assert alpha(GenerationStats()) is None


def test_perplexity_matches_the_mean_log_likelihood() -> None:
    model = tiny_lm("llama", 50)
    prompt, out = [3, 7, 9], [11, 4, 20, 8]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + out])).logits[0].float(), -1)
    nll = -sum(logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(out)) / len(out)
    assert perplexity(model, [prompt], [out]) == pytest.approx(math.exp(nll), rel=1e-5)


def _row(experiment: str, label: str, t: float, method: str, tps: float, **extra) -> dict:
    return dict(
        experiment=experiment, label=label, temperature=t, method=method, tokens_per_second=tps, **extra
    )


def test_goals_read_the_best_gateway_rows_and_the_tree_chain_ratio() -> None:
    rows = [
        _row("headline", "autoregressive", 0.0, "none", 5.0, speedup=1.0),
        _row("headline", "chain L=4", 0.0, "chain", 9.0, speedup=1.8),
        _row("headline", "adaptive chain", 0.0, "adaptive", 11.0, speedup=2.2),
        _row("baseline", "hf assisted", 0.0, "hf_assisted", 8.0),
        _row("headline", "autoregressive", 1.0, "none", 5.0, speedup=1.0),
        _row("headline", "rsd_s 2x4", 1.0, "rsd_s", 8.0, speedup=1.6),
        _row("baseline", "hf assisted", 1.0, "hf_assisted", 7.0),
        _row("exp1", "chain L=3", 1.0, "chain", 1.0, depth=3, block_efficiency=2.0),
        _row("exp1", "rsd_s 3x3", 1.0, "rsd_s", 1.0, depth=3, block_efficiency=2.4),
        _row("exp1", "chain L=2", 1.0, "chain", 1.0, depth=2, block_efficiency=2.0),
        _row("exp1", "rsd_c 2-2", 1.0, "rsd_c", 1.0, depth=2, block_efficiency=2.1),
    ]
    by_name = {g["name"]: g for g in goals(rows)}
    t0 = by_name["gateway vs autoregressive, T=0"]
    assert (t0["measured"], t0["met"]) == (2.2, True) and "adaptive chain" in t0["detail"]
    assert by_name["gateway vs transformers assisted, T=0"]["measured"] == pytest.approx(11 / 8)
    t1 = by_name["gateway vs autoregressive, T=1"]
    assert (t1["measured"], t1["met"]) == (1.6, False)
    assert by_name["gateway vs transformers assisted, T=1"]["met"] is False  # 8 / 7 < 1.25
    tree = by_name["best tree η / chain η at the same depth, T=1"]
    assert tree["measured"] == pytest.approx(1.2) and tree["met"] and "L=3" in tree["detail"]


def _default(label: str, t: float, tps: float, prompt_set: str = "code", **extra) -> dict:
    return dict(
        experiment="default",
        label=label,
        temperature=t,
        prompt_set=prompt_set,
        tokens_per_second=tps,
        **extra,
    )


def test_the_default_phase_compares_within_its_prompt_set_and_temperature() -> None:
    rows = [
        _default("llama-server", 0.0, 25.0),
        _default("hf assisted", 0.0, 8.0),
        _default("none", 0.0, 6.0),
        _default(DEFAULT_LABEL, 0.0, 12.0),
        _default("chain L=3", 0.0, 11.0),
        _default("chain L=4", 0.0, 12.5),
        _default("llama-server", 0.0, 30.0, prompt_set="chat"),  # another set: not a reference for code
        _default(DEFAULT_LABEL, 0.0, 9.0, prompt_set="chat"),
        dict(_default("none", 0.0, 20.0), experiment="default_scaling", concurrency=8),
        dict(_default(DEFAULT_LABEL, 0.0, 19.0), experiment="default_scaling", concurrency=8),
    ]
    _default_ratios(rows)
    code = rows[3]
    assert code["vs_llama_server"] == pytest.approx(12 / 25) and code["vs_hf_assisted"] == pytest.approx(1.5)
    assert code["speedup"] == pytest.approx(2.0)
    assert rows[7]["vs_llama_server"] == pytest.approx(9 / 30) and rows[7]["vs_hf_assisted"] is None
    assert rows[9]["speedup"] == pytest.approx(19 / 20)  # against none at the same concurrency
    by_name = {g["name"]: g for g in default_goals(rows)}
    assert by_name["default vs llama-server plain, code, T=0"]["met"] is False
    assert by_name["default vs transformers assisted, code, T=0"]["met"] is True
    hindsight = by_name["default / best fixed shape in hindsight, code, T=0"]
    assert (
        hindsight["measured"] == pytest.approx(12 / 12.5)
        and hindsight["met"]
        and "chain L=4" in hindsight["detail"]
    )
    assert by_name["default vs none at 8 streams, T=0"]["met"] is False
