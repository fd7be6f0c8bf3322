"""The verifier service: a tick of sessions' trees checked against the target model in one batched
tree-attention forward (specmesh.runtime.rounds.verify_steps, the same rule as the in-process
engine).

A caller's tick loop sends one `VerifyTick` per tick on its `Ticks` stream and gets one
`VerifyTickResult`; `Verify` is a tick of one item, through the same code. Concurrent ticks share
forwards through the ForwardBatcher (limits: --max-batch-size, --max-batch-tokens,
--max-wait-ms). Right after the forward, still on the model thread, every session gets its verdict
and its KV is compacted to the accepted path, so a session's state never holds half a round. A
session has at most one request in flight (a second gets ABORTED), which keeps its rounds in order.
Plain sessions may decode several tokens per tick (plain_steps); the tick is then a participant
of the batcher until its last step, so every session's next step makes the same batch.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from specmesh.core.grammar import TokenMask
from specmesh.core.ngram import NgramIndex
from specmesh.core.rides import SUFFIX_RIDE_DEPTH, SUFFIX_RIDE_NODES, Ride, RideSizer, ngram_ride
from specmesh.core.suffix import MAX_MATCH, SuffixIndex, best_proposal
from specmesh.core.tree import DraftTree
from specmesh.rpc import wire
from specmesh.rpc.metrics import RoundMetrics, count_labels
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.server import rpc
from specmesh.rpc.ticks import VerifyAnswer, VerifyResultMessage, VerifyTickMessage
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.rounds import (
    Cancelled,
    VerifyJob,
    VerifyOutcome,
    joined,
    plain_room,
    verify_steps,
)
from specmesh.services.config import VERIFIER_DEFAULTS
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
from verifier_service.run_ahead import RunAhead, Taken, after_step


@dataclass
class _Item:
    index: int
    verify: wire.VerifyInput  # what the call has left once a step run ahead of it is taken
    resume: Resume
    job: VerifyJob
    first: VerifyOutcome | None = None  # that step's


@dataclass
class _Begun:
    """A tick's calls once begun (`_begin_items`)."""

    items: list[_Item] = field(default_factory=list)  # to run
    befores: dict[str, Callable[[], None]] = field(default_factory=dict)  # session -> its reset
    completed: list[tuple[int, wire.VerifyInput, Resume]] = field(default_factory=list)  # ended ahead
    ahead_seconds: dict[int, float] = field(default_factory=dict)  # a run ahead -> its forwards' time


class VerifierService(ModelService, pb2_grpc.VerifierServicer):
    service_name = "Verifier"
    tick_method = "VerifyTick"
    tick_message = VerifyTickMessage

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        super().__init__(config, model, metrics)
        self._lookups: dict[str, NgramIndex] = {}  # sessions' n-gram indexes (plain steps' rides)
        # the mesh's finished outputs (the outputs log, --redis-url): suffix rides are looked up there
        gauge = metrics.gauge(
            "specmesh:verifier_suffix_tokens",
            "tokens of finished outputs the suffix rides look up (at most --suffix-tokens)",
        )
        self.learned = LearnedOutputs(SuffixIndex(config.suffix_tokens), config.redis_url, gauge)
        self._runs: dict[int, VerifyJob] = {}  # id -> a plain run of several steps, running (`_yield_runs`)
        self.rides = RideSizer({})  # priced by the forward cost `start` measures (core.rides)
        self.ahead = RunAhead(
            self,
            self.rides,
            metrics.counter(
                "specmesh:verifier_ahead_steps",
                "plain steps run ahead of their call (--run-ahead), by whether the next call took them",
                "outcome",
            ),
        )  # the steps run ahead of their calls (verifier_service/run_ahead.py)
        self._rounds = RoundMetrics(metrics)  # vLLM's spec-decode names, with the same meaning
        self._per_depth = metrics.counter(
            "specmesh:verifier_draft_tokens_per_depth",
            "verified tree nodes by depth (1 = children of the root)",
            "depth",
        )

    # ---- RPCs ----------------------------------------------------------------------------------

    @rpc
    async def Verify(
        self, request: pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb2.VerifyResponse:
        v = wire.parse_verify_request(request, self.vocab_size, self.limits)
        owner = self._owner(v.session_id, context)
        (out,), tick = await self.verify_items(
            [(v, owner)], abandoned=context.cancelled, ahead=self.config.run_ahead
        )
        if isinstance(out, BaseException):
            raise out
        verdict = out.verdict
        assert verdict is not None
        nodes, accepted = out.rides
        return wire.verdict_to_proto(
            verdict, out.plain_tokens, out.logprobs, ride_nodes=nodes, ride_accepted=accepted, **tick.stats
        )

    async def answer_tick(self, stream: TickStream, tick: VerifyTickMessage) -> VerifyResultMessage:
        items, trees = tick.items, tick.trees
        n = len(items)
        problems = trees.check(n, self.vocab_size)
        rows = trees.dense_rows() if len(trees.row_probs) else None
        steps, lookups, min_ngrams, max_tokens, suffix = (
            tick.plain_steps, tick.lookup_depth, tick.lookup_min_ngram, tick.max_tokens, tick.suffix_rides,
        )  # fmt: skip
        answers: list = [None] * n
        verifies, where = [], []
        positions, handles, feeds = items.positions.tolist(), items.handles.tolist(), items.feed.tolist()
        for i in range(n):
            try:
                o = stream.session(handles[i])
                if problems[i] is not None:
                    raise wire.WireError(
                        problems[i].field, str(problems[i]).removeprefix(f"{problems[i].field}: ")
                    )
                new = items.new_tokens.item(i).tolist()
                if not new:
                    raise wire.WireError(
                        "new_tokens", "must not be empty (the new tokens produce the root distribution)"
                    )
                tree = trees.tree(i, rows)
                plain = max(1, int(steps[i]))
                v = wire.VerifyInput(
                    session_id=o.session_id, position=positions[i], new_tokens=new, params=o.params,
                    grammar=o.grammar, tree=tree, plain_steps=plain, stop_token_ids=o.stop_token_ids,
                    top_logprobs=o.top_logprobs, lookup_depth=int(lookups[i]),
                    lookup_min_ngram=int(min_ngrams[i]), max_tokens=int(max_tokens[i]), salt=o.salt,
                    feed_limit=feeds[i] or None, suffix_rides=bool(suffix[i]),
                )  # fmt: skip
                wire.check_verify_input(v, self.limits)
                verifies.append((v, owner_hash(o.key)))
                where.append(i)
            except Exception as exc:
                answers[i] = self.failure("Verify", "", exc)

        outcomes, ran = await self.verify_items(
            verifies, on_start=stream.track(handles, where), ahead=self.config.run_ahead
        )
        for k, out in enumerate(outcomes):
            i = where[k]
            stream.answered(handles[i])
            if isinstance(out, BaseException):
                answers[i] = self.failure("Verify", verifies[k][0].session_id, out)
                continue
            if out.partial:  # a chunk of its prefill: the caller sends the rest
                answers[i] = self.prefilled(verifies[k][0].session_id, positions[i])
                continue
            verdict = out.verdict
            answers[i] = VerifyAnswer(
                tokens=[*out.plain_tokens, *verdict.emitted_tokens],
                plain=len(out.plain_tokens),
                accepted_nodes=list(verdict.accepted_nodes),
                bonus=verdict.bonus,
                logprobs=out.logprobs,
                rides=out.rides,
                cached=self.runner.reused_tokens(verifies[k][0].session_id) if positions[i] == 0 else 0,
            )
        return VerifyResultMessage(
            tick.id, answers, self.prefix_version(), self.metrics.kv_usage_now, **ran.stats
        )

    # ---- a tick's verifications ----------------------------------------------------------------

    async def verify_items(
        self,
        verifies: Sequence[tuple[wire.VerifyInput, bytes]],
        abandoned: Callable[[], bool] = lambda: False,
        on_start: Callable[[Sequence[tuple[int, VerifyJob]], TickRun], None] | None = None,
        ahead: bool = False,
    ) -> tuple[list[VerifyOutcome | BaseException], TickRun]:
        """The verdicts of a tick's verifications ((input, its caller's key hash) each): per item
        its VerifyOutcome or its exception; and the tick (its forwards' stats). ahead: the plain
        runs among them (2+ steps asked) go on with their next step before this returns."""
        out: list = [None] * len(verifies)
        masks: list = [None] * len(verifies)
        if any(v.grammar is not None for v, _ in verifies):
            asked = (self.grammar_masks(v) for v, _ in verifies)
            masks = await asyncio.gather(*asked, return_exceptions=True)
        begun = self._begin_items(verifies, masks, await self.ahead.take_many(verifies), out)
        items = begun.items
        tick = TickRun(self.batcher, [item.job for item in items])
        tick.forward_seconds += sum(begun.ahead_seconds.values())
        rounds: list[tuple[DraftTree | None, VerifyOutcome]] = []
        goes_on: list[tuple[wire.VerifyInput, VerifyJob, VerifyOutcome]] = []  # (call, job, outcome)
        for k, v, resume in begun.completed:
            self.end(v.session_id, resume, False, abandoned())
            rounds.append((None, out[k]))
            if ahead and v.plain_steps > 1 and not abandoned():
                goes_on.append((v, self._job(v, None), out[k]))  # the job that would have run it
        if on_start is not None and items:
            on_start([(item.index, item.job) for item in items], tick)
        outcomes = await self._run_items(tick, items, begun.befores) if items else []
        for item, outcome in zip(items, outcomes, strict=True):
            sid = item.verify.session_id
            gone = abandoned() or tick.abandoned or item.job.cancelled  # its caller dropped it
            if outcome.error is not None:
                nothing_ran = tick.withdrawn and outcome.steps == 0
                self.end(sid, item.resume, not nothing_ran, gone)
                out[item.index] = outcome.error
                continue
            whole = joined(item.first, outcome) if item.first is not None else outcome
            if not outcome.partial:
                rounds.append((item.verify.tree, whole))
            self.end(sid, item.resume, False, gone)
            out[item.index] = whole
            # not a yielded run: its next step would take a forward of its own before the chunk's
            if ahead and verifies[item.index][0].plain_steps > 1 and not gone and not item.job.yielded:
                goes_on.append((item.verify, item.job, outcome))
        self._record(rounds)
        await self.ahead.start(goes_on)
        return out, tick

    def _begin_items(
        self,
        verifies: Sequence[tuple[wire.VerifyInput, bytes]],
        masks: Sequence[Any],
        taken: Sequence[Taken | None],
        out: list,
    ) -> _Begun:
        """Begin each call (checked, its session held) as it stands after the step run ahead of
        it, if it took one (`taken`); a call that step ended has nothing left to run. A call that
        cannot begin gets its exception in `out`, as does one whose grammar mask failed."""
        begun = _Begun()
        for k, ((v, owner), mask, took) in enumerate(zip(verifies, masks, taken, strict=True)):
            first = None
            if took is not None:
                prior, first = took
                begun.ahead_seconds[id(prior.tick)] = prior.tick.forward_seconds  # once per run
                rest, done = after_step(v, first, prior.job)
                if done:  # the call is checked and holds its session as any call, with no step to take
                    try:
                        begun.completed.append((k, v, self.begin(replace(rest, new_tokens=[]), owner)))
                        out[k] = first
                    except Exception as exc:
                        out[k] = exc
                    continue
                v = rest
            try:
                if isinstance(mask, BaseException):
                    raise mask
                resume = self.begin(v, owner)
            except Exception as exc:
                out[k] = exc
                continue
            before = self.reset(v.session_id, resume, v.position)
            if before is not None:
                begun.befores[v.session_id] = before
            begun.items.append(_Item(k, v, resume, self._job(v, mask), first))
        return begun

    async def _run_items(
        self, tick: TickRun, items: Sequence[_Item], befores: dict[str, Callable[[], None]]
    ) -> list[VerifyOutcome]:
        """The items' forwards, one outcome each; on any exception every item's session is freed."""
        runs = self._yield_runs(items)
        try:
            try:
                ticked = verify_steps([item.job for item in items], self.runner.commit, self.rides)
                return await self.run_tick(tick, lambda: self.drive(tick, ticked, befores))
            except Withdrawn:
                return [VerifyOutcome(error=Cancelled("cancelled before its forward")) for _ in items]
        except BaseException:
            for item in items:
                self.end(item.verify.session_id, item.resume, True, True)
            raise
        finally:
            for job in runs:
                self._runs.pop(id(job), None)

    def _yield_runs(self, items: Sequence[_Item]) -> list[VerifyJob]:
        """A tick that starts a session or feeds a prefill chunk ends the plain runs already
        running after their current step (VerifyJob.yielded): the forwards from here on carry the
        chunk, and a run of 4 steps would hold its stream's tokens for 4 chunk forwards. Their
        callers' next ticks ask one step each beside the chunk (the tick loop's `_plain_steps`).
        -> this tick's own plain runs, now running."""
        if any(item.job.feed_limit is not None or item.verify.position == 0 for item in items):
            for job in self._runs.values():
                job.yielded = True
        runs = [item.job for item in items if item.job.plain_steps > 1]
        self._runs.update((id(job), job) for job in runs)
        return runs

    def _job(self, v: wire.VerifyInput, masks: TokenMask | None) -> VerifyJob:
        allowed = None
        if masks is not None and v.grammar is not None:
            start, sid = v.grammar.start, v.session_id

            def allowed(paths: list, masks: TokenMask = masks) -> object:
                # on the model thread after the forward: the runner holds this step's new tokens
                return masks.allowed((self.runner.committed_tokens(sid) or [])[start:], paths)

        max_context = self.runner.max_context
        room = [] if max_context is None else [max_context - v.committed_length + 1]
        room += [v.max_tokens] if v.max_tokens else []
        return VerifyJob(
            v.session_id, list(v.new_tokens), v.tree, v.params, v.params.seed or 0, v.committed_length,
            plain_steps=plain_room(v.plain_steps, v.committed_length, max_context),
            stop_token_ids=v.stop_token_ids, top_logprobs=v.top_logprobs, allowed=allowed,
            ride=functools.partial(self._ride, v) if v.lookup_depth or v.suffix_rides else None,
            lookup_depth=max(v.lookup_depth, self.suffix_depth if v.suffix_rides else 0),
            room=min(room, default=None), salt=v.salt, feed_limit=v.feed_limit,
        )  # fmt: skip

    @property
    def suffix_depth(self) -> int:
        return min(SUFFIX_RIDE_DEPTH, self.limits.max_depth)

    def _ride(self, v: wire.VerifyInput, before: int, after: list[int], depth: int) -> Ride | None:
        """A plain step's proposal after the session's first `before` committed tokens and `after`
        (the step's fed tokens): the n-gram chain of its own tokens (at most v.lookup_depth, from a
        match of at least v.lookup_min_ngram), or with v.suffix_rides the suffix tree of the
        mesh's outputs, whichever is expected to add more (core.rides). The session's n-gram index
        follows its committed tokens (rebuilt when they were rolled back); only this session's own
        request reads them, so any thread may call it."""
        tokens = self.runner.committed_tokens(v.session_id) or []
        chain = None
        if v.lookup_depth:
            index = self._lookups.setdefault(v.session_id, NgramIndex())
            index.sync(tokens[:before])
            proposal = index.propose(min(depth, v.lookup_depth), after, v.lookup_min_ngram)
            chain = ngram_ride(self.rides.calibration, proposal, self.vocab_size)
        if not v.suffix_rides:
            return chain
        context = [*tokens[max(0, before - MAX_MATCH) : before], *after]
        nodes = min(SUFFIX_RIDE_NODES, self.limits.max_tree_nodes)
        with self.learned.lock:
            found = best_proposal(self.learned.index, context, min(depth, self.suffix_depth), nodes)
        if found is None or not found.tokens:
            return chain
        calibration = self.rides.calibration
        tree = calibration.ride("suffix", found.tokens, found.parents, found.probs, self.vocab_size)
        return tree if chain is None or tree.expected > chain.expected else chain

    def forget_local(self, session_id: str) -> None:
        super().forget_local(session_id)
        self._lookups.pop(session_id, None)
        self.drop_own_work(session_id)

    def drop_own_work(self, session_id: str) -> None:
        self.ahead.drop(session_id)

    async def start(self) -> None:
        await super().start()
        self.rides.priced(self.forward_cost)
        self.learned.start()

    async def close(self) -> None:
        await self.learned.close()
        await self.ahead.close()
        await super().close()

    def _record(self, rounds: list[tuple[DraftTree | None, VerifyOutcome]]) -> None:
        """A tick's verifications (and their plain steps)."""
        counts, depths = [], []
        for tree, outcome in rounds:
            verdict = outcome.verdict
            assert verdict is not None
            counts += outcome.checked  # every step's, rides in plain steps included
            if tree is not None:
                depths += range(1, tree.num_nodes + 1) if tree.is_chain else tree.depths().tolist()
            depths += outcome.ride_depths
        self._rounds.observe_many(counts)
        count_labels(self._per_depth, depths)


def run(argv: list[str] | None = None) -> None:
    main(VerifierService, "python -m verifier_service", VERIFIER_DEFAULTS, argv)
