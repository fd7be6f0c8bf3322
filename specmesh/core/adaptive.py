"""Adaptive speculation: each round's draft depth from the acceptance and the costs seen so far.

A session keeps one tree family (the method and width of its TreeSpec) and the policy picks the
depth L of every round, L = 0 meaning plain autoregressive decoding. It maximises the predicted
token rate

    rate(L) = E(L) / (o + L·d + v(n(L))),     E(L) = 1 + Σ_{k=1..L} Π_{j=1..k} α_j

where α_j = P(the accepted path reaches depth j | it reached depth j-1) is counted per depth
over recent rounds, d is the measured time of one draft level, v(n) the measured verify time as
a line in the number of tree nodes n, and o the rest of a round (network, scheduling). Counts and
costs decay geometrically, so a session follows both the text (easy boilerplate, hard logic)
and the load (a verifier batching many sessions makes every node dearer, and speculation is
switched off when rate(0) wins). While off, a short probe round every `probe_every` rounds keeps
the acceptance estimate alive. A `PolicyMemory` hands a new session what the last finished
session with the same tree family and sampling learned, so short sessions need not start cold.

The choice depends only on finished rounds, never on the round being verified, so every round is
verified exactly as a fixed-shape round would be: adaptivity cannot bias the output.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field, replace

from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
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


@dataclass
class _LineFit:
    """Exponentially weighted least squares of y = a + b·x (b >= 0)."""

    decay: float
    sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wxx, wy, wxy

    def add(self, x: float, y: float) -> None:
        self.sums = [s * self.decay for s in self.sums]
        for i, term in enumerate((1.0, x, x * x, y, x * y)):
            self.sums[i] += term

    def __call__(self, x: float) -> float:
        w, wx, wxx, wy, wxy = self.sums
        det = w * wxx - wx * wx
        slope = max(0.0, (w * wxy - wx * wy) / det) if det > 1e-9 * max(w * wxx, 1e-12) else 0.0
        return max(0.0, (wy - slope * wx) / w + slope * x)


@dataclass
class AdaptivePolicy:
    """Per-session depth controller; `next_spec()` before a round, `observe()` after it."""

    base: TreeSpec
    max_depth: int = 8
    max_nodes: int = 64  # the replicas' default --max-tree-nodes: deeper trees would be refused
    decay: float = 0.8  # costs: follow the load quickly
    acceptance_decay: float = 0.95  # acceptance: ~20 rounds, one rejection is not a trend
    probe_every: int = 8
    probe_depth: int = 2
    tolerance: float = 0.03
    prior_alpha: float = 0.7
    prior_weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.base.method.drafts:
            raise ValueError("adaptive speculation needs a tree family, not method 'none'")
        if self.max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {self.max_depth}")
        self.max_depth = max(self.max_depth, self.base.depth)
        self.reached = [0.0] * self.max_depth  # decayed rounds whose path reached depth j+1
        self.tried = [0.0] * self.max_depth  # decayed rounds that reached depth j (could go on)
        self.verify = _LineFit(self.decay)
        self.draft_level: float | None = None  # seconds per draft level
        self.other: float | None = None  # seconds per round outside drafting and verifying
        self.rounds = 0
        self.off_rounds = 0
        self.last_depth: int | None = None
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
        spec = family_spec(self.base, depth)
        draft = depth * (self.draft_level or 0.0)
        seconds = (self.other or 0.0) + draft + self.verify(spec.max_nodes)
        return expected_tokens(self.alphas(), depth) / seconds if seconds > 0 else float("inf")

    def choose_depth(self) -> int:
        """The next round's depth. Not pure: counts off rounds, to probe every `probe_every`."""
        if self.draft_level is None:  # nothing measured yet (or only the prefill round)
            return self.base.depth
        rates = {d: self.predicted_rate(d) for d in self.depths}
        # The rate is flat near its maximum and acceptance estimates are noisy: take the shallowest
        # depth within `tolerance` of the best (cheaper rounds, less draft work wasted).
        best = min(d for d, r in rates.items() if r >= (1 - self.tolerance) * max(rates.values()))
        if best == 0:
            self.off_rounds += 1
            if self.off_rounds % self.probe_every == 0:
                return min(self.probe_depth, max(self.depths))
        return best

    def next_spec(self) -> TreeSpec:
        return family_spec(self.base, self.choose_depth())

    def _mean(self, old: float | None, new: float) -> float:
        return new if old is None else old * self.decay + (1 - self.decay) * new

    def observe(self, spec: TreeSpec, stats: GenerationStats) -> None:
        """Learn from one finished round: the spec it used and its stats delta."""
        self.rounds += 1
        depth = spec.depth  # 0 for Method.NONE
        if self.rounds > 1:  # the first round's times include both models' prompt prefill
            self.verify.add(float(stats.drafted_tokens), stats.verify_seconds)
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
        for j in range(min(accepted + 1, depth)):
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

    def new_policy(self, base: TreeSpec, params: SamplingParams) -> AdaptivePolicy:
        policy = AdaptivePolicy(base)
        with self._lock:
            learned = self._states.get(self._key(base, params))
            if learned is not None:
                for name in ("reached", "tried", "verify", "draft_level", "other"):
                    setattr(policy, name, copy.deepcopy(getattr(learned, name)))
        return policy

    def remember(self, policy: AdaptivePolicy, params: SamplingParams) -> None:
        if policy.draft_level is None:  # learned nothing usable
            return
        with self._lock:
            self._states[self._key(policy.base, params)] = copy.deepcopy(policy)
