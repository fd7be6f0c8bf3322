from __future__ import annotations

import random

import pytest
import torch

from specmesh.core.tree import (
    DraftTree,
    SamplingMode,
    accepted_cache_indices,
    tree_attention_mask,
    tree_depths,
    tree_position_ids,
)


def random_level_order_parents(rng: random.Random, n: int) -> list[int]:
    """Random tree in level order: each node's parent is a node of the previous level (or root)."""
    parents, levels = [], [[-1]]
    while len(parents) < n:
        level = []
        for _ in range(rng.randint(1, 4)):
            if len(parents) == n:
                break
            parents.append(rng.choice(levels[-1]))
            level.append(len(parents) - 1)
        levels.append(level)
    return parents


def brute_force(parents: list[int], prefix_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = len(parents)
    mask = torch.zeros(n, prefix_len + n, dtype=torch.bool)
    pos = torch.zeros(n, dtype=torch.long)
    for i in range(n):
        mask[i, :prefix_len] = True
        j, depth = i, 0
        while j >= 0:
            mask[i, prefix_len + j] = True
            j, depth = parents[j], depth + 1
        pos[i] = prefix_len + depth - 1
    return mask, pos


@pytest.mark.parametrize("seed", range(20))
def test_mask_and_positions_equal_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    parents = random_level_order_parents(rng, rng.randint(1, 40))
    prefix_len = rng.randint(0, 9)
    mask, pos = brute_force(parents, prefix_len)
    p = torch.tensor(parents)
    assert torch.equal(tree_attention_mask(p, prefix_len), mask)
    assert torch.equal(tree_position_ids(p, prefix_len), pos)


def test_chain_mask_is_causal() -> None:
    parents = torch.tensor([-1, 0, 1, 2])
    assert torch.equal(tree_attention_mask(parents, 0), torch.ones(4, 4, dtype=torch.bool).tril())
    assert tree_depths(parents).tolist() == [1, 2, 3, 4]


def test_accepted_cache_indices() -> None:
    assert accepted_cache_indices(3, [1, 4]).tolist() == [0, 1, 2, 4, 7]
    assert accepted_cache_indices(2, []).tolist() == [0, 1]


def make_tree(**overrides) -> DraftTree:
    fields = dict(
        tokens=torch.tensor([1, 2, 3]),
        parents=torch.tensor([-1, -1, 0]),
        mode=SamplingMode.WITHOUT_REPLACEMENT,
        draft_probs=torch.full((2, 5), 0.2),
        prob_rows=torch.tensor([0, 1, -1, -1]),
    )
    fields.update(overrides)
    return DraftTree(**fields)


def test_tree_accessors() -> None:
    tree = make_tree()
    tree.validate()
    assert tree.children(-1) == [0, 1]
    assert tree.children(0) == [2]
    assert tree.path(2) == [1, 3]
    assert tree.draft_dist(0).shape == (5,)
    with pytest.raises(KeyError):
        tree.draft_dist(1)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (dict(parents=torch.tensor([-1, 2, 0])), "parents"),
        (dict(parents=torch.tensor([-1, 0, -1])), "parents"),  # not level order
        (dict(tokens=torch.tensor([1, 2, 9])), "tokens"),
        (dict(prob_rows=torch.tensor([0, -1, -1, -1])), "prob_rows"),
        (dict(draft_probs=torch.full((2,), 0.2)), "draft_probs"),
        (dict(parents=torch.tensor([-1, -1])), "parents"),
        # issue 14, finding 5: rows that are not distributions
        (dict(draft_probs=torch.zeros(2, 5)), r"draft_probs\[0\]: sums to 0,"),
        (dict(draft_probs=torch.full((2, 5), 2e29)), r"draft_probs\[0\]: sums to 1e\+30"),
        (dict(draft_probs=torch.tensor([[0.2] * 5, [0.5, -0.1, 0.2, 0.2, 0.2]])), "finite and >= 0"),
        (dict(draft_probs=torch.tensor([[0.2] * 5, [float("nan")] * 5])), "finite and >= 0"),
    ],
)
def test_validate_names_the_bad_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        make_tree(**overrides).validate()


def test_a_drafted_token_must_be_possible_under_its_row() -> None:
    make_tree().check_drawable()
    rows = torch.tensor([[0.25, 0.25, 0.0, 0.25, 0.25], [0.2] * 5])  # token 2 (node 1) has p = 0
    with pytest.raises(ValueError, match=r"tokens\[1\]: token 2 has probability 0"):
        make_tree(draft_probs=rows).check_drawable()
    rows = torch.tensor([[0.2] * 5, [0.25, 0.25, 0.25, 0.0, 0.25]])  # token 3 (node 2, child of 0)
    with pytest.raises(ValueError, match=r"tokens\[2\]: token 3"):
        make_tree(draft_probs=rows).check_drawable()
