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
  proposed             (looked-up tokens: n-gram chains, suffix-tree trees, and a plain step as
                       the tree of no node) the target draws each position's token as a plain
                       step there would; the walk descends into the child (siblings carry
                       distinct tokens) that equals the draw, and stops at the first draw no
                       child equals
At temperature 0 every mode is verified greedily: the target's argmax path through the tree.

Randomness: one uniform per tree node is drawn up front, then one draw for the final token, so a
seeded stream (`specmesh.core.sampling.Draws`) gives the same verdict whatever path the walk takes,
and whatever other sessions a tick verifies beside it (`verify_many`). Proposed trees take each
position's first draw instead (`per_position_many`; the nodes of one depth share their position's),
so their text is the plain steps' text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.core.extras import missing
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.sampling import (
    Draws,
    SamplingParams,
    argmax_rows,
    as_draws,
    per_position_many,
    sample,
    sample_rows,
    uniform_many,
    warp,
    warp_rows,
)
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
    tree: DraftTree,
    target_logits: torch.Tensor,
    params: SamplingParams,
    draws: Draws | torch.Generator | None,
) -> Verdict:
    """target_logits [N + 1, V]: row 0 after the committed context (the root), row i + 1 after node i."""
    return verify_many([tree], [target_logits], [params], [as_draws(draws)])[0]


def autoregressive_step(
    root_logits: torch.Tensor, params: SamplingParams, draws: Draws | torch.Generator | None
) -> Verdict:
    """No tree (method "none", the baseline): the next token from q after the committed context.

    One rule for the engine and the verifier service. Greedy gives the argmax: what sampling the
    one-hot warp gives, without a vocabulary-wide CDF per token (~0.4 ms at V = 152k).
    """
    return verify_many([None], [root_logits.unsqueeze(0)], [params], [as_draws(draws)])[0]


def verify_many(
    trees: Sequence[DraftTree | None],
    logits: Sequence[torch.Tensor],
    params: Sequence[SamplingParams],
    draws: Sequence[Draws],
) -> list[Verdict]:
    """The verdicts of a tick's sessions, each exactly what its rule gives it alone.

    trees[b]: session b's tree (None: a plain step); logits[b] [N_b + 1, V]: its target rows (row 0
    after the committed context, row i + 1 after node i); params[b], draws[b]: its sampling and its
    round's "verify" stream. Greedy sessions take one argmax over all their rows; plain steps and
    proposed trees one vectorized draw (`_verify_proposals`); sampled chains one vectorized
    rejection test (`_verify_chains`); other trees their rule one by one."""
    out: list[Verdict | None] = [None] * len(trees)
    greedy, proposals, chains = [], [], []
    for b, (tree, rows, p) in enumerate(zip(trees, logits, params, strict=True)):
        n = 0 if tree is None else tree.num_nodes
        if rows.shape[0] != n + 1:
            raise ValueError(
                f"target_logits must have {n + 1} rows (root + one per node), got {rows.shape[0]}"
            )
        if p.greedy:
            greedy.append(b)
        elif tree is None or tree.mode is SamplingMode.PROPOSED:
            proposals.append(b)
        elif tree.mode is not SamplingMode.MTAD and tree.is_chain:
            chains.append(b)
        elif tree.mode is SamplingMode.MTAD:
            out[b] = _verify_mtad(tree, rows, p, draws[b])
        else:
            out[b] = _verify_rejection(tree, rows, p, draws[b])
    if greedy:  # one argmax for every greedy row of the tick
        argmax = argmax_rows(_cat([logits[b] for b in greedy]))
        at = 0
        for b in greedy:
            n = logits[b].shape[0]
            out[b] = _verify_greedy(trees[b], argmax[at : at + n])
            at += n
    if proposals:
        verdicts = _verify_proposals(
            [trees[b] for b in proposals],
            [logits[b] for b in proposals],
            [params[b] for b in proposals],
            [draws[b] for b in proposals],
        )
        for b, verdict in zip(proposals, verdicts, strict=True):
            out[b] = verdict
    if chains:
        for b, verdict in zip(
            chains,
            _verify_chains(
                [trees[b] for b in chains],
                [logits[b] for b in chains],
                [params[b] for b in chains],
                [draws[b] for b in chains],
            ),
            strict=True,
        ):
            out[b] = verdict
    return out  # type: ignore[return-value]


def _children_of(parents: torch.Tensor | list[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents.tolist() if isinstance(parents, torch.Tensor) else parents):
        children.setdefault(parent, []).append(node)
    return children


def _verify_greedy(tree: DraftTree | None, argmax: list[int]) -> Verdict:
    """argmax[i]: the target's argmax at row i. Walk the tree along the argmax path."""
    if tree is None:
        return Verdict([], [], argmax[0], bonus=True)
    tokens = tree.tokens.tolist()
    if tree.is_chain:
        n = 0
        while n < len(tokens) and tokens[n] == argmax[n]:
            n += 1
        return Verdict(tokens[:n], list(range(n)), argmax[n], bonus=n == len(tokens))
    return _walk(tokens, _children_of(tree.parents), argmax)


def _walk(tokens: list[int], children: dict[int, list[int]], drawn: list[int]) -> Verdict:
    """The path of the tree along the target's own tokens: drawn[i] is its token at row i (row 0
    the root's, row i + 1 after node i). From the root, descend into the child whose token is the
    drawn one (the first such, in sampling order); at a node none matches, emit the drawn token:
    a bonus when the node has no children, else a recovered token."""
    node, accepted = -1, []
    while True:
        y = drawn[node + 1]
        kids = children.get(node, [])
        match = next((c for c in kids if tokens[c] == y), None)
        if match is None:
            return Verdict([tokens[n] for n in accepted], accepted, y, bonus=not kids)
        node = match
        accepted.append(node)


def _chain_uniforms(draws: Sequence[Draws], lengths: list[int]) -> list[torch.Tensor]:
    """Per session: one uniform per node, then one for the final token (n + 1 draws, in that
    order, as `_verify_rejection` draws them)."""
    if all(d.key is not None for d in draws):
        u = uniform_many(draws, max(lengths) + 1)
        for d, n in zip(draws, lengths, strict=True):
            d.counter -= max(lengths) - n  # as if each had drawn its own n + 1
        return [u[b, : n + 1] for b, n in enumerate(lengths)]
    return [torch.cat([d.uniform(n), d.uniform(1)]) for d, n in zip(draws, lengths, strict=True)]


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat, without the copy of a vocabulary-wide row when a tick has one session."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _stack(rows: list[torch.Tensor]) -> torch.Tensor:
    return rows[0].unsqueeze(0) if len(rows) == 1 else torch.stack(rows)


def _verify_proposals(
    trees: list[DraftTree | None],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    draws: list[Draws],
) -> list[Verdict]:
    """Plain steps (None) and proposed trees (SamplingMode.PROPOSED), vectorized over the tick.

    Session b after position P: row 0 (the root) is position P, row i + 1 (after node i, at depth
    d_i, 1 for the root's children) position P + d_i. y_r is drawn from q_r = warp(row r) with the
    first draw of its position's stream (`per_position_many`), exactly what a plain step there
    draws; the rows of one depth share it (one of them is on the walked path). From the root, the
    walk descends into the child whose token is the current row's y (siblings are distinct); the
    first y no child equals is the next token: recovered, or a bonus at a node without children.
    Every emitted token is a plain step's, so the rule is lossless whatever was proposed and a
    seeded text is the same with or without proposals; a child x is kept with probability q(x),
    as rejection sampling of a one-hot draft would keep it. A chain (nodes x_0..x_{n-1}, row j at
    P + j) keeps x_j while x_j = y_j. Worked example, three sessions:

        session 0  tokens [7, 2, 4, 5], parents [-1, -1, 0, 0]: 7 and 2 under the root, 4 and 5
                   under 7; rows [root, 7, 2, 4, 5] at offsets [0, 1, 1, 2, 2] (3 positions)
                   y = [7, 4, 9, 1, 3]: root y 7 -> node 0; node 0's row y 4 -> node 2; node 2
                   has no children -> bonus y_3 = 1: emits [7, 4, 1], accepted nodes [0, 2]
        session 1  a chain [7, 5]: offsets [0, 1, 2], y = [7, 4, 9]: 7 kept, 5 != 4 -> [7, 4]
        session 2  a plain step: offsets [0], y = [3]: emits [3]
        per_position_many(draws, [3, 3, 1]) -> u [7]; row uniforms u[[0, 1, 1, 2, 2 | 3, 4, 5 | 6]]
    """
    offsets = [_position_offsets(t) for t in trees]  # per session: each row's position - P
    spans = [max(o) + 1 for o in offsets]  # positions drawn: max depth + 1 (a chain of n: n + 1)
    u = per_position_many(draws, spans)  # [sum(spans)]
    starts = [0]
    for n in spans[:-1]:
        starts.append(starts[-1] + n)
    u_rows = u[[start + o for start, o_b in zip(starts, offsets, strict=True) for o in o_b]]
    rows = _cat(logits)  # [sum(N + 1), V]
    q = warp_rows(rows, [p for p, o in zip(params, offsets, strict=True) for _ in o])
    drawn = sample_rows(q, u_rows.unsqueeze(-1))[:, 0].tolist()  # y of every row
    out, at = [], 0
    for tree, o in zip(trees, offsets, strict=True):
        y = drawn[at : at + len(o)]
        at += len(o)
        if tree is not None and not tree.is_chain:
            out.append(_walk(tree.tokens.tolist(), _children_of(tree.parents), y))
            continue
        proposed = tree.tokens.tolist() if tree is not None else []
        n = len(proposed)
        kept = next((j for j in range(n) if proposed[j] != y[j]), n)
        out.append(Verdict(proposed[:kept], list(range(kept)), y[kept], bonus=kept == n))
    return out


def _position_offsets(tree: DraftTree | None) -> list[int]:
    """Each target row's position after the committed context [N + 1]: 0 for the root, the depth
    of node i (1 for the root's children) for row i + 1. A chain's are 0..N."""
    if tree is None:
        return [0]
    if tree.is_chain:
        return list(range(tree.num_nodes + 1))
    return [0, *tree.depths().tolist()]


def _verify_chains(
    trees: list[DraftTree],
    logits: list[torch.Tensor],
    params: list[SamplingParams],
    draws: list[Draws],
) -> list[Verdict]:
    """Sampled chains of a draft model, vectorized over the tick (vLLM's rejection sampler).

    Session b, nodes x_0..x_{n-1}: q_i = warp(row i), p_i the draft row x_i was drawn from. x_i is
    accepted while u_i * p_i(x_i) < q_i(x_i); at the first rejection j the token comes from
    (q_j - p_j)+ (q_j where that is empty: q = p, where a rejection has probability 0), after a
    fully accepted chain from q_n: the bonus. One candidate per node, so the rule is the same for
    chains drawn i.i.d. or without replacement. Worked example, two sessions:

        lengths       [2, 1]
        rows          [q_0, q_1, q_2 | q_0, q_1]  flat, offsets [0, 3, 5]
        accept        [True, False | True]        (session 0's node 1 rejected)
        first reject  [1, 1]                      -> session 0 samples (q_1 - p_1)+, session 1 q_1
    """
    lengths = [t.num_nodes for t in trees]
    u = _chain_uniforms(draws, lengths)
    rows = _cat(logits)  # [sum(n + 1), V]
    q = warp_rows(rows, [p for p, n in zip(params, lengths, strict=True) for _ in range(n + 1)])
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n + 1)
    node_rows = [starts[b] + i for b, n in enumerate(lengths) for i in range(n)]
    tokens = torch.cat([t.tokens for t in trees])
    drawn_from = [t.prob_rows[:-1] for t in trees]  # a chain's node i drew from row prob_rows[i]
    p_x = torch.cat([t.draft_probs[r, t.tokens] for t, r in zip(trees, drawn_from, strict=True)]).double()
    q_x = q[node_rows, tokens].double()
    rejected = (torch.cat([u[b][:n] for b, n in enumerate(lengths)]) * p_x >= q_x).tolist()
    final, at = [], 0  # per session: the distribution the last token comes from
    stops = []
    for b, (tree, n) in enumerate(zip(trees, lengths, strict=True)):
        stop = next((i for i in range(n) if rejected[at + i]), n)  # first rejected node (n: none)
        row = q[starts[b] + stop]
        if stop < n:
            residual = (row - tree.draft_probs[drawn_from[b][stop]]).clamp_(min=0.0)
            row = residual if float(residual.sum()) > 0.0 else row
        final.append(row)
        stops.append(stop)
        at += n
    last = sample_rows(_stack(final), torch.stack([u[b][n : n + 1] for b, n in enumerate(lengths)]))
    last = last[:, 0].tolist()
    return [
        Verdict(tree.tokens[:stop].tolist(), list(range(stop)), int(last[b]), bonus=stop == n)
        for b, (tree, n, stop) in enumerate(zip(trees, lengths, stops, strict=True))
    ]


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
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, draws: Draws
) -> Verdict:
    without_replacement = tree.mode is SamplingMode.WITHOUT_REPLACEMENT
    children = _children_of(tree.parents)
    tokens = tree.tokens.tolist()
    uniforms = draws.uniform(tree.num_nodes).tolist()
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
            return Verdict([tokens[n] for n in accepted], accepted, sample(q, draws), bonus=False)
        node = kids[j]
        accepted.append(node)
    return Verdict([tokens[n] for n in accepted], accepted, sample(q, draws), bonus=True)


def _verify_mtad(
    tree: DraftTree, target_logits: torch.Tensor, params: SamplingParams, draws: Draws
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
    next_token = sample(q[accepted_len], draws)
    return Verdict(tokens[:accepted_len].tolist(), accepted, next_token, bonus=accepted_len == n)
