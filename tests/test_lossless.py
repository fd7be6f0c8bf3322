"""Every lossless drafting method + its verification rule reproduces the target's distribution.

For each method at three of the six temperature x filter settings (`MATRIX`), 50,000 seeded
generations of two tokens (as many draft/verify rounds as that takes) are compared with the
exactly enumerated joint distribution q(x1) q(x2 | x1) of the warped toy target. The same test is
shown to catch wrong rules.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import specmesh.core.verification as verification
from specmesh.core.drafting import TreeSpec, build_tree
from specmesh.core.grammar import constrain_draft, constrain_rows, mask_logits, tree_paths
from specmesh.core.ngram import chain_tree
from specmesh.core.sampling import Draws, SamplingParams, warp
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.core.verification import verify_tree
from tests.stats import chi_square_pvalue
from tests.toy import ToyModel

VOCAB = 8
SAMPLES = int(__import__("os").environ.get("SPECMESH_SAMPLES", 50_000))
# A correct rule passes at this level; each wrong rule below lands far under it (p < 1e-10 in
# practice). The runs are seeded, so the verdicts are deterministic.
P_VALUE_THRESHOLD = 1e-4

DRAFT = ToyModel(VOCAB, seed=11, scale=1.0)
TARGET = ToyModel(VOCAB, seed=22, scale=1.5)  # sharper and independent: far from the draft

LOSSLESS_SPECS = {
    "chain": TreeSpec("chain", depth=3),
    "mcsd_iid": TreeSpec("mcsd", depth=2, branching=(3, 2), replacement=True),
    "mcsd_wor": TreeSpec("mcsd", depth=2, branching=(3, 2), replacement=False),
    "rsd_c": TreeSpec("rsd_c", depth=3, branching=(4, 2, 1)),
    "rsd_s": TreeSpec("rsd_s", depth=3, beam_width=3),
}
PARAMS = {
    "T0.6": SamplingParams(temperature=0.6),
    "T1.0": SamplingParams(temperature=1.0),
    "T0.6-topk3": SamplingParams(temperature=0.6, top_k=3),
    "T1.0-topk3": SamplingParams(temperature=1.0, top_k=3),
    "T0.6-topp0.8": SamplingParams(temperature=0.6, top_p=0.8),
    "T1.0-topp0.8": SamplingParams(temperature=1.0, top_p=0.8),
}


def generate(
    spec: TreeSpec, params: SamplingParams, n: int, g: torch.Generator, mode=None, draft=DRAFT, target=TARGET
) -> tuple[list[int], int]:
    """Speculative generation of n tokens on a toy pair (the engine loop without a model).
    Returns the tokens and how many of them were accepted draft tokens."""
    out: list[int] = []
    accepted = 0
    while len(out) < n:
        context = tuple(out)
        tree = build_tree(spec, draft.next_logits(context), params, g)
        if mode is not None:  # deliberately verify with another sampling mode's rule
            tree = dataclasses.replace(tree, mode=mode)
        paths = [context] + [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
        verdict = verify_tree(tree, target.logits(paths), params, g)
        accepted += len(verdict.accepted_tokens)
        out += verdict.emitted_tokens
    return out[:n], accepted


def exact_two_token_distribution(params: SamplingParams) -> dict[tuple[int, int], float]:
    q0 = TARGET.dist((), params).double()
    return {
        (a, b): float(q0[a]) * float(TARGET.dist((a,), params).double()[b])
        for a in range(VOCAB)
        for b in range(VOCAB)
    }


def two_token_pvalue(
    spec: TreeSpec, params: SamplingParams, mode=None, samples: int = SAMPLES
) -> tuple[float, float]:
    """(p-value, share of emitted tokens that were accepted drafts) over `samples` generations."""
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    accepted = 0
    for _ in range(samples):
        tokens, n_accepted = generate(spec, params, 2, g, mode)
        counts[tuple(tokens)] += 1
        accepted += min(n_accepted, 2)
    return chi_square_pvalue(counts, exact_two_token_distribution(params)), accepted / (2 * samples)


# Every method meets no filter, top-k and top-p, and every filter both temperatures (with methods
# in turn): what a rule does with the zeros a filter leaves is per method, while a temperature only
# rescales the logits. The whole cross product (30 cases) took 42 of the suite's 83 CPU-minutes;
# docs/decisions.md, "The losslessness matrix".
MATRIX = [
    (method, params_name)
    for i, method in enumerate(LOSSLESS_SPECS)
    for params_name in (
        ("T1.0", "T0.6-topk3", "T1.0-topp0.8") if i % 2 == 0 else ("T0.6", "T1.0-topk3", "T0.6-topp0.8")
    )
]


@pytest.mark.parametrize(("method", "params_name"), MATRIX)
def test_output_distribution_equals_target(method: str, params_name: str) -> None:
    p_value, accepted_share = two_token_pvalue(LOSSLESS_SPECS[method], PARAMS[params_name])
    assert p_value > P_VALUE_THRESHOLD, f"{method} @ {params_name}: p = {p_value:.3g}"
    # both branches of the rule are exercised: drafts are often accepted and often rejected
    assert 0.15 < accepted_share < 0.95, accepted_share


# --- through ticks: many sessions verified in one call -------------------------------------------

# Four groups of sessions share every tick (draft chains, plain steps, n-gram chains of proposed
# tokens, RSD-S trees), each with its own sampling and its own counter-based draws, as a replica
# runs them. Plain steps and proposed chains are drawn in one vectorized call, with two samplings.
TICK_GROUPS = [("chain", "T1.0"), ("none", "T0.6-topk3"), ("ngram", "T1.0"), ("rsd_s", "T1.0-topp0.8")]


def proposed(context: tuple[int, ...]) -> DraftTree | None:
    """An n-gram drafter's kind of chain: a function of the tokens (here the target's own greedy
    continuation, two tokens), not a sample."""
    tokens: list[int] = []
    for _ in range(2):
        tokens.append(int(TARGET.row((*context, *tokens)).argmax()))
    return chain_tree(tokens, VOCAB)


def ticked_pvalues(sessions: int = 48, samples: int = SAMPLES // 2) -> list[float]:
    """Per group, the p-value of `samples` two-token generations run `sessions` at a time, every
    round of every running session verified in one `verify_many` call."""
    g = torch.Generator().manual_seed(0)  # the drafts (not what is batched here)
    counts = [Counter() for _ in TICK_GROUPS]
    started, seed = [0] * len(TICK_GROUPS), 0
    running: list[tuple[int, int, list[int]]] = []  # (group, seed, tokens)
    while running or min(started) < samples:
        while len(running) < sessions and min(started) < samples:
            group = started.index(min(started))  # the groups stay even
            started[group] += 1
            running.append((group, seed, []))
            seed += 1
        trees, logits, params, draws = [], [], [], []
        for group, key, out in running:
            method, p = TICK_GROUPS[group]
            context, params_ = tuple(out), PARAMS[p]
            if method in ("none", "ngram"):
                tree = None if method == "none" else proposed(context)
            else:
                tree = build_tree(LOSSLESS_SPECS[method], DRAFT.next_logits(context), params_, g)
            paths = [context] + (
                [] if tree is None else [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
            )
            trees.append(tree)
            logits.append(TARGET.logits(paths))
            params.append(params_)
            draws.append(Draws.derive(key, len(out), "verify"))
        for (group, _, out), verdict in zip(
            running, verification.verify_many(trees, logits, params, draws), strict=True
        ):
            out += verdict.emitted_tokens
            if len(out) >= 2:
                counts[group][tuple(out[:2])] += 1
        running = [r for r in running if len(r[2]) < 2]
    return [
        chi_square_pvalue(c, exact_two_token_distribution(PARAMS[p]))
        for c, (_, p) in zip(counts, TICK_GROUPS, strict=True)
    ]


def test_sessions_verified_in_shared_ticks_each_follow_the_target() -> None:
    for (method, p), p_value in zip(TICK_GROUPS, ticked_pvalues(), strict=True):
        assert p_value > P_VALUE_THRESHOLD, f"{method} @ {p} in ticks: p = {p_value:.3g}"


def test_detects_a_tick_warped_with_one_sessions_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    """The batching slip: every row of the tick warped with its first session's parameters."""
    warp_rows = verification.warp_rows
    monkeypatch.setattr(
        verification, "warp_rows", lambda rows, params: warp_rows(rows, [params[0]] * len(params))
    )
    assert min(ticked_pvalues(samples=SAMPLES // 5)) < P_VALUE_THRESHOLD


# --- the same test catches wrong rules --------------------------------------------------------


def test_detects_iid_rule_on_without_replacement_tree() -> None:
    """MCSD Alg. 1 (p never updated) applied to siblings sampled without replacement is biased."""
    spec = LOSSLESS_SPECS["mcsd_wor"]
    assert two_token_pvalue(spec, PARAMS["T1.0"], mode=SamplingMode.IID)[0] < P_VALUE_THRESHOLD


def test_detects_without_replacement_rule_on_iid_tree() -> None:
    """Recursive rejection sampling applied to i.i.d. siblings (duplicates possible) is biased."""
    spec = LOSSLESS_SPECS["mcsd_iid"]
    mode = SamplingMode.WITHOUT_REPLACEMENT
    assert two_token_pvalue(spec, PARAMS["T1.0"], mode=mode)[0] < P_VALUE_THRESHOLD


def _rejection_step_residual_after_removal(q, p, candidates, uniforms, without_replacement):
    """The classic slip (RSD trap 5): remove the rejected token from p BEFORE the residual."""
    for j, x in enumerate(candidates):
        px, qx = float(p[x]), float(q[x])
        if uniforms[j] * px < qx:
            return j, q
        if without_replacement and px < 1.0:
            p = p.clone()
            p[x] = 0.0
            p = p / (1.0 - px)
        residual = (q - p).clamp(min=0.0)
        if float(residual.sum()) > 0:
            q = residual / residual.sum()
    return None, q


def test_detects_residual_computed_after_removing_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(verification, "rejection_step", _rejection_step_residual_after_removal)
    for spec_name in ("mcsd_wor", "rsd_s"):  # a fifth of the samples: p < 1e-120 either way
        p_value = two_token_pvalue(LOSSLESS_SPECS[spec_name], PARAMS["T1.0"], samples=SAMPLES // 5)[0]
        assert p_value < P_VALUE_THRESHOLD, spec_name


def test_detects_unwarped_target() -> None:
    """Verifying against q at a different temperature than the draft used must be caught."""
    spec = LOSSLESS_SPECS["chain"]
    g = torch.Generator().manual_seed(0)
    draft_params, target_params = PARAMS["T0.6"], PARAMS["T1.0"]
    counts: Counter = Counter()
    for _ in range(SAMPLES // 5):
        tree = build_tree(spec, DRAFT.next_logits(()), draft_params, g)
        paths = [()] + [tuple(tree.path(i)) for i in range(tree.num_nodes)]
        verdict = verify_tree(tree, TARGET.logits(paths), draft_params, g)
        counts[verdict.emitted_tokens[0]] += 1
    q0 = TARGET.dist((), target_params)
    assert chi_square_pvalue(counts, {a: float(q0[a]) for a in range(VOCAB)}) < P_VALUE_THRESHOLD


# --- temperature 0 ----------------------------------------------------------------------------

GREEDY_SPECS = {
    **LOSSLESS_SPECS,
    "mtad": TreeSpec("mtad", depth=3, beam_width=4, mtad_threshold=0.3),
    "rsd_s_wide": TreeSpec("rsd_s", depth=2, beam_width=6),
    "mcsd_deep": TreeSpec("mcsd", depth=4, branching=(4, 2, 1, 1)),
}


@pytest.mark.parametrize("method", list(GREEDY_SPECS))
@pytest.mark.parametrize("vocab_seed", [3, 4, 5])
def test_greedy_emits_the_target_argmax_path(method: str, vocab_seed: int) -> None:
    target = ToyModel(12, vocab_seed, 1.0)
    draft = ToyModel(12, vocab_seed + 100, 0.8, base=target)  # agrees with the target often, not always
    g = torch.Generator().manual_seed(vocab_seed)
    tokens, accepted = generate(GREEDY_SPECS[method], SamplingParams(0.0), 40, g, draft=draft, target=target)
    assert tokens == target.greedy((), 40)
    assert 5 < accepted < 40  # the accepted path and the recovered token both matter


# --- constrained decoding (a grammar's mask) ----------------------------------------------------


class ToyGrammar:
    """A grammar whose allowed set depends on the whole context: x after ctx iff (x + sum(ctx)) % 3
    != 0 (5 or 6 of 8 tokens), so the root's row and each node's row need different masks."""

    def allowed(self, committed, paths) -> torch.Tensor:
        rows = []
        for p in paths:
            s = sum(committed) + sum(p)
            rows.append(torch.tensor([(x + s) % 3 != 0 for x in range(VOCAB)]))
        return torch.stack(rows)


GRAMMAR = ToyGrammar()


def exact_masked_two_tokens(params: SamplingParams) -> dict[tuple[int, int], float]:
    def q(path: tuple[int, ...]) -> torch.Tensor:
        logits = mask_logits(TARGET.row(path).unsqueeze(0), GRAMMAR.allowed((), [path]))
        return warp(logits[0], params).double()

    q0 = q(())
    return {(a, b): float(q0[a]) * float(q((a,))[b]) for a in range(VOCAB) for b in range(VOCAB)}


def masked_two_token_pvalue(spec: TreeSpec, params: SamplingParams, wrong: str = "", samples: int = SAMPLES):
    """Constrained generation of two tokens as the services run it: the draft masked per path
    (`constrain_draft`), every verified row masked after its own path (`constrain_rows`). wrong:
    "root-only" masks only the root's row; "draft-only" masks the draft but not the target."""
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    for _ in range(samples):
        out: list[int] = []
        while len(out) < 2:
            context = tuple(out)
            tree = build_tree(spec, constrain_draft(DRAFT.next_logits(context), GRAMMAR, context), params, g)
            paths = tree_paths(tree.parents.tolist(), tree.tokens.tolist())
            logits = TARGET.logits([(*context, *p) for p in paths])
            if wrong == "root-only":
                logits[:1] = constrain_rows(logits[:1], GRAMMAR, context, paths[:1])
            elif wrong != "draft-only":
                logits = constrain_rows(logits, GRAMMAR, context, paths)
            out += verify_tree(tree, logits, params, g).emitted_tokens
        counts[tuple(out[:2])] += 1
    return chi_square_pvalue(counts, exact_masked_two_tokens(params))


# The mask is one code path for every method (constrain_draft, constrain_rows); each rule meets it
# once, the two settings in turn.
@pytest.mark.parametrize(
    ("method", "params_name"), [("chain", "T0.6-topk3"), ("mcsd_wor", "T1.0"), ("rsd_s", "T0.6-topk3")]
)
def test_constrained_output_follows_the_masked_target(method: str, params_name: str) -> None:
    p_value = masked_two_token_pvalue(LOSSLESS_SPECS[method], PARAMS[params_name], samples=SAMPLES // 2)
    assert p_value > P_VALUE_THRESHOLD, f"{method} @ {params_name}: p = {p_value:.3g}"


@pytest.mark.parametrize("wrong", ["root-only", "draft-only"])
def test_detects_a_mask_missing_on_the_verified_rows(wrong: str) -> None:
    p_value = masked_two_token_pvalue(LOSSLESS_SPECS["chain"], PARAMS["T1.0"], wrong, samples=SAMPLES // 5)
    assert p_value < P_VALUE_THRESHOLD, wrong
