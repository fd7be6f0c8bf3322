"""The gateway's Prometheus metrics (docs/gateway.md): the rounds it committed, in the same terms
as the verifier's (specmesh.rpc.metrics.RoundMetrics, namespace "gateway"), and its own."""

from __future__ import annotations

from specmesh.core.stats import GenerationStats
from specmesh.rpc.metrics import TIME_BUCKETS, RoundMetrics, RpcMetrics

_ROUND_BUCKETS = (*TIME_BUCKETS, 10.0, 30.0)
_PHASES = "time per round and phase: draft, verify (as the replicas report), network, commit (Redis)"


class GatewayMetrics(RpcMetrics):
    def __init__(self) -> None:
        super().__init__()
        self.round_counts = RoundMetrics(self, "gateway")
        self.sessions = self.gauge("specmesh_gateway_sessions", "generations in progress")
        self.tokens = self.counter("specmesh_gateway_tokens", "generated tokens committed")
        self.failovers = self.counter(
            "specmesh_gateway_failovers", "replica calls that failed and moved the session, by role", "role"
        )
        self.phase = self.histogram("specmesh_gateway_phase_seconds", _PHASES, _ROUND_BUCKETS, "phase")

    def observe_round(self, stats: GenerationStats, tokens: int, commit_seconds: float) -> None:
        """One committed round: its stats delta and the tokens kept (after stop / length cuts)."""
        self.round_counts.observe(stats.drafted_tokens, stats.accepted_tokens)
        self.tokens.inc(tokens)
        for phase, seconds in (
            ("draft", stats.draft_seconds),
            ("verify", stats.verify_seconds),
            ("network", stats.network_seconds),
            ("commit", commit_seconds),
        ):
            self.phase.labels(phase).observe(seconds)
