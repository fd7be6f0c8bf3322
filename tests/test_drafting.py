from __future__ import annotations

import math
from collections import Counter, defaultdict

import pytest
import torch

from specmesh.core.drafting import TreeSpec, build_tree, truncated_gumbel
from specmesh.core.sampling import SamplingParams, warp
from specmesh.core.tree import SamplingMode
from tests.stats import chi_square_pvalue
from tests.toy import ToyModel

T1 = SamplingParams(temperature=1.0)


class CountingDraft(ToyModel):
    """Records how many paths each next_logits call asked for (one call per tree level)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def logits(self, paths):
        self.calls.append(len(paths))
        return super().logits(paths)


@pytest.mark.parametrize(
    ("spec", "nodes", "calls", "mode"),
    [
        (TreeSpec("chain", depth=4), 4, [1, 1, 1, 1], SamplingMode.IID),
        (TreeSpec("mcsd", depth=3, branching=(4, 2, 1), replacement=True), 4 + 8 + 8, [1, 4, 8], "iid"),
        (TreeSpec("mcsd", depth=3, branching=(4, 2, 1)), 20, [1, 4, 8], "without_replacement"),
        (TreeSpec("rsd_c", depth=2, branching=(2, 3)), 2 + 6, [1, 2], "without_replacement"),
        (TreeSpec("rsd_s", depth=3, beam_width=4), 12, [1, 4, 4], "without_replacement"),
        (TreeSpec("mtad", depth=3, beam_width=4), 3, [1, 4, 4], "mtad"),
    ],
)
@pytest.mark.parametrize("params", [T1, SamplingParams(0.0)])
def test_tree_shapes_and_one_call_per_level(spec, nodes, calls, mode, params) -> None:
    draft = CountingDraft(64, 1, 1.0)
    tree = build_tree(spec, draft.next_logits(()), params, torch.Generator().manual_seed(0))
    tree.validate()
    assert tree.num_nodes == nodes <= spec.max_nodes
    assert draft.calls == calls
    assert tree.mode == mode
    assert int(tree.depths().max()) == spec.depth


@pytest.mark.parametrize(
    "spec",
    [
        TreeSpec("chain", depth=3),
        TreeSpec("mcsd", depth=2, branching=(3, 2), replacement=True),
        TreeSpec("rsd_c", depth=2, branching=(3, 2)),
        TreeSpec("rsd_s", depth=3, beam_width=3),
    ],
)
def test_stored_distribution_is_the_one_children_were_sampled_from(spec) -> None:
    draft = ToyModel(20, 5, 1.0)
    params = SamplingParams(temperature=0.7, top_k=6, top_p=0.9)
    tree = build_tree(spec, draft.next_logits(()), params, torch.Generator().manual_seed(1))
    for node in [-1, *range(tree.num_nodes)]:
        kids = tree.children(node)
        if not kids:
            assert int(tree.prob_rows[node + 1]) == -1
            continue
        path = tuple(tree.path(node)) if node >= 0 else ()
        p = tree.draft_dist(node)
        torch.testing.assert_close(p, warp(draft.row(path), params))
        assert all(float(p[int(tree.tokens[c])]) > 0 for c in kids)


@pytest.mark.parametrize("method", ["mcsd", "rsd_c"])
def test_support_smaller_than_branching(method: str) -> None:
    draft = ToyModel(30, 2, 1.0)
    spec = TreeSpec(method, depth=2, branching=(5, 4))
    params = SamplingParams(temperature=1.0, top_k=3)
    tree = build_tree(spec, draft.next_logits(()), params, torch.Generator().manual_seed(0))
    tree.validate()
    assert len(tree.children(-1)) == 3  # only 3 tokens have mass
    for node in tree.children(-1):
        kids = [int(tree.tokens[c]) for c in tree.children(node)]
        assert len(kids) == len(set(kids)) == 3


def test_rsd_s_beam_narrower_support() -> None:
    draft = ToyModel(30, 2, 1.0)
    spec = TreeSpec("rsd_s", depth=2, beam_width=8)
    tree = build_tree(spec, draft.next_logits(()), SamplingParams(1.0, top_k=2), None)
    tree.validate()
    assert len(tree.children(-1)) == 2 and tree.num_nodes == 2 + 4


def test_iid_siblings_can_repeat() -> None:
    draft = ToyModel(3, 2, 0.5)
    spec = TreeSpec("mcsd", depth=1, branching=(6,), replacement=True)
    tree = build_tree(spec, draft.next_logits(()), T1, torch.Generator().manual_seed(0))
    assert len(set(tree.tokens.tolist())) < 6


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(method="beam"), "method"),
        (dict(method="chain", depth=0), "depth"),
        (dict(method="mcsd", depth=2, branching=(2,)), "branching"),
        (dict(method="rsd_c", depth=2, branching=(2, 0)), "branching"),
        (dict(method="chain", depth=2, branching=(2, 2)), "branching"),
        (dict(method="rsd_s", beam_width=0), "beam_width"),
        (dict(method="mtad", mtad_threshold=1.5), "mtad_threshold"),
    ],
)
def test_invalid_spec_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TreeSpec(**kwargs)


def test_truncated_gumbel_matches_the_naive_formula() -> None:
    g = torch.Generator().manual_seed(0)
    phi = torch.randn(3, 7, generator=g, dtype=torch.float64)
    u = torch.randn(3, 1, generator=g, dtype=torch.float64)
    z = phi.max(-1, keepdim=True).values
    naive = -torch.log(torch.exp(-u) - torch.exp(-z) + torch.exp(-phi))
    stable = truncated_gumbel(u, phi)
    torch.testing.assert_close(stable, naive)
    assert torch.equal(stable.max(-1, keepdim=True).values, u)  # the max maps to u exactly
    assert (stable <= u).all()


def test_truncated_gumbel_is_stable_at_extremes() -> None:
    phi = torch.tensor([[-math.inf, 0.0, -1e-12, -800.0, 900.0]], dtype=torch.float64)
    out = truncated_gumbel(torch.tensor([[50.0]], dtype=torch.float64), phi)
    assert not out.isnan().any()
    assert out[0, 0] == -math.inf and out[0, 4] == 50.0
    assert (out[0, 1:4] < 50).all()


def test_rsd_s_children_of_one_parent_are_a_sample_without_replacement() -> None:
    """Paper 001 Theorem 3.2, checked on level 2: for a fixed parent, its first child is
    distributed as p(.|parent) and its second child, given the first, as p without the first.
    This is what recursive rejection sampling needs (the number of children a parent gets may
    depend on the earlier children's scores, never on the next child's identity)."""
    vocab = 5
    draft = ToyModel(vocab, 9, 1.0)
    spec = TreeSpec("rsd_s", depth=2, beam_width=4)
    g = torch.Generator().manual_seed(0)
    first: dict[int, Counter] = defaultdict(Counter)
    second: dict[tuple[int, int], Counter] = defaultdict(Counter)
    for _ in range(30_000):
        tree = build_tree(spec, draft.next_logits(()), T1, g)
        for parent in tree.children(-1):
            kids = [int(tree.tokens[c]) for c in tree.children(parent)]
            a = int(tree.tokens[parent])
            if kids:
                first[a][kids[0]] += 1
            if len(kids) >= 2:
                second[(a, kids[0])][kids[1]] += 1
    checked = 0
    for a, counts in first.items():
        p = warp(draft.row((a,)), T1).double()
        if sum(counts.values()) > 500:
            assert chi_square_pvalue(counts, {x: float(p[x]) for x in range(vocab)}) > 1e-4
            checked += 1
    for (a, c1), counts in second.items():
        p = warp(draft.row((a,)), T1).double()
        if sum(counts.values()) > 500:
            rest = {x: (0.0 if x == c1 else float(p[x] / (1 - p[c1]))) for x in range(vocab)}
            assert chi_square_pvalue(counts, rest) > 1e-4
            checked += 1
    assert checked >= 8
