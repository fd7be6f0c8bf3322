"""The gateway's flags: `GatewayConfig`, each field declared once (specmesh.rpc.flags).

`python -m gateway`, `specmesh up` and docs/gateway.md's flag table are all built from these
declarations. This module imports no torch and no gRPC: `specmesh` builds its parser from it on
every command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmesh.rpc.flags import Limits, ServerConfig, flag, parse_flags

_TREE = Limits()


@dataclass(frozen=True)
class GatewayConfig(ServerConfig):
    port: int = flag("the gateway's gRPC port", 50051, bound=">= 0")
    metrics_port: int = flag(
        "a second Prometheus /metrics port (the HTTP port serves /metrics already); 0 = off", 0, bound=">= 0"
    )
    http_port: int = flag(
        "the OpenAI-compatible HTTP API with /health and /metrics (docs/http_api.md); 0 = off",
        8000,
        bound=">= 0",
    )
    served_model_name: str = flag(
        "the model name of the HTTP API (/v1/models, a request's `model`)",
        "",
        shown="the verifier's model id",
    )
    tool_call_parser: str = flag(
        "how the HTTP API reads tool calls out of a model's text with tool_choice auto: auto (the "
        "syntax the chat template teaches), none (auto refused), or a parser's name, e.g. hermes "
        '(docs/http_api.md, "Tool calls")',
        "auto",
    )
    max_concurrent_requests: int = flag(
        "generations at once, gRPC and HTTP together; one more is refused at once with "
        "RESOURCE_EXHAUSTED / HTTP 429 (0 = no limit)",
        0,
        bound=">= 0",
    )
    api_keys: str = flag(
        "comma-separated API keys; when set, every request needs one (gRPC metadata `authorization: "
        "Bearer KEY`, HTTP header `Authorization: Bearer KEY`), else UNAUTHENTICATED / 401",
        "",
        shown="empty (no key needed)",
    )
    private_api_keys: str = flag(
        "comma-separated API keys (each one of --api-keys) whose requests are all private: their "
        "outputs never teach other sessions' suffix drafts (GenerateRequest.private)",
        "",
        shown="empty",
    )
    replica_ca: str = flag(
        "PEM CA that signed the replicas' certificates: TLS to the replicas (a dns:/// target's "
        "certificate must name its host)",
        "",
        shown="empty (plaintext to the replicas)",
    )
    replica_cert: str = flag(
        "PEM client certificate the gateway shows the replicas (for replicas with --tls-client-ca)", ""
    )
    replica_key: str = flag("PEM private key of --replica-cert", "")
    drafters: str = flag(
        "drafter replicas: host:port and/or dns:///name:port (all addresses of a name, re-resolved: "
        "docker compose --scale drafter=N), comma-separated",
        "",
        shown="empty (method `none` only)",
    )
    ngram_drafters: str = flag(
        "model-free n-gram drafters (drafter_service --backend ngram), like --drafters; they serve "
        "method ngram, which the default may then choose (empty: no ngram)",
        "",
    )
    verifiers: str = flag("verifier replicas, like --drafters")
    redis_url: str = flag(
        "the session store: redis://[:PASSWORD@]HOST:PORT/DB (rediss:// for TLS), or through Sentinel "
        'redis+sentinel://[:PASSWORD@]HOST:PORT[,HOST:PORT...]/MASTER_NAME[/DB] (docs/gateway.md, "Redis"). '
        "A password is never logged; pass it as SPECMESH_REDIS_URL to keep it off the process list",
        "redis://127.0.0.1:6379/0",
    )
    redis_reconnect_seconds: float = flag(
        "how long a Redis operation is retried while Redis is unreachable (a restart, a failover) "
        "before the request fails with UNAVAILABLE; 0 = at the first error",
        30.0,
        bound=">= 0",
    )
    tokenizer: str = flag(
        "model source whose tokenizer the gateway loads, no weights; at start the gateway asks a "
        "healthy verifier for Info and does not become ready while this tokenizer's fingerprint "
        "differs from the verifier's. Set it when the verifier's model path does not exist where "
        "the gateway runs",
        "",
        shown="the verifier's --model",
    )
    max_new_tokens_limit: int = flag("the largest max_new_tokens a request may ask for", 1024, bound=">= 1")
    default_max_new_tokens: int = flag("max_new_tokens of a request that leaves it unset", 128, bound=">= 1")
    max_context: int = flag(
        "limit of prompt + max_new_tokens (0: the model config's max_position_embeddings)", 0
    )
    max_depth: int = flag(
        "the deepest tree (or DSI lookahead) a request may ask for; checked before anything is planned",
        _TREE.max_depth,
        bound=">= 1",
    )
    max_tree_nodes: int = flag("the most nodes a request's tree may have", _TREE.max_tree_nodes, bound=">= 1")
    max_branching: int = flag(
        "the most children per level a request may ask for (mcsd, rsd_c)", _TREE.max_branching, bound=">= 1"
    )
    max_beam_width: int = flag(
        "the widest beam a request may ask for (rsd_s, mtad)", _TREE.max_beam_width, bound=">= 1"
    )
    max_stop_sequences: int = flag("the most stop sequences in one request", 16)
    max_stop_length: int = flag("the longest stop sequence, in characters", 256, bound=">= 1")
    max_prompt_bytes: int = flag(
        "the largest text prompt (or a chat's roles and contents) in UTF-8 bytes, checked before "
        "tokenizing (which runs on a worker thread, never on the event loop)",
        1 << 20,
        bound=">= 1",
    )
    session_ttl: float = flag("seconds a session stays in Redis after its last write", 600.0, bound="> 0")
    lease_seconds: float = flag(
        "the ownership lease of a session's gateway: how soon after this gateway dies another may "
        "resume its sessions (renewed every third of it while a session runs)",
        3.0,
        bound="> 0",
    )
    round_timeout: float = flag(
        "seconds a replica call, or the wait for a healthy replica, may take", 60.0, bound="> 0"
    )
    max_attempts: int = flag("tries per round, over all replicas, before the request fails", 5, bound=">= 1")
    try_timeout_floor: float = flag(
        "the least seconds one Draft / Verify try gets before the round moves to a spare replica",
        2.0,
        bound="> 0",
    )
    try_timeout_factor: float = flag(
        "a try gets this many times what its forwards cost on the replica (measured at start-up); "
        "0 = no per-try timeout (every try may take the round timeout)",
        10.0,
        bound=">= 0",
    )
    retry_budget: float = flag(
        "replica retries in any 10 s may be this share of the rounds started in them, plus 10",
        0.2,
        bound=">= 0",
    )
    health_interval: float = flag(
        "seconds between health checks of a replica in use, unhealthy, or whose last check failed "
        "(also how long a failed replica stays out)",
        1.0,
        bound="> 0",
    )
    idle_health_interval: float = flag(
        "seconds between health checks of a healthy replica no session has sent work to for at "
        "least this long (cf. Envoy's no_traffic_healthy_interval; 0 = 10 x --health-interval; "
        'equal to it: every replica every interval; docs/gateway.md, "Flags")',
        0.0,
        bound=">= 0",
    )
    dsi_max_parallel: int = flag(
        "DSI: the most verifications of one session in flight at once (a request's "
        "speculation.parallel above it is refused)",
        4,
        bound=">= 1",
    )
    dsi_timeline: str = flag(
        "benchmarks: a folder where every DSI session writes when each block was drafted, sent, "
        "verified, resolved or cancelled, and on which replica (JSON per session; empty = off)",
        "",
    )
    pipeline: str = flag(
        "pipelined rounds: the drafter drafts round r+1 on the likely path while round r is verified. "
        "auto: when the session's measured costs and acceptance say a pre-draft pays; on: every "
        "round; off: serial rounds",
        "auto",
    )
    call_overhead_ms: float = flag(
        "what the default's cost model charges per replica call beside the forwards (gRPC, "
        "serialisation, batching); fixed, so that a seeded request's shape never follows the load",
        2.0,
    )
    plain_steps: int = flag(
        "plain decoding (no drafter): steps the verifier takes per call after the first, each one "
        "token or, with the default's n-gram rides, its accepted drafts and one more (one call per "
        "token costs a round trip each; more per call streams in larger pieces), at most 64",
        4,
        bound=">= 1",
    )
    suffix_rides: bool = flag(
        "the default's plain steps may carry suffix trees the verifier looks up in the mesh's "
        "finished outputs (the outputs log; the verifier needs --redis-url), each cut to what pays at "
        'the forward\'s size (docs/gateway.md, "Suffix drafts"); finished outputs are then published',
        True,
    )
    prefill_chunk: str = flag(
        "chunked prefill: the most tokens of prompts (or of any re-feed) one tick to a replica "
        "feeds, shared by the sessions prefilling (vLLM's max_num_batched_tokens); a longer prompt "
        "takes several ticks, and the other sessions' rounds run in each. auto: what costs the "
        "replica about 16 one-row forwards, by its start-up measurement, within 64-2048 (this 2-core "
        "CPU: ~100 tokens; a forward flat in rows, as a GPU's: 2048); 0: a prompt in one call "
        '(docs/gateway.md, "Long prompts and conversations")',
        "auto",
    )
    prefix_routing: bool = flag(
        "place a session without a replica on the one that holds the longest prefix of its tokens "
        '(the replicas\' summaries in Redis; docs/gateway.md, "Routing by cached prefix")',
        True,
    )
    prefix_balance: int = flag(
        "prefix routing: a replica with more than this many sessions above the least loaded one gets "
        "no session for its cached prefix (the least loaded does)",
        8,
        bound=">= 0",
    )

    def replica_tls(self) -> Any:
        """How the gateway reaches its replicas (specmesh.rpc.tls.ClientTls): TLS when any
        --replica-* flag is set, else None."""
        from specmesh.rpc.tls import client_tls  # gRPC: not needed to build a parser

        return client_tls(self.replica_ca, self.replica_cert, self.replica_key)

    def check(self) -> None:
        # imported here, not above: `specmesh` builds its parser from this module without torch
        from gateway.http.tools import TOOL_PARSERS
        from specmesh.core.rounds import Pipelining
        from specmesh.rpc.wire import MAX_PLAIN_STEPS

        super().check()
        self.replica_tls()
        Pipelining.parse(self.pipeline)
        if self.plain_steps > MAX_PLAIN_STEPS:
            raise ValueError(f"--plain-steps must be at most {MAX_PLAIN_STEPS}")
        if self.tool_call_parser not in ("auto", "none", *TOOL_PARSERS):
            raise ValueError(f"--tool-call-parser: one of auto, none, {', '.join(TOOL_PARSERS)}")
        if self.prefill_chunk != "auto" and not (self.prefill_chunk.isdigit()):
            raise ValueError(f"--prefill-chunk: auto or a number of tokens >= 0, got {self.prefill_chunk!r}")
        if not set(key_list(self.private_api_keys)) <= set(key_list(self.api_keys)):
            raise ValueError("--private-api-keys: every key must also be one of --api-keys")

    def chunk(self, cost: Mapping[int, float]) -> int:
        """--prefill-chunk for replicas of this forward cost (rows -> seconds)."""
        from gateway.retries import prefill_chunk

        return prefill_chunk(cost) if self.prefill_chunk == "auto" else int(self.prefill_chunk)


def key_list(keys: str) -> list[bytes]:
    """A comma-separated list of API keys (--api-keys, --private-api-keys)."""
    return [k.strip().encode() for k in keys.split(",") if k.strip()]


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    return parse_flags("python -m gateway", GatewayConfig, argv)
