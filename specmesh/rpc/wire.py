"""Wire messages (proto/specmesh/v1) <-> core types, and validation of requests.

Every problem with a request raises `WireError`, whose message starts with the proto field path
("tree.parents: ...", "sampling.top_p: ..."); the servers answer it with INVALID_ARGUMENT. Where
a core type already validates itself (SamplingParams, TreeSpec, DraftTree.validate) its own check
is used, and its message (which names the field first) is prefixed with the message path.

Distributions travel as little-endian bytes: sparse (int32 token ids + fp32 probabilities of the
support) whenever the row has zeros, which top-k, top-p and greedy make; dense (V fp32 values)
otherwise. Both are bit-exact: the verifier rebuilds exactly the fp32 row the drafter sampled
from, and the tokens outside the support are exactly 0.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specmesh.core.drafting import TreeSpec
from specmesh.core.extras import missing
from specmesh.core.grammar import Grammar
from specmesh.core.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from specmesh.core.ngram import MAX_MATCH
from specmesh.core.sampling import SamplingParams
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.core.verification import Verdict
from specmesh.rpc.flags import Limits
from specmesh.rpc.proto import pb2

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install (specmesh.core.extras)
    torch = missing(exc)

MAX_SESSION_ID_BYTES = 256
MAX_GRAMMAR_BYTES = 1 << 20  # a compiled grammar (Grammar.text); JSON schemas are far smaller
MAX_PLAIN_STEPS = 64  # tokens one plain Verify call may decode (VerifyRequest.plain_steps)
# Trailing metadata of a FAILED_PRECONDITION answer: resend all committed tokens with position 0.
RESYNC_KEY = "specmesh-resync"
# Request metadata: the caller's secret for one session; a replica serves the session only to it.
SESSION_KEY = "specmesh-session-key"


def session_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The metadata that carries a session key (none for the empty key)."""
    return ((SESSION_KEY, key),) if key else ()


def session_key(metadata: Any) -> str:
    """The session key in a call's metadata, "" if there is none."""
    return next((value for name, value in metadata or () if name == SESSION_KEY), "")


_MODE_TO_PROTO = {
    SamplingMode.IID: pb2.SAMPLING_MODE_IID,
    SamplingMode.WITHOUT_REPLACEMENT: pb2.SAMPLING_MODE_WITHOUT_REPLACEMENT,
    SamplingMode.MTAD: pb2.SAMPLING_MODE_MTAD,
    SamplingMode.PROPOSED: pb2.SAMPLING_MODE_PROPOSED,
}
_MODE_FROM_PROTO = {v: k for k, v in _MODE_TO_PROTO.items()}


class WireError(ValueError):
    """A request that cannot be served as sent; the message starts with the field path."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field


_FIELD = re.compile(r"[a-z_][a-z0-9_]*(\[\d+\])?(\.[a-z_][a-z0-9_]*(\[\d+\])?)*")


def field_of(details: str) -> str | None:
    """The field an INVALID_ARGUMENT's details name ("field: problem", a WireError's form), read
    where a status arrives over gRPC as text; None if they name none."""
    field, sep, _ = details.partition(":")
    return field if sep and _FIELD.fullmatch(field) else None


def core_error(prefix: str, exc: ValueError) -> WireError:
    """Core validators name the offending field first ("top_p must be in ..."): add the path."""
    text = str(exc)
    name = re.match(r"[a-z_]+(\[\d+\])?", text)
    if name is None:
        return WireError(prefix, text)
    return WireError(f"{prefix}.{name.group()}", text.removeprefix(f"{name.group()}: "))


# ---- sampling ----------------------------------------------------------------------------------


def sampling_to_proto(params: SamplingParams) -> pb2.SamplingParams:
    if params.seed is None:
        raise ValueError("a remote session needs a fixed seed (every replica derives its randomness from it)")
    msg = pb2.SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=params.seed)
    if params.top_p < 1.0:
        msg.top_p = params.top_p
    return msg


def sampling_from_proto(msg: Any, field: str = "sampling") -> SamplingParams:
    """The internal specmesh.v1.SamplingParams or the public specmesh.v1.Sampling. Unset top_p
    means 1.0 (no filter); an unset message is greedy (temperature 0); the seed as sent, None where
    the message leaves an optional seed unset (the caller then draws one: core.rounds.session_seed)."""
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    seed_field = msg.DESCRIPTOR.fields_by_name["seed"]
    seed = msg.seed if not seed_field.has_presence or msg.HasField("seed") else None
    try:
        return SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=top_p, seed=seed)
    except ValueError as exc:
        raise core_error(field, exc) from None


# ---- tree spec ---------------------------------------------------------------------------------


def tree_spec_to_proto(spec: TreeSpec) -> pb2.TreeSpec:
    return pb2.TreeSpec(
        method=spec.method,
        depth=spec.depth,
        branching=list(spec.branching),
        beam_width=spec.beam_width,
        replacement=spec.replacement,
        mtad_threshold=spec.mtad_threshold,
    )


def tree_spec_from_proto(msg: pb2.TreeSpec, limits: Limits, field: str = "tree_spec") -> TreeSpec:
    """A TreeSpec within the replica's limits; method "none" drafts nothing and is refused."""
    check_depth(msg.depth, limits, field)
    kwargs: dict = dict(
        method=msg.method,
        depth=msg.depth,
        branching=tuple(msg.branching),
        beam_width=msg.beam_width,
        replacement=msg.replacement,
    )
    if msg.HasField("mtad_threshold"):
        kwargs["mtad_threshold"] = msg.mtad_threshold
    try:
        spec = TreeSpec(**kwargs)
    except ValueError as exc:
        raise core_error(field, exc) from None
    if not spec.method.drafts:
        raise WireError(f"{field}.method", "'none' drafts no tree; send Verify with an empty tree instead")
    check_tree_limits(spec, limits, field)
    return spec


def check_depth(depth: int, limits: Limits, field: str, whose: str = "this replica's") -> None:
    """Before a TreeSpec is built (it makes a (1,) * depth tuple) or planned for."""
    _check_limit(f"{field}.depth", depth, limits.max_depth, "--max-depth", whose=whose)


def check_tree_limits(spec: TreeSpec, limits: Limits, field: str, whose: str = "this replica's") -> None:
    """Branching, beam width and node count within `limits` (the replicas', or the gateway's own)."""
    branching = max(spec.branching, default=1)
    _check_limit(f"{field}.branching", branching, limits.max_branching, "--max-branching", whose=whose)
    if spec.method.beamed:
        beam = spec.beam_width
        _check_limit(f"{field}.beam_width", beam, limits.max_beam_width, "--max-beam-width", whose=whose)
    nodes, limit = spec.max_nodes, limits.max_tree_nodes
    _check_limit(field, nodes, limit, "--max-tree-nodes", what="tree nodes", whose=whose)


def _check_limit(
    field: str, value: int, limit: int, flag: str, what: str = "", whose: str = "this replica's"
) -> None:
    if value > limit:
        label = f"{value} {what}".strip()
        raise WireError(field, f"{label} is above {whose} limit of {limit} ({flag})")


# ---- distributions -----------------------------------------------------------------------------


def encode_distribution(row: torch.Tensor) -> pb2.Distribution:
    """One fp32 row [V]: sparse when it has zeros, dense otherwise."""
    row = row.detach().to("cpu", torch.float32)
    support = row.nonzero().flatten()
    if support.numel() < row.numel():
        return pb2.Distribution(
            token_ids=support.numpy().astype("<i4").tobytes(),
            probs=row[support].numpy().astype("<f4").tobytes(),
        )
    return pb2.Distribution(probs=row.numpy().astype("<f4").tobytes())


def decode_distribution(msg: pb2.Distribution, vocab_size: int, field: str) -> torch.Tensor:
    """The exact fp32 row [V] that `encode_distribution` was given."""
    probs = _array(msg.probs, "<f4", f"{field}.probs")
    if not msg.token_ids:
        if probs.size != vocab_size:
            raise WireError(
                f"{field}.probs", f"a dense distribution needs {vocab_size} values, got {probs.size}"
            )
        row = probs.copy()
    else:
        ids = _array(msg.token_ids, "<i4", f"{field}.token_ids")
        if ids.size != probs.size:
            raise WireError(f"{field}.probs", f"{probs.size} probabilities for {ids.size} token ids")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise WireError(f"{field}.token_ids", f"token ids must be in [0, {vocab_size})")
        if np.unique(ids).size != ids.size:
            raise WireError(f"{field}.token_ids", "token ids must not repeat")
        row = np.zeros(vocab_size, dtype="<f4")
        row[ids] = probs
    if not np.isfinite(row).all() or (row < 0).any():
        raise WireError(f"{field}.probs", "probabilities must be finite and >= 0")
    return torch.from_numpy(row.astype(np.float32, copy=False))


def _array(data: bytes, dtype: str, field: str) -> np.ndarray:
    if len(data) % 4:
        raise WireError(field, f"{len(data)} bytes is not a whole number of 4-byte values")
    return np.frombuffer(data, dtype=dtype)


# ---- trees -------------------------------------------------------------------------------------


def tree_to_proto(tree: DraftTree) -> pb2.DraftTree:
    return pb2.DraftTree(
        tokens=tree.tokens.tolist(),
        parents=tree.parents.tolist(),
        mode=_MODE_TO_PROTO[tree.mode],
        draft_probs=[encode_distribution(row) for row in tree.draft_probs],
        prob_rows=tree.prob_rows.tolist(),
        mtad_threshold=tree.mtad_threshold,
        vocab_size=tree.vocab_size,
    )


def tree_from_proto(
    msg: pb2.DraftTree, vocab_size: int, limits: Limits | None = None, field: str = "tree"
) -> DraftTree | None:
    """The validated tree, or None for an empty one (a plain autoregressive step)."""
    n = len(msg.tokens)
    if n == 0:
        for name in ("parents", "draft_probs"):
            if len(getattr(msg, name)):
                raise WireError(f"{field}.{name}", f"must be empty when {field}.tokens is empty")
        return None
    if msg.vocab_size != vocab_size:
        raise WireError(
            f"{field}.vocab_size",
            f"the tree was drafted over {msg.vocab_size} tokens, this vocabulary has {vocab_size}",
        )
    if limits is not None:
        _check_limit(f"{field}.tokens", n, limits.max_tree_nodes, "--max-tree-nodes", what="nodes")
    if msg.mode not in _MODE_FROM_PROTO:
        raise WireError(f"{field}.mode", "must be set to the sampling mode the tree was drafted with")
    rows = [
        decode_distribution(d, vocab_size, f"{field}.draft_probs[{i}]") for i, d in enumerate(msg.draft_probs)
    ]
    tree = DraftTree(
        tokens=torch.tensor(list(msg.tokens), dtype=torch.long),
        parents=torch.tensor(list(msg.parents), dtype=torch.long),
        mode=_MODE_FROM_PROTO[msg.mode],
        draft_probs=torch.stack(rows) if rows else torch.zeros(0, vocab_size),
        prob_rows=torch.tensor(list(msg.prob_rows), dtype=torch.long),
        mtad_threshold=msg.mtad_threshold,
    )
    try:
        tree.validate(vocab_size)
    except ValueError as exc:
        raise core_error(field, exc) from None
    if limits is not None:
        depth = int(tree.depths().max())
        _check_limit(f"{field}.parents", depth, limits.max_depth, "--max-depth", what="levels")
    if tree.mode is SamplingMode.MTAD and not (0.0 <= tree.mtad_threshold <= 1.0):  # a chain: validate
        raise WireError(f"{field}.mtad_threshold", f"must be in [0, 1], got {tree.mtad_threshold}")
    return tree


# ---- requests and verdicts ---------------------------------------------------------------------


@dataclass(frozen=True)
class RoundInput:
    """The validated fields that Draft and Verify requests share."""

    session_id: str
    position: int
    new_tokens: list[int]
    params: SamplingParams
    grammar: Grammar | None = field(default=None, kw_only=True)  # structured output

    @property
    def committed_length(self) -> int:
        """Committed tokens once new_tokens are in: what a round's randomness is derived from."""
        return self.position + len(self.new_tokens)


@dataclass(frozen=True)
class DraftInput(RoundInput):
    spec: TreeSpec
    guess_next: bool = False  # also run the likely path's leaf: the next round's pre-draft
    speculative: bool = False  # a pre-draft: not committed yet, and a later Draft supersedes it
    supersedable: bool = False  # a later Draft of the session supersedes it (DSI's drafts)
    salt: bytes = b""  # the prefix cache's namespace of a session it starts (TickSession.prefix_salt)
    feed_limit: int | None = None  # chunked prefill: past it, the call feeds a chunk only (partial)
    private: bool = False  # its session's output never teaches other sessions' drafts (suffix)

    @property
    def superseded_by_next(self) -> bool:
        return self.speculative or self.supersedable


@dataclass(frozen=True)
class VerifyInput(RoundInput):
    tree: DraftTree | None  # None: a plain autoregressive step
    plain_steps: int = 1  # no tree: tokens to decode in this call (VerifyRequest.plain_steps)
    stop_token_ids: frozenset[int] = frozenset()  # no tree: decoding stops after one of these
    top_logprobs: int | None = None  # the emitted tokens' log-probabilities, with this many alternatives
    lookup_depth: int = 0  # no tree: n-gram proposals of at most this many tokens ride in the steps
    lookup_min_ngram: int = 0  # ... those whose match has at least this many tokens (0: any)
    max_tokens: int = 0  # no tree: tokens the call may emit at most, rides included (0: no bound)
    suffix_rides: bool = False  # no tree: suffix trees from the mesh's outputs may ride too
    salt: bytes = b""  # the prefix cache's namespace of a session it starts (TickSession.prefix_salt)
    feed_limit: int | None = None  # chunked prefill: past it, the call feeds a chunk only (partial)


def session_id_from_proto(value: str, field: str = "session_id") -> str:
    if not value:
        raise WireError(field, "must not be empty")
    if len(value.encode()) > MAX_SESSION_ID_BYTES:
        raise WireError(field, f"must be at most {MAX_SESSION_ID_BYTES} bytes")
    return value


def token_ids_from_proto(
    values, vocab_size: int, field: str = "new_token_ids", *, empty: bool = False
) -> list[int]:
    """Token ids inside the vocabulary (the first one outside is named); non-empty unless `empty`."""
    if not values and not empty:
        raise WireError(field, "must not be empty (the new tokens produce the root distribution)")
    tokens = [int(t) for t in values]
    for i, t in enumerate(tokens):
        if t >= vocab_size:
            raise WireError(f"{field}[{i}]", f"token id {t} is outside the vocabulary [0, {vocab_size})")
    return tokens


def _round_fields(req: pb2.DraftRequest | pb2.VerifyRequest, vocab_size: int) -> dict:
    return dict(
        session_id=session_id_from_proto(req.session_id),
        position=req.position,
        new_tokens=token_ids_from_proto(req.new_token_ids, vocab_size),
        params=sampling_from_proto(req.sampling),
        grammar=grammar_from_proto(req.grammar),
    )


def grammar_from_proto(msg: Any) -> Grammar | None:
    if not msg.text:
        return None
    if len(msg.text.encode()) > MAX_GRAMMAR_BYTES:
        raise WireError("grammar.text", f"must be at most {MAX_GRAMMAR_BYTES} bytes")
    return Grammar(msg.text, msg.start)


def grammar_to_proto(grammar: Grammar | None) -> pb2.Grammar | None:
    return None if grammar is None else pb2.Grammar(text=grammar.text, start=grammar.start)


def parse_draft_request(req: pb2.DraftRequest, vocab_size: int, limits: Limits) -> DraftInput:
    return DraftInput(
        **_round_fields(req, vocab_size),
        spec=tree_spec_from_proto(req.tree_spec, limits),
        guess_next=req.guess_next,
        speculative=req.speculative,
        supersedable=req.supersedable,
        private=req.private,
    )


def parse_verify_request(req: pb2.VerifyRequest, vocab_size: int, limits: Limits) -> VerifyInput:
    fields = _round_fields(req, vocab_size)
    tree = tree_from_proto(req.tree, vocab_size, limits)
    stops = frozenset(token_ids_from_proto(req.stop_token_ids, vocab_size, "stop_token_ids", empty=True))
    top = req.top_logprobs if req.HasField("top_logprobs") else None
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise WireError("top_logprobs", f"must be at most {MAX_TOP_LOGPROBS}, got {top}")
    v = VerifyInput(
        **fields, tree=tree, plain_steps=max(req.plain_steps, 1), stop_token_ids=stops, top_logprobs=top,
        lookup_depth=req.lookup_depth, lookup_min_ngram=req.lookup_min_ngram, max_tokens=req.max_tokens,
        suffix_rides=req.suffix_rides,
    )  # fmt: skip
    check_verify_input(v, limits)
    return v


def check_verify_input(v: VerifyInput, limits: Limits, field: str = "tree") -> None:
    """What a verification may be, however it came (a Verify call, an item of a tick): a tree
    within the replica's limits whose tokens its rows could have drawn (sampled verification), one
    plain step with a tree, at most MAX_PLAIN_STEPS without."""
    tree = v.tree
    if tree is not None:
        _check_limit(
            f"{field}.tokens", tree.num_nodes, limits.max_tree_nodes, "--max-tree-nodes", what="nodes"
        )
        depth = int(tree.depths().max()) if not tree.is_chain else tree.num_nodes
        _check_limit(f"{field}.parents", depth, limits.max_depth, "--max-depth", what="levels")
        if not v.params.greedy:
            try:
                tree.check_drawable()
            except ValueError as exc:
                raise core_error(field, exc) from None
    if v.plain_steps > 1 and tree is not None:
        raise WireError("plain_steps", "is for plain decoding only; a request with a tree decodes one round")
    if v.plain_steps > MAX_PLAIN_STEPS:
        raise WireError("plain_steps", f"must be at most {MAX_PLAIN_STEPS}, got {v.plain_steps}")
    if v.lookup_depth and tree is not None:
        raise WireError("lookup_depth", "is for plain decoding only; a request with a tree has its draft")
    if v.lookup_depth and v.grammar is not None:
        raise WireError("lookup_depth", "cannot be used with a grammar (its masks follow the draft's paths)")
    _check_limit("lookup_depth", v.lookup_depth, limits.max_depth, "--max-depth", what="tokens")
    if v.lookup_min_ngram and not v.lookup_depth:
        raise WireError("lookup_min_ngram", "is for n-gram rides only: set lookup_depth too")
    if v.lookup_min_ngram > MAX_MATCH:
        raise WireError("lookup_min_ngram", f"must be at most {MAX_MATCH} (the longest match it measures)")
    if v.max_tokens and tree is not None:
        raise WireError("max_tokens", "is for plain decoding only; a request with a tree decodes one round")
    if v.suffix_rides and tree is not None:
        raise WireError("suffix_rides", "is for plain decoding only; a request with a tree has its draft")
    if v.suffix_rides and v.grammar is not None:
        raise WireError("suffix_rides", "cannot be used with a grammar (its masks follow the draft's paths)")


def _round_message(
    session_id: str, position: int, new_tokens: list[int], params: SamplingParams, grammar: Grammar | None
) -> dict:
    return dict(
        session_id=session_id,
        position=position,
        new_token_ids=new_tokens,
        sampling=sampling_to_proto(params),
        grammar=grammar_to_proto(grammar),
    )


def draft_request(
    session_id: str, position: int, new_tokens: list[int], params: SamplingParams, spec: TreeSpec,
    *, guess_next: bool = False, speculative: bool = False, supersedable: bool = False,
    grammar: Grammar | None = None,
) -> pb2.DraftRequest:  # fmt: skip
    fields = _round_message(session_id, position, new_tokens, params, grammar)
    return pb2.DraftRequest(
        **fields, tree_spec=tree_spec_to_proto(spec), guess_next=guess_next, speculative=speculative,
        supersedable=supersedable,
    )  # fmt: skip


def verify_request(
    session_id: str,
    position: int,
    new_tokens: list[int],
    params: SamplingParams,
    tree: pb2.DraftTree | bytes | None,
    plain_steps: int = 1,
    stop_token_ids: Sequence[int] = (),
    top_logprobs: int | None = None,
    grammar: Grammar | None = None,
    lookup_depth: int = 0,
    lookup_min_ngram: int = 0,
    max_tokens: int = 0,
    suffix_rides: bool = False,
) -> pb2.VerifyRequest | pb2.VerifyRequestRelay:
    """tree None (or empty): a plain autoregressive step, or `plain_steps` of them in one call
    (stopping after a stop token); bytes: a tree relayed as the drafter encoded it (a
    VerifyRequestRelay, the same bytes on the wire). top_logprobs: VerifyRequest.top_logprobs."""
    fields = _round_message(session_id, position, new_tokens, params, grammar)
    if plain_steps > 1:
        fields.update(plain_steps=plain_steps, stop_token_ids=list(stop_token_ids))
    if top_logprobs is not None:
        fields.update(top_logprobs=top_logprobs)
    if lookup_depth:
        fields.update(lookup_depth=lookup_depth, lookup_min_ngram=lookup_min_ngram)
    if max_tokens:
        fields.update(max_tokens=max_tokens)
    if suffix_rides:
        fields.update(suffix_rides=True)
    if isinstance(tree, bytes):
        return pb2.VerifyRequestRelay(**fields, tree=tree)
    return pb2.VerifyRequest(**fields, tree=tree)


def verdict_to_proto(
    verdict: Verdict,
    plain_tokens: Sequence[int] = (),
    logprobs: Sequence[TokenLogprob] = (),
    **stats: float,
) -> pb2.VerifyResponse:
    """plain_tokens: tokens decoded by earlier plain steps of the call; logprobs: of the plain and
    the emitted tokens, in order; stats: batch_size, batch_tokens, forward_seconds, queue_seconds,
    ride_nodes and ride_accepted."""
    return pb2.VerifyResponse(
        accepted_token_ids=verdict.accepted_tokens,
        accepted_nodes=verdict.accepted_nodes,
        next_token=verdict.next_token,
        bonus=verdict.bonus,
        plain_token_ids=plain_tokens,
        logprobs=[
            pb2.EmittedLogprob(
                token=t.token, logprob=t.logprob, top_tokens=[a for a, _ in t.top],
                top_logprobs=[v for _, v in t.top],
            )
            for t in logprobs
        ],
        **stats,
    )  # fmt: skip


def logprobs_from_proto(messages: Sequence[Any]) -> list[TokenLogprob]:
    return [
        TokenLogprob(m.token, m.logprob, tuple(zip(m.top_tokens, m.top_logprobs, strict=True)))
        for m in messages
    ]


def verdict_from_proto(msg: pb2.VerifyResponse) -> Verdict:
    return Verdict(list(msg.accepted_token_ids), list(msg.accepted_nodes), msg.next_token, msg.bonus)
