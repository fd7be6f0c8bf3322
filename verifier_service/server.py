"""The verifier service: `Verify` checks one session's tree against the target model.

Concurrent Verify calls from different sessions are merged by the shared ForwardBatcher into one
target forward (limits: --max-batch-size, --max-batch-tokens, --max-wait-ms) and split again.
Right after the forward, still on the model thread, each session gets its verdict and its KV is
compacted to the accepted path (specmesh.runtime.rounds.verify_and_commit, the same rule as the
in-process engine), so a session's state never holds half a round. A session has at most one
request in flight (a second gets ABORTED), which keeps its rounds in order.
"""

from __future__ import annotations

import functools

import grpc
import torch

from specmesh.core.tree import DraftTree
from specmesh.core.verification import Verdict
from specmesh.rpc import wire
from specmesh.rpc.metrics import RoundMetrics, count_labels
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.server import rpc
from specmesh.runtime.models import LoadedModel
from specmesh.runtime.rounds import verify_and_commit
from specmesh.runtime.runner import Step
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
            "specmesh_draft_tokens_per_depth",
            "verified tree nodes by depth (1 = children of the root)",
            "depth",
        )

    @rpc
    async def Verify(
        self, request: pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb2.VerifyResponse:
        v = wire.parse_verify_request(request, self.vocab_size, self.limits)
        resume = self.begin(v, context)
        tree = v.tree
        nodes, parents = (tree.tokens.tolist(), tree.parents.tolist()) if tree is not None else ([], [])
        work = self.batcher.enqueue(
            Step(v.session_id, v.new_tokens, nodes, parents),
            before=self.reset(v.session_id, resume, v.position),
            finish=functools.partial(self._decide, v),
        )
        withdraw = functools.partial(self.batcher.withdraw, work)
        verdict, batch = await self.settle(v.session_id, resume, context, work, withdraw)
        self._record(tree, verdict)
        return wire.verdict_to_proto(
            verdict,
            batch_size=batch.size,
            batch_tokens=batch.tokens,
            forward_seconds=batch.forward_seconds,
            queue_seconds=batch.queue_seconds,
        )

    def _decide(self, v: wire.VerifyInput, logits: torch.Tensor) -> Verdict:
        """On the model thread, right after the forward: the verdict, then KV compaction."""
        return verify_and_commit(
            self.runner, v.session_id, v.tree, logits, v.params, v.params.seed, v.committed_length
        )

    def _record(self, tree: DraftTree | None, verdict: Verdict) -> None:
        self._rounds.observe(tree.num_nodes if tree is not None else 0, len(verdict.accepted_nodes))
        if tree is not None:
            count_labels(self._per_depth, tree.depths().tolist())


def run(argv: list[str] | None = None) -> None:
    main(VerifierService, "python -m verifier_service", DEFAULTS, argv)
