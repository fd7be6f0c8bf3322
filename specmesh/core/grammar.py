"""Constrained decoding (structured output): the target's distribution restricted to the tokens a
grammar allows after the tokens so far, then renormalised.

A grammar turns every position into a set of allowed tokens. Masking a row's logits to -inf outside
that set before the warp gives the constrained distribution q'(x | ctx) = q(x | ctx) 1[x allowed] / Z,
and every verification rule stays lossless for q' as long as *each row* it reads is masked with
the set after *that row's own path*: the root's row after the committed tokens, node i's row after
the committed tokens and node i's path (tests/test_lossless.py proves it with a chi-square test
and shows that masking only the root fails). The draft may be masked too (its proposals then stay
inside the grammar, which raises acceptance); losslessness does not depend on it, because the
rule only needs the p the draft was sampled from, which the tree carries.

Model-free: a `TokenMask` says which tokens are allowed after each path; specmesh.runtime.grammar
implements it with llguidance.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specmesh.core.extras import missing

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

Path = tuple[int, ...]


@dataclass(frozen=True)
class Grammar:
    """A request's constraint as the replicas get it: `text`, a grammar in llguidance's serialised
    form (from a JSON schema, a regex or Lark, compiled by the gateway), applies to the tokens
    from `start` on (the prompt's length: the prompt itself is not constrained)."""

    text: str
    start: int


class TokenMask(Protocol):
    """Which tokens a grammar allows after the committed tokens and each path below them."""

    def allowed(self, committed: Sequence[int], paths: Sequence[Path]) -> torch.Tensor:
        """committed: the session's tokens from the grammar's start on -> [len(paths), V] bool."""
        ...


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [K, V], allowed [K, V] bool -> logits with every disallowed token at -inf. A row with
    nothing allowed (a grammar in an error state) is left as it is: the session goes on unconstrained
    rather than sampling from an empty set (not logged: a row is built per path of every tree)."""
    empty = ~allowed.any(-1, keepdim=True)
    return logits.masked_fill(~(allowed | empty), -math.inf)


def tree_paths(parents: Sequence[int], tokens: Sequence[int]) -> list[Path]:
    """The path of the root (()) and of each node (root-to-node tokens), in row order: row 0 is
    the root's, row i + 1 node i's. parents[i] < i (a node comes after its parent)."""
    paths: list[Path] = [()]
    for node, parent in enumerate(parents):
        paths.append((*paths[parent + 1], tokens[node]))
    return paths


def constrain_rows(
    logits: torch.Tensor, mask: TokenMask, committed: Sequence[int], paths: Sequence[Path]
) -> torch.Tensor:
    """The verifier's side: logits [len(paths), V], row k after `paths[k]` (`tree_paths` order)."""
    return mask_logits(logits, mask.allowed(committed, paths))


def constrain_draft(
    next_logits: Callable[[list[Path]], torch.Tensor], mask: TokenMask, committed: Sequence[int]
) -> Callable[[list[Path]], torch.Tensor]:
    """The drafter's side: build_tree's `next_logits` with each path's row masked, so that the
    draft proposes only tokens the grammar allows (and its p, carried by the tree, is masked too)."""
    return lambda paths: mask_logits(next_logits(paths), mask.allowed(committed, paths))
