"""Draft token trees: the flattened layout, its attention mask, position ids and cache indices.

A tree is stored flat, in level order: `tokens[N]`, `parents[N]` (-1 = child of the root, the
committed context). Siblings keep the order in which they were sampled: that order is part of
the verification rule for trees sampled without replacement, so nothing may re-sort them. The
siblings of a tree of proposed tokens (looked up, not sampled) carry distinct tokens.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

from specmesh.core.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

# |sum - 1| allowed for a draft row: fp32 rounding over a vocabulary of ~10^5 stays far below it
DISTRIBUTION_TOLERANCE = 1e-3


class SamplingMode(StrEnum):
    """How the siblings of a tree were sampled; it decides the verification rule."""

    IID = "iid"  # chain, MCSD with replacement
    WITHOUT_REPLACEMENT = "without_replacement"  # MCSD without replacement, RSD-C, RSD-S
    MTAD = "mtad"  # a chain chosen by beam sampling, verified by MTAD's joint test
    # tokens looked up, not sampled (n-gram chains, suffix-tree trees): the walk descends into the
    # child whose token equals the target's own draw at its position, the draw a plain step there
    # would make (`verification`)
    PROPOSED = "proposed"

    @property
    def chain_only(self) -> bool:
        """Trees of this mode are chains (MTAD's joint test scores one candidate per position)."""
        return self is SamplingMode.MTAD

    @property
    def distinct_siblings(self) -> bool:
        """Siblings must carry distinct tokens: the rule descends into THE child whose token the
        target drew, which two alike would leave ambiguous."""
        return self is SamplingMode.PROPOSED

    @property
    def samples_drafts(self) -> bool:
        """The draft sampled its tokens and carries the rows it sampled them from (else tokens only)."""
        return self is not SamplingMode.PROPOSED


@dataclass(frozen=True, eq=False)
class DraftTree:
    """A drafted tree and the draft distributions its children were sampled from.

    tokens      [N]     int64  drafted token ids, level order
    parents     [N]     int64  parent node index, -1 for children of the root; parents[i] < i
    mode        SamplingMode
    draft_probs [M, V]  fp32   warped p(.|node) for the root and for every node that has children;
                               none at all (M = 0) for a greedy draft, whose verification never
                               reads them
    prob_rows   [N + 1] int64  row of draft_probs for the root (entry 0) and node i (entry i + 1),
                               -1 where the node has no children (its p was never sampled from)
    mtad_threshold             MTAD's acceptance threshold lambda (mode MTAD only)
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    mode: SamplingMode
    draft_probs: torch.Tensor
    prob_rows: torch.Tensor
    mtad_threshold: float = 0.0

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.numel())

    @property
    def vocab_size(self) -> int:
        return int(self.draft_probs.shape[-1])

    @property
    def has_draft_probs(self) -> bool:
        """False for a greedy draft: no distributions, only tokens (verified greedily)."""
        return self.draft_probs.shape[0] > 0

    @functools.cached_property
    def is_chain(self) -> bool:
        """One node per level, each the child of the one before."""
        return bool(torch.equal(self.parents, torch.arange(-1, self.num_nodes - 1)))

    def depths(self) -> torch.Tensor:
        return tree_depths(self.parents)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in sampling order."""
        return (self.parents == node).nonzero().flatten().tolist()

    def draft_dist(self, node: int) -> torch.Tensor:
        """p(.|node) for node -1 (root) or a node with children."""
        row = int(self.prob_rows[node + 1])
        if row < 0:
            raise KeyError(f"node {node} has no stored draft distribution")
        return self.draft_probs[row]

    def path(self, node: int) -> list[int]:
        """Token ids from the root down to `node` inclusive."""
        out = []
        while node >= 0:
            out.append(int(self.tokens[node]))
            node = int(self.parents[node])
        return out[::-1]

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when the tree is malformed."""
        n = self.num_nodes
        if self.tokens.dim() != 1 or self.parents.shape != self.tokens.shape:
            raise ValueError("parents must have one entry per token")
        if n == 0:
            raise ValueError("tokens must not be empty")
        vocab = self.vocab_size if vocab_size is None else vocab_size
        if self.draft_probs.dim() != 2 or self.draft_probs.shape[-1] != vocab:
            raise ValueError(f"draft_probs must have shape [M, {vocab}]")
        if int(self.tokens.min()) < 0 or int(self.tokens.max()) >= vocab:
            raise ValueError(f"tokens must be in [0, {vocab})")
        idx = torch.arange(n)
        if bool((self.parents < -1).any() or (self.parents >= idx).any()):
            raise ValueError("parents must come before their children (-1 <= parents[i] < i)")
        if bool((self.depths().diff() < 0).any()):
            raise ValueError("parents: nodes must be in level order")
        if self.prob_rows.shape != (n + 1,):
            raise ValueError(f"prob_rows must have {n + 1} entries")
        if int(self.prob_rows.max()) >= self.draft_probs.shape[0] or int(self.prob_rows.min()) < -1:
            raise ValueError("prob_rows must index draft_probs or be -1")
        if self.mode.chain_only and not self.is_chain:
            raise ValueError(f"parents: a {self.mode.name} tree must be a chain")
        if self.mode.distinct_siblings and not self.is_chain:
            self._check_distinct_siblings()
        if not self.mode.samples_drafts and self.has_draft_probs:
            name = self.mode.name
            raise ValueError(f"draft_probs: a {name} tree carries none (its tokens were not sampled)")
        if not self.has_draft_probs:  # a greedy draft, or proposed tokens: tokens only
            if bool((self.prob_rows != -1).any()):
                raise ValueError("prob_rows: must all be -1 when there are no draft_probs")
            return
        has_children = torch.zeros(n + 1, dtype=torch.bool)
        has_children[self.parents + 1] = True
        if bool((self.prob_rows[has_children] < 0).any()):
            raise ValueError("prob_rows: every node with children needs its draft distribution")
        self._validate_distributions()

    def _check_distinct_siblings(self) -> None:
        """No two children of a node carry the same token (ValueError naming the first repeat)."""
        first: dict[tuple[int, int], int] = {}
        for node, (parent, token) in enumerate(zip(self.parents.tolist(), self.tokens.tolist(), strict=True)):
            seen = first.setdefault((parent, token), node)
            if seen != node:
                of = "the root" if parent < 0 else f"node {parent}"
                raise ValueError(
                    f"tokens: siblings of a {self.mode.name} tree must carry distinct tokens "
                    f"(nodes {seen} and {node}, children of {of}, both carry {token})"
                )

    def _validate_distributions(self) -> None:
        """Every row a distribution. The acceptance rules divide by and subtract these rows: a row
        that is not one would bias the output without any error."""
        rows = self.draft_probs
        if not bool(torch.isfinite(rows).all()) or bool((rows < 0).any()):
            raise ValueError("draft_probs: probabilities must be finite and >= 0")
        sums = rows.sum(dim=-1, dtype=torch.float64)
        bad = ((sums - 1.0).abs() > DISTRIBUTION_TOLERANCE).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise ValueError(f"draft_probs[{i}]: sums to {float(sums[i]):.6g}, not 1")

    def check_drawable(self) -> None:
        """Every drafted token has p > 0 under the row it was sampled from (ValueError naming the
        first that has not). Only sampled verification needs it: at temperature 0 the siblings
        are the draft's top-k by logit and the rows are not used; proposed tokens carry none."""
        if not self.mode.samples_drafts:
            return
        if not self.has_draft_probs:
            raise ValueError("draft_probs: a greedy draft carries none; sampled verification needs them")
        drawn_from = self.prob_rows[self.parents + 1]
        p = self.draft_probs[drawn_from, self.tokens]
        zero = (p <= 0).nonzero().flatten()
        if zero.numel():
            i = int(zero[0])
            token = int(self.tokens[i])
            raise ValueError(f"tokens[{i}]: token {token} has probability 0 under its draft row")


def proposed_tree(tokens: list[int], parents: list[int], vocab_size: int) -> DraftTree:
    """A tree of proposed tokens (SamplingMode.PROPOSED: looked up, no draft distributions): the
    n-gram chains, suffix trees and rides."""
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.tensor(parents, dtype=torch.long),
        mode=SamplingMode.PROPOSED,
        draft_probs=torch.zeros(0, vocab_size),
        prob_rows=torch.full((len(tokens) + 1,), -1),
    )


def tree_depths(parents: torch.Tensor) -> torch.Tensor:
    """Level of every node [N]: 1 for children of the root."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents.tolist()):
        depth[i] = 1 if p < 0 else depth[p] + 1
    return torch.tensor(depth, dtype=torch.long)


def tree_attention_mask(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Boolean mask [N, prefix_len + N], True = may attend.

    Every node sees the whole prefix, itself and its ancestors: the usual causal mask with the
    ancestor matrix in its bottom-right block.
    """
    n = len(parents)
    depth = tree_depths(parents)
    ancestors = torch.eye(n, dtype=torch.bool)
    for level in range(2, int(depth.max()) + 1 if n else 0):
        nodes = (depth == level).nonzero().flatten()
        ancestors[nodes] |= ancestors[parents[nodes]]
    prefix = torch.ones(n, prefix_len, dtype=torch.bool)
    return torch.cat([prefix, ancestors], dim=1)


def tree_position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position id of every node [N]: prefix_len + depth - 1, shared by siblings and cousins."""
    return prefix_len + tree_depths(parents) - 1


def accepted_cache_indices(prefix_len: int, accepted_nodes: torch.Tensor | list[int]) -> torch.Tensor:
    """Cache positions to keep after verification: the prefix, then the accepted path's nodes."""
    nodes = torch.as_tensor(accepted_nodes, dtype=torch.long)
    return torch.cat([torch.arange(prefix_len), prefix_len + nodes])


def chain_suffix(tree: DraftTree, skip: int) -> DraftTree:
    """A chain without its first `skip` nodes, rooted where they end: what is left to verify of a
    chain whose first tokens were decided by another verification (DSI's guard, docs/gateway.md).
    Node i + skip becomes node i; the root's draft row is the old node skip - 1's.

    tokens [N] -> [N - skip]; prob_rows [N + 1] -> [N + 1 - skip]; draft_probs kept whole."""
    n = tree.num_nodes
    if not 0 < skip < n:
        raise ValueError(f"skip must be in [1, {n - 1}], got {skip}")
    if not bool((tree.parents == torch.arange(-1, n - 1)).all()):
        raise ValueError("chain_suffix takes a chain")
    return DraftTree(
        tokens=tree.tokens[skip:],
        parents=torch.arange(-1, n - skip - 1),
        mode=tree.mode,
        draft_probs=tree.draft_probs,
        prob_rows=tree.prob_rows[skip:],
        mtad_threshold=tree.mtad_threshold,
    )
