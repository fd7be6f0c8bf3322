"""The Prometheus metrics both model services export; each service adds its own to the registry."""

from __future__ import annotations

from specmesh.rpc.metrics import NS, SIZE_BUCKETS, TIME_BUCKETS, TOKEN_BUCKETS, RpcMetrics
from specmesh.runtime.backend import ModelBackend


class ServiceMetrics(RpcMetrics):
    """The Prometheus metrics both model services export; each adds its own to `registry`.
    `model_name`: the replica's model id (InfoResponse.model_id)."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.batch_size = self.histogram(f"{NS}batch_size", "sessions in one model forward", SIZE_BUCKETS)
        self.batch_tokens = self.histogram(
            f"{NS}batch_tokens", "query tokens in one model forward", TOKEN_BUCKETS
        )
        self.queue_wait = self.histogram(
            f"{NS}queue_wait_seconds", "how long a step waited before its forward started", TIME_BUCKETS
        )
        self.forward_time = self.histogram(
            f"{NS}forward_seconds", "duration of one batched model forward", TIME_BUCKETS
        )
        self.forward_cpu = self.counter(
            f"{NS}forward_cpu_seconds",
            "CPU time of the model thread inside the model's forwards (thread time, the forward floor's "
            "sleep not counted): what the model costs, against the process's whole CPU time",
        )
        self.sessions = self.gauge(f"{NS}num_sessions", "sessions the model runner holds")
        self.cached_tokens = self.gauge(f"{NS}kv_cache_tokens", "KV positions held over all sessions")
        self.kv_usage = self.gauge(
            f"{NS}kv_cache_usage_perc",
            "KV positions held / the runner's cache budget (--max-cache-tokens; 1 = full); 0 without one",
        )
        self.preemptions = self.counter(
            f"{NS}num_preemptions",
            "sessions whose KV the runner evicted (least recently used first) to fit a forward in its "
            "cache budget; such a session re-feeds its tokens on its next forward",
        )
        self.idle_releases = self.counter(
            f"{NS}idle_sessions_released",
            "sessions released after --session-idle-seconds without a request (their gateway died "
            "and no other resumed them)",
        )
        self.log_restarts = self.counter(
            f"{NS}kv_log_restarts",
            "--deterministic on llama.cpp: times the append-only KV cache reached its end, so that "
            "every session's KV was dropped and re-fed in order (docs/decisions.md, Batch invariance)",
        )
        # the runner's counts in `stats` (not part of the ModelBackend protocol) -> their counters
        self._counted = {"evictions": self.preemptions, "log_restarts": self.log_restarts}
        self._seen = dict.fromkeys(self._counted, 0)  # each count at the last observation

    def observe_runner(self, runner: ModelBackend) -> None:
        """Call on the model thread (the only thread that changes the runner)."""
        cached = runner.cached_positions()
        self.sessions.set(len(runner.sessions()))
        self.cached_tokens.set(cached)
        budget = runner.max_cache_tokens
        self.kv_usage.set(cached / budget if budget else 0.0)
        stats = getattr(runner, "stats", {})
        for key, counter in self._counted.items():
            count = stats.get(key, 0)
            if count > self._seen[key]:
                counter.inc(count - self._seen[key])
            self._seen[key] = count
