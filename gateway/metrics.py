"""The gateway's Prometheus metrics (docs/gateway.md); the registry comes from specmesh.serving."""

from __future__ import annotations

from specmesh.serving import TIME_BUCKETS, RpcMetrics
from specmesh.stats import GenerationStats

_ROUND_BUCKETS = (*TIME_BUCKETS, 10.0, 30.0)


class GatewayMetrics(RpcMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.sessions = self.gauge("specmesh_gateway_sessions", "generations in progress")
        self.rounds = self.counter("specmesh_gateway_rounds", "rounds committed")
        self.tokens = self.counter("specmesh_gateway_tokens", "generated tokens committed")
        self.failovers = self.counter(
            "specmesh_gateway_failovers", "replica calls that failed and moved the session, by role", "role"
        )
        self.phase = self.histogram(
            "specmesh_gateway_phase_seconds",
            "time per round and phase: draft, verify (as the replicas report), network, commit (Redis)",
            _ROUND_BUCKETS,
            "phase",
        )

    def observe_round(self, stats: GenerationStats, tokens: int, commit_seconds: float) -> None:
        self.rounds.inc()
        self.tokens.inc(tokens)
        self.phase.labels("draft").observe(stats.draft_seconds)
        self.phase.labels("verify").observe(stats.verify_seconds)
        self.phase.labels("network").observe(stats.network_seconds)
        self.phase.labels("commit").observe(commit_seconds)
