"""The gateway's Prometheus metrics (docs/gateway.md, "Metrics"), named like vLLM's under the
`specmesh:` namespace: per request (latencies, tokens, running / waiting) and per committed round
(specmesh.rpc.metrics.RoundMetrics with the prefix "specmesh:"). A "draft token" there is a tree
node; emitted tokens are the accepted ones plus one per round. `model_name` on every sample: the
model's name in the HTTP API."""

from __future__ import annotations

import asyncio
import collections
import time

from specmesh.core.stats import GenerationStats
from specmesh.rpc.metrics import NS, TIME_BUCKETS, RoundMetrics, RpcMetrics, observe_all

_ROUND_BUCKETS = (*TIME_BUCKETS, 10.0, 30.0)
_REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_PHASES = (
    "time per round and phase: draft, verify (as the replicas report), network, commit (Redis); "
    "drafter_call, verifier_call (the replica calls as the gateway sees them), round (the whole round, "
    "commit included)"
)


class GatewayMetrics(RpcMetrics):
    """model_name: --served-model-name; empty until the gateway has learnt its model (then set to
    the name the HTTP API reports)."""

    def __init__(self, model_name: str) -> None:
        super().__init__(model_name)
        self.round_counts = RoundMetrics(self, NS)
        self.running = self.gauge(f"{NS}num_requests_running", "requests generating (a session in Redis)")
        self.waiting = self.gauge(
            f"{NS}num_requests_waiting",
            "requests admitted whose first token has not come yet (tokenizing, placing, prefilling the "
            "prompt): what an endpoint picker scores a gateway's queue by",
        )
        self.kv_usage = self.gauge(
            f"{NS}kv_cache_usage_perc",
            "the gateway's healthy verifiers' mean KV cache usage (positions held / budget, 0-1), as "
            "their tick results said: what an endpoint picker scores a gateway's KV by",
        )
        self.prefill_chunk = self.gauge(
            f"{NS}prefill_chunk_tokens",
            "the most prompt tokens one tick to a replica feeds (--prefill-chunk; auto: from the replicas' "
            "start-up measurement), by role",
            "role",
        )
        self.prompt_tokens = self.counter(f"{NS}prompt_tokens", "prompt tokens of the requests that started")
        self.generation_tokens = self.counter(f"{NS}generation_tokens", "generated tokens committed")
        self.request_success = self.counter(
            f"{NS}request_success", "requests that finished, by finish reason", "finished_reason"
        )
        h = self.histogram
        self.queue_time = h(
            f"{NS}request_queue_time_seconds",
            "arrival to the first round starting (tokenizing, waiting for a healthy replica, placing)",
            _REQUEST_BUCKETS,
        )
        self.ttft = h(f"{NS}time_to_first_token_seconds", "arrival to the first token", _REQUEST_BUCKETS)
        self.itl = h(
            f"{NS}inter_token_latency_seconds",
            "time between two chunks of a stream (one chunk per round; a round may emit several tokens)",
            _ROUND_BUCKETS,
        )
        self.tpot = h(
            f"{NS}request_time_per_output_token_seconds",
            "per request: (end - first token) / (generated tokens - 1)",
            _ROUND_BUCKETS,
        )
        self.e2e = h(f"{NS}e2e_request_latency_seconds", "arrival to the last token", _REQUEST_BUCKETS)
        self.failovers = self.counter(
            f"{NS}failovers", "replica calls that failed and moved the session, by role", "role"
        )
        self.phase = h(f"{NS}round_phase_seconds", _PHASES, _ROUND_BUCKETS, "phase")
        self._phases = {p: self.phase.labels(p) for p in ("draft", "verify", "network")}  # made once
        self._rounds: list[tuple[GenerationStats, int, dict[str, float]]] = []  # this turn's, not counted yet
        self.answer_tick = h(
            f"{NS}answer_tick",
            "sessions' drafts or verifications in one tick the gateway sent a replica, by role",
            (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "role",
        )
        self.pre_drafts = self.counter(
            f"{NS}pipelined_rounds",
            "rounds that had a pre-draft (pipelined rounds), by outcome: hit (its tree was used), "
            "miss (dropped)",
            "outcome",
        )

    def observe_round(self, stats: GenerationStats, tokens: int, phases: dict[str, float]) -> None:
        """One committed round: its stats delta, the tokens kept (after stop / length cuts) and the
        gateway's own timings (`phases`: commit, drafter_call, verifier_call, round). Counted at
        the end of the event loop's turn, with every other round of that turn (a tick's): one
        update per series, not one per round."""
        self._rounds.append((stats, tokens, phases))
        if len(self._rounds) == 1:
            try:
                asyncio.get_running_loop().call_soon(self._count_rounds)
            except RuntimeError:  # no loop (a test): now
                self._count_rounds()

    def _count_rounds(self) -> None:
        rounds, self._rounds = self._rounds, []
        self.round_counts.observe_many((s.drafted_tokens, s.accepted_tokens) for s, _, _ in rounds)
        self.generation_tokens.inc(sum(tokens for _, tokens, _ in rounds))
        seconds: dict[str, list[float]] = collections.defaultdict(list)
        for stats, _, phases in rounds:
            seconds["draft"].append(stats.draft_seconds)
            seconds["verify"].append(stats.verify_seconds)
            seconds["network"].append(stats.network_seconds)
            for name, value in phases.items():
                seconds[name].append(value)
        for name, values in seconds.items():
            child = self._phases.get(name)
            if child is None:
                child = self._phases[name] = self.phase.labels(name)
            observe_all(child, values)


class RequestClock:
    """One request's latencies, observed as its chunks go out (the same for gRPC and HTTP)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first: float | None = None
        self.tokens = 0

    def started(self) -> None:
        """The request leaves the waiting ones: its first round starts."""
        self.metrics.queue_time.observe(time.perf_counter() - self.start)

    def chunk(self, tokens: int) -> None:
        if not tokens:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.tokens += tokens

    def finished(self, reason: str) -> None:
        m = self.metrics
        m.request_success.labels(reason).inc()
        m.e2e.observe(time.perf_counter() - self.start)
        if self.first is not None and self.tokens > 1:
            m.tpot.observe((self.last - self.first) / (self.tokens - 1))
