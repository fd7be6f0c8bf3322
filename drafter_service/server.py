"""The drafter service: `Draft` builds one tree per request with the engine's tree builders and
seeding (specmesh.core.rounds.draft_round); the level forwards of concurrent requests share one
ModelRunner.forward.

Every Draft runs `build_tree` in a builder thread (the builders ask for one level at a time,
synchronously). Each level goes through the shared ForwardBatcher, where every running builder is a
participant: a level forward starts as soon as all of them have asked for their next level (or
after --max-wait-ms), so sessions that arrive together draft in lockstep, one forward per level.

The drafter is never told the verdict: the next Draft's new tokens say what was committed, and
the pending nodes on that path are kept (specmesh.runtime.rounds, the same rule the in-process
engine follows). The compaction runs on the model thread right before the root forward.

Pipelined rounds (specmesh.core.ahead): a Draft with `guess_next` also runs its tree's likely leaf
and answers the path plus the draft's guess of the next token; the caller then sends those tokens
as a `speculative` Draft beside its Verify. A later Draft of the session cancels a speculative one
(or a `supersedable` one: DSI's drafts, which a rejection makes stale while they run) at its next
level forward (instead of ABORTED); what it had fed stays committed here, and a Draft
whose position is below what the drafter holds keeps the longest common prefix of the two and
feeds only the rest.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch

from specmesh.core.ahead import likely_path
from specmesh.core.drafting import Path
from specmesh.core.grammar import TokenMask, constrain_draft
from specmesh.core.methods import Method
from specmesh.core.ngram import draft_ngram
from specmesh.core.rounds import draft_round
from specmesh.core.tree import DraftTree
from specmesh.rpc import wire
from specmesh.rpc.metrics import count_labels
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.server import rpc
from specmesh.runtime.backend import Backend
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.rounds import level_forwards, reusable_nodes
from specmesh.runtime.runner import Step
from specmesh.services.batching import ForwardBatcher
from specmesh.services.metrics import ServiceMetrics
from specmesh.services.model_service import ModelService, RequestCancelled, Resume, ServiceConfig, main

DEFAULTS = {
    "model": "default-draft",
    "port": 50061,
    "metrics_port": 9091,
    "max_wait_ms": 10.0,
}


class _LevelForward:
    """`runner_forward` for level_forwards: every level goes through the shared batcher, the
    first one carries the compaction, and a cancelled request stops at its next level."""

    def __init__(
        self, batcher: ForwardBatcher, before: Callable[[], None], cancelled: threading.Event
    ) -> None:
        self._batcher, self._before, self._cancelled = batcher, before, cancelled
        self.calls = 0

    def __call__(self, step: Step) -> torch.Tensor:
        if self._cancelled.is_set():
            raise RequestCancelled("the caller cancelled the request")
        before, self._before = self._before, None
        self.calls += 1
        return self._batcher.run_threadsafe(step, before)


class DrafterService(ModelService, pb2_grpc.DrafterServicer):
    service_name = "Drafter"

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        super().__init__(config, model, metrics)
        self._builders = ThreadPoolExecutor(config.max_batch_size, thread_name_prefix="draft")
        self._pending: dict[str, dict[Path, int]] = {}  # session -> its pending tree: path -> node
        # session -> its speculative or supersedable Draft in flight: (its cancel flag, its work)
        self._supersedable: dict[str, tuple[threading.Event, asyncio.Future]] = {}
        self._drafts = metrics.counter("specmesh:drafter_drafts", "trees drafted")
        self._per_depth = metrics.counter(
            "specmesh:drafter_draft_tokens_per_depth",
            "drafted tree nodes by depth (1 = children of the root)",
            "depth",
        )
        self._reused = metrics.counter(
            "specmesh:drafter_reused_tokens", "committed tokens whose KV was kept from the pending tree"
        )

    async def close(self) -> None:
        await asyncio.to_thread(self._builders.shutdown)
        await super().close()

    def forget_local(self, session_id: str) -> None:
        super().forget_local(session_id)
        self._pending.pop(session_id, None)

    @rpc
    async def Draft(self, request: pb2.DraftRequest, context: grpc.aio.ServicerContext) -> pb2.DraftResponse:
        draft = wire.parse_draft_request(request, self.vocab_size, self.limits)
        self._check_method(draft.spec.method)
        # n-gram drafts are not masked: the verifier's mask rejects what leaves the grammar
        masks = await self.grammar_masks(draft) if draft.spec.method is not Method.NGRAM else None
        await self._supersede(draft.session_id, context)
        resume = self.begin(draft, context)
        if draft.speculative and resume is not Resume.CONTINUE:
            # A pre-draft overtaken by the real Draft (gRPC does not order two calls) would roll the
            # session back onto a guess: it only ever continues what the drafter holds.
            self.slots.free(draft.session_id)
            return pb2.DraftResponse(superseded=True)
        cancelled = threading.Event()
        try:
            job = self._builders.submit(self._draft, draft, resume, cancelled, masks)
        except BaseException:
            self.slots.free(draft.session_id)
            raise
        work = asyncio.wrap_future(job)
        if draft.superseded_by_next:
            sid = draft.session_id
            self._supersedable[sid] = (cancelled, work)
            work.add_done_callback(
                lambda w: self._supersedable.pop(sid) if self._supersedable.get(sid, (0, 0))[1] is w else None
            )

        def withdraw() -> None:
            cancelled.set()
            job.cancel()

        return await self.settle(draft.session_id, resume, context, work, withdraw)

    async def _supersede(self, session_id: str, context: grpc.aio.ServicerContext) -> None:
        """Stop the session's speculative or supersedable Draft, if one runs, and wait until it
        has stopped (at most its level forward in flight)."""
        running = self._supersedable.get(session_id)
        if running is None:
            return
        self._owner(session_id, context)  # only the session's own caller may cancel it
        cancelled, work = running
        cancelled.set()
        await asyncio.wait({work})
        await asyncio.sleep(0)  # settle's callback frees the session's slot

    def _check_method(self, method: Method) -> None:
        """A drafter with a model drafts with it; one with none (--backend ngram) looks up n-grams."""
        if self.model.backend is Backend.NGRAM and method is not Method.NGRAM:
            raise wire.WireError(
                "tree_spec.method",
                f"this drafter has no model (--backend ngram); it drafts 'ngram', not {method!r}",
            )
        if self.model.backend is not Backend.NGRAM and method is Method.NGRAM:
            raise wire.WireError(
                "tree_spec.method",
                "'ngram' is drafted by drafters started with --backend ngram, not this one",
            )

    def _draft(
        self, d: wire.DraftInput, resume: Resume, cancelled: threading.Event, masks: TokenMask | None
    ) -> pb2.DraftResponse:
        """In a builder thread: compact, build the tree level by level, encode it. masks: the
        session's grammar, applied to every level's rows."""
        start = time.perf_counter()
        sid = d.session_id
        # what the tree drafts after, for the grammar: before this call's forwards change the runner
        committed = (self.runner.committed_tokens(sid) or [])[: d.position] + d.new_tokens
        pending = self._pending.pop(sid, {})
        fed, compact = self._resume(d, resume, pending)
        if d.spec.method is Method.NGRAM:
            return self._draft_ngram(d, fed, compact, start)
        forward = _LevelForward(self.batcher, compact, cancelled)
        nodes: dict[Path, int] = {}
        self.loop.call_soon_threadsafe(self.batcher.join)
        try:
            next_logits = level_forwards(forward, sid, d.new_tokens[fed:], nodes)
            if masks is not None and d.grammar is not None:
                next_logits = constrain_draft(next_logits, masks, committed[d.grammar.start :])
            tree = draft_round(d.spec, next_logits, d.params, d.params.seed, d.committed_length)
            likely = _guess_next(forward, sid, tree, nodes) if d.guess_next else []
        except RequestCancelled:
            if not d.superseded_by_next:
                raise
            # Superseded: nothing ran (the pending tree stays) or what was fed stays committed
            # (the next Draft's position rolls it back); its half-built tree is dropped.
            self._pending[sid] = pending if forward.calls == 0 else {}
            return pb2.DraftResponse(superseded=True)
        finally:
            self.loop.call_soon_threadsafe(self.batcher.leave)
        self._pending[sid] = nodes
        self._record(tree, fed)
        return pb2.DraftResponse(
            tree=wire.tree_to_proto(tree),
            draft_calls=forward.calls,
            draft_seconds=time.perf_counter() - start,
            likely_token_ids=likely,
            tree_nodes=tree.num_nodes,
            tree_depth=int(tree.depths().max()),
        )

    def _draft_ngram(
        self, d: wire.DraftInput, fed: int, compact: Callable[[], None], start: float
    ) -> pb2.DraftResponse:
        """No model: record the new tokens and look the proposal up in the session's tokens (the
        token runner is thread-safe and computes nothing, so no batcher and no model thread)."""
        compact()
        self.runner.forward([Step(d.session_id, new_tokens=list(d.new_tokens[fed:]))])
        tokens = self.runner.committed_tokens(d.session_id) or []
        tree = draft_ngram(tokens, d.spec.depth, self.vocab_size)
        if tree is None:  # no match: an empty tree, the round is a plain step
            return pb2.DraftResponse(draft_seconds=time.perf_counter() - start)
        self._record(tree, fed)
        return pb2.DraftResponse(
            tree=wire.tree_to_proto(tree),
            draft_seconds=time.perf_counter() - start,
            tree_nodes=tree.num_nodes,
            tree_depth=tree.num_nodes,
        )

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

    def _record(self, tree: DraftTree, reused: int) -> None:
        self._drafts.inc()
        self._reused.inc(reused)
        count_labels(self._per_depth, tree.depths().tolist())


def _guess_next(
    forward: _LevelForward, session_id: str, tree: DraftTree, nodes: dict[Path, int]
) -> list[int]:
    """Run the tree's likely leaf (one more draft forward, kept pending like the tree's nodes) and
    return its path's tokens plus the draft's most likely next token: what the next round's
    pre-draft assumes. [] when the leaf already ran (its logits are gone): no pre-draft then."""
    path = likely_path(tree)
    tokens = tuple(tree.path(path[-1])) if path else ()
    if not tokens or tokens in nodes:
        return []
    parent = nodes[tokens[:-1]] if len(tokens) > 1 else -1
    logits = forward(Step(session_id, node_tokens=[tokens[-1]], node_parents=[parent]))
    nodes[tokens] = len(nodes)
    return [*tokens, int(logits[-1].argmax())]


def run(argv: list[str] | None = None) -> None:
    main(DrafterService, "python -m drafter_service", DEFAULTS, argv)
