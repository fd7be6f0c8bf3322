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
    argmax_rows,
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
        if self.method in (Method.RSD_S, Method.SUFFIX):
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
    level for the tick), so are RSD-S beams (`_beam_levels`); other methods run their own level
    protocol (`tree_levels`) side by side. Each tree depends only on its own logits, params and
    draws, never on its neighbours."""
    groups: list[tuple[list[int], ManyLevels]] = []  # (its sessions, one protocol for all of them)
    for method, levels in _DRAFTED_TOGETHER.items():
        members = [b for b, s in enumerate(specs) if s.method is method]
        if members:
            groups.append((members, levels(*([xs[b] for b in members] for xs in (specs, params, draws)))))
    alone = [b for b, s in enumerate(specs) if s.method not in _DRAFTED_TOGETHER]
    groups += [([b], _one(tree_levels(specs[b], params[b], draws[b]))) for b in alone]
    if len(groups) == 1:  # one family (the usual): nothing to interleave
        return (yield from groups[0][1])
    trees: list[DraftTree | None] = [None] * len(specs)
    wants: dict[int, list[list[Path]]] = {}  # group -> what its sessions ask for this level
    for g, (members, levels) in enumerate(groups):
        try:
            wants[g] = next(levels)
        except StopIteration as done:
            for b, tree in zip(members, done.value, strict=True):
                trees[b] = tree
    while wants:
        asked: list[list[Path]] = [[] for _ in specs]
        for g, paths in wants.items():
            for b, p in zip(groups[g][0], paths, strict=True):
                asked[b] = p
        if not any(asked):
            break
        logits = yield asked
        for g in list(wants):
            members, levels = groups[g]
            if not any(wants[g]):
                continue
            try:
                wants[g] = levels.send([logits[b] for b in members])
            except StopIteration as done:
                del wants[g]
                for b, tree in zip(members, done.value, strict=True):
                    trees[b] = tree
    return trees


def _one(levels: Levels) -> ManyLevels:
    """One tree's level protocol as a protocol of many (of one); a dropped session (its logits
    None: its step failed, it was cancelled) ends with no tree."""
    try:
        paths = next(levels)
        while True:
            (logits,) = yield [paths]
            if logits is None:
                return [None]
            paths = levels.send(logits)
    except StopIteration as done:
        return [done.value]


def _chain_levels(specs: list[TreeSpec], params: list[SamplingParams], draws: list[Draws]) -> ManyLevels:
    """Chains of `depth` tokens, drawn i.i.d. from the draft (plain speculative decoding). Level
    l: greedy chains take the argmax of their row, sampled ones warp their rows together and draw
    one token each by inverse CDF with their next uniform. A greedy chain keeps no distributions.

        depths [2, 1]: level 0 asks for both chains' root rows, level 1 only the first's."""
    depths = [s.depth for s in specs]
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
            picked = argmax_rows(rows_now)
        else:
            picked = argmax_rows(rows_now) if len(sampled) < len(active) else [0] * len(active)
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
    """The level protocol of one tree of a method drafted tree by tree (not chain or rsd_s)."""
    match spec.method:
        case Method.MCSD:
            return (yield from _build_kary(spec.branching, spec.replacement, params, draws))
        case Method.RSD_C:
            return (yield from _build_kary(spec.branching, False, params, draws))
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


def _beam_levels(specs: list[TreeSpec], params: list[SamplingParams], draws: list[Draws]) -> ManyLevels:
    """RSD-S trees of a tick's sessions in lockstep: each level keeps, per session, the global top-W
    (parent, token) pairs by truncated perturbed score, in decreasing score order (a node may get
    no children; siblings may be non-contiguous). The level's vocabulary-wide math (warp,
    log-probabilities, truncated Gumbels) runs once over every session's beam rows, and so does
    the top-W, over the rows padded to [sessions, rows x V]; per session remain its Gumbel draws
    (its own stream) and its nodes. Every step is per row or per session, so a tree is what it
    would be alone. Two sessions, beam_width 2, then 3:

        level 0   rows [1 | 1]    padded [2, 1 x V]   top-3, session 0 keeps its first 2
        level 1   rows [2 | 3]    padded [2, 3 x V]   session 0's third row all -inf"""
    n = len(specs)
    trees = [_TreeBuilder() for _ in specs]
    beams: list[list[int]] = [[-1] for _ in specs]
    seq_logp = [torch.zeros(1, 1, dtype=torch.float64) for _ in specs]  # phi: log p of each beam
    score = [torch.zeros(1, 1, dtype=torch.float64) for _ in specs]  # psi: truncated perturbed score
    dropped: set[int] = set()
    for level in range(max((s.depth for s in specs), default=0)):
        active = [b for b in range(n) if level < specs[b].depth and b not in dropped]
        if not active:
            break
        asking = set(active)
        logits = yield [[trees[b].paths[x] for x in beams[b]] if b in asking else [] for b in range(n)]
        dropped.update(b for b in active if logits[b] is None)
        active = [b for b in active if logits[b] is not None]
        if not active:
            break
        sizes = [logits[b].shape[0] for b in active]
        rows = torch.cat([logits[b] for b in active]).float()  # [sum of beams, V]
        row_params = [params[b] for b, size in zip(active, sizes, strict=True) for _ in range(size)]
        probs = warp_rows(rows, row_params)
        greedy = [params[b].greedy for b in active]
        if all(greedy):  # beams ranked by the unwarped log-probabilities
            token_logp = rows.log_softmax(-1)
        elif not any(greedy):
            token_logp = probs.log()
        else:
            is_greedy = torch.tensor([p.greedy for p in row_params]).unsqueeze(-1)
            token_logp = torch.where(is_greedy, rows.log_softmax(-1), probs.log())
        phi = torch.cat([seq_logp[b] for b in active]) + token_logp.double()  # [sum of beams, V]
        psi = phi
        if not all(greedy):
            perturbed = torch.cat(
                [
                    chunk if params[b].greedy else chunk + gumbel_like(chunk, draws[b].generator())
                    for b, chunk in zip(active, phi.split(sizes), strict=True)
                ]
            )
            truncated = truncated_gumbel(torch.cat([score[b] for b in active]), perturbed)
            psi = truncated if not any(greedy) else torch.where(is_greedy, phi, truncated)
        finite = torch.isfinite(psi).sum(-1).tolist()
        offsets = [sum(sizes[:j]) for j in range(len(active))]
        widths = [
            min(specs[b].beam_width, sum(finite[at : at + size]))
            for b, at, size in zip(active, offsets, sizes, strict=True)
        ]
        picks, scores = _top_w(psi, sizes, widths)
        kept_rows, kept_tokens = [], []
        for b, at, session_picks in zip(active, offsets, picks, strict=True):
            beams[b] = [trees[b].add(beams[b][i], x, probs[at + i]) for i, x in session_picks]
            kept_rows += [at + i for i, _ in session_picks]
            kept_tokens += [x for _, x in session_picks]
        for b, phi_b, score_b in zip(
            active, phi[kept_rows, kept_tokens].split(widths), scores.split(widths), strict=True
        ):
            seq_logp[b], score[b] = phi_b.unsqueeze(-1), score_b.unsqueeze(-1)
    return [None if b in dropped else trees[b].finish(SamplingMode.WITHOUT_REPLACEMENT) for b in range(n)]


# the families whose trees a tick drafts as one protocol (the others go tree by tree)
_DRAFTED_TOGETHER: dict[Method, Callable[..., ManyLevels]] = {
    Method.CHAIN: _chain_levels,
    Method.RSD_S: _beam_levels,
}


def _top_w(
    psi: torch.Tensor, sizes: list[int], widths: list[int]
) -> tuple[list[list[tuple[int, int]]], torch.Tensor]:
    """Each session's widths[j] best (row, token) pairs of its sizes[j] rows of psi [sum(sizes), V],
    in decreasing score, and their scores (flat, session after session): one topk over the rows
    padded to [sessions, most rows x V] with -inf, which no pick reaches (a width is at most the
    session's finite scores). Rows are the session's own (0 .. sizes[j] - 1)."""
    vocab, most = psi.shape[-1], max(sizes)
    member = torch.tensor([j for j, size in enumerate(sizes) for _ in range(size)])
    within = torch.tensor([r for size in sizes for r in range(size)])
    padded = psi.new_full((len(sizes), most, vocab), -math.inf)
    padded[member, within] = psi
    top = padded.view(len(sizes), most * vocab).topk(max(widths))
    rows, tokens = (top.indices // vocab).tolist(), (top.indices % vocab).tolist()
    picks = [list(zip(r[:w], t[:w], strict=True)) for r, t, w in zip(rows, tokens, widths, strict=True)]
    kept = torch.arange(top.values.shape[-1]) < torch.tensor(widths).unsqueeze(-1)  # [sessions, max W]
    return picks, top.values[kept]


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
