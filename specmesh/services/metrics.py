"""The Prometheus metrics both model services export; each service adds its own to the registry."""

from __future__ import annotations

from specmesh.rpc.metrics import SIZE_BUCKETS, TIME_BUCKETS, TOKEN_BUCKETS, RpcMetrics
from specmesh.runtime.backend import ModelBackend


class ServiceMetrics(RpcMetrics):
    """The Prometheus metrics both model services export; each adds its own to `registry`."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_size = self.histogram("specmesh_batch_size", "sessions in one model forward", SIZE_BUCKETS)
        self.batch_tokens = self.histogram(
            "specmesh_batch_tokens", "query tokens in one model forward", TOKEN_BUCKETS
        )
        self.queue_wait = self.histogram(
            "specmesh_queue_wait_seconds", "how long a step waited before its forward started", TIME_BUCKETS
        )
        self.forward_time = self.histogram(
            "specmesh_forward_seconds", "duration of one batched model forward", TIME_BUCKETS
        )
        self.sessions = self.gauge("specmesh_sessions", "sessions the model runner holds")
        self.cached_tokens = self.gauge("specmesh_cached_tokens", "KV positions held over all sessions")

    def observe_runner(self, runner: ModelBackend) -> None:
        """Call on the model thread (the only thread that changes the runner)."""
        self.sessions.set(len(runner.sessions()))
        self.cached_tokens.set(runner.cached_positions())
