"""The drafter service: trees for a tick of sessions (specmesh.runtime.rounds.draft_steps, the same
rule as the in-process engine), one draft forward per tree level for all of them.

A caller's tick loop sends one `DraftTick` per tick on its `Ticks` stream (every session it has
ready, in columns) and gets one `DraftTickResult`; `Draft` is a tick of one item, through the same
code. Concurrent ticks (other callers, DSI's drafts) share forwards through the ForwardBatcher:
every running tick is a participant, so a level forward starts as soon as all of them have asked
for their next level (or after --max-wait-ms).

The drafter is never told the verdict: the next draft's new tokens say what was committed, and the
pending nodes on that path are kept (specmesh.runtime.rounds.reusable_nodes). The compaction runs on
the model thread right before the tick's first forward.

Pipelined rounds (specmesh.core.ahead): a draft with `guess_next` also runs its tree's likely leaf
and answers the path plus the draft's guess of the next token; the caller then sends those tokens
as a `speculative` draft beside its verification. A later draft of the session cancels a
speculative one (or a `supersedable` one: DSI's drafts, which a rejection makes stale while they
run) at its next level forward (answered superseded) instead of being refused as busy; what it had
fed stays committed here, and a draft whose position is below what the drafter holds keeps the
longest common prefix of the two and feeds only the rest.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc

from specmesh.core.drafting import Path
from specmesh.core.grammar import TokenMask
from specmesh.core.methods import Method
from specmesh.core.suffix import SuffixDrafts, lookup_tree
from specmesh.core.tree import DraftTree
from specmesh.rpc import wire
from specmesh.rpc.metrics import count_labels
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.server import rpc
from specmesh.rpc.ticks import (
    GUESS_NEXT,
    SPECULATIVE,
    SUPERSEDABLE,
    DraftAnswer,
    DraftResultMessage,
    DraftTickMessage,
    ItemFailure,
    Prefilled,
)
from specmesh.runtime.backend import Backend
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.rounds import Cancelled, DraftJob, DraftOutcome, draft_steps, reusable_nodes
from specmesh.runtime.runner import Step
from specmesh.services.config import DRAFTER_DEFAULTS
from specmesh.services.learned import LearnedOutputs
from specmesh.services.metrics import ServiceMetrics
from specmesh.services.model_service import (
    ModelService,
    Resume,
    ServiceConfig,
    TickRun,
    TickStream,
    Withdrawn,
    main,
    owner_hash,
)


@dataclass
class _Item:
    """A draft of the tick whose session is reserved."""

    index: int
    draft: wire.DraftInput
    resume: Resume
    pending: dict[Path, int]  # the session's pending tree before this draft took it
    job: DraftJob
    fed: int  # new tokens the drafter already held (pending nodes kept)
    before: Callable[[], None]  # on the model thread before the first forward: keep / roll back / restart


SUPERSEDED = "superseded"  # a speculative / supersedable draft a later one stopped


class DrafterService(ModelService, pb2_grpc.DrafterServicer):
    service_name = "Drafter"
    tick_method = "DraftTick"
    tick_message = DraftTickMessage

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        super().__init__(config, model, metrics)
        self._pending: dict[str, dict[Path, int]] = {}  # session -> its pending tree: path -> node
        self._drafted: list[tuple[DraftTree, int]] = []  # this tick's trees, for the metrics
        # session -> its speculative or supersedable draft in flight: (its tick, its job, its end)
        self._supersedable: dict[str, tuple[TickRun, DraftJob, asyncio.Future]] = {}
        self._drafts = metrics.counter("specmesh:drafter_drafts", "trees drafted")
        self._per_depth = metrics.counter(
            "specmesh:drafter_draft_tokens_per_depth",
            "drafted tree nodes by depth (1 = children of the root)",
            "depth",
        )
        self._reused = metrics.counter(
            "specmesh:drafter_reused_tokens", "committed tokens whose KV was kept from the pending tree"
        )
        # a model-free drafter's suffix drafts: the finished outputs it learnt, within a budget
        model_free = model.backend is Backend.NGRAM
        self.suffix = SuffixDrafts(config.suffix_tokens) if model_free else None
        gauge = metrics.gauge(
            "specmesh:drafter_suffix_tokens",
            "tokens of finished outputs the suffix drafts look up (at most --suffix-tokens)",
        )
        self.learned = LearnedOutputs(self.suffix.shared, config.redis_url, gauge) if self.suffix else None

    async def start(self) -> None:
        await super().start()
        if self.learned is not None:
            self.learned.start()

    async def close(self) -> None:
        if self.learned is not None:
            await self.learned.close()
        await super().close()

    def forget_local(self, session_id: str) -> None:
        if self.learned is not None:  # a model-free drafter: it has suffix drafts
            assert self.suffix is not None
            # with the outputs log, the gateways publish what finished (all of the mesh's); without
            # it, the session's tokens here teach the shared index (unless it is private)
            tokens = None if self.learned.follows else self.runner.committed_tokens(session_id)
            with self.learned.lock:
                self.suffix.finish(session_id, tokens)
            self.learned.measure()
        super().forget_local(session_id)
        self._pending.pop(session_id, None)

    # ---- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Draft(self, request: pb2.DraftRequest, context: grpc.aio.ServicerContext) -> pb2.DraftResponse:
        start = time.perf_counter()
        draft = wire.parse_draft_request(request, self.vocab_size, self.limits)
        owner = self._owner(draft.session_id, context)
        (out,) = await self.draft_items([(draft, owner)], abandoned=context.cancelled)
        if isinstance(out, BaseException):
            raise out
        if out == SUPERSEDED:
            return pb2.DraftResponse(superseded=True)
        tree = out.tree
        if tree is None:  # an n-gram drafter found no match: an empty tree, the round is a plain step
            return pb2.DraftResponse(draft_seconds=time.perf_counter() - start)
        return pb2.DraftResponse(
            tree=wire.tree_to_proto(tree),
            draft_calls=out.forwards,
            draft_seconds=time.perf_counter() - start,
            likely_token_ids=out.likely,
            tree_nodes=tree.num_nodes,
            tree_depth=int(tree.depths().max()),
        )

    async def answer_tick(self, stream: TickStream, tick: DraftTickMessage) -> DraftResultMessage:
        start = time.perf_counter()
        items, specs, spec_index, flags = tick.items, tick.specs, tick.spec_index, tick.flags
        n = len(items)
        answers: list = [None] * n
        drafts, where = [], []
        positions, handles, feeds = items.positions.tolist(), items.handles.tolist(), items.feed.tolist()
        for i in range(n):
            try:
                o = stream.session(handles[i])
                spec = specs[int(spec_index[i])]
                if isinstance(spec, wire.WireError):
                    raise spec
                new = items.new_tokens.item(i).tolist()
                if not new:
                    raise wire.WireError(
                        "new_tokens", "must not be empty (the new tokens produce the root distribution)"
                    )
                f = int(flags[i])
                draft = wire.DraftInput(
                    session_id=o.session_id, position=positions[i], new_tokens=new, params=o.params,
                    grammar=o.grammar, spec=spec, guess_next=bool(f & GUESS_NEXT),
                    speculative=bool(f & SPECULATIVE), supersedable=bool(f & SUPERSEDABLE), salt=o.salt,
                    feed_limit=feeds[i] or None, private=o.private,
                )  # fmt: skip
                drafts.append((draft, owner_hash(o.key)))
                where.append(i)
            except Exception as exc:
                answers[i] = self.failure("Draft", "", exc)

        outcomes = await self.draft_items(drafts, on_start=stream.track(handles, where))
        for k, out in enumerate(outcomes):
            i = where[k]
            stream.answered(handles[i])
            if isinstance(out, BaseException):
                answers[i] = self.failure("Draft", drafts[k][0].session_id, out)
            elif out == SUPERSEDED:
                answers[i] = ItemFailure(grpc.StatusCode.CANCELLED.value[0], "superseded by a later draft")
            elif isinstance(out, Prefilled):  # a chunk of its prefill: the caller sends the rest
                answers[i] = out
            else:
                if positions[i] == 0:
                    out.cached = self.runner.reused_tokens(drafts[k][0].session_id)
                answers[i] = out
        return DraftResultMessage.of(
            tick.id, answers, self.vocab_size, seconds=time.perf_counter() - start,
            prefix_version=self.prefix_version(), kv_usage=self.metrics.kv_usage_now,
        )  # fmt: skip

    # ---- a tick's drafts -----------------------------------------------------------------------

    async def draft_items(
        self,
        drafts: Sequence[tuple[wire.DraftInput, bytes]],
        abandoned: Callable[[], bool] = lambda: False,
        on_start: Callable[[Sequence[tuple[int, DraftJob]], TickRun], None] | None = None,
    ) -> list[DraftAnswer | BaseException | str]:
        """The trees of a tick's drafts ((input, its caller's key hash) each): a DraftAnswer, the
        item's exception, or SUPERSEDED. abandoned(): whether the caller went away."""
        out: list = [None] * len(drafts)
        await self._supersede([d.session_id for d, _ in drafts])
        masks = await self._masks(drafts)
        items: list[_Item] = []
        befores: dict[str, Callable[[], None]] = {}
        lookups: list[_Item] = []
        for k, ((d, owner), mask) in enumerate(zip(drafts, masks, strict=True)):
            try:
                if isinstance(mask, BaseException):
                    raise mask
                self._check_method(d.spec.method)
                resume = self.begin(d, owner)
            except Exception as exc:
                out[k] = exc
                continue
            if d.speculative and resume is not Resume.CONTINUE:
                # A pre-draft overtaken by the real draft (two calls are not ordered) would roll the
                # session back onto a guess: it only ever continues what the drafter holds.
                self.slots.free(d.session_id)
                out[k] = SUPERSEDED
                continue
            item = self._start(k, d, resume, mask)
            befores[d.session_id] = item.before
            (lookups if d.spec.method.model_free else items).append(item)
        for item in lookups:  # no model: a lookup, on the loop
            out[item.index] = self._draft_lookup(item)
        if items:
            await self._run(items, befores, out, abandoned, on_start)
        drafted, self._drafted = self._drafted, []
        self._record(drafted)
        return out

    def _start(self, k: int, d: wire.DraftInput, resume: Resume, masks: TokenMask | None) -> _Item:
        sid = d.session_id
        pending = self._pending.pop(sid, {})
        fed, before = self._resume(d, resume, pending)
        allowed = None
        if masks is not None and d.grammar is not None:
            # what the tree drafts after: before this call's forwards change the runner
            committed = (self.runner.committed_tokens(sid) or [])[: d.position] + d.new_tokens
            allowed = functools.partial(masks.allowed, committed[d.grammar.start :])
        job = DraftJob(
            sid, list(d.new_tokens[fed:]), d.spec, d.params, d.params.seed or 0, d.committed_length,
            guess_next=d.guess_next, allowed=allowed, salt=d.salt, feed_limit=d.feed_limit,
        )  # fmt: skip
        return _Item(k, d, resume, pending, job, fed, before)

    async def _run(
        self,
        items: list[_Item],
        befores: dict[str, Callable[[], None]],
        out: list,
        abandoned: Callable[[], bool],
        on_start: Callable[[Sequence[tuple[int, DraftJob]], TickRun], None] | None,
    ) -> None:
        jobs = [item.job for item in items]
        tick = TickRun(self.batcher, jobs)
        ended = self.loop.create_future()
        for item in items:
            if item.draft.superseded_by_next:
                self._supersedable[item.draft.session_id] = (tick, item.job, ended)
        if on_start is not None:
            on_start([(item.index, item.job) for item in items], tick)
        try:
            try:
                outcomes = await self.run_tick(tick, lambda: self.drive(tick, draft_steps(jobs), befores))
            except Withdrawn:
                outcomes = [DraftOutcome(error=Cancelled("cancelled before its forward")) for _ in items]
            for item, outcome in zip(items, outcomes, strict=True):
                out[item.index] = self._settle(item, outcome, tick, abandoned())
        except BaseException:
            for item in items:
                self.end(item.draft.session_id, item.resume, True, True)
            raise
        finally:
            for item in items:
                if self._supersedable.get(item.draft.session_id, (None, None, None))[1] is item.job:
                    del self._supersedable[item.draft.session_id]
            ended.set_result(None)

    def _settle(
        self, item: _Item, outcome: DraftOutcome, tick: TickRun, abandoned: bool
    ) -> DraftAnswer | BaseException | str:
        sid, d = item.draft.session_id, item.draft
        if isinstance(outcome.error, Cancelled) and d.superseded_by_next and not abandoned:
            # Superseded: nothing ran (the pending tree stays) or what was fed stays committed (the
            # next draft's position rolls it back); its half-built tree is dropped.
            self._pending[sid] = item.pending if item.job.forwards == 0 else {}
            self.end(sid, item.resume, False, False)
            return SUPERSEDED
        gone = abandoned or tick.abandoned or item.job.cancelled  # its caller dropped it
        if outcome.error is not None:
            if item.job.forwards == 0 and tick.withdrawn:
                self._pending[sid] = item.pending  # nothing ran
                self.end(sid, item.resume, False, gone)
            else:
                self.end(sid, item.resume, True, gone)
            return outcome.error
        self._pending[sid] = item.job.nodes
        self.end(sid, item.resume, False, gone)
        if outcome.partial:  # a chunk of its prefill
            return self.prefilled(sid, d.position)
        self._drafted.append((outcome.tree, item.fed))
        return DraftAnswer(outcome.tree, outcome.likely, item.job.forwards)

    async def _supersede(self, session_ids: list[str]) -> None:
        """Stop these sessions' speculative or supersedable drafts, if any run, and wait until
        they have stopped (at most their level forward in flight)."""
        waits = []
        for sid in session_ids:
            running = self._supersedable.get(sid)
            if running is not None:
                tick, job, ended = running
                tick.cancel(job)
                waits.append(ended)
        if waits:
            await asyncio.wait(waits)

    async def _masks(self, drafts: Sequence[tuple[wire.DraftInput, bytes]]) -> list:
        """Each draft's grammar matcher, or None, or the error compiling it (lookups are not
        masked: the verifier's mask rejects what leaves the grammar)."""
        constrained = [d.grammar is not None and not d.spec.method.model_free for d, _ in drafts]
        if not any(constrained):
            return [None] * len(drafts)
        asked = [self.grammar_masks(d) for (d, _), c in zip(drafts, constrained, strict=True) if c]
        got = iter(await asyncio.gather(*asked, return_exceptions=True))
        return [next(got) if c else None for c in constrained]

    def _check_method(self, method: Method) -> None:
        """A drafter with a model drafts with it; one with none (--backend ngram) looks drafts up
        (methods ngram and suffix)."""
        if self.model.backend is Backend.NGRAM and not method.model_free:
            raise wire.WireError(
                "tree_spec.method",
                f"this drafter has no model (--backend ngram): it drafts 'ngram' and 'suffix', "
                f"not {method!r}",
            )
        if self.model.backend is not Backend.NGRAM and method.model_free:
            raise wire.WireError(
                "tree_spec.method",
                f"{method!r} is drafted by drafters started with --backend ngram, not this one",
            )

    def _draft_lookup(self, item: _Item) -> DraftAnswer | BaseException:
        """No model: record the new tokens and look the proposal up in the session's tokens (and,
        for suffix drafts, in the outputs of finished sessions). The token runner is thread-safe
        and computes nothing, so no batcher and no model thread."""
        d, sid = item.draft, item.draft.session_id
        try:
            item.before()
            self.runner.forward([Step(sid, new_tokens=list(d.new_tokens[item.fed :]))])
            assert self.suffix is not None  # a model-free drafter (_check_method)
            tokens = self.runner.committed_tokens(sid) or []
            tree = lookup_tree(self.suffix, sid, tokens, d.spec, self.vocab_size, d.private)
        except Exception as exc:
            self.end(sid, item.resume, True, False)
            return exc
        self._pending[sid] = {}
        if tree is not None:
            self._drafted.append((tree, item.fed))
        self.end(sid, item.resume, False, False)
        return DraftAnswer(tree, [], 0)

    def _resume(
        self, d: wire.DraftInput, resume: Resume, pending: dict[Path, int]
    ) -> tuple[int, Callable[[], None]]:
        """(how many of the new tokens the drafter already holds, what runs on the model thread
        before the first forward). CONTINUE: the pending nodes on the new tokens' path are kept.
        ROLLBACK (a pre-draft that did not apply, DSI): the committed tokens past `position` that
        agree with the new tokens are kept, the rest dropped. The last new token is always fed."""
        sid = d.session_id
        if resume is Resume.CONTINUE:
            keep = reusable_nodes(pending, d.new_tokens)
            return len(keep), functools.partial(self.runner.commit, sid, keep)
        if resume is Resume.ROLLBACK:
            held = (self.runner.committed_tokens(sid) or [])[d.position :]
            same = 0
            while same < min(len(held), len(d.new_tokens) - 1) and held[same] == d.new_tokens[same]:
                same += 1
            return same, functools.partial(self.runner.truncate, sid, d.position + same)
        reset = self.reset(sid, resume, d.position)
        assert reset is not None
        return 0, reset

    def _record(self, trees: list[tuple[DraftTree, int]]) -> None:
        """A tick's trees, each with the committed tokens whose KV was kept for it."""
        if not trees:
            return
        self._drafts.inc(len(trees))
        self._reused.inc(sum(reused for _, reused in trees))
        count_labels(self._per_depth, (d for tree, _ in trees for d in _depths(tree)))


def _depths(tree: DraftTree) -> Iterable[int]:
    return range(1, tree.num_nodes + 1) if tree.is_chain else tree.depths().tolist()


def run(argv: list[str] | None = None) -> None:
    main(DrafterService, "python -m drafter_service", DRAFTER_DEFAULTS, argv)
