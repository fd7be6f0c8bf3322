"""Pipelined rounds keep the target's distribution: the rule of specmesh.core.ahead, χ²-tested.

The toy loop below is the round client's pipelining without services: each round drafts the next
round's tree on the likely path plus the draft's guess (`likely_path`, `PreDraft`) before it is
verified, and uses that tree only where `PreDraft.applies`. Three tokens are generated, so that a
pre-drafted tree decides the third token whenever round one accepted its path and guessed the
bonus. A wrong variant (trusting the drafter's guess as the committed token when the path was
accepted) is caught by the same test. The services and the gateway run the real thing in
test_services.py and test_gateway.py (greedy equal to the target's decode, pipelining on).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from specmesh.core.ahead import PipelinePolicy, PreDraft, likely_path
from specmesh.core.drafting import TreeSpec, build_tree
from specmesh.core.rounds import Pipelining
from specmesh.core.sampling import SamplingParams
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.core.verification import verify_tree
from tests.stats import chi_square_pvalue
from tests.test_lossless import P_VALUE_THRESHOLD, SAMPLES, TARGET, VOCAB
from tests.toy import ToyModel

DRAFT = ToyModel(VOCAB, seed=33, scale=0.7, base=TARGET)  # near the target: pre-drafts often apply
TOKENS = 3
RUNS = SAMPLES // 2  # 512 outcomes of three tokens: ~50 generations each at the default
SPECS = {
    "chain": TreeSpec("chain", depth=1),
    "rsd_s": TreeSpec("rsd_s", depth=1, beam_width=2),  # the likely path is a tree's best leaf
}
PARAMS = {"T1.0": SamplingParams(temperature=1.0), "T0.6-topk4": SamplingParams(temperature=0.6, top_k=4)}
CASES = [("chain", "T1.0"), ("chain", "T0.6-topk4"), ("rsd_s", "T1.0")]


def pipelined(
    spec: TreeSpec, params: SamplingParams, g: torch.Generator, trust_guess: bool = False
) -> tuple[list[int], int]:
    """TOKENS tokens by pipelined rounds; -> (tokens, rounds whose tree was pre-drafted).
    trust_guess: the wrong variant, which commits the assumed tokens once the path was accepted."""
    out: list[int] = []
    ahead: tuple[PreDraft, DraftTree] | None = None
    hits = 0
    while len(out) < TOKENS:
        context = tuple(out)
        if ahead is not None and ahead[0].applies(out):
            tree, hits = ahead[1], hits + 1
        else:
            tree = build_tree(spec, DRAFT.next_logits(context), params, g)
        path = tuple(tree.path(likely_path(tree)[-1]))
        assumed = (*path, int(DRAFT.row((*context, *path)).argmax()))
        pre = PreDraft(len(out), assumed)  # drafted beside the verification below
        ahead = (pre, build_tree(spec, DRAFT.next_logits((*context, *assumed)), params, g))
        paths = [context] + [(*context, *tree.path(i)) for i in range(tree.num_nodes)]
        emitted = verify_tree(tree, TARGET.logits(paths), params, g).emitted_tokens
        if trust_guess and tuple(emitted[:-1]) == path:
            emitted = list(assumed)
        out += emitted
    return out[:TOKENS], hits


def exact_distribution(params: SamplingParams) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(TOKENS):
        out = {
            (*prefix, t): p * float(TARGET.dist(prefix, params).double()[t])
            for prefix, p in out.items()
            for t in range(VOCAB)
        }
    return out


def pvalue(spec: TreeSpec, params: SamplingParams, trust_guess: bool = False) -> tuple[float, float]:
    """(p-value, share of generations in which a pre-drafted tree was used)."""
    g = torch.Generator().manual_seed(0)
    counts: Counter = Counter()
    used = 0
    for _ in range(RUNS):
        tokens, hits = pipelined(spec, params, g, trust_guess)
        counts[tuple(tokens)] += 1
        used += hits > 0
    return chi_square_pvalue(counts, exact_distribution(params)), used / RUNS


@pytest.mark.parametrize(("method", "params_name"), CASES)
def test_pipelined_rounds_keep_the_target_distribution(method: str, params_name: str) -> None:
    p, used = pvalue(SPECS[method], PARAMS[params_name])
    assert p > P_VALUE_THRESHOLD, f"{method} @ {params_name}: p = {p:.3g}"
    assert used > 0.05, used  # pre-drafted trees really decide tokens here


def test_detects_a_pipeline_that_commits_the_drafters_guess() -> None:
    assert pvalue(SPECS["chain"], PARAMS["T1.0"], trust_guess=True)[0] < P_VALUE_THRESHOLD


# ---- the rule's parts ---------------------------------------------------------------------------


def _tree(tokens: list[int], parents: list[int], rows: list[list[float]], prob_rows: list[int]) -> DraftTree:
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        mode=SamplingMode.WITHOUT_REPLACEMENT,
        draft_probs=torch.tensor(rows),
        prob_rows=torch.tensor(prob_rows),
    )


def test_likely_path_is_the_most_probable_leaf_not_the_greedy_descent() -> None:
    # root -> a (0.6) | b (0.4); a -> c (0.5) | d (0.5); b -> e (1.0): leaves c, d 0.3; e 0.4
    tree = _tree(
        tokens=[0, 1, 2, 3, 4],
        parents=[-1, -1, 0, 0, 1],
        rows=[[0.6, 0.4, 0, 0, 0], [0, 0, 0.5, 0.5, 0], [0, 0, 0, 0, 1.0]],
        prob_rows=[0, 1, 2, -1, -1, -1],
    )
    assert likely_path(tree) == [1, 4]
    chain = _tree([3, 2, 1], [-1, 0, 1], [[0, 0, 0, 1.0], [0, 0, 1.0, 0], [0, 1.0, 0, 0]], [0, 1, 2, -1])
    assert likely_path(chain) == [0, 1, 2]


def test_a_pre_draft_applies_only_to_exactly_the_tokens_it_assumed() -> None:
    pre = PreDraft(base=3, assumed=(7, 8, 9))
    assert pre.applies([1, 2, 3, 7, 8, 9])
    assert not pre.applies([1, 2, 3, 7, 8])  # cut short (a stop token, max_new_tokens)
    assert not pre.applies([1, 2, 3, 7, 8, 5])  # another bonus token
    assert not pre.applies([1, 2, 3, 7, 8, 9, 4])


def test_the_policy_pre_drafts_only_when_it_pays_and_keeps_measuring_the_other_side() -> None:
    assert not PipelinePolicy(Pipelining.OFF).wants()
    assert PipelinePolicy(Pipelining.ON).wants()
    now = [0.0]
    policy = PipelinePolicy(Pipelining.AUTO, clock=lambda: now[0])
    assert not policy.wants()  # nothing measured: the first round is serial
    policy.observe(verify=0.016, beside=False, draft=0.020, levels=4)
    assert policy.wants()  # a hit saves a 20 ms draft, a miss costs at most a 5 ms level
    # drafting beside the verification slows it down by more than it saves (a shared CPU)
    for _ in range(20):
        policy.observe(verify=0.060, beside=True, hit=True)
    assert not policy.pays()
    assert policy.wants()  # the epoch's decision holds for every round in it
    decisions = []
    for _ in range(2 * policy.probe_every):
        now[0] += policy.epoch_seconds
        decisions.append([policy.wants() for _ in range(3)])
    assert all(len(set(d)) == 1 for d in decisions)  # one decision per epoch
    assert [d[0] for d in decisions].count(True) == 2  # off, but re-measured one epoch in probe_every
    # a drafter that never guesses right
    policy = PipelinePolicy(Pipelining.AUTO)
    policy.observe(verify=0.016, beside=False, draft=0.008, levels=1)
    for _ in range(20):
        policy.observe(verify=0.016, beside=True, hit=False)
    assert not policy.pays()


def test_a_round_that_waits_for_a_late_pre_draft_drafts_itself() -> None:
    """A pre-draft not in after its patience wakes the round that waits for it, with None (the
    round then drafts itself). `_late` used to cancel the pre-draft, which forgets the waiter,
    before waking it: nobody was woken, and a gateway's request waited for good, with no timer
    left and nothing logged (two routing runs of `bench conversation` on a busy 2-core host)."""
    import asyncio

    from specmesh.rpc.round_client import _PreDraftCall

    woken: list[object] = []

    async def run() -> None:
        ahead = _PreDraftCall(PreDraft(base=4, assumed=(1, 2)), TreeSpec("chain", depth=2), loop=None)  # type: ignore[arg-type]
        ahead.wait(woken.append, patience=0.01)
        await asyncio.sleep(0.1)
        ahead.answered(RuntimeError("failed late"))  # after the round moved on: nobody is woken twice

    asyncio.run(run())
    assert woken == [None]
