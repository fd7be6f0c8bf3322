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
        self.prefix_queries = self.counter(
            f"{NS}prefix_cache_queries",
            "tokens of the sessions that started without KV (new, resynced, evicted), looked up in the "
            "prefix cache (vLLM's name)",
        )
        self.prefix_hits = self.counter(
            f"{NS}prefix_cache_hits",
            "of them, tokens whose KV a kept prefix or a live session's already held (vLLM's name)",
        )
        self.kept_prefixes = self.gauge(f"{NS}kept_prefixes", "released sessions' KV kept as prefixes")
        self.kept_evictions = self.counter(
            f"{NS}kept_prefix_evictions", "kept prefixes dropped for room (least recently used first)"
        )
        self.prefill_tokens = self.counter(
            f"{NS}prefill_tokens", "tokens fed by partial items (chunked prefill), past the prefixes taken"
        )
        self.waiting = self.gauge(
            f"{NS}num_requests_waiting",
            "sessions whose step waits for a forward (queued in the batcher): what an endpoint picker "
            "scores a replica's queue by",
        )
        # the runner's counts in `stats` (not part of the ModelBackend protocol) -> their counters
        self._counted = {
            "evictions": self.preemptions, "log_restarts": self.log_restarts,
            "prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
            "kept_evictions": self.kept_evictions,
        }  # fmt: skip
        self._seen = dict.fromkeys(self._counted, 0)  # each count at the last observation
        self.kv_usage_now = 0.0

    def observe_runner(self, runner: ModelBackend) -> None:
        """Call on the model thread (the only thread that changes the runner)."""
        cached = runner.cached_positions()
        self.sessions.set(len(runner.sessions()))
        self.kept_prefixes.set(getattr(runner, "kept_prefixes", lambda: 0)())
        self.cached_tokens.set(cached)
        budget = runner.max_cache_tokens
        self.kv_usage_now = cached / budget if budget else 0.0  # what tick results say (kv_usage)
        self.kv_usage.set(self.kv_usage_now)
        stats = getattr(runner, "stats", {})
        for key, counter in self._counted.items():
            count = stats.get(key, 0)
            if count > self._seen[key]:
                counter.inc(count - self._seen[key])
            self._seen[key] = count
