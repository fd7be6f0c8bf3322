"""The model services' flags: `ServiceConfig`, each field declared once (specmesh.rpc.flags).

drafter_service and verifier_service parse them with their own defaults (`DRAFTER_DEFAULTS`,
`VERIFIER_DEFAULTS`: model, ports, --max-wait-ms); `specmesh up` and docs/services.md's flag
table are built from the same declarations. No torch here: `specmesh` builds its parser from this
module on every command.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from specmesh.core.suffix import SHARED_TOKENS
from specmesh.rpc.flags import Limits, ServerConfig, flag, parse_flags

_TREE = Limits()


@dataclass(frozen=True)
class BatchLimits:
    max_batch_size: int
    max_batch_tokens: int
    max_wait_s: float


@dataclass(frozen=True)
class ForwardFloor:
    """A benchmark knob: the least a forward of `rows` rows lasts, fixed + per_row x rows seconds
    (the rest is slept on the model thread). A GPU's forward is nearly flat in rows, so a tiny
    model with this floor stands in for a real pair (--forward-latency-ms, --forward-ms-per-row)."""

    fixed: float = 0.0
    per_row: float = 0.0

    def __call__(self, rows: int) -> float:
        if not (self.fixed or self.per_row):
            return 0.0
        return self.fixed + self.per_row * rows


@dataclass(frozen=True)
class ServiceConfig(ServerConfig):
    model: str = flag(
        "anything load_model accepts: a folder, a .gguf file, a hub id, default-draft / default-target"
    )
    backend: str = flag(
        "auto (llama.cpp for a GGUF model, the default pair included, on a machine without a GPU "
        "when llama-cpp-python is installed; else torch), torch (any transformers causal LM; GPU or "
        "CPU), llama.cpp (a GGUF file as it is, CPU), or ngram (drafters: no model, n-gram drafts "
        "from the session's own tokens; --model then only names the vocabulary): docs/services.md, "
        '"Backends"',
        "auto",
    )
    dtype: str = flag(
        "torch backend: bf16, fp16, fp32, or int8 (int8 Linear weights, fp32 activations, CPU; for drafters)",
        "bf16",
    )
    device: str = flag("torch device (empty = cuda when available, else cpu)", "", shown="auto")
    max_batch_size: int = flag(
        "sessions per model forward: a tick of up to this many sessions runs one forward per draft level",
        64,
        bound=">= 1",
    )
    max_batch_tokens: int = flag(
        "query tokens per model forward; a single larger step (a long prompt) runs alone", 4096, bound=">= 1"
    )
    max_wait_ms: float = flag(
        "the longest a queued step waits, while the model is idle, for a step known to be coming "
        '(the drafter\'s running tree builders: docs/services.md, "Batching"); a step with nothing to '
        "wait for never waits",
        bound=">= 0",
    )
    max_tree_nodes: int = flag("largest tree drafted or verified", _TREE.max_tree_nodes, bound=">= 1")
    max_depth: int = flag("deepest tree drafted or verified", _TREE.max_depth, bound=">= 1")
    max_branching: int = flag(
        "largest per-level branching factor a Draft may ask for (mcsd, rsd_c)",
        _TREE.max_branching,
        bound=">= 1",
    )
    max_beam_width: int = flag(
        "largest beam width a Draft may ask for (rsd_s, mtad)", _TREE.max_beam_width, bound=">= 1"
    )
    max_cache_tokens: int = flag(
        "KV positions over all sessions and kept prefixes before eviction: kept prefixes go first, "
        "then least recently used idle sessions lose their KV (rebuilt on their next request); 0 = no limit",
        0,
    )
    max_message_bytes: int = flag(
        "largest request / response; larger requests get RESOURCE_EXHAUSTED", 64 * 1024 * 1024, bound=">= 1"
    )
    torch_threads: int = flag(
        "compute threads: torch intra-op or llama.cpp's (0 = the backend's default: all cores)", 0
    )
    deterministic: bool = flag(
        "a row's logits do not depend on the rows a forward holds nor on the other sessions. "
        "llama.cpp: kernels that do not depend on the rows of a forward, V cached in bf16, an "
        "append-only KV cache (re-fed in full when it fills); verifier calls +16 %% at one row, +52 %% "
        "at four. torch (CPU, sdpa models): linear layers on fixed 16-row tiles, attention on fixed "
        "32 x 64 tiles summed in key order; +30-55 %% per verification, prefill ~4x. int8 replicas "
        'refuse it (docs/decisions.md, "Batch invariance")',
        False,
    )
    forward_latency_ms: float = flag(
        "benchmarks only: every forward takes at least this long, the rest slept on the model "
        "thread (the replica is busy, like a slower model on its own accelerator): a drafter/target "
        "latency ratio on tiny models (specmesh bench dsi-stack, bench mesh); the start-up "
        "forward-cost measurement reports the floored times; 0 = off",
        0.0,
        bound=">= 0",
    )
    forward_ms_per_row: float = flag(
        "benchmarks only: with --forward-latency-ms, each row (query token) of a forward adds this "
        "much to its floor: fixed + per-row x rows, a GPU-like cost curve; 0 = flat",
        0.0,
        bound=">= 0",
    )
    session_idle_seconds: float = flag(
        "a session no request touched for this long is released (its gateway died and no other "
        "resumed it; 0 = never); longer than the gateway's --session-ttl, so its keys go first",
        900.0,
        bound=">= 0",
    )
    run_ahead: bool = flag(
        "verifier: a plain run's next step runs while its call's answer travels, and the next "
        "call that goes on from it takes it, any other rolls it back (docs/services.md, "
        '"Run-ahead: the next plain step while the answer travels")',
        True,
    )
    suffix_tokens: int = flag(
        "drafter --backend ngram and verifier: tokens of finished outputs kept for method suffix's "
        "drafts and the verifier's suffix rides (the oldest outputs go first; about 300 bytes a token)",
        SHARED_TOKENS,
        bound=">= 0",
    )
    redis_url: str = flag(
        "drafter --backend ngram and verifier: the gateways' Redis; the mesh's outputs log there "
        "(every finished, non-private session's output) teaches method suffix's drafts and the "
        "verifier's suffix rides, replayed from its start, so a replica that starts late learns what "
        "the others did",
        "",
        shown="empty (a drafter learns from the sessions it serves, a verifier nothing)",
    )
    prefix_cache: bool = flag(
        "keep released sessions' KV as prefixes and start sessions from the longest prefix held "
        '(docs/services.md, "Prefixes")',
        True,
    )
    kept_prefixes: int = flag(
        "kept prefixes at most (least recently used go first; 0: only live sessions' prefixes are "
        "shared); all of them count in --max-cache-tokens (the llama.cpp backend: one sequence id each)",
        64,
        bound=">= 0",
    )

    @property
    def forward_floor(self) -> ForwardFloor:
        return ForwardFloor(self.forward_latency_ms / 1000.0, self.forward_ms_per_row / 1000.0)

    @property
    def limits(self) -> Limits:
        return Limits(self.max_tree_nodes, self.max_depth, self.max_branching, self.max_beam_width)

    @property
    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.max_batch_size, self.max_batch_tokens, self.max_wait_ms / 1000.0)


DRAFTER_DEFAULTS = {"model": "default-draft", "port": 50061, "metrics_port": 9091, "max_wait_ms": 10.0}
VERIFIER_DEFAULTS = {"model": "default-target", "port": 50062, "metrics_port": 9092, "max_wait_ms": 2.0}


def parse_config(prog: str, argv: list[str] | None, defaults: Mapping[str, Any]) -> ServiceConfig:
    """Flags --foo-bar; each defaults to $SPECMESH_FOO_BAR, then to the role's `defaults`."""
    return parse_flags(prog, ServiceConfig, argv, defaults)
