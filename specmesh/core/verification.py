"""Verification: which drafted tokens the target keeps, and the one token it adds.

Model-free. Vocabulary (as in vLLM's rejection sampler):
  accepted   drafted tokens on the path the target keeps;
  recovered  the token sampled from the residual after all children of a node were rejected;
  bonus      the token sampled from q after the path ran out of children (a leaf, or an RSD-S
             node that got none).
Every round emits accepted + exactly one recovered or bonus token.

The rule comes from the tree's sampling mode (docs/architecture.md), never from a separate setting:
  iid                  MCSD Alg. 1: residual against the fixed p (a chain is the K = 1 case)
  without_replacement  recursive rejection sampling (MCSD Alg. 2 = RSD): residual against the
                       current p, then remove the rejected token from p and renormalise
  mtad                 longest prefix whose joint ratio sum(log q) - sum(log p) > log(lambda);
                       next token from q (approximate by design)
At temperature 0 every mode is verified greedily: the target's argmax path through the tree.

Randomness: one uniform per tree node is drawn up front, then one draw for the final token, so a
seeded generator gives the same verdict whatever path the walk takes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specmesh.core.extras import missing
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.sampling import SamplingParams, sample, warp
from specmesh.core.tree import DraftTree, SamplingMode

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)


@dataclass(frozen=True)
class Verdict:
    accepted_tokens: list[int]
    accepted_nodes: list[int]  # indices into the tree, root-to-leaf
    next_token: int  # recovered (after a rejection) or bonus (after the path ended)
    bonus: bool  # True when next_token is a bonus token
    logprobs: tuple[TokenLogprob, ...] = ()  # of emitted_tokens, when asked for (verify_round)

    @property
    def emitted_tokens(self) -> list[int]:
        return [*self.accepted_tokens, self.next_token]

    @property
    def emitted_rows(self) -> list[int]:
        """The target-logits row each emitted token was drawn after: the root's, then each
        accepted node's (row i + 1 is after node i)."""
        return [0, *(node + 1 for node in self.accepted_nodes)]


def verify_tree(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """target_logits [N + 1, V]: row 0 after the committed context (the root), row i + 1 after node i."""
    if target_logits.shape[0] != tree.num_nodes + 1:
        raise ValueError(
            f"target_logits must have {tree.num_nodes + 1} rows (root + one per node), "
            f"got {target_logits.shape[0]}"
        )
    if params.greedy:
        return _verify_greedy(tree, target_logits)
    if tree.mode is SamplingMode.MTAD:
        return _verify_mtad(tree, target_logits, params, generator)
    return _verify_rejection(tree, target_logits, params, generator)


def autoregressive_step(
    root_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """No tree (method "none", the baseline): the next token from q after the committed context.

    One rule for the engine and the verifier service. Greedy gives the argmax: what sampling the
    one-hot warp gives, without a vocabulary-wide CDF per token (~0.4 ms at V = 152k).
    """
    if params.greedy:
        return Verdict([], [], int(root_logits.argmax()), bonus=True)
    return Verdict([], [], sample(warp(root_logits, params), generator), bonus=True)


def _children_of(parents: torch.Tensor) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist()):
        children.setdefault(parent, []).append(node)
    return children


def _verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Verdict:
    children = _children_of(tree.parents)
    tokens = tree.tokens.tolist()
    argmax = target_logits.argmax(-1).tolist()
    node, accepted = -1, []
    while True:
        best = argmax[node + 1]
        kids = children.get(node, [])
        match = next((c for c in kids if tokens[c] == best), None)
        if match is None:
            return Verdict([tokens[n] for n in accepted], accepted, best, bonus=not kids)
        node = match
        accepted.append(node)


def rejection_step(
    q: torch.Tensor,
    p: torch.Tensor,
    candidates: list[int],
    uniforms: list[float],
    without_replacement: bool,
) -> tuple[int | None, torch.Tensor]:
    """Multi-candidate rejection sampling at one node (RSD Alg. 1 / MCSD Alg. 1 and 2).

    q, p [V]: target and draft distributions at the node; candidates: its children's tokens in
    sampling order. Returns (index of the accepted candidate, q) or (None, the last residual).
    """
    for j, x in enumerate(candidates):
        px, qx = float(p[x]), float(q[x])
        if uniforms[j] * px < qx:  # accept with probability min(1, q(x) / p(x))
            return j, q
        residual = (q - p).clamp_(min=0.0)  # against the current p, before removing x
        mass = float(residual.sum())
        if mass > 0.0:  # mass 0 means q == p, where a rejection has probability 0: keep q
            q = residual / mass
        if without_replacement and px < 1.0:
            p = p.clone()
            p[x] = 0.0
            p = p / (1.0 - px)
    return None, q


def _verify_rejection(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    without_replacement = tree.mode is SamplingMode.WITHOUT_REPLACEMENT
    children = _children_of(tree.parents)
    tokens = tree.tokens.tolist()
    uniforms = torch.rand(tree.num_nodes, generator=generator, dtype=torch.float64).tolist()
    node, accepted = -1, []
    while True:
        q = warp(target_logits[node + 1], params)
        kids = children.get(node, [])
        if not kids:
            break
        j, q = rejection_step(
            q,
            tree.draft_dist(node),
            [tokens[c] for c in kids],
            [uniforms[c] for c in kids],
            without_replacement,
        )
        if j is None:
            return Verdict([tokens[n] for n in accepted], accepted, sample(q, generator), bonus=False)
        node = kids[j]
        accepted.append(node)
    return Verdict([tokens[n] for n in accepted], accepted, sample(q, generator), bonus=True)


def _verify_mtad(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> Verdict:
    """MTAD: keep the LONGEST prefix d_1..d_i with sum log q - sum log p > log(lambda) (strict, so
    lambda = 1 rejects everything); a shorter failing prefix does not stop the scan, because the
    ratio of products is not monotone. The next token comes from q, not from a residual."""
    n = tree.num_nodes
    if not torch.equal(tree.parents, torch.arange(n) - 1):
        raise ValueError("parents: an MTAD draft must be a chain")
    tokens = tree.tokens
    q = warp(target_logits, params)  # [n + 1, V]
    log_q = q[:n].gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double().log()
    p_rows = tree.draft_probs[tree.prob_rows[:n]]  # p(.|root), p(.|d_1), ..., p(.|d_{n-1})
    log_p = p_rows.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).double().log()
    log_ratio = (log_q.cumsum(0) - log_p.cumsum(0)).tolist()
    log_threshold = math.log(tree.mtad_threshold) if tree.mtad_threshold > 0 else -math.inf
    accepted_len = max((i + 1 for i, r in enumerate(log_ratio) if r > log_threshold), default=0)
    accepted = list(range(accepted_len))
    next_token = sample(q[accepted_len], generator)
    return Verdict(tokens[:accepted_len].tolist(), accepted, next_token, bonus=accepted_len == n)
