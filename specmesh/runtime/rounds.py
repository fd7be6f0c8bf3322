"""The model side of a tick, shared by the in-process engine and the two model services: the
drafter's level forwards and KV reuse, the verifier's verdict-then-commit, for every session of a
tick at once.

Chunked prefill: a job with a `feed_limit` whose first step would feed more tokens than that past
the prefix its session starts from is *partial*: that step feeds as many and the job ends there,
deciding nothing (`partial` in its outcome); its caller sends the rest in a later tick.

Both are step protocols (`ForwardSteps`): a generator that yields the runner steps of its next forward
(one `Step` per session, all in ONE `forward`), is sent their logits (per step: a tensor, or the
exception that failed that step alone), and returns one outcome per job. The engine drives them
with `runner.forward`; the services through their ForwardBatcher, which merges concurrent ticks
into the same forwards and runs each resumption on the model thread right after its forward.

Drafter. After a round the session's tree stays pending in the drafter's runner, with a map path
-> pending node (`DraftJob.nodes`). The next round's new tokens (those committed since: normally
the accepted path plus the recovered or bonus token) decide what to keep: `reusable_nodes` are the
pending nodes whose paths are proper prefixes of them, exactly the accepted nodes the draft has run
(an accepted leaf of the last level never ran). They are committed before the next root forward
and the rest of the new tokens is fed; the last new token is always fed, its logits are the root
of the next tree. Whatever the caller sends (a verdict from another replica, a restart) is handled
the same way, because a kept node's KV is the KV of that token at that position.

Verifier. `verify_steps` decides every session's round (core.rounds.verify_rounds) and compacts
each session's KV to its accepted path right away, so a session's state never holds half a round;
plain sessions (no tree) may go on for more steps in the same call (`VerifyJob.plain_steps`).
A plain step may carry a proposal (`VerifyJob.ride`: a "ride", the session's n-gram chain or a
suffix tree from the mesh's outputs, checked in the step's own forward by the proposed-token rule
of a model-free drafter's trees) and then emits the accepted tokens and one more; a forward's rides
are cut together to what pays at its size (core.rides). Each step's random draws are keyed by
its root's position, as any round's.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace

import torch

from specmesh.core.ahead import likely_path
from specmesh.core.drafting import NextLogits, Path, TreeSpec, draft_many
from specmesh.core.grammar import mask_logits, tree_paths
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.rides import Ride, RideSizer
from specmesh.core.rounds import draft_draws, verify_rounds
from specmesh.core.sampling import SamplingParams, argmax_rows
from specmesh.core.tree import DraftTree
from specmesh.core.verification import Verdict
from specmesh.runtime.backend import Step

# steps of one forward -> per step its logits or the exception that failed it alone
ForwardSteps = Generator[list[Step], list["torch.Tensor | BaseException"], list]
# a grammar's rows: (paths below the committed tokens) -> allowed [len(paths), V] bool
Allowed = Callable[[list[Path]], torch.Tensor]


class Cancelled(Exception):
    """The job's caller went away or superseded it: it stopped before its next forward."""


# ---- drafter -----------------------------------------------------------------------------------


@dataclass
class DraftJob:
    """One session's draft in a tick."""

    session_id: str
    feed: list[int]  # committed tokens the drafter has not run yet (the root step's new tokens)
    spec: TreeSpec
    params: SamplingParams
    seed: int
    committed_length: int  # committed tokens once `feed` is in: the round's randomness
    guess_next: bool = False  # also run the likely leaf: the next round's pre-draft guess
    allowed: Allowed | None = None  # structured output: every level's rows masked
    cancelled: bool = False  # set from outside: the job stops before its next forward
    salt: bytes = b""  # the prefix cache's namespace of a session it starts
    feed_limit: int | None = None  # chunked prefill: the most tokens its root step feeds
    nodes: dict[Path, int] = field(default_factory=dict)  # out: path -> the runner's pending node
    forwards: int = 0  # out: forwards the job took part in


@dataclass
class DraftOutcome:
    tree: DraftTree | None = None
    likely: list[int] = field(default_factory=list)  # guess_next: the likely path, then the guess
    error: BaseException | None = None
    partial: bool = False  # its root step fed a chunk of its tokens only: no tree


def draft_steps(jobs: Sequence[DraftJob]) -> ForwardSteps:
    """The drafts of a tick: one forward per tree level for every job (core.drafting.draft_many),
    then one more for the jobs that guess the next round's start. A job whose step fails, or that
    is cancelled between levels, drops out alone."""
    outcomes = [DraftOutcome() for _ in jobs]
    if not jobs:
        return outcomes
    levels = draft_many([j.spec for j in jobs], [j.params for j in jobs],
                        [draft_draws(j.seed, j.committed_length) for j in jobs])  # fmt: skip
    wants, trees = next(levels), None
    while trees is None:
        for b, paths in enumerate(wants):
            if paths and jobs[b].cancelled and outcomes[b].error is None:
                outcomes[b].error = Cancelled("the caller cancelled the draft")
        done = [outcomes[b].error is not None or outcomes[b].partial for b in range(len(jobs))]
        live = [b for b, paths in enumerate(wants) if paths and not done[b]]
        logits: list[torch.Tensor | None] = [None] * len(jobs)  # None: the tree is dropped
        if live:
            rows = [_level_step(jobs[b], wants[b]) for b in live]
            results = yield [step for step, _ in rows]
            for b, (step, pick), out in zip(live, rows, results, strict=True):
                jobs[b].forwards += 1
                if isinstance(out, BaseException):
                    outcomes[b].error = out
                    continue
                if _partial(step, out):
                    outcomes[b].partial = True
                    continue
                out = out[pick]
                allowed = jobs[b].allowed
                logits[b] = mask_logits(out, allowed(wants[b])) if allowed is not None else out
        try:
            wants = levels.send(logits)
        except StopIteration as done:
            trees = done.value
    for b, tree in enumerate(trees):
        if outcomes[b].error is None and not outcomes[b].partial:
            outcomes[b].tree = tree
    yield from _guess_next(jobs, outcomes)
    return outcomes


def _level_step(job: DraftJob, paths: list[Path]) -> tuple[Step, list[int]]:
    """The runner step that gives `paths` their logits, and which of its rows is whose: the root
    feeds the new tokens; a level appends the paths' last tokens under their cached parents (i.i.d.
    siblings can repeat a path: each distinct path runs once)."""
    if paths == [()]:
        return Step(job.session_id, new_tokens=list(job.feed), feed_limit=job.feed_limit, salt=job.salt), [0]
    unique = list(dict.fromkeys(paths))
    base = len(job.nodes)
    parents = [job.nodes[p[:-1]] if len(p) > 1 else -1 for p in unique]
    job.nodes.update((p, base + i) for i, p in enumerate(unique))
    step = Step(job.session_id, node_tokens=[p[-1] for p in unique], node_parents=parents)
    return step, [job.nodes[p] - base for p in paths]


def _guess_next(jobs: Sequence[DraftJob], outcomes: list[DraftOutcome]) -> ForwardSteps:
    """Run each guessing job's likely leaf (kept pending like the tree's nodes) and answer its path's
    tokens plus the draft's most likely next token: what the next round's pre-draft assumes.
    Nothing when the leaf already ran (its logits are gone)."""
    guesses = []
    for job, out in zip(jobs, outcomes, strict=True):
        if not job.guess_next or out.tree is None or job.cancelled:
            continue
        path = likely_path(out.tree)
        tokens = tuple(out.tree.path(path[-1])) if path else ()
        if tokens and tokens not in job.nodes:
            guesses.append((job, out, tokens))
    if not guesses:
        return
    steps = []
    for job, _, tokens in guesses:
        parent = job.nodes[tokens[:-1]] if len(tokens) > 1 else -1
        job.nodes[tokens] = len(job.nodes)
        steps.append(Step(job.session_id, node_tokens=[tokens[-1]], node_parents=[parent]))
    results = yield steps
    for (job, out, tokens), logits in zip(guesses, results, strict=True):
        job.forwards += 1
        if isinstance(logits, BaseException):
            out.error, out.tree = logits, None
        else:
            out.likely = [*tokens, *argmax_rows(logits[-1:])]


def level_forwards(
    runner_forward: Callable[[Step], torch.Tensor],
    session_id: str,
    new_tokens: list[int],
    nodes: dict[Path, int],
) -> NextLogits:
    """A model-backed `next_logits` for core.drafting.build_tree (one session, one draft forward per
    tree level): what `draft_steps` does for a tick, for callers that drive one tree themselves."""
    job = DraftJob(session_id, list(new_tokens), TreeSpec(), SamplingParams(), 0, 0, nodes=nodes)

    def next_logits(paths: list[Path]) -> torch.Tensor:
        step, pick = _level_step(job, paths)
        return runner_forward(step)[pick]

    return next_logits


def reusable_nodes(pending: dict[Path, int], new_tokens: list[int]) -> list[int]:
    """The pending nodes to commit: those whose paths are proper prefixes of new_tokens, root first."""
    keep = []
    for end in range(1, len(new_tokens)):
        node = pending.get(tuple(new_tokens[:end]))
        if node is None:
            break
        keep.append(node)
    return keep


# ---- verifier ----------------------------------------------------------------------------------


@dataclass
class VerifyJob:
    """One session's verification in a tick (and its further plain steps)."""

    session_id: str
    new_tokens: list[int]  # committed tokens the verifier has not run yet
    tree: DraftTree | None  # None: plain decoding
    params: SamplingParams
    seed: int
    committed_length: int  # committed tokens once `new_tokens` are in
    plain_steps: int = 1  # no tree: tokens to decode in this call (stops after a stop token)
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None
    allowed: Allowed | None = None  # grammar: paths below the runner's committed tokens -> rows
    cancelled: bool = False  # set from outside: no further plain step
    yielded: bool = False  # set from outside: a prefill chunk came; the run answers after this step
    # plain steps: (committed tokens before `after`, after = the step's fed tokens, depth) -> the
    # step's proposal (core.rides: its nodes' estimated probabilities, depth at most `depth`), or
    # None; called on the thread that builds the step
    ride: Callable[[int, list[int], int], Ride | None] | None = None
    lookup_depth: int = 0  # the deepest ride
    room: int | None = None  # tokens the call may emit: the model's context, the request's max_tokens
    salt: bytes = b""  # the prefix cache's namespace of a session it starts
    feed_limit: int | None = None  # chunked prefill: the most tokens its first step feeds


@dataclass
class VerifyOutcome:
    verdict: Verdict | None = None  # the last step's
    plain_tokens: list[int] = field(default_factory=list)  # decoded by the steps before it
    logprobs: list[TokenLogprob] = field(default_factory=list)  # every step's, in token order
    error: BaseException | None = None
    steps: int = 0  # forwards it took part in
    emitted: int = 0  # tokens its verdicts emitted (plain_tokens and the last verdict's)
    checked: list[tuple[int, int]] = field(default_factory=list)  # per step: (tree nodes, accepted)
    ride_depths: list[int] = field(default_factory=list)  # every ridden node's depth (for the metrics)
    partial: bool = False  # its first step fed a chunk of its tokens only: no verdict

    @property
    def rides(self) -> tuple[int, int]:
        """A plain run's n-gram rides: (nodes checked, accepted) over its steps."""
        return sum(n for n, _ in self.checked), sum(a for _, a in self.checked)


def verify_steps(
    jobs: Sequence[VerifyJob], commit: Callable[[str, list[int]], None], sizer: RideSizer | None = None
) -> ForwardSteps:
    """Verify every job's tree (or take its plain step) in one forward, commit each session's
    accepted path (`commit(session, nodes)`, on the model thread), then run further plain steps
    for the jobs that asked for them, each fed the token the step before decoded. A forward's
    rides are sized together by `sizer` (core.rides; None: each rides whole), and teach its
    calibration."""
    outcomes = [VerifyOutcome() for _ in jobs]
    feed = {b: list(j.new_tokens) for b, j in enumerate(jobs)}
    rides = {b: _ride(j, feed[b], 0) for b, j in enumerate(jobs)}  # proposed, before sizing
    live = list(range(len(jobs)))
    while live:
        kept = _size_rides(jobs, [outcomes[b].steps == 0 for b in live], live, feed, rides, sizer)
        trees = {b: jobs[b].tree if jobs[b].tree is not None else _tree(kept[b]) for b in live}
        steps = []
        for b in live:
            tree = trees[b]
            nodes = (tree.tokens.tolist(), tree.parents.tolist()) if tree is not None else ([], [])
            limit = jobs[b].feed_limit if outcomes[b].steps == 0 else None
            steps.append(Step(jobs[b].session_id, feed[b], *nodes, feed_limit=limit, salt=jobs[b].salt))
        results = yield steps
        ok = []
        for b, step, out in zip(live, steps, results, strict=True):
            outcomes[b].steps += 1
            if isinstance(out, BaseException):
                outcomes[b].error = out
            elif _partial(step, out):
                outcomes[b].partial = True
            else:
                ok.append((b, out))
        if ok:
            logits = [_grammar_rows(jobs[b], trees[b], out) for b, out in ok]
            verdicts = verify_rounds(
                [trees[b] for b, _ in ok], logits, [jobs[b].params for b, _ in ok],
                [jobs[b].seed for b, _ in ok],
                [jobs[b].committed_length + outcomes[b].emitted for b, _ in ok],  # each root's position
                [jobs[b].top_logprobs for b, _ in ok],
            )  # fmt: skip
            for (b, _), verdict in zip(ok, verdicts, strict=True):
                try:
                    commit(jobs[b].session_id, verdict.accepted_nodes)
                except Exception as exc:  # this session fails alone
                    outcomes[b].error = exc
                    continue
                _record_step(outcomes[b], trees[b], rides[b], verdict, sizer)
        live = [b for b in live if _continues(jobs[b], outcomes[b])]
        for b in live:
            feed[b] = [outcomes[b].verdict.next_token]  # type: ignore[union-attr]
            rides[b] = _ride(jobs[b], feed[b], outcomes[b].emitted)
    return outcomes


def _record_step(
    out: VerifyOutcome, tree: DraftTree | None, ride: Ride | None, verdict: Verdict, sizer: RideSizer | None
) -> None:
    """One step's verdict into its job's outcome; a proposal (all of it, ridden or cut) and what
    the step emitted into the sizer's calibration."""
    if out.verdict is not None:
        out.plain_tokens += out.verdict.emitted_tokens
    out.verdict = verdict
    out.emitted += len(verdict.emitted_tokens)
    out.checked.append((tree.num_nodes if tree is not None else 0, len(verdict.accepted_nodes)))
    out.logprobs += verdict.logprobs
    if ride is not None:
        out.ride_depths += tree.depths().tolist() if tree is not None else []
        if sizer is not None:
            sizer.calibration.observe(ride, verdict.emitted_tokens)


def _size_rides(
    jobs: Sequence[VerifyJob], first: list[bool], live: list[int], feed: dict[int, list[int]],
    rides: dict[int, Ride | None], sizer: RideSizer | None,
) -> dict[int, Ride | None]:  # fmt: skip
    """The next forward's rides, cut together to what pays (core.rides.sized): the forward's steps
    and its rows without rides (fed tokens, drafted trees) price every node."""
    proposed = [rides[b] for b in live]
    if sizer is None or not any(r is not None for r in proposed):
        return dict(zip(live, proposed, strict=True))
    rows = 0
    for b, is_first in zip(live, first, strict=True):
        job = jobs[b]
        limit = job.feed_limit if is_first else None  # a prefill chunk feeds at most this many
        rows += min(len(feed[b]), limit) if limit else len(feed[b])
        rows += job.tree.num_nodes if job.tree is not None else 0
    return dict(zip(live, sizer.size(proposed, len(live), rows), strict=True))


def _tree(ride: Ride | None) -> DraftTree | None:
    return ride.tree() if ride is not None else None


def _ride(job: VerifyJob, feed: list[int], emitted: int) -> Ride | None:
    """A plain step's proposal (None: a plain step): at most lookup_depth deep, none past the
    call's room. Not with a grammar: its masks follow a tree's paths the lookup knows nothing of."""
    if job.ride is None or job.tree is not None or job.allowed is not None or job.cancelled:
        return None
    depth = job.lookup_depth
    if job.room is not None:
        depth = min(depth, job.room - emitted - 1)
    if depth < 1:
        return None
    before = job.committed_length + emitted - len(feed)  # committed tokens before this step's feed
    return job.ride(before, feed, depth)


def _continues(job: VerifyJob, out: VerifyOutcome) -> bool:
    """Whether a plain job takes another step in this call: its steps are not all taken, and
    `_goes_on` (whatever a cancelled or yielded job's run could do, it takes no further step)."""
    return out.steps < job.plain_steps and not (job.cancelled or job.yielded) and _goes_on(job, out)


def _partial(step: Step, logits: torch.Tensor) -> bool:
    """Whether a step with a feed limit came back partial: no rows where a whole one has some."""
    return step.feed_limit is not None and logits.shape[0] == 0 and bool(step.new_tokens)


def _goes_on(job: VerifyJob, out: VerifyOutcome) -> bool:
    """Whether a plain run may decode past its last step: no error, no stop token, room left."""
    if out.error is not None or out.verdict is None or job.tree is not None:
        return False
    if job.room is not None and out.emitted >= job.room:
        return False
    return not any(t in job.stop_token_ids for t in out.verdict.emitted_tokens)


def next_plain_job(job: VerifyJob, out: VerifyOutcome) -> VerifyJob | None:
    """The first step of the call that goes on decoding where this plain call ended: fed its last
    token, same settings, one step. A verifier runs it while the answer travels (the overlap);
    its draws are keyed by the root's position as any step's, so it decodes exactly what that
    call would. None where the run ended (a stop token, no room, an error) or took a grammar
    (its masks follow state outside the job). Worked example: a call with committed_length 10
    emits [a, b, c] (a ride accepted a, then b, then the bonus c); the runner holds 12 tokens
    (c is not fed yet), so the next job feeds [c] at committed_length 13, its room 3 smaller."""
    if job.allowed is not None or not _goes_on(job, out):
        return None
    assert out.verdict is not None
    return replace(
        job, new_tokens=[out.verdict.next_token], committed_length=job.committed_length + out.emitted,
        plain_steps=1, room=None if job.room is None else job.room - out.emitted,
        cancelled=False, yielded=False,
    )  # fmt: skip


def joined(first: VerifyOutcome, then: VerifyOutcome) -> VerifyOutcome:
    """One call's outcome from a step run ahead of it (`first`, next_plain_job's) and the steps it
    then took itself, fed first's last token."""
    if then.error is not None or first.verdict is None:
        return then
    return VerifyOutcome(
        verdict=then.verdict,
        plain_tokens=[*first.plain_tokens, *first.verdict.emitted_tokens, *then.plain_tokens],
        logprobs=first.logprobs + then.logprobs,
        steps=first.steps + then.steps,
        emitted=first.emitted + then.emitted,
        checked=first.checked + then.checked,
        ride_depths=first.ride_depths + then.ride_depths,
    )


def _grammar_rows(job: VerifyJob, tree: DraftTree | None, logits: torch.Tensor) -> torch.Tensor:
    """Every row masked after its own path (structured output), else as it is."""
    if job.allowed is None:
        return logits
    paths = tree_paths(tree.parents.tolist(), tree.tokens.tolist()) if tree is not None else [()]
    return mask_logits(logits[: len(paths)], job.allowed(paths))


def plain_room(plain_steps: int, committed_length: int, max_context: int | None) -> int:
    """Plain steps a call may take: no token past the model's context."""
    room = plain_steps if max_context is None else max_context - committed_length + 1
    return max(1, min(plain_steps, room))


def run_ticked(ticked: ForwardSteps, forward: Callable[[list[Step]], list[torch.Tensor]]) -> list:
    """Drive a step protocol with a runner's forward (the in-process engine): a forward that fails
    fails every step in it."""
    try:
        steps = next(ticked)
        while True:
            try:
                results: list = list(forward(steps))
            except Exception as exc:
                results = [exc] * len(steps)
            steps = ticked.send(results)
    except StopIteration as done:
        return done.value
