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
cascade). A rejection throws speculation away: the state's `version` changes, and a draft started
under an older version is stale.

The guard (Alg. 1's target thread): while no block is unresolved, a target-only forward on the
committed tokens runs, and its token decides the next position, always. A block drafted from that
position while the guard is in flight is verified from one position later, assuming its first
token (`assumed`); when the guard answers, that token must be exactly the guard's (the
exact-match rule, `specmesh.core.ahead.agrees`: the test of every draft made ahead), else the
block and every younger one are thrown away like a rejection. Tokens committed while a draft was
being built (by guards, or a bonus token) are matched the same way when it arrives: on a match
the rest of the draft is the block (`skip` tokens shorter), else the draft is dropped. A fully
accepted block's bonus token is kept when the next block's verification has not started yet (one
verifier, busy) and decides that block's first position by the same exact match; once that
verification has started, it decides the position and the bonus is dropped. So a slow drafter
never makes DSI slower than the target decoding alone (the guards decide every token), and a
bonus no longer throws away a draft that begins with it.

Each position is decided by exactly one verification whose context is the committed prefix, with
the draft distribution of the token drafted there; that is standard speculative sampling, so the
output is the target's distribution (tests/test_dsi.py checks it statistically). Which
verification decides a position never depends on that position's sample: a guard decides the
position it started at (it starts only while nothing is unresolved), a block the positions after
its assumed tokens, and only once they were matched; a bonus is kept or dropped by whether the
next verification had started, which the scheduler fixes without looking at unapplied verdicts.
A draft kept by the exact-match rule is a draft sampled after the committed tokens, so its
remaining tokens are verified against the right draft distributions.

`simulate` runs the same state machine in virtual time with SP target workers (every forward a
wait of its latency, preemption on rejection), for checking the algorithm against the analytic
model in specmesh.core.dsi_sim and for the losslessness test with toy models.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from specmesh.core.ahead import agrees


@dataclass(frozen=True)
class Block:
    """Drafted tokens awaiting verification; `start` is the position of the first one."""

    id: int
    start: int
    tokens: tuple[int, ...]
    draft: Any = field(default=None, compare=False, repr=False)  # what the drafter sent (its tree)
    skip: int = 0  # the draft's first tokens not in `tokens`: verify the draft without them
    assumed: tuple[int, ...] = ()  # the last of those, before `start`: a guard in flight decides them

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
    """What one `finish` / `finish_guard` changed."""

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
        self.guard: int | None = None  # the position the guard in flight decides
        self.sent: set[int] = set()  # blocks whose verification has started
        self._next_id = 0

    def context(self) -> list[int]:
        """Where the next block is drafted from: the committed tokens and every unresolved block."""
        return self.committed + [t for b in self.blocks for t in (*b.assumed, *b.tokens)]

    @property
    def context_length(self) -> int:
        return self.blocks[-1].end if self.blocks else len(self.committed)

    def prefix(self, block: Block) -> list[int]:
        """The tokens a verifier must hold before verifying `block`."""
        return self.context()[: block.start]

    def add(
        self, tokens: Sequence[int], version: int, draft: Any = None, start: int | None = None
    ) -> Block | None:
        """A block drafted from the first `start` tokens of `context()` (default: all of it) as it
        was at `version`; None if that is stale, or if nothing of it is left to verify. Tokens
        committed since its draft began must be exactly its first ones (the exact-match rule); a
        guard in flight at its first position makes that token assumed."""
        if version != self.version or not tokens:
            return None
        tokens = [int(t) for t in tokens]
        start = self.context_length if start is None else start
        if self.blocks:  # drafted after every unresolved block: nothing was decided meanwhile
            if start != self.context_length:
                return None
            skip = 0
        elif start > len(self.committed) or not agrees(self.committed, start, tokens):
            return None
        else:
            skip = len(self.committed) - start
        assumed = tuple(tokens[skip : skip + 1]) if self.guard == start + skip else ()
        skip += len(assumed)
        if skip >= len(tokens):
            return None
        block = Block(self._next_id, start + skip, tuple(tokens[skip:]), draft, skip, assumed)
        self._next_id += 1
        self.blocks.append(block)
        return block

    def current(self, block: Block) -> Block | None:
        """The block as it stands now (a bonus or a guard may have decided its first token since it
        was added); None once it is resolved or thrown away."""
        return next((b for b in self.blocks if b.id == block.id), None)

    def mark_sent(self, block: Block) -> None:
        """Its verification started: from now on it decides its first position (see _cascade)."""
        self.sent.add(block.id)

    def next_depth(self, lookahead: int, parallel: int) -> int:
        """Tokens to draft for the next block: one more than `lookahead` when its first token will
        be decided before its verification starts (every verifier busy with older blocks, so the
        bonus of the one before it is kept: `_cascade`; or a guard in flight at its first
        position), so that `lookahead` are still verified."""
        waits = len(self.blocks) >= parallel or (self.guard is not None and not self.blocks)
        return lookahead + 1 if waits else lookahead

    @property
    def may_guard(self) -> bool:
        """No block is unresolved and no guard is in flight."""
        return not self.blocks and self.guard is None

    def start_guard(self) -> int | None:
        """The position a guard started now decides; None unless `may_guard`."""
        if not self.may_guard:
            return None
        self.guard = len(self.committed)
        return self.guard

    def abandon_guard(self, position: int) -> Resolution:
        """The guard started at `position` will not answer (its call failed or was cancelled):
        the blocks that assumed its token are thrown away."""
        res = Resolution()
        if self.guard == position:
            self.guard = None
            if self.blocks:
                self._throw_away(res)
        return res

    def finish_guard(self, position: int, next_token: int) -> Resolution:
        """A guard's verdict: the target's token after the committed tokens. It is committed; a
        block that assumed another token is thrown away with every younger one."""
        res = Resolution()
        if self.guard != position:
            return res  # from before a restart
        self.guard = None
        self.committed.append(int(next_token))
        res.emitted.append(int(next_token))
        if self.blocks:
            head = self.blocks[0]
            if head.assumed == (int(next_token),):
                self.blocks[0] = dataclasses.replace(head, assumed=())
                self._cascade(res)
            else:
                self._throw_away(res)
        return res

    def finish(self, block_id: int, outcome: Outcome) -> Resolution:
        """Record a block's verdict and apply every verdict that is now at the head."""
        res = Resolution()
        block = next((b for b in self.blocks if b.id == block_id), None)
        if block is None:
            return res  # cancelled meanwhile: its verdict means nothing
        if not 0 <= outcome.accepted <= len(block.tokens):
            raise ValueError(f"block {block.id}: {outcome.accepted} accepted of {len(block.tokens)} tokens")
        self.outcomes[block_id] = outcome
        self._cascade(res)
        return res

    def _cascade(self, res: Resolution) -> None:
        """Apply the verdicts at the head, in draft order, while its assumed token is decided."""
        while self.blocks and self.blocks[0].id in self.outcomes and not self.blocks[0].assumed:
            head = self.blocks.pop(0)
            out = self.outcomes.pop(head.id)
            self.sent.discard(head.id)
            res.resolved.append((head, out))
            res.emitted += head.tokens[: out.accepted]
            self.committed += head.tokens[: out.accepted]
            full = out.accepted == len(head.tokens)
            if full and self.blocks and self.blocks[0].id in self.sent:
                continue  # the bonus position belongs to the next block's verification
            res.emitted.append(out.next_token)
            self.committed.append(out.next_token)
            if not full:
                self._throw_away(res)
            elif self.blocks:  # the bonus decides the next block's first position: exact match
                self._match_head(out.next_token, res)
            # else a draft in progress after the block is matched against the bonus (add)

    def _match_head(self, token: int, res: Resolution) -> None:
        """`token` was committed at the unsent head block's first position: the head goes on
        without its first token if that is exactly `token` (gone if nothing is left of it,
        younger blocks stand), else it is thrown away with every younger block."""
        head = self.blocks[0]
        if not agrees([token], 0, head.tokens):
            self._throw_away(res)
        elif len(head.tokens) == 1:
            res.cancelled.append(self.blocks.pop(0))
        else:
            self.blocks[0] = dataclasses.replace(
                head, start=head.start + 1, tokens=head.tokens[1:], skip=head.skip + 1
            )

    def _throw_away(self, res: Resolution) -> None:
        res.cancelled += self.blocks
        self.blocks = []
        self.outcomes.clear()
        self.sent.clear()
        res.restart = True
        self.version += 1


def drafting_limit(parallel: int, ahead: bool) -> int:
    """Unresolved blocks at which the drafter stops: one more than `parallel` verifications can take,
    so a verifier never waits for a draft it could have had; 1 without drafting ahead (SI's schedule)."""
    return parallel + 1 if ahead else 1


def guards(parallel: int, ahead: bool, lookahead: int) -> bool:
    """Whether guards run: only drafting ahead, with a second verifier, so that the block drafted
    meanwhile never waits for a replica the guard holds, and blocks of 2 tokens or more (a block
    verified after its assumed first token must have something left)."""
    return ahead and parallel >= 2 and lookahead >= 2


@dataclass(frozen=True)
class Schedule:
    """What a DSI session starts whenever something of it ended, written once for the gateway
    (gateway/dsi.py) and the virtual-time run (`simulate`): verifications of queued blocks while
    fewer than `parallel` are in flight; a guard while no block is unresolved and a second
    verifier is left (`guards`); the next draft while none is in flight and fewer than
    `drafting_limit` blocks are unresolved. `room`: how many more tokens the session may take."""

    lookahead: int
    parallel: int
    ahead: bool = True
    max_depth: int | None = None  # the replicas' deepest tree (--max-depth): the extra token's cap

    @property
    def unresolved(self) -> int:
        return drafting_limit(self.parallel, self.ahead)

    @property
    def guarding(self) -> bool:
        return guards(self.parallel, self.ahead, self.lookahead)

    def verifications(self, queued: int, verifying: int) -> int:
        """How many of the queued blocks may start their verification now (in draft order)."""
        return max(0, min(queued, self.parallel - verifying))

    def guard(self, state: DsiState, verifying: int, room: int) -> bool:
        """Whether a guard starts now (then `state.start_guard()`)."""
        return self.guarding and room > 0 and verifying + 1 < self.parallel and state.may_guard

    def draft(self, state: DsiState, drafting: bool, room: int) -> int | None:
        """The depth of the draft to start now, or None."""
        if drafting or len(state.blocks) >= self.unresolved or room <= 0:
            return None
        depth = state.next_depth(self.lookahead, self.parallel)
        return depth if self.max_depth is None else min(depth, self.max_depth)


@dataclass
class Learnt:
    """What a gateway's finished DSI sessions taught it, for the next one's choice of shape
    (`choose_shape`): the per-token acceptance (decayed, `acceptance_decay` for the older sessions;
    the prior 0.7), and per (drafting ahead, verifications in flight at most) a verification's time
    over the verifier's start-up cost for its rows (SI's schedule is (False, 1)). Over SI's, that
    is what drafting beside and other verifications on the same hardware cost a forward."""

    acceptance: float = 0.7
    acceptance_decay: float = 0.5
    forward_scale: dict[tuple[bool, int], float] = field(default_factory=dict)
    forward_decay: float = 0.9

    def learn_acceptance(self, mean_accepted: float, lookahead: int) -> None:
        """A finished session's mean accepted tokens per verified block of `lookahead`."""
        seen = acceptance_from_blocks(mean_accepted, lookahead)
        self.acceptance = self.acceptance_decay * self.acceptance + (1 - self.acceptance_decay) * seen

    def learn_forward(self, ahead: bool, parallel: int, seconds: float, expected: float) -> None:
        """One verification that took `seconds` where the start-up costs said `expected`."""
        if seconds <= 0 or expected <= 0:
            return
        seen, key = seconds / expected, (ahead, parallel)
        old = self.forward_scale.get(key, seen)
        self.forward_scale[key] = self.forward_decay * old + (1 - self.forward_decay) * seen

    def overlap_slowdown(self, parallel: int) -> float:
        """A forward's slowdown drafting ahead with `parallel` in flight, over SI's schedule. Not
        measured yet: the most measured at fewer in flight (more in flight is no faster on shared
        hardware), else none; so an untried shape is tried once, then judged by what it cost."""
        scale = self.forward_scale
        seen = [v for (ahead, p), v in scale.items() if ahead and p <= parallel]
        ahead = scale.get((True, parallel), max(seen, default=1.0))
        return ahead / scale.get((False, 1), 1.0)


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
    take, so a worker never waits for a draft it could have had). While no block is unresolved a
    guard runs on a free worker (`guards`): `verify` of an empty block at the committed tokens.
    A rejection preempts the cancelled blocks' workers and the draft in progress at once.
    ahead=False: the drafter waits for every verdict, which is SI's schedule (every fully accepted
    block keeps its bonus)."""
    if lookahead < 1 or sp < 1 or n_tokens < 1:
        raise ValueError("lookahead, sp and n_tokens must be >= 1")
    run = _VirtualRun(new_state(prompt), Schedule(lookahead, sp, ahead), draft_seconds, verify_seconds)
    goal = len(run.state.committed) + n_tokens
    run.schedule(goal)
    while len(run.state.committed) < goal:
        if run.next_event(draft, verify):
            run.schedule(goal)
    tokens = run.state.committed[len(prompt) : goal]
    return SimResult(tokens, run.now, run.forwards, run.most)


class _VirtualRun:
    """`simulate`'s clock and workers: events in virtual time, in the order they were pushed at
    equal times."""

    def __init__(
        self,
        state: DsiState,
        plan: Schedule,
        draft_seconds: Callable[[], float],
        verify_seconds: Callable[[], float],
    ) -> None:
        self.state, self.plan = state, plan
        self.draft_seconds, self.verify_seconds = draft_seconds, verify_seconds
        self.now, self._seq = 0.0, 0
        self._events: list[tuple[float, int, str, object]] = []  # (time, order, kind, payload)
        self.drafting: int | None = None  # version of the draft in progress
        self.running: dict[
            int, Block
        ] = {}  # block id -> block, on a worker (a guard: an empty block, id < 0)
        self.queued: list[Block] = []  # drafted, waiting for a worker
        self.forwards = self.most = 0

    def _push(self, t: float, kind: str, payload: object) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, payload))
        self._seq += 1

    def _run(self, block: Block, prefix: list[int]) -> None:
        self.running[block.id] = block
        self.forwards += 1
        self.most = max(self.most, len(self.running))
        self._push(self.now + self.verify_seconds(), "verified", (block, prefix))

    def schedule(self, goal: int) -> None:
        """Start what the schedule lets start: verifications of queued blocks, a guard, a draft."""
        state, plan = self.state, self.plan
        for _ in range(plan.verifications(len(self.queued), len(self.running))):
            block = state.current(self.queued.pop(0))
            assert block is not None  # thrown-away blocks leave the queue at once
            state.mark_sent(block)
            self._run(block, state.prefix(block))
        room = goal - len(state.committed)
        if plan.guard(state, len(self.running), room):
            position = state.start_guard()
            assert position is not None
            self._run(Block(-1 - position, position, ()), list(state.committed))
        k = plan.draft(state, self.drafting is not None, room)
        if k is not None:
            self.drafting = state.version
            at = self.now + self.draft_seconds() * k / plan.lookahead
            self._push(at, "drafted", (state.version, state.context(), k))

    def next_event(self, draft: DraftFn, verify: VerifyFn) -> bool:
        """The next draft or verdict, applied to the state at its time; False if it was stale (a
        preempted draft or verification), which changes nothing."""
        state = self.state
        self.now, _, kind, payload = heapq.heappop(self._events)
        if kind == "drafted":
            version, context, k = payload  # type: ignore[misc]
            if version != self.drafting:
                return False  # preempted by a restart
            self.drafting = None
            tokens, drafted = draft(context, k)
            block = state.add(tokens, version, drafted, len(context))
            if block is not None:
                self.queued.append(block)
            return True
        block, prefix = payload  # type: ignore[misc]
        if self.running.pop(block.id, None) is None:
            return False  # preempted: its worker was freed when it was cancelled
        if block.tokens:
            res = state.finish(block.id, verify(prefix, block))
        else:  # a guard
            res = state.finish_guard(block.start, verify(prefix, block).next_token)
        for b in res.cancelled:
            self.running.pop(b.id, None)
        gone = {b.id for b in res.cancelled}
        self.queued = [b for b in self.queued if b.id not in gone]
        if res.restart:
            self.drafting = None
        return True


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
        # drafts are all 1s; the target's next token (a guard's, a bonus) is 1, the draft's
        # choice, with probability `acceptance` (what the exact-match rule compares)
        n = 0
        while n < len(block.tokens) and rng.random() < acceptance:
            n += 1
        return Outcome(n, int(n == len(block.tokens) and rng.random() < acceptance))

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
    overlap_slowdown: float | Callable[[int], float] = 1.0,
) -> Shape:
    """The lookahead and parallel verifications that `iid_latency` predicts fastest (ties: the
    fewest replicas, then the shortest lookahead). Deterministic: seeded, common random numbers.

    sequential: SI's schedule (no drafting ahead) is a candidate too, and wins ties. With one
    verifier, working ahead saves one draft per fully accepted block but loses that block's bonus
    token (the younger block decides the position); where a block takes longer to draft than a
    forward, the verdict comes first, the bonus is kept and the draft restarted, which is SI's
    timing. So with one verifier it rarely pays, and SI's schedule keeps DSI from being slower.
    overlap_slowdown: a forward's measured time beside drafting over its time alone (above 1 where
    the drafter shares the target's cores), charged to every candidate that drafts ahead; a
    function of `parallel` where it was measured per number of verifications in flight (other
    verifiers on the same cores slow a forward too)."""
    slowdown_of = overlap_slowdown if callable(overlap_slowdown) else lambda parallel: overlap_slowdown
    candidates = [(1, False)] if sequential else []
    candidates += [(parallel, True) for parallel in sorted(parallels)]
    best: Shape | None = None
    for parallel, ahead in candidates:
        slowdown = slowdown_of(parallel) if ahead else 1.0
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
