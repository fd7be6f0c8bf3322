"""MTAD's verification rule, pinned: the longest passing prefix, a strict >, the next token from q."""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from specmesh.core.drafting import TreeSpec, build_tree
from specmesh.core.sampling import SamplingParams, warp
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.core.verification import verify_tree
from tests.stats import chi_square_pvalue
from tests.toy import ToyModel

T1 = SamplingParams(temperature=1.0)


def mtad_chain(tokens: list[int], draft_probs: torch.Tensor, threshold: float) -> DraftTree:
    """A chain whose node i was chosen from draft_probs[i] (row 0 = root)."""
    n = len(tokens)
    rows = torch.full((n + 1,), -1, dtype=torch.long)
    rows[:n] = torch.arange(n)
    return DraftTree(
        tokens=torch.tensor(tokens),
        parents=torch.arange(n) - 1,
        mode=SamplingMode.MTAD,
        draft_probs=draft_probs.float(),
        prob_rows=rows,
        mtad_threshold=threshold,
    )


def dist(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64)


def test_accepts_the_longest_passing_prefix_not_the_first_failure() -> None:
    # draft gives each chosen token 0.5; the target's cumulative ratios are 0.4, 0.8, 0.16
    p = torch.stack([dist(0.5, 0.5, 0, 0), dist(0, 0.5, 0.5, 0), dist(0, 0, 0.5, 0.5)])
    q = torch.stack(
        [dist(0.2, 0.8, 0, 0), dist(0, 1.0, 0, 0), dist(0, 0, 0.1, 0.9), dist(0.25, 0.25, 0.25, 0.25)]
    )
    tree = mtad_chain([0, 1, 2], p, threshold=0.5)
    verdict = verify_tree(tree, q.log(), T1, torch.Generator().manual_seed(0))
    assert verdict.accepted_nodes == [0, 1]  # prefix 1 fails (0.4), prefix 2 passes (0.8)
    assert verdict.accepted_tokens == [0, 1]
    assert verdict.next_token in (2, 3)  # drawn from q after d_1 d_2
    assert not verdict.bonus


def test_threshold_is_strict() -> None:
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    q = warp(logits, T1)
    tokens = [int(q[0].argmax()), int(q[1].argmax()), int(q[2].argmax())]
    tree = mtad_chain(tokens, q[:3], threshold=1.0)  # p == q exactly: every ratio is exactly 1
    g = torch.Generator().manual_seed(0)
    assert verify_tree(tree, logits, T1, g).accepted_nodes == []  # 1 > 1 is false
    tree = mtad_chain(tokens, q[:3], threshold=0.999)
    verdict = verify_tree(tree, logits, T1, g)
    assert verdict.accepted_nodes == [0, 1, 2]
    assert verdict.bonus


def test_next_token_is_sampled_from_q_not_from_a_residual() -> None:
    p = torch.stack([dist(0.7, 0.1, 0.1, 0.1), dist(0.25, 0.25, 0.25, 0.25)])
    q_root = dist(0.4, 0.3, 0.2, 0.1)  # q(d_1) / p(d_1) = 4/7 < 0.9: nothing accepted
    q = torch.stack([q_root, dist(0.25, 0.25, 0.25, 0.25), dist(0.25, 0.25, 0.25, 0.25)])
    tree = mtad_chain([0, 1], p, threshold=0.9)
    g = torch.Generator().manual_seed(0)
    counts = Counter(verify_tree(tree, q.log(), T1, g).next_token for _ in range(20_000))
    assert counts[0] > 0  # the residual (q - p)+ gives token 0 probability 0
    assert chi_square_pvalue(counts, {i: float(q_root[i]) for i in range(4)}) > 1e-4
    residual = (q_root - p[0]).clamp(min=0)
    residual /= residual.sum()
    assert chi_square_pvalue(counts, {i: float(residual[i]) for i in range(4)}) < 1e-4


def test_threshold_zero_accepts_the_whole_chain() -> None:
    draft, target = ToyModel(10, 1, 1.0), ToyModel(10, 2, 1.0)
    g = torch.Generator().manual_seed(0)
    tree = build_tree(
        TreeSpec("mtad", depth=4, beam_width=3, mtad_threshold=0.0), draft.next_logits(()), T1, g
    )
    paths = [()] + [tuple(tree.path(i)) for i in range(tree.num_nodes)]
    verdict = verify_tree(tree, target.logits(paths), T1, g)
    assert verdict.accepted_nodes == [0, 1, 2, 3] and verdict.bonus


def test_greedy_beam_keeps_the_most_likely_sequence() -> None:
    """With W >= V^depth every sequence survives, so the chain is the draft's argmax sequence."""
    draft = ToyModel(4, 7, 1.5)
    spec = TreeSpec("mtad", depth=2, beam_width=16)
    tree = build_tree(spec, draft.next_logits(()), SamplingParams(0.0), None)

    def log_likelihood(seq: tuple[int, ...]) -> float:
        return sum(float(draft.row(seq[:i]).log_softmax(-1)[x]) for i, x in enumerate(seq))

    best = max(itertools.product(range(4), repeat=2), key=log_likelihood)
    assert tuple(tree.tokens.tolist()) == best


def test_sampled_beam_records_the_draft_distributions_of_the_chain() -> None:
    draft = ToyModel(9, 3, 1.0)
    params = SamplingParams(temperature=0.8, top_k=5)
    tree = build_tree(TreeSpec("mtad", depth=3, beam_width=4), draft.next_logits(()), params, None)
    tree.validate()
    assert tree.parents.tolist() == [-1, 0, 1]
    for node in (-1, 0, 1):
        path = tuple(tree.path(node)) if node >= 0 else ()
        torch.testing.assert_close(tree.draft_dist(node), warp(draft.row(path), params))
    for i, x in enumerate(tree.tokens.tolist()):
        assert float(tree.draft_dist(i - 1)[x]) > 0  # beams only extend with tokens p can produce
