"""How long one replica call may take, and how many retries the gateway may spend.

Per-try timeout: a call is given `factor` times what its forwards cost on that replica (measured
at start-up, InfoResponse.forward_cost), never less than `floor`. A try past it is cancelled and the
round moves to a spare replica (gateway/rounds.py); without a spare it waits on, up to the round
timeout. The factor covers the queue: a call may wait for a batch forward in progress before its
own, and share its forward with other sessions' rows.

Retry budget: failovers are extra load exactly when the mesh is least able to take it (a slow
verifier that makes every try time out would otherwise see each call twice). Retries in the last
`window` seconds may be at most `ratio` of the rounds started in it, plus `minimum`, as Envoy's and
Finagle's retry budgets do; past it a failed round fails its request.
"""

from __future__ import annotations

import collections
import itertools
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["RetryBudget", "TryTimeouts", "forward_seconds", "prefill_chunk"]

# --prefill-chunk auto: a chunk's forward costs about this many one-row forwards (a running
# stream's step beside it waits that long), within these bounds (docs/decisions.md, "Chunked prefill")
CHUNK_STEPS, MIN_CHUNK, MAX_CHUNK = 16, 64, 2048


def forward_seconds(cost: Mapping[int, float], rows: int) -> float:
    """Seconds of one forward of `rows` rows: the measured table, linear between and beyond its
    points (0 when nothing was measured)."""
    if not cost:
        return 0.0
    points = sorted(cost.items())
    if rows <= points[0][0]:
        return points[0][1]
    for (r0, s0), (r1, s1) in itertools.pairwise(points):
        if rows <= r1:
            return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)
    r_last, s_last = points[-1]
    return s_last * rows / r_last  # past the table: proportional to rows (a prefill)


def prefill_chunk(cost: Mapping[int, float], steps: float = CHUNK_STEPS) -> int:
    """The prefill chunk whose forward costs `steps` one-row forwards of `cost` (rows -> seconds,
    a replica's start-up measurement), by the line through the table (a CPU's forward grows with
    every row, a GPU's hardly: its chunk is larger), within [MIN_CHUNK, MAX_CHUNK]. The line is
    Theil-Sen's (the median of the pairwise slopes): one point measured while the host was busy
    moves it little, where the slope of the last two points once gave 499 tokens for 64 (a
    16-row forward measured as fast as an 8-row one, on replicas starting together on 2 cores)."""
    points = sorted(cost.items())
    if len(points) < 2:
        return MIN_CHUNK * 4
    slope = max(
        statistics.median((s1 - s0) / (r1 - r0) for (r0, s0), (r1, s1) in itertools.combinations(points, 2)),
        1e-9,
    )
    fixed = statistics.median(s - slope * r for r, s in points)
    rows = (steps * points[0][1] - fixed) / slope
    return int(min(MAX_CHUNK, max(MIN_CHUNK, rows)))


@dataclass
class TryTimeouts:
    """The per-try timeout of Draft and Verify calls (module docstring)."""

    floor: float
    factor: float
    draft_cost: dict[int, float] = field(default_factory=dict)  # rows -> seconds, a drafter's
    verify_cost: dict[int, float] = field(default_factory=dict)  # rows -> seconds, the verifier's
    # (table, rows) -> forward_seconds: asked several times a round, for a few row counts
    _seconds: dict[tuple[bool, int], float] = field(default_factory=dict, init=False, repr=False)

    def draft(self, new_tokens: int, levels: int) -> float:
        """A Draft: the new tokens' forward, then one forward per further tree level."""
        seconds = self._forward(True, new_tokens) + max(levels - 1, 0) * self._forward(True, 1)
        return max(self.floor, self.factor * seconds)

    def verify(self, new_tokens: int, nodes: int, plain_steps: int = 1) -> float:
        """A Verify: one forward of the new tokens and the tree's nodes, then a one-row forward per
        further plain step."""
        seconds = self._forward(False, new_tokens + nodes) + (plain_steps - 1) * self._forward(False, 1)
        return max(self.floor, self.factor * seconds)

    def _forward(self, draft: bool, rows: int) -> float:
        seconds = self._seconds.get((draft, rows))
        if seconds is None:
            table = self.draft_cost if draft else self.verify_cost
            seconds = self._seconds[(draft, rows)] = forward_seconds(table, rows)
        return seconds


class RetryBudget:
    """Retries allowed over a sliding window, relative to the rounds started (module docstring).
    Event loop only."""

    def __init__(self, ratio: float = 0.2, minimum: int = 10, window: float = 10.0) -> None:
        self.ratio, self.minimum, self.window = ratio, minimum, window
        self._rounds: collections.deque[float] = collections.deque()
        self._retries: collections.deque[float] = collections.deque()

    def round_started(self) -> None:
        self._rounds.append(time.monotonic())

    def try_spend(self) -> bool:
        """One retry, if the budget has room (then it is counted)."""
        now = time.monotonic()
        for events in (self._rounds, self._retries):
            while events and events[0] < now - self.window:
                events.popleft()
        if len(self._retries) >= self.minimum + self.ratio * len(self._rounds):
            return False
        self._retries.append(now)
        return True
