"""Adaptive speculation: each round's draft depth from the acceptance and the costs seen so far.

A session keeps one tree family (the method and width of its TreeSpec) and the policy picks the
depth L of every round, L = 0 meaning plain autoregressive decoding. It maximises the predicted
token rate

    rate(L) = E(L) / (o + L·d + v(s·(1 + n(L)))),     E(L) = 1 + Σ_{k=1..L} Π_{j=1..k} α_j

where α_j = P(the accepted path reaches depth j | it reached depth j-1) is counted per depth
over recent rounds, d is the measured time of one draft level, o the rest of a round (network,
scheduling), n(L) the tree's nodes and v(rows) the time of one target forward of that many rows.
v is the verifier's own start-up measurement (`ForwardCost`, rows -> seconds: on a CPU every row
costs, on a GPU a few dozen are nearly free) scaled by what the rounds observe, so it follows the
load. s is the number of sessions sharing the target forward: a node costs the whole batch, not
just its session, and with s sessions each drafting n(L) nodes the forward holds s·(1 + n(L))
rows; so under load trees shrink and speculation is switched off when rate(0) wins (assuming the
other sessions choose alike, which they do: they run the same policy on the same costs). While
off, a short probe round keeps the acceptance estimate alive: after `probe_every` off rounds, then
after twice as many each time a probe leaves it off (up to `max_probe_every`), so that text or a
machine where speculation never pays spends little on probing (a probe costs the drafter a
catch-up over the skipped tokens and the target a wider forward). A
`PolicyMemory` hands a new session what the last finished session with the same tree family and
sampling learned, so short sessions need not start cold.

The choice depends only on finished rounds, never on the round being verified, so every round is
verified exactly as a fixed-shape round would be: adaptivity cannot bias the output.

Reproducible mode (`draft_cost` given; the gateway's): a seeded request must give the same text
every time, whatever the load, and a round's shape decides which random numbers it draws. The
policy then reads no clock: d is the drafter's start-up cost of one level, v the verifier's
start-up curve (never rescaled), o a fixed cost per call (two calls for a speculative round, one
for a plain one), s = 1; only the session's own acceptance counts move it, and nothing is carried
over from earlier sessions.

The default path (`FamilyPolicy`) decides every round instead: plain steps, each carrying the
n-gram lookup's proposal of up to L tokens when there is one (a "ride": verified in the step's own
forward, no drafter call) when its match has at least k tokens, or a round of the draft
model's chain. The n-gram side's rate per step is

    rate(k, L) = (Σ_{n≥k} m_n·E_n(L) + 1 - M) / (M·v(1 + L) + (1 - M)·v(1) + o / S),  M = Σ_{n≥k} m_n

with m_n the share of positions whose match falls in class n (its length, measured back from the
n-gram up to 10 tokens, in classes 1, 2, 3-4, 5-9 and 10), E_n from its acceptance per depth (both
from `NgramEstimate`, a function of the session's tokens) and S the plain steps per call; L = 0 is
plain decoding. A longer match is a better guess, so k sorts the proposals worth a step's extra
rows from those that are not (on a CPU, chat's 1-token matches are not, and in a copying answer
an edit's fresh 3-token matches often are not while a copy that has run for 8 tokens is). The
chain's side is its own AdaptivePolicy; the faster (by the tolerance) wins.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field, replace

from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.ngram import NgramEstimate
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationStats


def family_spec(base: TreeSpec, depth: int) -> TreeSpec:
    """The tree of `base`'s family at another depth (branching cut, or extended with 1s)."""
    if depth == 0:
        return TreeSpec(Method.NONE)
    if base.method.branched:
        branching = (base.branching + (1,) * depth)[:depth]
        return replace(base, depth=depth, branching=branching)
    return replace(base, depth=depth)


def expected_tokens(alphas: list[float], depth: int) -> float:
    """E(L): tokens a round emits on average (accepted drafts + the recovered / bonus token)."""
    total, reach = 1.0, 1.0
    for a in alphas[:depth]:
        reach *= a
        total += reach
    return total


@dataclass(frozen=True)
class Load:
    """What the target forward that verified a round held: sessions, and rows (the new tokens and
    tree nodes of all of them)."""

    sessions: int
    rows: int


@dataclass
class ForwardCost:
    """v(rows): seconds of one target forward. `measured` (rows -> seconds, from the replica's
    start-up measurement) gives the shape, interpolated linearly and extended with its last slope;
    `scale`, a decayed mean of observed / predicted, follows the machine's load. With nothing
    measured the shape is flat (every row free) and the scale is the observed time itself."""

    measured: InitVar[Mapping[int, float]]
    decay: float
    scale: float | None = None
    points: tuple[tuple[int, float], ...] = field(init=False)  # `measured`, by rows

    def __post_init__(self, measured: Mapping[int, float]) -> None:
        self.points = tuple(sorted(measured.items()))

    def shape(self, rows: float) -> float:
        points = self.points
        if not points:
            return 1.0
        if rows <= points[0][0] or len(points) == 1:
            return points[0][1]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2:]
        return y1 + max(0.0, (y1 - y0) / (x1 - x0)) * (rows - x1)

    def __call__(self, rows: float) -> float:
        scale = self.scale if self.scale is not None else (1.0 if self.points else 0.0)
        return scale * self.shape(rows)

    def observe(self, rows: float, seconds: float) -> None:
        ratio = seconds / max(self.shape(rows), 1e-9)
        self.scale = ratio if self.scale is None else self.scale * self.decay + (1 - self.decay) * ratio


@dataclass(frozen=True)
class RoundPlan:
    """One round of a session: what it drafts and how it is verified."""

    spec: TreeSpec  # Method.NONE: nothing drafted
    lookup_depth: int = 0  # plain rounds: n-gram proposals of up to this many tokens ride in each step
    lookup_min_ngram: int = 0  # ... when they match a suffix of at least this many tokens (0: any)
    plain_run: bool = False  # plain rounds: several steps in one Verify call (--plain-steps)
    suffix_rides: bool = False  # plain rounds: the mesh's suffix trees may ride too (core.rides)


@dataclass
class AdaptivePolicy:
    """Per-session depth controller; `next_spec()` before a round, `observe()` after it."""

    base: TreeSpec
    forward_cost: InitVar[Mapping[int, float] | None] = None  # the target's, rows -> seconds
    max_depth: int = 8
    max_nodes: int = 64  # the replicas' default --max-tree-nodes: deeper trees would be refused
    decay: float = 0.8  # costs: follow the load quickly
    acceptance_decay: float = 0.95  # acceptance: ~20 rounds, one rejection is not a trend
    probe_every: int = 8  # off rounds before the first probe
    max_probe_every: int = 128  # the interval doubles after every probe that leaves it off
    probe_depth: int = 2
    tolerance: float = 0.03
    prior_alpha: float = 0.7
    prior_weight: float = 1.0
    draft_cost: float | None = None  # seconds per draft level, fixed: reproducible mode (module doc)
    call_overhead: float = 0.0  # reproducible mode: seconds per replica call beside the forwards

    def __post_init__(self, forward_cost: Mapping[int, float] | None) -> None:
        if not self.base.method.drafts:
            raise ValueError("adaptive speculation needs a tree family, not method 'none'")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        self.max_depth = max(self.max_depth, self.base.depth)
        self.reached = [0.0] * self.max_depth  # decayed rounds whose path reached depth j+1
        self.tried = [0.0] * self.max_depth  # decayed rounds that reached depth j (could go on)
        self.verify = ForwardCost(forward_cost or {}, self.decay)
        self.sessions = 1.0  # decayed mean of the sessions sharing the target forward
        self.draft_level: float | None = self.draft_cost  # seconds per draft level
        self.other: float | None = None  # seconds per round outside drafting and verifying
        self.rounds = 0
        self.off_rounds = 0  # since the last probe
        self.probe_interval = self.probe_every
        self.last_depth: int | None = None
        self.probing = False  # the last choose_depth() was a probe, not the predicted best
        # depths this family may take: the requested one (the replicas accepted it), and those
        # within max_depth and max_nodes
        fits = {
            d for d in range(1, self.max_depth + 1) if family_spec(self.base, d).max_nodes <= self.max_nodes
        }
        self.depths = [0, *sorted(fits | {self.base.depth})]

    def alphas(self) -> list[float]:
        """α_j per depth; unobserved depths lean on the depth above (acceptance rarely rises)."""
        out, prior = [], self.prior_alpha
        for reached, tried in zip(self.reached, self.tried, strict=True):
            a = (reached + self.prior_weight * prior) / (tried + self.prior_weight)
            out.append(a)
            prior = a
        return out

    def predicted_rate(self, depth: int) -> float:
        """Tokens per second a round of this depth is expected to give."""
        seconds = self.round_seconds(depth)
        return expected_tokens(self.alphas(), depth) / seconds if seconds > 0 else float("inf")

    def round_seconds(self, depth: int) -> float:
        """What a round of this depth is expected to take."""
        spec = family_spec(self.base, depth)
        draft = depth * (self.draft_level or 0.0)
        rows = self.sessions * (1 + spec.max_nodes)  # each session's new token and its nodes
        other = (2 if depth else 1) * self.call_overhead if self.reproducible else (self.other or 0.0)
        return other + draft + self.verify(rows)

    def best_rate(self) -> float:
        """The best rate a drafting depth is predicted to give now (before any round: at the prior
        acceptance)."""
        return max(self.predicted_rate(d) for d in self.depths if d)

    @property
    def reproducible(self) -> bool:
        return self.draft_cost is not None

    def choose_depth(self) -> int:
        """The next round's depth. Not pure: counts off rounds, to probe now and then."""
        self.probing = False
        if self.draft_level is None:  # nothing measured yet (or only the prefill round)
            return self.base.depth
        rates = {d: self.predicted_rate(d) for d in self.depths}
        # The rate is flat near its maximum and acceptance estimates are noisy: take the shallowest
        # depth within `tolerance` of the best (cheaper rounds, less draft work wasted).
        best = min(d for d, r in rates.items() if r >= (1 - self.tolerance) * max(rates.values()))
        if best == 0:
            self.off_rounds += 1
            if self.off_rounds >= self.probe_interval:
                self.off_rounds = 0
                self.probe_interval = min(2 * self.probe_interval, self.max_probe_every)
                self.probing = True
                return min(self.probe_depth, max(self.depths))
        else:
            self.probe_interval = self.probe_every  # speculation pays again
        return best

    def next_spec(self) -> TreeSpec:
        return family_spec(self.base, self.choose_depth())

    def plan(self, tokens: Sequence[int]) -> RoundPlan:  # a depth policy reads no tokens
        return RoundPlan(self.next_spec())

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old * self.decay + (1 - self.decay) * new

    def observe(self, spec: TreeSpec, stats: GenerationStats, load: Load | None = None) -> None:
        """Learn from one finished round: the spec it used, its stats delta and what the target
        forward held (None: this session alone)."""
        self.rounds += 1
        depth = spec.depth  # 0 for Method.NONE
        load = load or Load(1, 1 + stats.drafted_tokens)
        if self.rounds > 1 and not self.reproducible:  # the first round's times include the prefills
            self.verify.observe(load.rows, stats.verify_seconds)
            self.sessions = self._mean(self.sessions, load.sessions)
            self.other = self._mean(self.other, stats.network_seconds)
            # after autoregressive rounds the drafter first catches up on the skipped tokens
            if depth and self.last_depth != 0:
                self.draft_level = self._mean(self.draft_level, stats.draft_seconds / depth)
        self.last_depth = depth
        if depth == 0:
            return
        self.reached = [r * self.acceptance_decay for r in self.reached]
        self.tried = [t * self.acceptance_decay for t in self.tried]
        accepted = stats.accepted_tokens
        drafted = len(stats.accepted_per_depth)  # n-gram drafts may be shorter than asked, or none
        for j in range(min(accepted + 1, depth, drafted)):
            self.tried[j] += 1.0
            if j < accepted:
                self.reached[j] += 1.0


class PolicyMemory:
    """Per process (engine, gateway): the last finished session's estimates per (tree family,
    sampling), the starting point of the next such session. Thread-safe."""

    def __init__(self) -> None:
        self._states: dict[tuple, AdaptivePolicy] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _key(base: TreeSpec, params: SamplingParams) -> tuple:
        family = family_spec(base, 16)  # the whole family: branching (4,2,1) differs from (4,4,2)
        return (family, params.temperature, params.top_k, params.top_p)

    def new_policy(
        self, base: TreeSpec, params: SamplingParams, forward_cost: Mapping[int, float] | None = None
    ) -> AdaptivePolicy:
        """forward_cost: the target's measured rows -> seconds, for a session that starts cold."""
        policy = AdaptivePolicy(base, forward_cost)
        with self._lock:
            learned = self._states.get(self._key(base, params))
            if learned is not None:
                names = ("reached", "tried", "verify", "sessions", "draft_level", "other", "probe_interval")
                for name in names:
                    setattr(policy, name, copy.deepcopy(getattr(learned, name)))
        return policy

    def remember(self, policy: AdaptivePolicy, params: SamplingParams) -> None:
        if policy.draft_level is None:  # learned nothing usable
            return
        with self._lock:
            self._states[self._key(policy.base, params)] = copy.deepcopy(policy)


MAX_LOOKUP = 6  # the deepest n-gram ride: its rows cost every step that has a proposal


def lookup_rate(
    classes: Mapping[int, tuple[float, list[float]]], min_ngram: int, depth: int, verify: ForwardCost,
    call_share: float,
) -> float:  # fmt: skip
    """Tokens per second of plain steps whose lookup proposals of up to `depth` tokens, matching at
    least `min_ngram` tokens, ride in the step's forward (module doc); classes: the estimate's
    (share, alphas) per match length (`NgramEstimate.classes`); call_share: the call's fixed cost
    over its steps."""
    riding = [c for n, c in classes.items() if n >= max(1, min_ngram)] if depth else []
    m = sum(share for share, _ in riding)
    ridden = sum(share * expected_tokens(alphas, depth) for share, alphas in riding)
    return _ride_rate(m, ridden, depth, verify, call_share)


def _ride_rate(m: float, ridden: float, depth: int, verify: ForwardCost, call_share: float) -> float:
    """rate(k, L) of the module doc from M (the riding share) and Σ m_n·E_n(L) (`ridden`)."""
    seconds = m * verify(1 + depth) + (1.0 - m) * verify(1) + call_share
    return (ridden + 1.0 - m) / seconds if seconds > 0 else float("inf")


class FamilyPolicy:
    """The default path's choice of every round (reproducible: start-up costs and the session's
    tokens and rounds only): plain steps with n-gram rides of the best depth (0: none), or a round of
    the draft model's chain when its AdaptivePolicy wants one (its best depth, or a probe) and it is
    predicted faster by more than the tolerance. Switches both ways within a session."""

    def __init__(
        self,
        forward_cost: Mapping[int, float],
        call_overhead: float,
        plain_steps: int,
        prompt_length: int,
        chain: AdaptivePolicy | None = None,
        max_lookup: int = MAX_LOOKUP,
        tolerance: float = 0.03,
        suffix_rides: bool = False,
    ) -> None:
        self.verify = ForwardCost(forward_cost, decay=0.0)  # never rescaled: reproducible
        self.suffix_rides = suffix_rides  # plain rounds: the verifier may ride the mesh's suffix trees
        self.call_share = call_overhead / max(1, plain_steps)
        self.estimate = NgramEstimate(start=prompt_length)
        self.chain, self.max_lookup, self.tolerance = chain, max_lookup, tolerance
        if chain is not None and chain.best_rate() <= (1 + tolerance) / (self.verify(1) + self.call_share):
            # at the acceptance it assumes before any round it would lose to plain steps: never
            # probed. A bound at 100 % acceptance let this CPU probe it (a draft level costs more
            # served than its start-up forward, and a probe first catches the drafter up)
            self.chain = None

    def best_lookup(self) -> tuple[int, int, float]:
        """(min_ngram, depth, rate): the rides with the best predicted rate (on a tie the shallower,
        then the longer matches), if it beats plain steps by the tolerance; else (0, 0, plain).
        min_ngram is the lower bound of the weakest match class that rides. (The shallowest
        choice within the tolerance of the best, as before, gave up 1-8 % on the copying sets'
        answers replayed against this CPU's forward costs: docs/decisions.md.)"""
        classes = self.estimate.classes()
        plain = lookup_rate(classes, 0, 0, self.verify, self.call_share)
        best = (0, 0, plain)
        longest_first = sorted(classes, reverse=True)
        for d in range(1, self.max_lookup + 1):
            # lookup_rate(k, d) for every k in one pass: each class adds its share's tokens and rows
            m = ridden = 0.0
            for k in longest_first:
                share, alphas = classes[k]
                m, ridden = m + share, ridden + share * expected_tokens(alphas, d)
                rate = _ride_rate(m, ridden, d, self.verify, self.call_share)
                if rate > best[2]:
                    best = (k, d, rate)
        return best if best[2] > (1 + self.tolerance) * plain else (0, 0, plain)

    def plan(self, tokens: Sequence[int]) -> RoundPlan:
        """The next round after the session's `tokens` (prompt included)."""
        self.estimate.sync(tokens)
        min_ngram, depth, rate = self.best_lookup()
        if self.chain is not None:
            chain_depth = self.chain.choose_depth()  # 0: plain wins by its model (probes included)
            chain_rate = self.chain.predicted_rate(chain_depth) if chain_depth else 0.0
            if chain_depth and (self.chain.probing or chain_rate > (1 + self.tolerance) * rate):
                return RoundPlan(family_spec(self.chain.base, chain_depth))
        return RoundPlan(
            TreeSpec(Method.NONE), lookup_depth=depth, lookup_min_ngram=min_ngram, plain_run=True,
            suffix_rides=self.suffix_rides,
        )  # fmt: skip

    def observe(self, spec: TreeSpec, stats: GenerationStats, load: Load | None = None) -> None:
        if self.chain is not None and spec.method.drafts:
            self.chain.observe(spec, stats, load)


RoundPolicy = AdaptivePolicy | FamilyPolicy  # plan(tokens) before a round, observe() after it
