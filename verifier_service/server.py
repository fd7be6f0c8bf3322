"""The verifier service: `Verify` checks one session's tree against the target model.

Concurrent Verify calls from different sessions are merged by the shared ForwardBatcher into one
target forward (limits: --max-batch-size, --max-batch-tokens, --max-wait-ms) and split again.
Right after the forward, still on the model thread, each session gets its verdict and its KV is
compacted to the accepted path (specmesh.runtime.rounds.verify_and_commit, the same rule as the
in-process engine), so a session's state never holds half a round. A session has at most one
request in flight (a second gets ABORTED), which keeps its rounds in order.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from specmesh.core.grammar import TokenMask, constrain_rows, tree_paths
from specmesh.core.tree import DraftTree
from specmesh.core.verification import Verdict
from specmesh.rpc import wire
from specmesh.rpc.metrics import RoundMetrics, count_labels
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.server import rpc
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.rounds import verify_and_commit
from specmesh.runtime.runner import Step
from specmesh.services.batching import ForwardBatcher
from specmesh.services.metrics import ServiceMetrics
from specmesh.services.model_service import ModelService, ServiceConfig, main

DEFAULTS = {
    "model": "default-target",
    "port": 50062,
    "metrics_port": 9092,
    "max_wait_ms": 2.0,
}


class VerifierService(ModelService, pb2_grpc.VerifierServicer):
    service_name = "Verifier"

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        super().__init__(config, model, metrics)
        self._rounds = RoundMetrics(metrics)  # vLLM's spec-decode names, with the same meaning
        self._per_depth = metrics.counter(
            "specmesh:verifier_draft_tokens_per_depth",
            "verified tree nodes by depth (1 = children of the root)",
            "depth",
        )

    @rpc
    async def Verify(
        self, request: pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb2.VerifyResponse:
        v = wire.parse_verify_request(request, self.vocab_size, self.limits)
        masks = await self.grammar_masks(v)
        resume = self.begin(v, context)
        run = _Run(self.batcher, v, self.runner.max_context)
        before = self.reset(v.session_id, resume, v.position)
        decide = functools.partial(self._decide, masks)
        work = asyncio.ensure_future(run(before, decide, self._record))
        outcome = await self.settle(v.session_id, resume, context, work, run.withdraw)
        return wire.verdict_to_proto(
            outcome.verdict, outcome.plain_tokens, outcome.logprobs, **outcome.batch_stats
        )

    def _decide(
        self, masks: TokenMask | None, v: wire.VerifyInput, committed_length: int, logits: torch.Tensor
    ) -> Verdict:
        """On the model thread, right after the forward: the verdict, then KV compaction. masks:
        the session's grammar: every row masked after its own path first."""
        if masks is not None and v.grammar is not None:
            committed = self.runner.committed_tokens(v.session_id) or []
            tree = v.tree
            paths = tree_paths(tree.parents.tolist(), tree.tokens.tolist()) if tree is not None else [()]
            logits = constrain_rows(logits[: len(paths)], masks, committed[v.grammar.start :], paths)
        return verify_and_commit(
            self.runner, v.session_id, v.tree, logits, v.params, v.params.seed, committed_length,
            v.top_logprobs,
        )  # fmt: skip

    def _record(self, tree: DraftTree | None, verdict: Verdict) -> None:
        self._rounds.observe(tree.num_nodes if tree is not None else 0, len(verdict.accepted_nodes))
        if tree is not None:
            count_labels(self._per_depth, tree.depths().tolist())


def run(argv: list[str] | None = None) -> None:
    main(VerifierService, "python -m verifier_service", DEFAULTS, argv)


@dataclass
class _Outcome:
    verdict: Verdict  # the call's last step
    plain_tokens: list[int]  # tokens decoded by the steps before it (plain decoding)
    batch_stats: dict[str, float]
    logprobs: list  # every step's, when asked for (TokenLogprob, in token order)


class _Run:
    """One Verify call's forwards: the round, then, for plain decoding with plain_steps > 1, more
    plain steps, each fed the token the step before decoded, until plain_steps tokens, a stop
    token or the model's context. While it runs it is a participant of the batcher, so that
    every session's next step makes the same batch. `withdraw` stops it before its next forward."""

    def __init__(self, batcher: ForwardBatcher, v: wire.VerifyInput, max_context: int | None) -> None:
        """max_context: the model's; the call decodes no token past it."""
        self.batcher, self.v = batcher, v
        room = v.plain_steps if max_context is None else max_context - v.committed_length + 1
        self.steps = max(1, min(v.plain_steps, room))
        self.stopped = False
        self._item: asyncio.Future | None = None

    def withdraw(self) -> None:
        self.stopped = True
        if self._item is not None:
            self.batcher.withdraw(self._item)

    async def __call__(
        self,
        before: Callable[[], None] | None,
        decide: Callable[[wire.VerifyInput, int, torch.Tensor], Verdict],
        record: Callable[[DraftTree | None, Verdict], None],
    ) -> _Outcome:
        """before: on the model thread before the first forward; decide(v, committed length,
        logits): a step's verdict, on the model thread; record: a step's metrics."""
        batcher, v = self.batcher, self.v
        tokens, logprobs, new, forward_s, queue_s = [], [], v.new_tokens, 0.0, 0.0
        nodes, parents = (v.tree.tokens.tolist(), v.tree.parents.tolist()) if v.tree is not None else ([], [])
        if self.stopped:  # withdrawn before it began: nothing happened
            raise asyncio.CancelledError
        participant = self.steps > 1
        if participant:
            batcher.join()
        try:
            for i in range(self.steps):  # a tree comes with one step only (wire.parse_verify_request)
                self._item = batcher.enqueue(
                    Step(v.session_id, new, nodes, parents),
                    before=before if i == 0 else None,
                    finish=functools.partial(decide, v, v.committed_length + i),
                )
                verdict, batch = await self._item
                record(v.tree, verdict)
                forward_s, queue_s = forward_s + batch.forward_seconds, queue_s + batch.queue_seconds
                tokens.append(verdict.next_token)
                logprobs += verdict.logprobs
                new = [verdict.next_token]
                if self.stopped or verdict.next_token in v.stop_token_ids:
                    break
        finally:
            if participant:
                batcher.leave()
        stats = dict(
            batch_size=batch.size, batch_tokens=batch.tokens, forward_seconds=forward_s, queue_seconds=queue_s
        )
        return _Outcome(verdict, tokens[:-1], stats, logprobs)
