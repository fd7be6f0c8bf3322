"""Ticks on the wire (proto/specmesh/v1, "ticks"): the columns of specmesh.core.ticks <-> messages.

Every column is packed little-endian bytes read with one numpy call; a column of the wrong size is a
`WireError` naming it (the whole tick is refused), a bad item an `ItemError` of its own (its session
alone fails, the others in the tick go on).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specmesh.core.grammar import Grammar
from specmesh.core.logprobs import MAX_TOP_LOGPROBS
from specmesh.core.sampling import SamplingParams
from specmesh.core.ticks import ColumnError, Ragged, TreeColumns
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2

GUESS_NEXT, SPECULATIVE, SUPERSEDABLE = 1, 2, 4  # DraftTick.flags bits


def packed(values: Any, dtype: str) -> bytes:
    return np.ascontiguousarray(values, dtype=dtype).tobytes()


def column(data: bytes, dtype: str, field: str, n: int | None = None) -> np.ndarray:
    """A packed column; n: the entries it must have."""
    size = np.dtype(dtype).itemsize
    if len(data) % size:
        raise wire.WireError(field, f"{len(data)} bytes is not a whole number of {size}-byte values")
    out = np.frombuffer(data, dtype=dtype)
    if n is not None and len(out) != n:
        raise wire.WireError(field, f"{len(out)} entries, need {n}")
    return out


def ragged_to_proto(r: Ragged, dtype: str = "<i4") -> pb2.Ragged:
    return pb2.Ragged(offsets=packed(r.offsets, "<i4"), values=packed(r.values, dtype))


def ragged_from_proto(msg: Any, n: int, field: str, dtype: str = "<i4") -> Ragged:
    offsets = column(msg.offsets, "<i4", f"{field}.offsets").astype(np.int64)
    values = column(msg.values, dtype, f"{field}.values")
    if not len(offsets):  # an empty message: n empty lists
        offsets = np.zeros(n + 1, np.int64)
    r = Ragged(offsets, values)
    try:
        r.check(field, n)
    except ColumnError as exc:
        raise wire.WireError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    return r


def trees_to_proto(c: TreeColumns) -> pb2.Trees:
    return pb2.Trees(
        tokens=ragged_to_proto(c.tokens),
        parents=packed(c.parents, "<i4"),
        modes=packed(c.modes, "u1"),
        mtad_thresholds=packed(c.thresholds, "<f4"),
        prob_rows=packed(c.prob_rows, "<i4"),
        item_rows=packed(c.item_rows, "<i4"),
        row_ids=ragged_to_proto(c.row_ids),
        row_probs=ragged_to_proto(c.row_probs, "<f4"),
        vocab_size=c.vocab_size,
    )


def trees_from_proto(msg: Any, n: int, field: str = "trees") -> TreeColumns:
    """The columns as sent, sizes checked against the tick's n items (`TreeColumns.check` then
    checks each tree). An unset message is n items without a tree."""
    tokens = ragged_from_proto(msg.tokens, n, f"{field}.tokens")
    nodes = len(tokens.values)
    item_rows = column(msg.item_rows, "<i4", f"{field}.item_rows").astype(np.int64)
    if not len(item_rows):
        item_rows = np.zeros(n + 1, np.int64)
    rows = int(item_rows[-1]) if len(item_rows) == n + 1 else 0
    modes = column(msg.modes, "u1", f"{field}.modes")
    thresholds = column(msg.mtad_thresholds, "<f4", f"{field}.mtad_thresholds")
    prob_rows = column(msg.prob_rows, "<i4", f"{field}.prob_rows")
    if not nodes and not len(modes):  # no tree at all: the defaults
        modes, thresholds = np.zeros(n, np.uint8), np.zeros(n, np.float32)
        prob_rows = np.full(n, -1, np.int32) if not len(prob_rows) else prob_rows
    return TreeColumns(
        tokens=tokens,
        parents=column(msg.parents, "<i4", f"{field}.parents"),
        modes=modes,
        thresholds=thresholds,
        prob_rows=prob_rows,
        item_rows=item_rows,
        row_ids=ragged_from_proto(msg.row_ids, rows, f"{field}.row_ids"),
        row_probs=ragged_from_proto(msg.row_probs, rows, f"{field}.row_probs", "<f4"),
        vocab_size=msg.vocab_size,
    )


# ---- sessions named by a stream -----------------------------------------------------------------


@dataclass(frozen=True)
class Opened:
    """What a stream said of a session when it opened its handle."""

    session_id: str
    key: str
    params: SamplingParams
    stop_token_ids: frozenset[int] = frozenset()
    top_logprobs: int | None = None
    grammar: Grammar | None = None
    salt: bytes = b""  # the prefix cache's namespace (TickSession.prefix_salt)


def opened_from_proto(msg: Any, vocab_size: int) -> Opened:
    session_id = wire.session_id_from_proto(msg.session_id, "open.session_id")
    top = msg.top_logprobs if msg.HasField("top_logprobs") else None
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise wire.WireError("open.top_logprobs", f"must be at most {MAX_TOP_LOGPROBS}, got {top}")
    stops = wire.token_ids_from_proto(msg.stop_token_ids, vocab_size, "open.stop_token_ids", empty=True)
    return Opened(
        session_id=session_id,
        key=msg.key,
        params=wire.sampling_from_proto(msg.sampling, "open.sampling"),
        stop_token_ids=frozenset(stops),
        top_logprobs=top,
        grammar=wire.grammar_from_proto(msg.grammar),
        salt=msg.prefix_salt,
    )


def opened_to_proto(handle: int, o: Opened) -> pb2.TickSession:
    msg = pb2.TickSession(
        handle=handle,
        session_id=o.session_id,
        key=o.key,
        sampling=wire.sampling_to_proto(o.params),
        stop_token_ids=sorted(o.stop_token_ids),
        grammar=wire.grammar_to_proto(o.grammar),
        prefix_salt=o.salt,
    )
    if o.top_logprobs is not None:
        msg.top_logprobs = o.top_logprobs
    return msg


# ---- the items of a tick ------------------------------------------------------------------------


@dataclass(frozen=True)
class TickItems:
    """The columns every tick has: which sessions, from where, with which new tokens."""

    handles: np.ndarray  # uint32 [n]
    positions: np.ndarray  # int64 [n]
    new_tokens: Ragged
    cancel: np.ndarray  # uint32 handles
    release: np.ndarray  # uint32 handles
    feed: np.ndarray  # uint32 [n]: > 0, the item's feed limit (chunked prefill)

    def __len__(self) -> int:
        return len(self.handles)


def items_from_proto(msg: Any, vocab_size: int) -> TickItems:
    handles = column(msg.handles, "<u4", "handles")
    n = len(handles)
    new = ragged_from_proto(msg.new_tokens, n, "new_tokens")
    bad = np.flatnonzero((new.values < 0) | (new.values >= vocab_size))
    if len(bad):
        raise wire.WireError("new_tokens", f"token id {int(new.values[bad[0]])} is outside the vocabulary "
                             f"[0, {vocab_size})")  # fmt: skip
    return TickItems(
        handles=handles,
        positions=column(msg.positions, "<i8", "positions", n),
        new_tokens=new,
        cancel=column(msg.cancel, "<u4", "cancel"),
        release=column(msg.release, "<u4", "release"),
        feed=column(msg.feed, "<u4", "feed", n) if msg.feed else np.zeros(n, np.uint32),
    )


def items_fields(
    handles: Sequence[int], positions: Sequence[int], new_tokens: Sequence[Sequence[int]],
    feed: Sequence[int] = (),
) -> dict:  # fmt: skip
    return dict(
        handles=packed(handles, "<u4"),
        positions=packed(positions, "<i8"),
        new_tokens=ragged_to_proto(Ragged.from_lists(new_tokens)),
        feed=packed(feed, "<u4") if any(feed) else b"",
    )


def draft_specs_from_proto(msg: Any, n: int, limits: wire.Limits) -> tuple[list, np.ndarray]:
    """(the tick's TreeSpecs, or the WireError of a bad one, per spec; each item's spec index)."""
    specs: list = []
    for i, spec in enumerate(msg.specs):
        try:
            specs.append(wire.tree_spec_from_proto(spec, limits, f"specs[{i}]"))
        except wire.WireError as exc:
            specs.append(exc)
    index = column(msg.spec_index, "u1", "spec_index", n).astype(np.int64)
    if n and int(index.max()) >= len(specs):
        raise wire.WireError("spec_index", f"indexes {len(specs)} specs")
    return specs, index


@dataclass
class ItemFailure:
    """One item's error, as a call would have had it."""

    code: int
    message: str
    resync: bool = False


@dataclass
class Prefilled:
    """What a partial item did (it fed a chunk only): committed tokens the replica holds after it,
    of which `cached` it took from a kept or shared prefix."""

    held: int
    cached: int = 0


@dataclass
class DraftAnswer:
    """What the drafter answers for one item."""

    tree: Any = None  # DraftTree | None
    likely: list[int] = field(default_factory=list)
    forwards: int = 0
    cached: int = 0  # tokens the item's session took from a prefix when the item started it


@dataclass
class VerifyAnswer:
    tokens: list[int]  # plain, accepted, next
    plain: int
    accepted_nodes: list[int]
    bonus: bool
    logprobs: list = field(default_factory=list)  # TokenLogprob, when asked
    rides: tuple[int, int] = (0, 0)  # plain steps' n-gram rides: nodes checked, accepted
    cached: int = 0  # as DraftAnswer.cached


def prefill_fields(outcomes: Sequence[Any]) -> dict:
    """The result's `held` and `cached` columns (each absent when it says nothing)."""
    held = [o.held if isinstance(o, Prefilled) else -1 for o in outcomes]
    cached = [getattr(o, "cached", 0) for o in outcomes]
    return dict(
        held=packed(held, "<i8") if any(h >= 0 for h in held) else b"",
        cached=packed(cached, "<u4") if any(cached) else b"",
    )


def prefills_from_proto(msg: Any, n: int) -> tuple[list[int], list[int]]:
    """(held per item, -1 where it is no prefill; cached per item) of a result (the caller's side)."""
    held = column(msg.held, "<i8", "held", n).tolist() if msg.held else [-1] * n
    cached = column(msg.cached, "<u4", "cached", n).tolist() if msg.cached else [0] * n
    return held, cached


def status_fields(outcomes: Sequence[Any]) -> dict:
    status = np.zeros(len(outcomes), np.uint8)
    errors = []
    for i, o in enumerate(outcomes):
        if isinstance(o, ItemFailure):
            status[i] = o.code
            errors.append(pb2.ItemError(index=i, code=o.code, message=o.message, resync=o.resync))
    return dict(status=status.tobytes(), errors=errors)


def draft_result(
    tick_id: int, outcomes: Sequence[DraftAnswer | Prefilled | ItemFailure], vocab_size: int,
    seconds: float, prefix_version: int = 0, kv_usage: float = 0.0,
):  # fmt: skip
    trees = [o.tree if isinstance(o, DraftAnswer) else None for o in outcomes]
    return pb2.DraftTickResult(
        id=tick_id,
        **status_fields(outcomes),
        **prefill_fields(outcomes),
        prefix_version=prefix_version,
        kv_usage=kv_usage,
        trees=trees_to_proto(TreeColumns.from_trees(trees, vocab_size)),
        likely=ragged_to_proto(
            Ragged.from_lists([o.likely if isinstance(o, DraftAnswer) else [] for o in outcomes])
        ),
        forwards=packed([o.forwards if isinstance(o, DraftAnswer) else 0 for o in outcomes], "<u2"),
        seconds=seconds,
    )


def verify_result(
    tick_id: int, outcomes: Sequence[VerifyAnswer | Prefilled | ItemFailure], prefix_version: int = 0,
    kv_usage: float = 0.0, **stats: float,
):  # fmt: skip
    ok = [o if isinstance(o, VerifyAnswer) else None for o in outcomes]
    logprobs = [t for o in ok if o is not None for t in o.logprobs]
    return pb2.VerifyTickResult(
        id=tick_id,
        **status_fields(outcomes),
        **prefill_fields(outcomes),
        prefix_version=prefix_version,
        kv_usage=kv_usage,
        tokens=ragged_to_proto(Ragged.from_lists([o.tokens if o else [] for o in ok])),
        plain=packed([o.plain if o else 0 for o in ok], "<i4"),
        accepted_nodes=ragged_to_proto(Ragged.from_lists([o.accepted_nodes if o else [] for o in ok])),
        bonus=packed([bool(o and o.bonus) for o in ok], "u1"),
        logprob_counts=packed([len(o.logprobs) if o else 0 for o in ok], "<i4"),
        rides=packed([o.rides if o else (0, 0) for o in ok], "<i4")
        if any(o and any(o.rides) for o in ok)
        else b"",
        logprobs=[
            pb2.EmittedLogprob(
                token=t.token,
                logprob=t.logprob,
                top_tokens=[a for a, _ in t.top],
                top_logprobs=[v for _, v in t.top],
            )
            for t in logprobs
        ],
        **stats,
    )


def item_failures(msg: Any, n: int) -> dict[int, ItemFailure]:
    """The failed items of a result (the caller's side)."""
    status = column(msg.status, "u1", "status", n)
    failures = {e.index: ItemFailure(e.code, e.message, e.resync) for e in msg.errors}
    for i in np.flatnonzero(status).tolist():
        failures.setdefault(i, ItemFailure(int(status[i]), "failed"))
    return failures
