"""DSI, distributed speculative inference (Timor et al., "Distributed Speculative Inference of
Large Language Models is Provably Faster"): the bookkeeping of speculation parallelism.

The drafter drafts block after block of `lookahead` tokens without waiting for verification. Each
block is verified, by any free target replica, after the context it was drafted from: the
committed tokens plus every older block. Verdicts may arrive in any order; `DsiState.finish`
applies them strictly in draft order (the oldest unresolved block is "the current verifier"):

    head fully accepted, a younger block exists  -> commit its tokens and drop its bonus token: the
                                                    younger block's verification decides that
                                                    position, and deciding it twice is not lossless
    head fully accepted, nothing younger         -> commit its tokens and the bonus token
    head rejected after i tokens                 -> commit tokens[:i] and the recovered token,
                                                    cancel every younger block

A verdict for a younger block waits until the older ones are resolved (the paper's Alg. 1
cascade). Whenever speculation is thrown away (a rejection, or a bonus committed where a block may
be being drafted) the state's `version` changes: a draft started under an older version is stale.

Each position is decided by exactly one verification whose context is the committed prefix, with
the draft distribution of the token drafted there; that is standard speculative sampling, so the
output is the target's distribution (tests/test_dsi.py checks it statistically).

`simulate` runs the same state machine in virtual time with SP target workers (every forward a
wait of its latency, preemption on rejection), for checking the algorithm against the analytic
model in specmesh.core.dsi_sim and for the losslessness test with toy models.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Block:
    """Drafted tokens awaiting verification; `start` is the position of the first one."""

    id: int
    start: int
    tokens: tuple[int, ...]
    draft: Any = field(default=None, compare=False, repr=False)  # what the drafter sent (its tree)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Outcome:
    """A block's verdict: how many of its tokens the target accepted, and the recovered token
    (after a rejection) or the bonus token (all accepted)."""

    accepted: int
    next_token: int


@dataclass
class Resolution:
    """What one `finish` changed."""

    emitted: list[int] = field(default_factory=list)  # newly committed, in order
    resolved: list[tuple[Block, Outcome]] = field(default_factory=list)  # verdicts applied, in order
    cancelled: list[Block] = field(default_factory=list)  # unresolved blocks thrown away
    restart: bool = False  # speculation was discarded: a draft being built is stale


class DsiState:
    """Committed tokens and the unresolved blocks after them (module docstring)."""

    def __init__(self, committed: Sequence[int]) -> None:
        self.committed = [int(t) for t in committed]
        self.blocks: list[Block] = []  # unresolved, in draft order
        self.outcomes: dict[int, Outcome] = {}  # verdicts of unresolved blocks not yet applied
        self.version = 0
        self._next_id = 0

    def context(self) -> list[int]:
        """Where the next block is drafted from: the committed tokens and every unresolved block."""
        return self.committed + [t for b in self.blocks for t in b.tokens]

    @property
    def context_length(self) -> int:
        return self.blocks[-1].end if self.blocks else len(self.committed)

    def prefix(self, block: Block) -> list[int]:
        """The tokens a verifier must hold before verifying `block`."""
        return self.context()[: block.start]

    def add(self, tokens: Sequence[int], version: int, draft: Any = None) -> Block | None:
        """A block drafted from `context()` as it was at `version`; None if that is stale."""
        if version != self.version or not tokens:
            return None
        block = Block(self._next_id, self.context_length, tuple(int(t) for t in tokens), draft)
        self._next_id += 1
        self.blocks.append(block)
        return block

    def finish(self, block_id: int, outcome: Outcome) -> Resolution:
        """Record a block's verdict and apply every verdict that is now at the head."""
        res = Resolution()
        if all(b.id != block_id for b in self.blocks):
            return res  # cancelled meanwhile: its verdict means nothing
        self.outcomes[block_id] = outcome
        while self.blocks and self.blocks[0].id in self.outcomes:
            head = self.blocks.pop(0)
            out = self.outcomes.pop(head.id)
            if not 0 <= out.accepted <= len(head.tokens):
                raise ValueError(f"block {head.id}: {out.accepted} accepted of {len(head.tokens)} tokens")
            res.resolved.append((head, out))
            res.emitted += head.tokens[: out.accepted]
            self.committed += head.tokens[: out.accepted]
            if out.accepted == len(head.tokens) and self.blocks:
                continue  # the bonus position belongs to the next block's verification
            res.emitted.append(out.next_token)
            self.committed.append(out.next_token)
            res.cancelled, self.blocks = self.blocks, []
            self.outcomes.clear()
            res.restart = True
            self.version += 1
        return res


def drafting_limit(parallel: int, ahead: bool) -> int:
    """Unresolved blocks at which the drafter stops: one more than `parallel` verifications can take,
    so a verifier never waits for a draft it could have had; 1 without drafting ahead (SI's schedule)."""
    return parallel + 1 if ahead else 1


# ---- the coordinator in virtual time -----------------------------------------------------------

# (context, lookahead) -> (drafted tokens, what verify needs of the draft, e.g. its tree)
DraftFn = Callable[[list[int], int], tuple[Sequence[int], Any]]
VerifyFn = Callable[[list[int], Block], Outcome]  # (prefix, block) -> verdict


@dataclass(frozen=True)
class SimResult:
    tokens: list[int]  # generated (the prompt excluded), exactly n_tokens of them
    latency: float  # virtual seconds until the n-th token was committed
    target_forwards: int  # verifications started (cancelled ones included)
    max_parallel: int  # most verifications in flight at once


def simulate(
    prompt: Sequence[int],
    n_tokens: int,
    lookahead: int,
    sp: int,
    draft: DraftFn,
    verify: VerifyFn,
    draft_seconds: Callable[[], float],
    verify_seconds: Callable[[], float],
    new_state: Callable[[Sequence[int]], DsiState] = DsiState,
    ahead: bool = True,
) -> SimResult:
    """DSI with one drafter and `sp` target workers, every forward a wait of its latency.

    draft_seconds(): the time to draft one block; verify_seconds(): one target forward. The drafter
    works ahead while fewer than sp + 1 blocks are unresolved (one more than the workers can
    take, so a worker never waits for a draft it could have had). A rejection preempts the
    cancelled blocks' workers and the draft in progress at once. ahead=False: the drafter waits
    for every verdict, which is SI's schedule (every fully accepted block keeps its bonus token)."""
    if lookahead < 1 or sp < 1 or n_tokens < 1:
        raise ValueError("lookahead, sp and n_tokens must be >= 1")
    state = new_state(prompt)
    goal = len(state.committed) + n_tokens
    now, seq = 0.0, 0
    events: list[tuple[float, int, str, object]] = []  # (time, order, kind, payload)
    drafting: int | None = None  # version of the draft in progress
    running: dict[int, Block] = {}  # block id -> block, on a worker
    queued: list[Block] = []  # drafted, waiting for a worker
    forwards = most = 0
    unresolved = drafting_limit(sp, ahead)

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, payload))
        seq += 1

    def schedule() -> None:
        nonlocal drafting, forwards, most
        while queued and len(running) < sp:
            block = queued.pop(0)
            running[block.id] = block
            forwards += 1
            most = max(most, len(running))
            push(now + verify_seconds(), "verified", (block, state.prefix(block)))
        if drafting is None and len(state.blocks) < unresolved and len(state.committed) < goal:
            drafting = state.version
            push(now + draft_seconds(), "drafted", (state.version, state.context()))

    schedule()
    while len(state.committed) < goal:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "drafted":
            version, context = payload  # type: ignore[misc]
            if version != drafting:
                continue  # preempted by a restart
            drafting = None
            tokens, drafted = draft(context, lookahead)
            block = state.add(tokens, version, drafted)
            if block is not None:
                queued.append(block)
        else:
            block, prefix = payload  # type: ignore[misc]
            if running.pop(block.id, None) is None:
                continue  # preempted: its worker was freed when it was cancelled
            res = state.finish(block.id, verify(prefix, block))
            for b in res.cancelled:
                running.pop(b.id, None)
            queued = [b for b in queued if b not in res.cancelled]
            if res.restart:
                drafting = None
        schedule()
    tokens = state.committed[len(prompt) : goal]
    return SimResult(tokens, now, forwards, most)


# ---- the paper's acceptance model, and choosing a shape with it --------------------------------


def iid_latency(
    acceptance: float,
    lookahead: int,
    sp: int,
    draft_seconds: float,
    verify_seconds: Callable[[int], float] | float,
    n_tokens: int = 128,
    seed: int = 0,
    ahead: bool = True,
) -> SimResult:
    """`simulate` with each drafted token accepted independently with probability `acceptance`
    (the paper's model); draft_seconds per drafted token, verify_seconds(rows) per target forward
    of `rows` = lookahead + 1 query rows (or a constant)."""
    rng = random.Random(seed)
    forward = verify_seconds if callable(verify_seconds) else (lambda rows: float(verify_seconds))

    def verify(prefix: list[int], block: Block) -> Outcome:
        n = 0
        while n < len(block.tokens) and rng.random() < acceptance:
            n += 1
        return Outcome(n, 0)

    return simulate(
        [0], n_tokens, lookahead, sp, lambda context, k: ([1] * k, None), verify,
        lambda: lookahead * draft_seconds, lambda: forward(lookahead + 1), ahead=ahead,
    )  # fmt: skip


@dataclass(frozen=True)
class Shape:
    lookahead: int
    parallel: int
    seconds_per_token: float  # predicted
    ahead: bool = True  # False: the drafter waits for every verdict (SI's schedule, one verifier)


def choose_shape(
    acceptance: float,
    draft_seconds: float,
    verify_seconds: Callable[[int], float],
    parallels: Sequence[int],
    lookaheads: Sequence[int] = range(1, 9),
    n_tokens: int = 96,
    sequential: bool = False,
    overlap_slowdown: float = 1.0,
) -> Shape:
    """The lookahead and parallel verifications that `iid_latency` predicts fastest (ties: the
    fewest replicas, then the shortest lookahead). Deterministic: seeded, common random numbers.

    sequential: SI's schedule (no drafting ahead) is a candidate too, and wins ties. With one
    verifier, working ahead saves one draft per fully accepted block but loses that block's bonus
    token (the younger block decides the position); where a block takes longer to draft than a
    forward, the verdict comes first, the bonus is kept and the draft restarted, which is SI's
    timing. So with one verifier it rarely pays, and SI's schedule keeps DSI from being slower.
    overlap_slowdown: a forward's measured time beside drafting over its time alone (above 1 where
    the drafter shares the target's cores), charged to every candidate that drafts ahead."""
    candidates = [(1, False)] if sequential else []
    candidates += [(parallel, True) for parallel in sorted(parallels)]
    best: Shape | None = None
    for parallel, ahead in candidates:
        slowdown = overlap_slowdown if ahead else 1.0
        forward = lambda rows, s=slowdown: s * verify_seconds(rows)  # noqa: E731
        for lookahead in sorted(lookaheads):
            runs = [
                iid_latency(acceptance, lookahead, parallel, draft_seconds, forward, n_tokens, seed, ahead)
                for seed in range(3)
            ]
            per_token = sum(r.latency for r in runs) / (len(runs) * n_tokens)
            if best is None or per_token < best.seconds_per_token * (1 - 1e-9):
                best = Shape(lookahead, parallel, per_token, ahead)
    assert best is not None
    return best


def acceptance_from_blocks(mean_accepted: float, lookahead: int) -> float:
    """The per-token acceptance a whose truncated geometric mean a + a^2 + ... + a^lookahead is
    `mean_accepted` (accepted tokens per verified block), by bisection."""
    target = min(max(mean_accepted, 0.0), float(lookahead))
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, lookahead + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
