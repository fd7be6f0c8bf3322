"""N-gram (prompt-lookup) drafts: the lookup, the one-hot chain, and losslessness through the
chain rule (a chi-square test over two-token outputs that a drafter sending the wrong q fails)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from specmesh.core.ngram import chain_tree, draft_ngram, prompt_hit_rate, propose
from specmesh.core.sampling import SamplingParams
from specmesh.core.tree import SamplingMode
from specmesh.core.verification import verify_tree
from tests.stats import chi_square_pvalue
from tests.test_lossless import (
    P_VALUE_THRESHOLD,
    PARAMS,
    SAMPLES,
    TARGET,
    VOCAB,
    exact_two_token_distribution,
)
from tests.toy import ToyModel


def test_the_worked_example() -> None:
    assert propose([5, 6, 7, 9, 5, 6, 7], depth=3) == [9, 5, 6]


def test_the_longest_suffix_wins_then_the_latest_occurrence() -> None:
    # [2, 3] occurred twice (followed by 4, then by 8); the 3-gram [1, 2, 3] only once (-> 4)
    assert propose([1, 2, 3, 4, 0, 2, 3, 8, 1, 2, 3], depth=1) == [4]
    assert propose([9, 2, 3, 4, 0, 2, 3, 8, 7, 2, 3], depth=2) == [8, 7]


def test_no_match_drafts_nothing_and_depth_cuts() -> None:
    assert propose([1, 2, 3, 4], depth=4) == []
    assert propose([1], depth=4) == []
    assert propose([1, 2, 1], depth=4) == [2, 1]  # what follows runs to the end of the tokens
    assert draft_ngram([1, 2, 3], 4, VOCAB) is None


def test_the_chain_carries_one_hot_draft_distributions() -> None:
    tree = chain_tree([3, 1, 4], VOCAB)
    assert tree is not None
    tree.validate(VOCAB)
    assert tree.tokens.tolist() == [3, 1, 4] and tree.parents.tolist() == [-1, 0, 1]
    assert tree.mode is SamplingMode.IID
    for node, token in [(-1, 3), (0, 1), (1, 4)]:
        assert tree.draft_dist(node).tolist() == [float(i == token) for i in range(VOCAB)]


def test_prompt_hit_rate_tells_repeating_text_from_fresh_text() -> None:
    repeating = [1, 2, 3, 4, 5, 6] * 8
    fresh = list(range(48))
    assert prompt_hit_rate(repeating) == 1.0
    assert prompt_hit_rate(fresh) == 0.0
    assert prompt_hit_rate([1, 2, 3]) == 0.0


# --- lossless ---------------------------------------------------------------------------------

# The lookup's source: every token a, followed by the target's argmax after (a,), so that the
# proposals change with the generated tokens and are often (not always) accepted.
HISTORY = [t for a in range(VOCAB) for t in (a, int(TARGET.row((a,)).argmax()))]


def ngram_generate(
    params: SamplingParams, n: int, g: torch.Generator, wrong_q: bool = False
) -> tuple[list[int], int]:
    """n tokens from the toy target with n-gram drafts of depth 3 looked up in HISTORY + output.
    wrong_q: the drafter sends a uniform q instead of its one-hot one (a drafter that does not
    say its drafts are deterministic)."""
    out: list[int] = []
    accepted = 0
    while len(out) < n:
        context = tuple(out)
        tree = draft_ngram([*HISTORY, *out], 3, VOCAB)
        assert tree is not None  # every token occurred in HISTORY
        if wrong_q:
            tree = dataclasses.replace(tree, draft_probs=torch.full_like(tree.draft_probs, 1.0 / VOCAB))
        paths = [context] + [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
        verdict = verify_tree(tree, TARGET.logits(paths), params, g)
        accepted += len(verdict.accepted_tokens)
        out += verdict.emitted_tokens
    return out[:n], accepted


def ngram_two_token_pvalue(params: SamplingParams, wrong_q: bool = False) -> tuple[float, float]:
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    accepted = 0
    for _ in range(SAMPLES):
        tokens, n_accepted = ngram_generate(params, 2, g, wrong_q)
        counts[tuple(tokens)] += 1
        accepted += min(n_accepted, 2)
    return chi_square_pvalue(counts, exact_two_token_distribution(params)), accepted / (2 * SAMPLES)


@pytest.mark.parametrize("params_name", ["T0.6", "T1.0", "T1.0-topk3", "T1.0-topp0.8"])
def test_ngram_drafts_keep_the_target_distribution(params_name: str) -> None:
    p_value, accepted_share = ngram_two_token_pvalue(PARAMS[params_name])
    assert p_value > P_VALUE_THRESHOLD, f"ngram @ {params_name}: p = {p_value:.3g}"
    assert 0.1 < accepted_share < 0.95, accepted_share  # drafts are accepted and rejected


def test_detects_a_drafter_that_sends_the_wrong_q() -> None:
    assert ngram_two_token_pvalue(PARAMS["T1.0"], wrong_q=True)[0] < P_VALUE_THRESHOLD


def test_greedy_emits_the_target_argmax_path() -> None:
    target = ToyModel(VOCAB, 5, 1.0)
    g = torch.Generator().manual_seed(0)
    out: list[int] = []
    while len(out) < 40:
        tree = draft_ngram([*HISTORY, *out], 4, VOCAB)
        paths = [tuple(out)] + [(*out, *tree.path(i)) for i in range(tree.num_nodes)]
        out += verify_tree(tree, target.logits(paths), SamplingParams(0.0), g).emitted_tokens
    assert out[:40] == target.greedy((), 40)


@pytest.mark.parametrize("seed", range(5))
def test_prompt_hit_rate_is_what_propose_guesses(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 6, (80,), generator=g).tolist()  # a small alphabet: many repeats
    start = len(prompt) // 4
    want = sum(propose(prompt[:i], 1) == [prompt[i]] for i in range(start, 80)) / (80 - start)
    assert prompt_hit_rate(prompt) == pytest.approx(want)
