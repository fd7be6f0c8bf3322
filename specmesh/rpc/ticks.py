"""Ticks on the wire (proto/specmesh/v1, "ticks"): the columns of specmesh.core.ticks <-> messages.

The four messages of a tick stream each have one codec here, a dataclass with `to_proto` and
`from_proto`: `DraftTickMessage` and `VerifyTickMessage` (a gateway's tick loop to a replica), and
`DraftResultMessage` and `VerifyResultMessage` (the replica's answers). Nothing else reads or
writes those protos: the tick loop (specmesh.rpc.tick_client) and the services build and read
these dataclasses.

Every column is packed little-endian bytes read with one numpy call; a column of the wrong size is a
`WireError` naming it (the whole tick is refused), a bad item an `ItemError` of its own (its session
alone fails, the others in the tick go on), and so is a bad session opening (its handle alone).
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
    private: bool = False  # its output never teaches other sessions' drafts (TickSession.private)


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
        private=msg.private,
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
        private=o.private,
    )
    if o.top_logprobs is not None:
        msg.top_logprobs = o.top_logprobs
    return msg


def _optional(values: Any, dtype: str) -> bytes:
    """A column whose absence means zeros: left out when every value is 0."""
    return packed(values, dtype) if np.any(values) else b""


def _zeros_if_absent(data: bytes, dtype: str, field: str, n: int) -> np.ndarray:
    """An optional column (`_optional`) as read: n zeros where it was left out."""
    return column(data, dtype, field, n) if data else np.zeros(n, dtype)


# ---- the items of a tick ------------------------------------------------------------------------


@dataclass(frozen=True)
class TickItems:
    """The columns every tick has: which sessions, from where, with which new tokens."""

    handles: np.ndarray  # uint32 [n]
    positions: np.ndarray  # int64 [n]
    new_tokens: Ragged  # [n] items
    cancel: np.ndarray  # uint32 [any]: handles whose work in flight stops
    release: np.ndarray  # uint32 [any]: handles whose sessions end
    feed: np.ndarray  # uint32 [n]: > 0, the item's feed limit (chunked prefill); 0: none

    def __len__(self) -> int:
        return len(self.handles)

    @classmethod
    def of(
        cls, handles: Sequence[int], positions: Sequence[int], new_tokens: Sequence[Sequence[int]],
        feed: Sequence[int] = (), cancel: Sequence[int] = (), release: Sequence[int] = (),
    ) -> TickItems:  # fmt: skip
        n = len(handles)
        return cls(
            handles=np.asarray(handles, np.uint32),
            positions=np.asarray(positions, np.int64),
            new_tokens=Ragged.from_lists(new_tokens),
            cancel=np.asarray(cancel, np.uint32),
            release=np.asarray(release, np.uint32),
            feed=np.asarray(feed, np.uint32) if len(feed) else np.zeros(n, np.uint32),
        )

    @classmethod
    def from_proto(cls, msg: Any, vocab_size: int) -> TickItems:
        handles = column(msg.handles, "<u4", "handles")
        n = len(handles)
        new = ragged_from_proto(msg.new_tokens, n, "new_tokens")
        bad = np.flatnonzero((new.values < 0) | (new.values >= vocab_size))
        if len(bad):
            token = int(new.values[bad[0]])
            raise wire.WireError(
                "new_tokens", f"token id {token} is outside the vocabulary [0, {vocab_size})"
            )
        return cls(
            handles=handles,
            positions=column(msg.positions, "<i8", "positions", n),
            new_tokens=new,
            cancel=column(msg.cancel, "<u4", "cancel"),
            release=column(msg.release, "<u4", "release"),
            feed=_zeros_if_absent(msg.feed, "<u4", "feed", n),
        )

    def fields(self) -> dict:
        """The message fields these columns fill (the same in both kinds of tick)."""
        return dict(
            handles=packed(self.handles, "<u4"),
            positions=packed(self.positions, "<i8"),
            new_tokens=ragged_to_proto(self.new_tokens),
            feed=_optional(self.feed, "<u4"),
            cancel=packed(self.cancel, "<u4"),
            release=packed(self.release, "<u4"),
        )


Opens = list[tuple[int, "Opened | wire.WireError"]]  # handle -> the session it names, or why not


def _opens_from_proto(msg: Any, vocab_size: int) -> Opens:
    """Each session a tick opens, or the error that refuses its handle alone."""
    out: Opens = []
    for m in msg.open:
        try:
            out.append((m.handle, opened_from_proto(m, vocab_size)))
        except wire.WireError as exc:
            out.append((m.handle, exc))
    return out


def _opens_to_proto(opens: Opens) -> list[pb2.TickSession]:
    return [opened_to_proto(h, o) for h, o in opens if isinstance(o, Opened)]


# ---- the four messages of a tick stream: each one's only codec --------------------------------------


@dataclass
class DraftTickMessage:
    """A draft tick (pb2.DraftTick): the items, and what each drafts."""

    id: int
    opens: Opens
    items: TickItems
    specs: list  # the tick's distinct TreeSpecs; a bad one's WireError, which fails its items alone
    spec_index: np.ndarray  # int64 [n]: each item's spec
    flags: np.ndarray  # uint8 [n]: GUESS_NEXT | SPECULATIVE | SUPERSEDABLE

    def to_proto(self) -> pb2.DraftTick:
        return pb2.DraftTick(
            id=self.id, open=_opens_to_proto(self.opens), **self.items.fields(),
            specs=[wire.tree_spec_to_proto(s) for s in self.specs], spec_index=packed(self.spec_index, "u1"),
            flags=packed(self.flags, "u1"),
        )  # fmt: skip

    @classmethod
    def from_proto(cls, msg: Any, vocab_size: int, limits: wire.Limits) -> DraftTickMessage:
        items = TickItems.from_proto(msg, vocab_size)
        n = len(items)
        specs: list = []
        for i, spec in enumerate(msg.specs):
            try:
                specs.append(wire.tree_spec_from_proto(spec, limits, f"specs[{i}]"))
            except wire.WireError as exc:
                specs.append(exc)
        index = column(msg.spec_index, "u1", "spec_index", n).astype(np.int64)
        if n and int(index.max()) >= len(specs):
            raise wire.WireError("spec_index", f"indexes {len(specs)} specs")
        flags = column(msg.flags, "u1", "flags", n) if n else np.zeros(0, np.uint8)
        return cls(msg.id, _opens_from_proto(msg, vocab_size), items, specs, index, flags)


@dataclass
class VerifyTickMessage:
    """A verify tick (pb2.VerifyTick): the items, each one's tree (none: plain decoding), and its
    plain decoding's settings."""

    id: int
    opens: Opens
    items: TickItems
    trees: TreeColumns  # [n] items; an item without nodes decodes plainly
    plain_steps: np.ndarray  # uint8 [n]: plain steps at most (0 reads as 1)
    lookup_depth: np.ndarray  # uint8 [n]: the deepest n-gram ride of a plain step (0: none)
    lookup_min_ngram: np.ndarray  # uint8 [n]: ... of matches at least this long
    max_tokens: np.ndarray  # uint32 [n]: tokens the item may emit at most (0: no bound)
    # uint8 [n]: 1: suffix trees may ride its plain steps (empty: none may)
    suffix_rides: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint8))

    def to_proto(self) -> pb2.VerifyTick:
        return pb2.VerifyTick(
            id=self.id, open=_opens_to_proto(self.opens), **self.items.fields(),
            trees=trees_to_proto(self.trees), plain_steps=packed(self.plain_steps, "u1"),
            lookup_depth=_optional(self.lookup_depth, "u1"),
            lookup_min_ngram=_optional(self.lookup_min_ngram, "u1"),
            max_tokens=_optional(self.max_tokens, "<u4"), suffix_rides=_optional(self.suffix_rides, "u1"),
        )  # fmt: skip

    @classmethod
    def from_proto(cls, msg: Any, vocab_size: int, limits: wire.Limits | None = None) -> VerifyTickMessage:
        items = TickItems.from_proto(msg, vocab_size)
        n = len(items)
        return cls(
            msg.id, _opens_from_proto(msg, vocab_size), items, trees_from_proto(msg.trees, n),
            plain_steps=column(msg.plain_steps, "u1", "plain_steps", n) if n else np.zeros(0, np.uint8),
            lookup_depth=_zeros_if_absent(msg.lookup_depth, "u1", "lookup_depth", n),
            lookup_min_ngram=_zeros_if_absent(msg.lookup_min_ngram, "u1", "lookup_min_ngram", n),
            max_tokens=_zeros_if_absent(msg.max_tokens, "<u4", "max_tokens", n),
            suffix_rides=_zeros_if_absent(msg.suffix_rides, "u1", "suffix_rides", n),
        )  # fmt: skip


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

    tree: Any = None  # DraftTree | None; None on the caller's side (`DraftResultMessage.trees`)
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


Outcome = Any  # an item's: its kind's answer, Prefilled, or ItemFailure


def _outcome_fields(outcomes: Sequence[Outcome]) -> dict:
    """The columns every result has: each item's status and error, and what a partial item holds."""
    status = np.zeros(len(outcomes), np.uint8)
    errors = []
    for i, o in enumerate(outcomes):
        if isinstance(o, ItemFailure):
            status[i] = o.code
            errors.append(pb2.ItemError(index=i, code=o.code, message=o.message, resync=o.resync))
    held = [o.held if isinstance(o, Prefilled) else -1 for o in outcomes]
    cached = [getattr(o, "cached", 0) for o in outcomes]
    return dict(
        status=status.tobytes(),
        errors=errors,
        held=packed(held, "<i8") if any(h >= 0 for h in held) else b"",
        cached=_optional(cached, "<u4"),
    )


def _outcomes(msg: Any, n: int, answers: list) -> list[Outcome]:
    """Each item's outcome from a result: its failure, or what it prefilled, or its answer
    (`answers`, whose `cached` this fills)."""
    status = column(msg.status, "u1", "status", n)
    failures = {e.index: ItemFailure(e.code, e.message, e.resync) for e in msg.errors}
    for i in np.flatnonzero(status).tolist():
        failures.setdefault(i, ItemFailure(int(status[i]), "failed"))
    held = column(msg.held, "<i8", "held", n).tolist() if msg.held else [-1] * n
    cached = _zeros_if_absent(msg.cached, "<u4", "cached", n).tolist()
    out: list[Outcome] = []
    for i in range(n):
        if i in failures:
            out.append(failures[i])
        elif held[i] >= 0:  # a limited item that fed a chunk only
            out.append(Prefilled(held[i], cached[i]))
        else:
            answers[i].cached = cached[i]
            out.append(answers[i])
    return out


@dataclass
class DraftResultMessage:
    """A draft tick's answer (pb2.DraftTickResult). The trees stay columns: a gateway relays them
    to its verifier without decoding them (a gateway-only install has no torch)."""

    id: int
    outcomes: list[Outcome]  # [n]: DraftAnswer (its tree in `trees`), Prefilled or ItemFailure
    trees: TreeColumns  # [n] items; an item without a tree has no nodes
    seconds: float = 0.0  # the tick's time on the drafter
    prefix_version: int = 0  # of what its `Prefixes` answers (0: no prefix cache)
    kv_usage: float = 0.0  # the share of its KV budget in use

    @classmethod
    def of(
        cls, tick_id: int, outcomes: Sequence[Outcome], vocab_size: int, **rest: Any
    ) -> DraftResultMessage:
        """The drafter's side: answers with their DraftTrees."""
        trees = [o.tree if isinstance(o, DraftAnswer) else None for o in outcomes]
        return cls(tick_id, list(outcomes), TreeColumns.from_trees(trees, vocab_size), **rest)

    def to_proto(self) -> pb2.DraftTickResult:
        ok = [o if isinstance(o, DraftAnswer) else None for o in self.outcomes]
        return pb2.DraftTickResult(
            id=self.id, **_outcome_fields(self.outcomes), trees=trees_to_proto(self.trees),
            likely=ragged_to_proto(Ragged.from_lists([o.likely if o else [] for o in ok])),
            forwards=packed([o.forwards if o else 0 for o in ok], "<u2"), seconds=self.seconds,
            prefix_version=self.prefix_version, kv_usage=self.kv_usage,
        )  # fmt: skip

    @classmethod
    def from_proto(cls, msg: Any, n: int) -> DraftResultMessage:
        likely = ragged_from_proto(msg.likely, n, "likely").lists()
        forwards = column(msg.forwards, "<u2", "forwards", n).tolist() if n else []
        answers = [DraftAnswer(None, likely[i], forwards[i]) for i in range(n)]
        return cls(
            msg.id, _outcomes(msg, n, answers), trees_from_proto(msg.trees, n), msg.seconds,
            msg.prefix_version, msg.kv_usage,
        )  # fmt: skip


@dataclass
class VerifyResultMessage:
    """A verify tick's answer (pb2.VerifyTickResult), with the tick's forward statistics."""

    id: int
    outcomes: list[Outcome]  # [n]: VerifyAnswer, Prefilled or ItemFailure
    prefix_version: int = 0  # as DraftResultMessage's
    kv_usage: float = 0.0
    batch_size: int = 0  # the largest forward's steps
    batch_tokens: int = 0  # ... and rows
    forward_seconds: float = 0.0
    queue_seconds: float = 0.0

    def to_proto(self) -> pb2.VerifyTickResult:
        ok = [o if isinstance(o, VerifyAnswer) else None for o in self.outcomes]
        logprobs = [t for o in ok if o is not None for t in o.logprobs]
        return pb2.VerifyTickResult(
            id=self.id,
            **_outcome_fields(self.outcomes),
            prefix_version=self.prefix_version,
            kv_usage=self.kv_usage,
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
            batch_size=self.batch_size,
            batch_tokens=self.batch_tokens,
            forward_seconds=self.forward_seconds,
            queue_seconds=self.queue_seconds,
        )

    @classmethod
    def from_proto(cls, msg: Any, n: int) -> VerifyResultMessage:
        tokens = ragged_from_proto(msg.tokens, n, "tokens").lists()
        nodes = ragged_from_proto(msg.accepted_nodes, n, "accepted_nodes").lists()
        plain = column(msg.plain, "<i4", "plain", n).tolist() if n else []
        bonus = column(msg.bonus, "u1", "bonus", n).tolist() if n else []
        counts = column(msg.logprob_counts, "<i4", "logprob_counts", n).tolist() if n else []
        logprobs = wire.logprobs_from_proto(msg.logprobs)
        rides = column(msg.rides, "<i4", "rides", 2 * n).reshape(n, 2).tolist() if msg.rides else [[0, 0]] * n
        starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).tolist() if n else [0]
        answers = [
            VerifyAnswer(
                tokens[i],
                plain[i],
                nodes[i],
                bool(bonus[i]),
                logprobs[starts[i] : starts[i + 1]],
                (int(rides[i][0]), int(rides[i][1])),
            )
            for i in range(n)
        ]
        return cls(
            msg.id, _outcomes(msg, n, answers), msg.prefix_version, msg.kv_usage, msg.batch_size,
            msg.batch_tokens, msg.forward_seconds, msg.queue_seconds,
        )  # fmt: skip
