"""Tree builders: how a draft model's next-token distributions become a DraftTree.

Every builder is a level protocol (`Levels`): it yields the paths whose draft logits it needs next,
one whole tree level at a time (one draft forward per level), and never sees a model.
`draft_many` runs a tick's trees in lockstep (chains vectorized over the tick); `build_tree(spec,
next_logits, params, draws)` drives one tree with a `next_logits` callable. Methods:

  chain   plain speculative decoding: one child per node                      (iid)
  mcsd    per-depth k-config, children i.i.d. or without replacement (MCSD)   (iid | without_replacement)
  rsd_c   per-depth branching, Gumbel-top-k siblings (RSD-C)                  (without_replacement)
  rsd_s   stochastic beam search with truncated Gumbels (RSD-S)               (without_replacement)
  mtad    beam sampling, the most likely beam kept as a chain (MTAD)          (mtad)

At temperature 0 every builder is deterministic: siblings are the draft's top-k tokens by raw
logit, and beams are ranked by the unwarped log-probabilities. Verification is then greedy, so
any tree is exact; the width only buys more chances to contain the target's argmax.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass

from specmesh.core.extras import missing
from specmesh.core.methods import METHODS, Method
from specmesh.core.sampling import (
    Draws,
    SamplingParams,
    as_draws,
    gumbel_like,
    gumbel_top_k,
    sample_iid,
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

Path = tuple[int, ...]
# paths below the committed context -> raw logits [len, V] (a string: torch may be missing)
NextLogits = Callable[[list[Path]], "torch.Tensor"]


@dataclass(frozen=True)
class TreeSpec:
    """The shape of the tree to draft. `Method.NONE` is plain autoregressive decoding (depth 0).

    `method` may be given as a string; it is stored as a `Method`."""

    method: Method = Method.CHAIN
    depth: int = 4
    branching: tuple[int, ...] = ()
    beam_width: int = 1
    replacement: bool = False
    mtad_threshold: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "branching", tuple(int(b) for b in self.branching))
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        object.__setattr__(self, "method", Method(self.method))
        if not self.method.drafts:
            object.__setattr__(self, "depth", 0)  # drafts nothing, whatever was passed
            return
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if self.method.branched:
            if len(self.branching) != self.depth:
                raise ValueError(
                    f"branching must have one entry per level (depth={self.depth}), got {self.branching}"
                )
            if min(self.branching) < 1:
                raise ValueError(f"branching entries must be >= 1, got {self.branching}")
        elif self.branching and self.branching != (1,) * self.depth:
            raise ValueError(f"branching does not apply to method {self.method!r}")
        if self.method.beamed and self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if not (0.0 <= self.mtad_threshold <= 1.0):
            raise ValueError(f"mtad_threshold must be in [0, 1], got {self.mtad_threshold}")

    @property
    def max_nodes(self) -> int:
        """Upper bound on the number of tree nodes (what the target verifies per round)."""
        if not self.method.drafts:
            return 0
        if self.method.one_node_per_level:
            return self.depth
        if self.method is Method.RSD_S:
            return self.beam_width * self.depth
        return sum(math.prod(self.branching[: d + 1]) for d in range(self.depth))


# One tree's level protocol: yields the paths whose draft logits it needs next (one forward for the
# level), is sent those logits [len(paths), V], and returns the tree.
Levels = Generator[list[Path], "torch.Tensor", DraftTree]
# Many trees' levels in lockstep (a tick): yields each tree's paths ([] once it is done), is sent
# each tree's logits, returns the trees.
ManyLevels = Generator[list[list[Path]], list["torch.Tensor | None"], list["DraftTree | None"]]


def build_tree(
    spec: TreeSpec, next_logits: NextLogits, params: SamplingParams, draws: Draws | torch.Generator | None
) -> DraftTree:
    """Draft one tree below the committed context: `draft_many` for one session."""
    levels = draft_many([spec], [params], [as_draws(draws)])
    paths = next(levels)
    try:
        while True:
            paths = levels.send([next_logits(paths[0])])
    except StopIteration as done:
        return done.value[0]


def draft_many(
    specs: Sequence[TreeSpec], params: Sequence[SamplingParams], draws: Sequence[Draws]
) -> ManyLevels:
    """The trees of a tick's sessions, level by level in lockstep: every level is one draft forward
    for all of them. Chains are sampled together (`_chain_levels`, one warp and one inverse CDF per
    level for the tick); other methods run their own level protocol (`tree_levels`) side by side.
    Each tree depends only on its own logits, params and draws, never on its neighbours."""
    chains = [b for b, s in enumerate(specs) if s.method is Method.CHAIN]
    chain = _chain_levels(
        [specs[b].depth for b in chains], [params[b] for b in chains], [draws[b] for b in chains]
    )
    if len(chains) == len(specs):  # a tick of chains (the usual): nothing to interleave
        return (yield from chain)
    others = {
        b: tree_levels(s, params[b], draws[b]) for b, s in enumerate(specs) if s.method is not Method.CHAIN
    }
    trees: dict[int, DraftTree | None] = {}
    wants: dict[int, list[Path]] = {}
    for b, levels in others.items():
        wants[b] = next(levels)
    chain_paths = next(chain) if chains else None
    while True:
        if chain_paths is not None:
            wants.update(zip(chains, chain_paths, strict=True))
        if not any(wants.values()):
            break
        logits = yield [wants.get(b, []) for b in range(len(specs))]
        for b in list(others):
            if not wants[b]:
                continue
            if logits[b] is None:  # dropped by the caller (its step failed, it was cancelled)
                trees[b], wants[b] = None, []
                del others[b]
                continue
            try:
                wants[b] = others[b].send(logits[b])
            except StopIteration as done:
                trees[b], wants[b] = done.value, []
                del others[b]
        if chain_paths is not None:
            try:
                chain_paths = chain.send([logits[b] for b in chains])
            except StopIteration as done:
                trees.update(zip(chains, done.value, strict=True))
                for b in chains:
                    wants[b] = []
                chain_paths = None
    return [trees[b] for b in range(len(specs))]


def _chain_levels(depths: list[int], params: list[SamplingParams], draws: list[Draws]) -> ManyLevels:
    """Chains of `depths[b]` tokens, drawn i.i.d. from the draft (plain speculative decoding). Level
    l: greedy chains take the argmax of their row, sampled ones warp their rows together and draw
    one token each by inverse CDF with their next uniform. A greedy chain keeps no distributions.

        depths [2, 1]: level 0 asks for both chains' root rows, level 1 only the first's."""
    n_chains = len(depths)
    tokens: list[list[int]] = [[] for _ in depths]
    rows: list[list[torch.Tensor]] = [[] for _ in depths]
    active = [b for b, d in enumerate(depths) if d > 0]
    vocab = 0
    dropped: set[int] = set()
    while active:
        asked = [[] for _ in range(n_chains)] if len(active) < n_chains else None
        if asked is None:
            logits = yield [[tuple(t)] for t in tokens]
        else:
            for b in active:
                asked[b] = [tuple(tokens[b])]
            logits = yield asked
        if any(logits[b] is None for b in active):
            dropped.update(b for b in active if logits[b] is None)
            active = [b for b in active if logits[b] is not None]
            if not active:
                break
        rows_now = torch.cat([logits[b] for b in active]).float()  # [len(active), V]
        vocab = rows_now.shape[-1]
        sampled = [i for i, b in enumerate(active) if not params[b].greedy]
        if not sampled:  # all greedy: the argmax, no distribution kept
            picked = rows_now.argmax(-1).tolist()
        else:
            picked = rows_now.argmax(-1).tolist() if len(sampled) < len(active) else [0] * len(active)
            everyone = len(sampled) == len(active)
            probs = warp_rows(
                rows_now if everyone else rows_now[sampled], [params[active[i]] for i in sampled]
            )
            u = uniform_many([draws[active[i]] for i in sampled], 1)
            for j, (i, t) in enumerate(zip(sampled, sample_rows(probs, u)[:, 0].tolist(), strict=True)):
                picked[i] = t
                rows[active[i]].append(probs[j])
        for b, t in zip(active, picked, strict=True):
            tokens[b].append(t)
        active = [b for b in active if len(tokens[b]) < depths[b]]
    return [None if b in dropped else _chain_tree(chain, rows[b], vocab) for b, chain in enumerate(tokens)]


def _chain_tree(tokens: list[int], rows: list[torch.Tensor], vocab: int) -> DraftTree:
    """A drafted chain; rows: the distributions its tokens were drawn from (none: greedy)."""
    n = len(tokens)
    prob_rows = torch.arange(n + 1) if rows else torch.full((n + 1,), -1)
    prob_rows[n] = -1  # the root and node i drew from rows 0 and i + 1; the leaf from none
    return DraftTree(
        tokens=torch.tensor(tokens, dtype=torch.long),
        parents=torch.arange(-1, n - 1),
        mode=SamplingMode.IID,
        draft_probs=torch.stack(rows) if rows else torch.zeros(0, vocab),
        prob_rows=prob_rows,
    )


def tree_levels(spec: TreeSpec, params: SamplingParams, draws: Draws) -> Levels:
    """The level protocol of one tree of a method other than chain."""
    match spec.method:
        case Method.MCSD:
            return (yield from _build_kary(spec.branching, spec.replacement, params, draws))
        case Method.RSD_C:
            return (yield from _build_kary(spec.branching, False, params, draws))
        case Method.RSD_S:
            return (yield from _build_stochastic_beam(spec, params, draws))
        case Method.MTAD:
            return (yield from _build_mtad(spec, params, draws))
    raise ValueError(f"method {spec.method!r} drafts no tree from a draft model")


class _TreeBuilder:
    """Accumulates nodes in level order and the draft distributions of nodes with children."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.paths: dict[int, Path] = {-1: ()}
        self.rows: dict[int, torch.Tensor] = {}  # node (-1 = root) -> the p its children came from

    def add(self, parent: int, token: int, dist: torch.Tensor) -> int:
        self.rows.setdefault(parent, dist)
        self.tokens.append(token)
        self.parents.append(parent)
        node = len(self.tokens) - 1
        self.paths[node] = (*self.paths[parent], token)
        return node

    def finish(self, mode: SamplingMode, threshold: float = 0.0) -> DraftTree:
        n = len(self.tokens)
        prob_rows = torch.full((n + 1,), -1, dtype=torch.long)
        for row, node in enumerate(self.rows):
            prob_rows[node + 1] = row
        return DraftTree(
            tokens=torch.tensor(self.tokens, dtype=torch.long),
            parents=torch.tensor(self.parents, dtype=torch.long),
            mode=mode,
            draft_probs=torch.stack(list(self.rows.values())).float(),
            prob_rows=prob_rows,
            mtad_threshold=threshold,
        )


def _children(
    probs: torch.Tensor, logits: torch.Tensor, k: int, replacement: bool, params: SamplingParams, draws: Draws
) -> list[int]:
    """k children of one node, in sampling order."""
    if params.greedy:
        return logits.topk(min(k, logits.numel())).indices.tolist()
    if replacement:
        return sample_iid(probs, k, draws).tolist()
    return gumbel_top_k(probs.log(), k, draws.generator()).tolist()


def _build_kary(branching: Sequence[int], replacement: bool, params: SamplingParams, draws: Draws) -> Levels:
    """MCSD and RSD-C: every node of level d gets branching[d] children (fewer when the filtered
    support is smaller). Flattening is parent-major within a level."""
    tree = _TreeBuilder()
    frontier = [-1]
    for k in branching:
        logits = (yield [tree.paths[n] for n in frontier]).float()
        probs = warp(logits, params)
        frontier = [
            tree.add(node, x, probs[i])
            for i, node in enumerate(frontier)
            for x in _children(probs[i], logits[i], k, replacement, params, draws)
        ]
    mode = SamplingMode.IID if replacement else SamplingMode.WITHOUT_REPLACEMENT
    return tree.finish(mode)


def _log1mexp(a: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(a)) for a <= 0, accurate near 0 and near -inf."""
    return torch.where(a > -math.log(2.0), (-a.expm1()).log(), (-a.exp()).log1p())


def truncated_gumbel(parent_score: torch.Tensor, perturbed: torch.Tensor) -> torch.Tensor:
    """RSD eq. (11), T(u, phi~) = -log(e^-u - e^-Z + e^-phi~) with Z = max phi~ per row, in the
    stable form u - softplus(u - phi~ + log1mexp(phi~ - Z)). The row's maximum maps to u exactly.

    parent_score [n, 1], perturbed [n, V] -> [n, V]
    """
    z = perturbed.max(dim=-1, keepdim=True).values
    v = parent_score - perturbed + _log1mexp(perturbed - z)
    return parent_score - torch.nn.functional.softplus(v)


def _build_stochastic_beam(spec: TreeSpec, params: SamplingParams, draws: Draws) -> Levels:
    """RSD-S: each level keeps the global top-W (parent, token) pairs by truncated perturbed score,
    in decreasing score order. A node may get no children; siblings may be non-contiguous."""
    tree = _TreeBuilder()
    beam = [-1]
    seq_logp = torch.zeros(1, 1, dtype=torch.float64)  # phi: log p of each beam sequence
    score = torch.zeros(1, 1, dtype=torch.float64)  # psi: truncated perturbed score of each sequence
    for _ in range(spec.depth):
        logits = (yield [tree.paths[n] for n in beam]).float()
        probs = warp(logits, params)
        token_logp = (logits.log_softmax(-1) if params.greedy else probs.log()).double()
        phi = seq_logp + token_logp
        psi = phi if params.greedy else truncated_gumbel(score, phi + gumbel_like(phi, draws.generator()))
        width = min(spec.beam_width, int(torch.isfinite(psi).sum()))
        top = psi.flatten().topk(width)
        vocab = psi.shape[-1]
        parent_idx, token = top.indices // vocab, top.indices % vocab
        beam = [
            tree.add(beam[b], x, probs[b]) for b, x in zip(parent_idx.tolist(), token.tolist(), strict=True)
        ]
        seq_logp = phi[parent_idx, token].unsqueeze(-1)
        score = top.values.unsqueeze(-1)
    return tree.finish(SamplingMode.WITHOUT_REPLACEMENT)


def _build_mtad(spec: TreeSpec, params: SamplingParams, draws: Draws) -> Levels:
    """MTAD beam sampling: W beams extended for `depth` steps by sampling (beam, token) pairs
    without replacement in proportion to beam weight x p(token | beam); the beam with the highest
    weight (= highest joint draft likelihood) becomes a chain."""
    beams: list[Path] = [()]
    weight = torch.zeros(1, dtype=torch.float64)  # log beam weights, renormalised over kept beams
    dists: list[list[torch.Tensor]] = [[]]  # per beam: the p each of its tokens was chosen from
    for _ in range(spec.depth):
        logits = (yield list(beams)).float()
        probs = warp(logits, params)
        token_logp = (logits.log_softmax(-1) if params.greedy else probs.log()).double()
        joint = (weight.unsqueeze(-1) + token_logp).flatten()
        width = min(spec.beam_width, int(torch.isfinite(joint).sum()))
        if params.greedy:
            picked = joint.topk(width).indices
        else:
            picked = (joint + gumbel_like(joint, draws.generator())).topk(width).indices
        vocab = token_logp.shape[-1]
        parent_idx, token = (picked // vocab).tolist(), (picked % vocab).tolist()
        beams = [(*beams[b], x) for b, x in zip(parent_idx, token, strict=True)]
        dists = [[*dists[b], probs[b]] for b in parent_idx]
        weight = joint[picked].log_softmax(-1)
    best = int(weight.argmax())
    tree = _TreeBuilder()
    node = -1
    for x, dist in zip(beams[best], dists[best], strict=True):
        node = tree.add(node, x, dist)
    return tree.finish(SamplingMode.MTAD, spec.mtad_threshold)
