"""Prometheus metrics: the registry and per-RPC counter of every server, and what a verified round
adds up to (`RoundMetrics`, in vLLM's spec-decode vocabulary), one definition for the verifier and
the gateway. A "draft token" is a tree node: a tree of 9 nodes whose path accepts 3 counts 9 draft
tokens and 3 accepted tokens, and emits 4 (the accepted ones plus the recovered or bonus token).

Like vLLM's `vllm:` series, every server's are named `specmesh:…` (a replica's that would mean
something else than the gateway's of the same name carry their role: `specmesh:verifier_rounds`)
and every sample carries `model_name`, the model the process serves. No `_created` series.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import socket
import ssl
import threading
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric

NS = "specmesh:"  # the namespace of every series, the gateway's and the replicas'
TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
SIZE_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ModelRegistry(CollectorRegistry):
    """A registry whose every sample carries `model_name` (vLLM's label): the served model, set at
    construction or later (a gateway without --served-model-name learns it from a verifier; until
    then it is empty). Added when scraped, so the metrics themselves need no such label."""

    def __init__(self, model_name: str) -> None:
        super().__init__()
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        return _with_model_name(super().collect(), self)

    def restricted_registry(self, names: Iterable[str]) -> _Restricted:
        """What a scrape with `name[]=` parameters reads: those series, labelled the same."""
        return _Restricted(super().restricted_registry(names), self)


class _Restricted:
    def __init__(self, restricted: Any, registry: ModelRegistry) -> None:
        self._restricted, self._registry = restricted, registry

    def collect(self) -> Iterator[Metric]:
        return _with_model_name(self._restricted.collect(), self._registry)


def _with_model_name(families: Iterable[Metric], registry: ModelRegistry) -> Iterator[Metric]:
    for family in families:
        labelled = Metric(family.name, family.documentation, family.type, family.unit)
        labelled.samples = [
            s._replace(labels={"model_name": registry.model_name, **s.labels}) for s in family.samples
        ]
        yield labelled


class RpcMetrics:
    """The registry and the per-RPC counter every specmesh server exports. `model_name`: the
    model the process serves, on every sample (a property: a gateway sets it once it has learnt
    its model)."""

    def __init__(self, model_name: str) -> None:
        disable_created_metrics()  # no `<name>_created` series beside the counters and histograms
        self.registry = ModelRegistry(model_name)
        self.requests = self.counter(
            f"{NS}rpc_requests", "calls answered, by method and status code", "method", "code"
        )
        self.handler_time = self.histogram(
            f"{NS}rpc_handler_seconds", "time inside a call's handler, by method", TIME_BUCKETS, "method"
        )

    @property
    def model_name(self) -> str:
        return self.registry.model_name

    @model_name.setter
    def model_name(self, name: str) -> None:
        self.registry.model_name = name

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, buckets: tuple, *labels: str) -> Histogram:
        return Histogram(name, doc, labels, buckets=buckets, registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, labels, registry=self.registry)


_CHILDREN: dict[tuple[int, int], Any] = {}  # (counter, label value) -> its child, made once


def count_labels(counter: Counter, values: Iterable[int]) -> None:
    """counter{label=v} += how often v occurs (e.g. tokens per depth); a tick's values in one
    call, so that each label is counted once per tick."""
    for value, n in collections.Counter(values).items():
        child = _CHILDREN.get((id(counter), value))
        if child is None:
            child = _CHILDREN[(id(counter), value)] = counter.labels(str(value))
        child.inc(n)


def observe_all(histogram: Any, values: Iterable[float]) -> None:
    """histogram (a child: no labels left) observes every value, at the cost of one observe per
    bucket hit rather than per value (a tick's rounds at once). The same counts and sum as
    `observe` each (tests/test_ticks.py checks it against prometheus_client)."""
    values = list(values)
    if not values:
        return
    histogram._raise_if_not_observable()
    for i, n in collections.Counter(bisect.bisect_left(histogram._upper_bounds, v) for v in values).items():
        histogram._buckets[i].inc(n)
    histogram._sum.inc(sum(values))


class RoundMetrics:
    """Counters of verified rounds, in vLLM's spec-decode names and meanings under `prefix`: the
    gateway's public series are "specmesh:" (specmesh:spec_decode_num_draft_tokens, ...), the
    verifier's "specmesh:verifier_", so both can be scraped side by side without double counting."""

    def __init__(self, metrics: RpcMetrics, prefix: str = f"{NS}verifier_") -> None:
        c = metrics.counter
        self.rounds = c(f"{prefix}rounds", "verified rounds (one per session per target forward)")
        self.emitted = c(
            f"{prefix}spec_decode_num_emitted_tokens", "tokens the rounds emitted: accepted + 1 per round"
        )
        self.drafts = c(f"{prefix}spec_decode_num_drafts", "draft trees verified")
        self.draft_tokens = c(f"{prefix}spec_decode_num_draft_tokens", "drafted tokens verified (tree nodes)")
        self.accepted = c(f"{prefix}spec_decode_num_accepted_tokens", "drafted tokens accepted")
        per_pos = "accepted tokens by position (0 = depth 1)"
        self.accepted_per_pos = c(f"{prefix}spec_decode_num_accepted_tokens_per_pos", per_pos, "position")

    def observe(self, tree_nodes: int, accepted: int) -> None:
        """One round: a tree of `tree_nodes` nodes (0: a plain autoregressive step) and the length
        of its accepted path."""
        self.observe_many([(tree_nodes, accepted)])

    def observe_many(self, rounds: Iterable[tuple[int, int]]) -> None:
        """A tick's rounds, (tree nodes, accepted path length) each: every counter added once."""
        rounds = list(rounds)
        self.rounds.inc(len(rounds))
        self.emitted.inc(sum(accepted + 1 for _, accepted in rounds))
        drafted = [(nodes, accepted) for nodes, accepted in rounds if nodes]
        if not drafted:
            return
        self.drafts.inc(len(drafted))
        self.draft_tokens.inc(sum(nodes for nodes, _ in drafted))
        self.accepted.inc(sum(accepted for _, accepted in drafted))
        count_labels(self.accepted_per_pos, (pos for _, accepted in drafted for pos in range(accepted)))


class MetricsServer:
    """/metrics over HTTP (HTTPS with `cert` and `key`) from a thread: prometheus_client's own
    (`start_http_server`) polls its socket twice a second, and on a small shared host each wake-up
    of an idle process costs ~1.5 ms of CPU, taken from the forwards beside it. This one sleeps
    until a scrape comes; `close` wakes it by shutting its listening socket down."""

    def __init__(
        self, host: str, port: int, registry: CollectorRegistry, cert: str | None = None,
        key: str | None = None,
    ) -> None:  # fmt: skip
        family, _, _, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        server_class = type("_Server", (ThreadingWSGIServer,), {"address_family": family})
        self.httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), server_class, _SilentHandler)
        if cert and key:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(cert, key)
            self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_port
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": None}, name="metrics", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        stopping = threading.Thread(target=self.httpd.shutdown, daemon=True)  # sets its flag, waits
        stopping.start()
        while stopping.is_alive():  # a shut listening socket is readable: its select returns
            with contextlib.suppress(OSError):
                self.httpd.socket.shutdown(socket.SHUT_RDWR)
            stopping.join(0.05)
        self.httpd.server_close()


class _SilentHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line on stderr per scrape."""
