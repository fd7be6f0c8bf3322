"""Drafting ahead on the likely path: the rule pipelined rounds share, written once.

While round r is verified, the drafter drafts round r+1 as if the verdict were the one it finds
most likely: every node of `likely_path(tree)` accepted, then the draft's own guess of the next
(recovered or bonus) token. The pre-drafted tree is used only if the committed tokens turn out to
be exactly those (`PreDraft.applies`); it is then the very tree a serial Draft would have drafted
(same tokens before it, same seed: the round's draws, specmesh.core.rounds.draft_draws). Otherwise it
is dropped. Drafts are only proposals, so the verified output keeps the target's distribution
either way; what pipelining changes is only when the tree is ready. The verifier's run-ahead (a
plain run's next step while its answer travels) has the same rule for its side: `goes_on`.

`PipelinePolicy` decides per round whether a pre-draft pays, from what its sessions measured (the
gateway shares one among all its sessions, so that finding out is paid once, not per session):
  gain of a hit   the Draft call the next round does not wait for;
  cost of a miss  the pre-draft's level forward still running when the real Draft arrives;
  cost always     how much slower a Verify runs with a Draft beside it (shared hardware: on a CPU
                  the two processes take each other's cores; on separate accelerators ~0).
It pre-drafts when p_hit * draft > (1 - p_hit) * level + slowdown, decided once per epoch (all
the sessions of a tick alike), and re-measures the other side one epoch in `probe_every`, so a
pre-draft that stopped paying is dropped.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specmesh.core.rounds import Pipelining
from specmesh.core.tree import DraftTree


def likely_path(tree: DraftTree) -> list[int]:
    """The node indices, root first, of the tree's most probable leaf under the draft: the leaf
    with the largest product of its path's draft probabilities (ties: the first in level order).
    A chain's is the whole chain."""
    if tree.num_nodes == 0:
        return []
    if tree.is_chain:
        return list(range(tree.num_nodes))
    parents = tree.parents.tolist()
    rows = tree.prob_rows[tree.parents + 1]  # the row each node's token was drawn from
    logq = tree.draft_probs[rows, tree.tokens].double().clamp_min(1e-300).log().tolist()
    total: list[float] = []
    for i, parent in enumerate(parents):  # parents[i] < i: level order
        total.append(logq[i] + (total[parent] if parent >= 0 else 0.0))
    inner = set(parents)
    leaves = [i for i in range(len(parents)) if i not in inner]
    node = max(leaves, key=lambda i: total[i])  # max keeps the first of equal maxima
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def agrees(committed: Sequence[int], base: int, assumed: Sequence[int]) -> bool:
    """Whether the tokens committed after the first `base` are exactly the first of `assumed`: the
    test a draft made ahead on assumed tokens must pass to be used (here, and DSI's chains drafted
    ahead of their predecessors' verdicts, specmesh.core.dsi)."""
    decided = committed[base:]
    return len(decided) <= len(assumed) and all(a == b for a, b in zip(decided, assumed, strict=False))


@dataclass(frozen=True)
class PreDraft:
    """A tree drafted ahead: `base` committed tokens were known when it was asked for, and it
    assumes the next committed tokens are `assumed` (the likely path plus the guessed token)."""

    base: int
    assumed: tuple[int, ...]

    def applies(self, committed: Sequence[int]) -> bool:
        """Whether the session's committed tokens are exactly base + assumed: only then is the tree
        the one a serial Draft would draft now."""
        return len(committed) == self.base + len(self.assumed) and agrees(committed, self.base, self.assumed)


# A call's settings that a step run ahead of it does not depend on (run-ahead, verifier_service/
# run_ahead.py): how many steps the call asks for and how many tokens it has room for, and its
# rides: a step emits the tokens a plain step draws whatever rode in it (the argmax, or the
# position's own draw: SamplingMode.PROPOSED), so the call's text is its own. (The gateway changes
# its rides on ~1 call in 10 of a copying answer, and each change threw a forward away.)
RUN_AHEAD_LOOSE = ("plain_steps", "max_tokens", "lookup_depth", "lookup_min_ngram")


def goes_on(expected: Any, call: Any) -> bool:
    """Whether `call` (a verify call's dataclass) starts where a step run ahead left the session,
    with that step's settings: equal to `expected`, the call the step assumed, but for
    RUN_AHEAD_LOOSE. The run-ahead's counterpart of PreDraft.applies: what ran ahead is used only
    if it is what the caller would have asked for now."""
    loose = {name: getattr(expected, name) for name in RUN_AHEAD_LOOSE}
    return dataclasses.replace(call, **loose) == expected


def _ema(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class PipelinePolicy:
    """Whether the next round pre-drafts (module docstring). Times in seconds, over the rounds of
    the sessions that share it."""

    mode: Pipelining = Pipelining.AUTO
    weight: float = 0.25  # of a new measurement in the moving averages
    probe_every: int = 16  # epochs; one of serial rounds (AUTO, pre-drafting) or pre-drafts (AUTO, not)
    # a decision holds for an epoch: the sessions of a tick decide alike (one that pre-drafts
    # skips the drafter's next tick, one that does not waits for it: mixed, they split the ticks)
    epoch_seconds: float = 0.25
    clock: Callable[[], float] = time.monotonic
    hit_rate: float = 0.5  # the prior, before any pre-draft was judged
    draft: float | None = None  # a Draft call's wall when the round waited for all of it
    level: float | None = None  # one draft forward (the longest a miss waits for the pre-draft)
    verify_alone: float | None = None  # a Verify call's wall, no Draft beside it
    verify_beside: float | None = None  # ... with a pre-draft running beside it
    _since_probe: int = field(default=0, repr=False)
    _decision: bool = field(default=False, repr=False)
    _decided_at: float | None = field(default=None, repr=False)

    def wants(self) -> bool:
        """Whether to pre-draft beside the coming verification: decided once per epoch."""
        if not self.mode.enabled:
            return False
        if self.mode is Pipelining.ON:
            return True
        if self.draft is None or self.verify_alone is None:
            return False  # the first rounds measure the serial side
        now = self.clock()
        if self._decided_at is not None and now - self._decided_at < self.epoch_seconds:
            return self._decision
        self._decided_at = now
        pays = self.pays()
        self._since_probe += 1
        if self._since_probe >= self.probe_every:  # measure the other side again
            self._since_probe = 0
            pays = not pays
        self._decision = pays
        return pays

    def pays(self) -> bool:
        if self.draft is None or self.verify_alone is None:
            return False
        slowdown = max(0.0, (self.verify_beside or self.verify_alone) - self.verify_alone)
        miss = (1 - self.hit_rate) * (self.level or 0.0)
        return self.hit_rate * self.draft > miss + slowdown

    def observe(
        self,
        *,
        verify: float,
        beside: bool,
        draft: float | None = None,
        levels: int = 0,
        hit: bool | None = None,
    ) -> None:
        """One round: its Verify call's wall, whether a pre-draft ran beside it, the Draft call's
        wall if the round waited for a whole one (and its level forwards), and, if a pre-draft
        was judged this round, whether it applied."""
        w = self.weight
        if beside:
            self.verify_beside = _ema(self.verify_beside, verify, w)
        else:
            self.verify_alone = _ema(self.verify_alone, verify, w)
        if draft is not None:
            self.draft = _ema(self.draft, draft, w)
            if levels:
                self.level = _ema(self.level, draft / levels, w)
        if hit is not None:
            self.hit_rate = _ema(self.hit_rate, 1.0 if hit else 0.0, w)
