"""The verifier service: `Verify` checks one session's tree against the target model.

Concurrent Verify calls from different sessions are merged by the shared ForwardBatcher into one
target forward (limits: --max-batch-size, --max-batch-tokens, --max-wait-ms) and split again.
Right after the forward, still on the model thread, each session gets its verdict
(`verify_tree` with `derive_generator(seed, committed length, "verify")`, or a plain sample from
the root row for an empty tree) and its KV is compacted to the accepted path, so a session's state
never holds half a round. A session has at most one request in flight (a second gets ABORTED),
which keeps its rounds in order.
"""

from __future__ import annotations

import functools

import grpc
import torch

from specmesh import wire
from specmesh.models import LoadedModel
from specmesh.proto import pb2, pb2_grpc
from specmesh.runtime import Step
from specmesh.sampling import derive_generator
from specmesh.serving import ModelService, ServiceConfig, ServiceMetrics, count_labels, main, rpc
from specmesh.tree import DraftTree
from specmesh.verification import Verdict, autoregressive_step, verify_tree

DEFAULTS = {"model": "default-target", "port": 50062, "max_wait_ms": 2.0}


class VerifierService(ModelService, pb2_grpc.VerifierServicer):
    service_name = "Verifier"

    def __init__(self, config: ServiceConfig, model: LoadedModel, metrics: ServiceMetrics) -> None:
        super().__init__(config, model, metrics)
        m = metrics
        self._rounds = m.counter(
            "specmesh_rounds", "verification rounds (one per session per target forward)"
        )
        self._emitted = m.counter("specmesh_emitted_tokens", "tokens committed: accepted + 1 per round")
        # vLLM's spec-decode metric names, with the same meaning
        self._drafts = m.counter("spec_decode_num_drafts", "draft trees verified")
        self._draft_tokens = m.counter("spec_decode_num_draft_tokens", "drafted tokens verified (tree nodes)")
        self._accepted = m.counter("spec_decode_num_accepted_tokens", "drafted tokens accepted")
        self._accepted_per_pos = m.counter(
            "spec_decode_num_accepted_tokens_per_pos", "accepted tokens by position (0 = depth 1)", "position"
        )
        self._per_depth = m.counter(
            "specmesh_draft_tokens_per_depth",
            "verified tree nodes by depth (1 = children of the root)",
            "depth",
        )

    @rpc
    async def Verify(
        self, request: pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> pb2.VerifyResponse:
        v = wire.parse_verify_request(request, self.vocab_size, self.limits)
        continuing = self.begin(v.session_id, v.position)
        tree = v.tree
        nodes, parents = (tree.tokens.tolist(), tree.parents.tolist()) if tree is not None else ([], [])
        work = self.batcher.enqueue(
            Step(v.session_id, v.new_tokens, nodes, parents),
            before=None if continuing else functools.partial(self.runner.release, v.session_id),
            finish=functools.partial(self._decide, v),
        )
        verdict, batch = await self.settle(v.session_id, work, functools.partial(self.batcher.withdraw, work))
        self._record(tree, verdict)
        return wire.verdict_to_proto(
            verdict,
            batch_size=batch.size,
            forward_seconds=batch.forward_seconds,
            queue_seconds=batch.queue_seconds,
        )

    def _decide(self, v: wire.VerifyInput, logits: torch.Tensor) -> Verdict:
        """On the model thread, right after the forward: the verdict, then KV compaction."""
        generator = derive_generator(v.params.seed, v.committed_length, "verify")
        if v.tree is None:
            verdict = autoregressive_step(logits[0], v.params, generator)
        else:
            verdict = verify_tree(v.tree, logits, v.params, generator)
        self.runner.commit(v.session_id, verdict.accepted_nodes)
        return verdict

    def _record(self, tree: DraftTree | None, verdict: Verdict) -> None:
        accepted = len(verdict.accepted_nodes)
        self._rounds.inc()
        self._emitted.inc(accepted + 1)
        if tree is None:
            return
        self._drafts.inc()
        self._draft_tokens.inc(tree.num_nodes)
        self._accepted.inc(accepted)
        count_labels(self._accepted_per_pos, range(accepted))
        count_labels(self._per_depth, tree.depths().tolist())


def run(argv: list[str] | None = None) -> None:
    main(VerifierService, "python -m verifier_service", DEFAULTS, argv)
