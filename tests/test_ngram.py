"""N-gram (prompt-lookup) drafts: the lookup, the chain of proposed tokens, and losslessness through the
rule of proposed tokens (a chi-square test over two-token outputs that one draw shared by the
positions fails), and seeded texts that rides leave as they were."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from specmesh.core import verification
from specmesh.core.ngram import (
    CANDIDATES,
    MAX_MATCH,
    NgramEstimate,
    NgramIndex,
    chain_tree,
    draft_ngram,
    prompt_hit_rate,
    propose,
)
from specmesh.core.rides import Calibration, ngram_ride
from specmesh.core.rounds import verify_round
from specmesh.core.sampling import SamplingParams
from specmesh.core.tree import SamplingMode
from specmesh.core.verification import verify_tree
from specmesh.runtime.rounds import VerifyJob, run_ticked, verify_steps
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


def test_of_a_recurring_n_gram_the_longest_match_is_copied() -> None:
    """[5, 6, 7] occurred twice; the first time after a 1, as the sequence's end: that is the
    passage being copied, though the other occurrence is later. An equal match: the latest."""
    tokens = [1, 5, 6, 7, 9, 2, 5, 6, 7, 8, 1, 5, 6, 7]
    assert propose(tokens, depth=3) == [9, 2, 5]
    index = NgramIndex()
    index.extend(tokens[:-1])
    assert index.lookup(3, tokens[-1:]) == (4, [9, 2, 5])
    index.extend(tokens[-1:])
    assert index.lookup(3) == (4, [9, 2, 5])
    assert propose([3, 5, 6, 7, 9, 2, 5, 6, 7, 8, 1, 5, 6, 7], depth=1) == [8]
    # only the latest CANDIDATES occurrences are compared: k later ones after a 2 (a match of 3)

    def far(k: int) -> list[int]:
        return [1, 5, 6, 7, 9, *[t for _ in range(k) for t in (2, 5, 6, 7)], 8, 1, 5, 6, 7]

    assert propose(far(CANDIDATES - 1), depth=1) == [9]
    assert propose(far(CANDIDATES), depth=1) == [8]


def test_no_match_drafts_nothing_and_depth_cuts() -> None:
    assert propose([1, 2, 3, 4], depth=4) == []
    assert propose([1], depth=4) == []
    assert propose([1, 2, 1], depth=4) == [2, 1]  # what follows runs to the end of the tokens
    assert draft_ngram([1, 2, 3], 4, VOCAB) is None


def test_the_chain_is_proposed_tokens_only() -> None:
    tree = chain_tree([3, 1, 4], VOCAB)
    assert tree is not None
    tree.validate(VOCAB)
    assert tree.tokens.tolist() == [3, 1, 4] and tree.parents.tolist() == [-1, 0, 1]
    assert tree.mode is SamplingMode.PROPOSED and not tree.has_draft_probs
    tree.check_drawable()  # sampled verification needs no rows for proposed tokens
    branching = dataclasses.replace(tree, parents=torch.tensor([-1, -1, 0]))
    branching.validate(VOCAB)  # a tree of proposed tokens may branch, its siblings distinct
    with pytest.raises(ValueError, match="tokens: siblings of a PROPOSED tree must carry distinct tokens"):
        dataclasses.replace(branching, tokens=torch.tensor([3, 3, 4])).validate(VOCAB)
    rows = torch.full((3, VOCAB), 1.0 / VOCAB)
    with pytest.raises(ValueError, match="draft_probs: a PROPOSED tree carries none"):
        dataclasses.replace(tree, draft_probs=rows, prob_rows=torch.tensor([0, 1, 2, -1])).validate(VOCAB)


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


def ngram_generate(params: SamplingParams, n: int, seed: int) -> tuple[list[int], int]:
    """n tokens from the toy target with n-gram drafts of depth 3 looked up in HISTORY + output,
    each round verified with the draws of its position (`verify_round`, as the services)."""
    out: list[int] = []
    accepted = 0
    while len(out) < n:
        context = tuple(out)
        tree = draft_ngram([*HISTORY, *out], 3, VOCAB)
        assert tree is not None  # every token occurred in HISTORY
        paths = [context] + [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
        verdict = verify_round(tree, TARGET.logits(paths), params, seed, len(HISTORY) + len(out))
        accepted += len(verdict.accepted_tokens)
        out += verdict.emitted_tokens
    return out[:n], accepted


def ngram_two_token_pvalue(params: SamplingParams) -> tuple[float, float]:
    counts: Counter = Counter()
    accepted = 0
    for seed in range(SAMPLES):
        tokens, n_accepted = ngram_generate(params, 2, seed)
        counts[tuple(tokens)] += 1
        accepted += min(n_accepted, 2)
    return chi_square_pvalue(counts, exact_two_token_distribution(params)), accepted / (2 * SAMPLES)


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


@pytest.mark.parametrize("seed", range(5))
def test_the_index_proposes_what_propose_does(seed: int) -> None:
    """NgramIndex kept token by token = `propose` over the same tokens (short of its window), with
    a step's fed tokens given apart; sync rebuilds after a rollback."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 5, (300,), generator=g).tolist()
    index = NgramIndex()
    for i in range(1, 300):
        index.sync(tokens[: i - 1])
        assert index.propose(4, tokens[i - 1 : i]) == propose(tokens[:i], 4)
    index.sync(tokens[:50])  # rolled back
    assert index.tokens == tokens[:50]
    assert index.propose(3) == propose(tokens[:50], 3)


def test_the_lookup_says_how_long_its_match_is() -> None:
    """(m, proposal): m counts the tokens before the proposal's source that agree with the end of
    the sequence, past the n-gram and up to MAX_MATCH; min_ngram: shorter matches propose nothing."""
    index = NgramIndex()
    index.sync([5, 6, 7, 9, 5, 6])
    assert index.lookup(3, [7]) == (3, [9, 5, 6])
    index.sync([1, 5, 6, 7, 9, 1, 5, 6])
    assert index.lookup(3, [7]) == (4, [9, 1, 5])  # the 1 before [5, 6, 7] agrees too
    index.sync([5, 9, 1, 2, 5])
    assert index.lookup(2) == (1, [9, 1])
    assert index.lookup(2, min_ngram=2) == (1, [])
    passage = _passage(40, 11)
    index.sync([*passage, 7, *passage[:30]])
    assert index.lookup(2) == (MAX_MATCH, passage[30:32])  # a copy that has run 30 tokens: capped
    assert index.lookup(2, min_ngram=MAX_MATCH) == (MAX_MATCH, passage[30:32])
    index.sync([*passage, 7, 8, *passage[3:12]])
    assert index.lookup(2) == (9, passage[12:14])  # the copy started at passage[3]


def _passage(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 5000, (n,), generator=g).tolist()


def test_the_estimate_sees_an_answer_copy_its_prompt_and_stop() -> None:
    """Fresh text: few proposals, and wrong ones. An answer that copies a passage of its prompt:
    nearly every position has a proposal and nearly all of it is right. Then fresh text again:
    the estimate falls back (the counts decay)."""
    passage = _passage(200, 0)
    prompt = [*_passage(50, 1), *passage, *_passage(20, 2)]
    fresh = _passage(120, 3)
    estimate = NgramEstimate(start=len(prompt))

    def matched() -> float:
        return sum(share for share, _ in estimate.classes().values())

    estimate.sync([*prompt, *fresh])
    assert matched() < 0.2
    estimate.sync([*prompt, *fresh, *passage[:150]])
    share, alphas = estimate.classes()[MAX_MATCH]  # a copy that has run: long matches, right
    assert share > 0.7 and min(alphas[:4]) > 0.8
    estimate.sync([*prompt, *fresh, *passage[:150], *_passage(150, 4)])
    assert matched() < 0.2


def test_the_estimate_is_a_function_of_the_tokens() -> None:
    """However the tokens arrive (one by one, all at once, after a rollback to other tokens), the
    same tokens give the same estimate: a resumed session chooses as the original would have."""
    passage = _passage(100, 5)
    tokens = [*passage, *_passage(30, 6), *passage[:60], *_passage(30, 7)]
    whole = NgramEstimate(start=100)
    whole.sync(tokens)
    stepwise = NgramEstimate(start=100)
    stepwise.sync([*tokens[:150], 1, 2, 3])  # a branch later rolled back
    for i in range(140, len(tokens) + 1):
        stepwise.sync(tokens[:i])
    assert stepwise.classes() == whole.classes()


# --- rides: n-gram proposals inside a verifier's plain steps ---------------------------------------


class ToyVerifier:
    """The toy target behind `verify_steps`, one session: its committed tokens (HISTORY, then what
    the steps emitted); a step's logits are the target's rows after the tokens past HISTORY."""

    def __init__(self) -> None:
        self.tokens = list(HISTORY[:-1])
        self.nodes: list[int] = []  # the last step's node tokens

    def forward(self, steps: list) -> list[torch.Tensor]:
        (step,) = steps
        self.tokens += step.new_tokens
        context = tuple(self.tokens[len(HISTORY) :])
        paths = [context]
        for t, parent in zip(step.node_tokens, step.node_parents, strict=True):
            paths.append((*paths[parent + 1], t))
        self.nodes = list(step.node_tokens)
        return [TARGET.logits(paths)]

    def commit(self, session_id: str, nodes: list[int]) -> None:
        self.tokens += [self.nodes[n] for n in nodes]


def ride_run(params: SamplingParams, seed: int, steps: int, depth: int = 3) -> tuple[list[int], int]:
    """One plain call of `steps` steps from HISTORY, with rides of up to `depth` tokens looked up
    in HISTORY and the output (the verifier's NgramIndex); -> (emitted tokens, accepted ride
    tokens). depth 0: plain steps alone."""
    toy, index = ToyVerifier(), NgramIndex()

    def ride(before: int, after: list[int], depth: int):
        index.sync(toy.tokens[:before])
        return ngram_ride(Calibration(), index.propose(depth, after), VOCAB)

    job = VerifyJob(
        "s", [HISTORY[-1]], None, params, seed, len(HISTORY), plain_steps=steps, ride=ride, lookup_depth=depth
    )
    (outcome,) = run_ticked(verify_steps([job], toy.commit), toy.forward)
    assert outcome.error is None
    return [*outcome.plain_tokens, *outcome.verdict.emitted_tokens], outcome.rides[1]


RIDE_SAMPLES = SAMPLES // 2  # a call through verify_steps costs ~2 ms: half the samples, still 64 cells x 390


def ride_two_token_pvalue(params: SamplingParams) -> tuple[float, float]:
    """The first two tokens of plain calls of two or three steps (a ride emits 1-4 tokens, so the
    two are often one step's, else two steps'), against the target's exact distribution."""
    counts: Counter = Counter()
    accepted = 0
    for seed in range(RIDE_SAMPLES):
        tokens, n_accepted = ride_run(params, seed, steps=2 + seed % 2)
        counts[tuple(tokens[:2])] += 1
        accepted += min(n_accepted, 2)
    return chi_square_pvalue(counts, exact_two_token_distribution(params)), accepted / (2 * RIDE_SAMPLES)


# n-gram drafts from the drafter (a round of their own), or riding in a verifier's plain steps
PVALUES = {"drafter": ngram_two_token_pvalue, "ride": ride_two_token_pvalue}


@pytest.mark.parametrize(
    ("how", "params_name"),
    [
        *(("drafter", p) for p in ("T1.0", "T1.0-topk3", "T1.0-topp0.8")),  # T0.6: the ride's
        ("ride", "T1.0"),
        ("ride", "T0.6-topk3"),
    ],
)
def test_ngram_drafts_keep_the_target_distribution(how: str, params_name: str) -> None:
    p_value, accepted_share = PVALUES[how](PARAMS[params_name])
    assert p_value > P_VALUE_THRESHOLD, f"ngram ({how}) @ {params_name}: p = {p_value:.3g}"
    assert 0.1 < accepted_share < 0.95, accepted_share  # drafts are accepted and rejected


@pytest.mark.parametrize("how", list(PVALUES))
def test_detects_one_draw_shared_by_the_positions(how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The slip the rule invites: one uniform for the round, reused at every proposed position
    (each token is still drawn from its own row, but the tokens of a round are no longer
    independent)."""

    def one_draw(streams, lengths):
        return torch.cat([d.uniform(1).repeat(n) for d, n in zip(streams, lengths, strict=True)])

    monkeypatch.setattr(verification, "per_position_many", one_draw)
    assert PVALUES[how](PARAMS["T1.0"])[0] < P_VALUE_THRESHOLD


@pytest.mark.parametrize("params_name", ["T1.0", "T0.6-topk3", "T1.0-topp0.8"])
def test_rides_leave_a_seeded_text_as_it_was(params_name: str) -> None:
    """Each position's token is the one a plain step there draws: the same seed gives the same
    text with rides as without them, token for token (and the rides did ride)."""
    accepted = 0
    for seed in range(40):
        plain, _ = ride_run(PARAMS[params_name], seed, steps=8, depth=0)
        ridden, n = ride_run(PARAMS[params_name], seed, steps=8)
        assert ridden[: len(plain)] == plain[: len(ridden)], seed
        accepted += n
    assert accepted > 40


def test_greedy_rides_emit_the_targets_greedy_decode() -> None:
    tokens, accepted = ride_run(SamplingParams(0.0), 0, steps=12)
    assert accepted > 0 and tokens == TARGET.greedy((), len(tokens))
