"""Rides: proposals checked in a plain step's own forward, and how much of them a forward takes.

A ride is a tree of proposed tokens (SamplingMode.PROPOSED: the n-gram chain from the session's own
tokens, or a suffix tree from the mesh's finished outputs) with each node's estimated probability
of being accepted, its path's. Proposals are verified by the proposed-token rule, so which nodes
ride never changes what a step emits, only how many tokens it emits: sizing is free to read the
load, the clock and other sessions.

**Sizing (per forward).** A node costs every session in the forward the time its row adds and is
worth its probability in tokens. With T the forward's steps (each emits one token for sure), R its
rows without rides and v the verifier's measured forward cost by rows, the forward keeps the nodes
of probability at least θ, the θ that maximises

    (T + Σ_{p_i ≥ θ} p_i) / v(R + #{p_i ≥ θ})

the forward's tokens per second. On this CPU (v: 1 / 1.5 / 2.5 rows-equivalents at 1 / 2 / 4 rows)
one session's first node needs p > 0.5; with T sessions a node must beat T·Δv/v(R), and the rides
that are not that sure stay home: under load speculation does not cost. On a GPU v is nearly flat
in rows and nearly every node rides.

**Calibration.** A suffix tree's counts say how often a continuation followed its match before,
not how often the target agrees (one occurrence reads 1.0); an n-gram chain has no estimate at
all. So a node's probability is its parent's times its own conditional one, P(accepted | parent
accepted), and that is learnt per bucket (`bucket`: a suffix node by the tenth of its share of
its parent's occurrences, an n-gram node by its depth): the bucket's decayed share of accepted
nodes, from a prior of PRIOR_WEIGHT nodes at the raw share. It is learnt in hindsight from what
the step emitted (`Calibration.observe`), for every proposed node, ridden or cut: rides never
change the tokens, so a node would have been accepted exactly when its path is what came. A node
counts once its parent's path came and the step emitted a token at its depth; whether that
happened depends on the draws above the node, never its own, so the counts are unbiased, and a
bucket cut for looking poor is still watched and rides again once its text changes. Worked
example (one session, v(1..3) = 30 / 45 / 55 ms, a chain calibrated to [0.9, 0.6]): θ = 0.9
keeps 1 node, (1 + 0.9) / 45 = 42 tokens/s; θ = 0.6 keeps 2, (1 + 1.5) / 55 = 45: both ride,
against 1 / 30 = 33 without.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from specmesh.core.adaptive import ForwardCost
from specmesh.core.tree import DraftTree, proposed_tree

SUFFIX_BUCKETS = 10  # a suffix node's bucket: the tenth of its count's estimate
MAX_RIDE_DEPTH = 16  # n-gram buckets: a chain node's depth, capped
PRIOR_WEIGHT = 4.0  # nodes' worth of the raw estimate in a fresh bucket
DECAY = 0.995  # per node seen in the bucket: about the last 200 count
NGRAM_PRIOR = 0.8  # an n-gram node's raw estimate per level (the gateway rides it: it pays there)
SUFFIX_RIDE_DEPTH = 8  # a suffix ride's tree, before sizing: as method suffix's default shape
SUFFIX_RIDE_NODES = 16


def bucket(source: str, raw: float, depth: int) -> int:
    """A node's calibration bucket: suffix nodes 0..9 by their raw conditional estimate (the share
    of its parent's occurrences), n-gram nodes by depth."""
    if source == "suffix":
        return min(SUFFIX_BUCKETS - 1, max(0, int(raw * SUFFIX_BUCKETS)))
    return SUFFIX_BUCKETS + min(depth, MAX_RIDE_DEPTH) - 1


@dataclass(frozen=True)
class Ride:
    """A plain step's proposal: tokens [N] and parents [N] (level order, -1: a child of the root),
    probs [N] (calibrated, each at most its parent's), buckets [N] (`bucket`)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    buckets: list[int]
    vocab_size: int

    @property
    def expected(self) -> float:
        """Tokens it is expected to add to its step."""
        return sum(self.probs)

    def tree(self) -> DraftTree:
        return proposed_tree(self.tokens, self.parents, self.vocab_size)

    def kept(self, threshold: float) -> Ride | None:
        """The nodes of probability >= threshold (a tree: a node is never surer than its parent);
        None when none is."""
        keep = [i for i, p in enumerate(self.probs) if p >= threshold]
        if not keep:
            return None
        at = {old: new for new, old in enumerate(keep)}
        return Ride(
            [self.tokens[i] for i in keep], [at.get(self.parents[i], -1) for i in keep],
            [self.probs[i] for i in keep], [self.buckets[i] for i in keep], self.vocab_size,
        )  # fmt: skip


def _depths(parents: Sequence[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


class Calibration:
    """Per bucket, the decayed count of nodes judged and of those that would have been accepted
    (module doc). Thread-safe: rides are built and observed on the model thread, read elsewhere."""

    def __init__(self) -> None:
        size = SUFFIX_BUCKETS + MAX_RIDE_DEPTH
        self.tried, self.accepted = [0.0] * size, [0.0] * size
        self._lock = threading.Lock()

    def probability(self, b: int, raw: float) -> float:
        """P(accepted | parent accepted) of bucket b's nodes, from a prior at `raw`."""
        with self._lock:
            return (self.accepted[b] + PRIOR_WEIGHT * raw) / (self.tried[b] + PRIOR_WEIGHT)

    def ride(
        self, source: str, tokens: Sequence[int], parents: Sequence[int], raw: Sequence[float],
        vocab_size: int,
    ) -> Ride:  # fmt: skip
        """A proposal of `source` ("ngram" or "suffix") with its raw path probabilities, calibrated:
        each node's its parent's times its bucket's conditional probability."""
        depths = _depths(parents)
        probs: list[float] = []
        buckets = []
        for i, (r, d) in enumerate(zip(raw, depths, strict=True)):
            above = probs[parents[i]] if parents[i] >= 0 else 1.0
            share = r / raw[parents[i]] if parents[i] >= 0 and raw[parents[i]] > 0 else r
            b = bucket(source, share, d)
            buckets.append(b)
            probs.append(above * self.probability(b, min(1.0, share)))
        return Ride(list(tokens), list(parents), probs, buckets, vocab_size)

    def observe(self, ride: Ride, emitted: Sequence[int]) -> None:
        """A step's proposal (all of it, ridden or cut) and the tokens the step emitted: every node
        whose parent's path came and that the step emitted a token under counts, accepted when its
        own token came too (module doc)."""
        came: list[bool] = []  # per node: its path is what the step emitted
        depths = _depths(ride.parents)
        with self._lock:
            for i, (token, parent, depth) in enumerate(zip(ride.tokens, ride.parents, depths, strict=True)):
                judged = (parent < 0 or came[parent]) and depth <= len(emitted)
                came.append(judged and emitted[depth - 1] == token)
                if judged:
                    b = ride.buckets[i]
                    self.tried[b] = self.tried[b] * DECAY + 1.0
                    self.accepted[b] = self.accepted[b] * DECAY + came[i]


def ngram_ride(calibration: Calibration, chain: Sequence[int], vocab_size: int) -> Ride | None:
    """The n-gram lookup's chain as a ride (None: no proposal)."""
    if not chain:
        return None
    raw = [NGRAM_PRIOR ** (d + 1) for d in range(len(chain))]
    return calibration.ride("ngram", chain, list(range(-1, len(chain) - 1)), raw, vocab_size)


def threshold(rides: Sequence[Ride | None], steps: int, rows: int, verify: ForwardCost) -> float:
    """θ of the module doc: the forward's `steps` steps, `rows` rows without rides. Above every
    probability (nothing rides) when no θ beats plain steps."""
    probs = sorted((p for r in rides if r is not None for p in r.probs), reverse=True)
    best, best_rate, tokens = float("inf"), steps / max(verify(rows), 1e-12), float(steps)
    for k, p in enumerate(probs, start=1):
        tokens += p
        if k < len(probs) and probs[k] == p:
            continue  # a tie rides together: θ takes all of them
        rate = tokens / max(verify(rows + k), 1e-12)
        if rate > best_rate:
            best, best_rate = p, rate
    return best


def sized(rides: Sequence[Ride | None], steps: int, rows: int, verify: ForwardCost) -> list[Ride | None]:
    """The rides a forward takes (module doc): each cut to its nodes above the forward's θ."""
    theta = threshold(rides, steps, rows, verify)
    return [r.kept(theta) if r is not None else None for r in rides]


class RideSizer:
    """What a verifier sizes its forwards' rides with: its measured forward cost (rows -> seconds,
    never rescaled) and the calibration its verdicts teach."""

    def __init__(self, forward_cost: Mapping[int, float]) -> None:
        self.calibration = Calibration()
        self.priced(forward_cost)

    def priced(self, forward_cost: Mapping[int, float]) -> None:
        """The forward cost measured at start-up (until then nothing is priced: every node rides)."""
        self.verify = ForwardCost(forward_cost, decay=0.0)

    def size(self, rides: Sequence[Ride | None], steps: int, rows: int) -> list[Ride | None]:
        return sized(rides, steps, rows, self.verify)
