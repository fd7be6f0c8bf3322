"""The model backend interface: what the engine and the model services need from a model.

A backend holds many sessions of one model. Each session has committed tokens (kept even when its
KV is evicted) and, while a tree is drafted or verified, pending tree nodes. One `forward` runs
the steps of many sessions in ONE model call; `commit` keeps an accepted root-to-node path and
drops the other pending nodes. Two implementations:

  torch      `specmesh.runtime.runner.ModelRunner`: any Hugging Face causal LM, CPU or GPU
  llama.cpp  `specmesh.runtime.llama_cpp.LlamaCppRunner`: a GGUF file as it is (quantised weights),
             through llama-cpp-python; CPU

Both take the same `Step`s and return the same rows, and every rule about steps (`check_step`,
`check_path`) is written once, here.

Prefixes kept across requests (`enable_prefix_cache`): a released session's KV stays as a *kept
prefix* (the session's state itself, moved out of the session table), indexed with the live
sessions' committed tokens by chained block hashes (specmesh.core.prefix). A session that starts
without KV (new, or evicted) takes the longest prefix of its tokens that a live session or a kept
prefix holds, with the same salt, and feeds only the rest: each backend says how it takes it (the
llama.cpp backend shares the cells, `seq_cp`; the torch backend copies the positions). Under the
KV budget, kept prefixes go first, least recently used first, then idle sessions' KV.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

import torch

from specmesh.core.prefix import BLOCK_TOKENS, PrefixIndex


class Backend(StrEnum):
    AUTO = "auto"  # llama.cpp for a GGUF model on a machine without a GPU, else torch
    TORCH = "torch"
    LLAMA_CPP = "llama.cpp"
    NGRAM = "ngram"  # no model: the session's tokens only (the n-gram drafter, specmesh.runtime.token_runner)


class UnknownSessionError(KeyError):
    """The backend does not hold this session (never started, released, or a restart)."""


@dataclass
class Step:
    """One session's part of a forward: new committed tokens and/or new pending tree nodes.

    node_parents[i] is the parent of node_tokens[i]: -1 for the root (the position right after the
    committed tokens), else the index of a pending node (earlier calls' nodes first, then this
    call's, in order). New tokens are only allowed when the session has no pending nodes.

    feed_limit (chunked prefill): the step may feed at most this many tokens past the prefix its
    session starts from. Within it, the step runs whole; past it, it is *partial*: it feeds that
    many of its new tokens (never its nodes) and returns no rows, and the session holds fewer
    committed tokens (`committed_length` says how many). salt: the prefix cache's namespace of a
    session this step starts (specmesh.core.prefix)."""

    session_id: str
    new_tokens: list[int] = field(default_factory=list)
    node_tokens: list[int] = field(default_factory=list)
    node_parents: list[int] = field(default_factory=list)
    feed_limit: int | None = None
    salt: bytes = b""

    @property
    def rows(self) -> int:
        """What it feeds at most: its new tokens and nodes, or its limit."""
        rows = len(self.new_tokens) + len(self.node_tokens)
        return rows if self.feed_limit is None else min(rows, self.feed_limit)


class ModelBackend(Protocol):
    vocab_size: int
    device: torch.device
    max_cache_tokens: int | None
    max_context: int | None  # the longest session the model takes (its trained positions); None: unknown

    def committed_tokens(self, session_id: str) -> list[int] | None: ...

    def committed_length(self, session_id: str) -> int | None:
        """len(committed_tokens), without the copy (None: an unknown session)."""
        ...

    def pending_tokens(self, session_id: str) -> list[int]: ...

    def sessions(self) -> list[str]: ...

    def cached_positions(self) -> int:
        """Positions holding KV over all sessions (what `max_cache_tokens` bounds)."""
        ...

    def forward(self, steps: list[Step]) -> list[torch.Tensor]:
        """ONE model call for all steps; per step fp32 logits [R, V] with R = (1 if new_tokens
        else 0) + len(node_tokens): the row after the last new token (the root distribution),
        then one row per new node (a partial step, `feed_limit`: none)."""
        ...

    def reused_tokens(self, session_id: str) -> int:
        """Tokens the session's KV took from a kept or shared prefix when it last started."""
        ...

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        """Keep the pending nodes `keep_nodes` (a root-to-node path, in order) as committed
        tokens; drop every other pending node."""
        ...

    def truncate(self, session_id: str, length: int) -> None:
        """Keep the first `length` committed tokens and drop the pending tree (a caller that
        speculated past what turned out true rolls the session back)."""
        ...

    def release(self, session_id: str, keep: bool = True) -> None:
        """The session ends; keep: its KV may stay as a kept prefix (when the cache is on)."""
        ...


@dataclass(eq=False)
class SessionState:
    """What every backend keeps of a session besides its KV: committed tokens (kept when the KV is
    evicted) and the pending tree. Backends subclass it with where the KV lives. A kept prefix is
    the state of the session it was, its pending tree gone."""

    tokens: list[int] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_parents: list[int] = field(default_factory=list)
    salt: bytes = b""  # the prefix cache's namespace (specmesh.core.prefix)
    reused: int = 0  # tokens its KV took from a prefix when it last started

    @property
    def cached(self) -> int:
        """Positions holding KV (0: none, the session is new or evicted)."""
        raise NotImplementedError

    @property
    def own_cells(self) -> int:
        """Of `cached`, the positions whose KV no other state's already counts (shared cells)."""
        return self.cached


S = TypeVar("S", bound=SessionState)


KEPT_PREFIX = "\x00kept:"  # kept prefixes' keys: no session id has a NUL
MAX_KEPT = 64  # kept prefixes at most, by default (the llama.cpp backend: one sequence each)


@dataclass
class Checked:
    """A step checked against its session: the session (a new one for a first step), whether it
    was known, the step with plain ints (a partial one cut to its limit), the prefix a session
    without KV starts from (its owner's key, None: none; its length), and whether it is partial."""

    session: Any
    known: bool
    step: Step
    source: str | None = None
    reused: int = 0
    partial: bool = False


class StepPlan(Protocol):
    """What a backend's plan of one step must say, for `SessionTable.forward`."""

    session_id: str
    session: Any
    step: Step
    rebuild: bool  # the session had lost its KV and is re-fed in full
    source: str | None  # the prefix it starts from (its owner's key), if any

    @property
    def feeds(self) -> bool:
        """The step gives the model something to run."""
        ...


class SessionTable(Generic[S]):
    """The session bookkeeping both backends share: the table in least-recently-used order, the
    queries of `ModelBackend`, and `forward` around the backend's own `_plan`, `_make_room`,
    `_run` and `_discard_failed`."""

    vocab_size: int
    device: torch.device

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, S] = OrderedDict()  # least recently used first
        self._kept: OrderedDict[str, S] = OrderedDict()  # kept prefixes, least recently used first
        self._kept_ids = itertools.count(1)
        self.prefix: PrefixIndex | None = None  # None: no prefix cache
        self.max_kept = 0
        self._lock = threading.RLock()  # forward, commit and release run one at a time
        self.stats: dict[str, Any] = {
            "forwards": 0, "rebuilds": 0, "evictions": 0,
            "prefix_queries": 0, "prefix_hits": 0, "kept_evictions": 0,
        }  # fmt: skip

    def enable_prefix_cache(self, max_kept: int = MAX_KEPT) -> None:
        """Keep released sessions' KV (at most `max_kept` prefixes) and start sessions from the
        longest prefix held (module docstring). max_kept 0: share live sessions' prefixes only."""
        with self._lock:
            self.prefix = self.prefix or PrefixIndex()
            self.max_kept = max_kept
            for sid, s in self._sessions.items():
                if s.cached:
                    self.prefix.update(sid, s.tokens, s.salt)
            self._trim_kept()

    def kept_prefixes(self) -> int:
        return len(self._kept)

    def reused_tokens(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None else s.reused

    def prefix_summary(self) -> tuple[int, list[int]]:
        """(version, route hashes held): what a router needs to know of this replica's prefixes."""
        with self._lock:
            if self.prefix is None:
                return 0, []
            return self.prefix.version, self.prefix.summary()

    def committed_tokens(self, session_id: str) -> list[int] | None:
        s = self._sessions.get(session_id)
        return None if s is None else list(s.tokens)

    def committed_length(self, session_id: str) -> int | None:
        s = self._sessions.get(session_id)
        return None if s is None else len(s.tokens)

    def pending_tokens(self, session_id: str) -> list[int]:
        s = self._sessions.get(session_id)
        return [] if s is None else list(s.pending_tokens)

    def sessions(self) -> list[str]:
        return list(self._sessions)

    def cached_positions(self) -> int:
        """Positions currently holding KV over all sessions and kept prefixes, shared ones once
        (what `max_cache_tokens` bounds)."""
        return sum(s.own_cells for s in self._sessions.values()) + sum(
            s.own_cells for s in self._kept.values()
        )

    def forward(self, steps: list[Step]) -> list[torch.Tensor]:
        """ONE model call for all steps. Returns per step fp32 logits [R, V] where
        R = (1 if new_tokens else 0) + len(node_tokens): first the row after the last new token
        (the root distribution), then one row per new node. Every step is checked before anything
        changes; a failed call leaves the sessions' tokens as they were."""
        with self._lock, torch.inference_mode():
            ids = [st.session_id for st in steps]
            if len(set(ids)) != len(ids):
                raise ValueError("a session may appear only once per forward")
            plans = [self._plan(st) for st in steps]
            for sid in ids:
                if sid in self._sessions:
                    self._sessions.move_to_end(sid)
            active = [p for p in plans if p.feeds]  # a step with nothing to feed needs no KV either
            results: list[torch.Tensor] = []
            if active:
                sources = {p.source for p in active if p.source is not None}
                for key in sources:  # a prefix taken is used: the last to go
                    if key in self._kept:
                        self._kept.move_to_end(key)
                self._make_room(active, set(ids) | sources)
                try:
                    results = self._run(active)
                except BaseException:
                    self._discard_failed(active)
                    raise
                for p in active:
                    self._record(p.session_id, p.session, p.step, p.rebuild)
            empty = torch.zeros(0, self.vocab_size, device=self.device)
            it = iter(results)
            return [next(it) if p.feeds else empty for p in plans]

    def release(self, session_id: str, keep: bool = True) -> None:
        """The session ends. keep (and the prefix cache on): its committed tokens' KV stays as a
        kept prefix, unless another owner holds all of it already."""
        with self._lock, torch.inference_mode():  # the torch store is an inference tensor
            s = self._sessions.pop(session_id, None)
            if s is None:
                return
            if not (keep and self.max_kept and s.cached and len(s.tokens) >= BLOCK_TOKENS):
                self._lose_kv(session_id, s)
                return
            assert self.prefix is not None
            covered = self.prefix.match(s.tokens, s.salt, exclude=session_id)
            if covered is not None and covered.length == len(s.tokens):
                self._lose_kv(session_id, s)  # another owner has all of it: keep that one
                if covered.owner in self._kept:
                    self._kept.move_to_end(covered.owner)
                return
            self._drop_pending_kv(s)
            s.pending_tokens, s.pending_parents = [], []
            key = f"{KEPT_PREFIX}{next(self._kept_ids)}"
            self.prefix.rename(session_id, key)
            self._kept[key] = s
            self._rekeyed(session_id, key)
            self._drop_kept_prefixes_of(key, s)
            self._trim_kept()

    def _drop_kept_prefixes_of(self, key: str, s: S) -> None:
        """Kept prefixes whose tokens start `s`'s, with its salt, serve nothing `s` cannot (one
        conversation's turns: each turn's prefix extends the last one's)."""
        assert self.prefix is not None
        for other, o in list(self._kept.items()):
            same_start = o.salt == s.salt and s.tokens[: len(o.tokens)] == o.tokens
            if other != key and len(o.tokens) <= len(s.tokens) and same_start:
                self._evict(other, o, counted=False)

    def _trim_kept(self) -> None:
        while len(self._kept) > self.max_kept:
            key = next(iter(self._kept))
            self._evict(key, self._kept[key])

    def _victims(self, keep: set[str]) -> Iterator[tuple[str, S]]:
        """What may lose its KV to make room, in order: kept prefixes, least recently used first,
        then the least recently used sessions not in `keep` that hold KV."""
        for key, s in list(self._kept.items()):
            if key not in keep:
                yield key, s
        for sid, s in list(self._sessions.items()):
            if sid not in keep and s.cached:
                yield sid, s

    def _evict(self, key: str, s: S, counted: bool = True) -> None:
        """Take the KV of a kept prefix (gone) or of a session (its tokens and tree stay)."""
        if key in self._kept:
            del self._kept[key]
            self.stats["kept_evictions"] += counted
        else:
            self.stats["evictions"] += 1
        self._lose_kv(key, s)

    def _lose_kv(self, key: str, s: S) -> None:
        if self.prefix is not None:
            self.prefix.remove(key)
        self._drop_kv(s)

    def _indexed(self, key: str, s: S) -> None:
        """The index follows a state's committed tokens (after they changed)."""
        if self.prefix is not None and s.cached:
            self.prefix.update(key, s.tokens, s.salt)

    def _state(self, key: str) -> S:
        """A live session's or a kept prefix's state."""
        s = self._sessions.get(key)
        return s if s is not None else self._kept[key]

    def truncate(self, session_id: str, length: int) -> None:
        with self._lock:
            s = self._get(session_id)
            if not 0 < length <= len(s.tokens):
                raise ValueError(f"length: {length} is not in [1, {len(s.tokens)}] committed tokens")
            self._truncate_kv(s, length)
            s.tokens = s.tokens[:length]
            s.pending_tokens, s.pending_parents = [], []
            self._sessions.move_to_end(session_id)
            self._indexed(session_id, s)

    def _plan(self, step: Step) -> StepPlan:
        raise NotImplementedError

    def _truncate_kv(self, s: S, length: int) -> None:
        """Drop the KV of every position from `length` on (the pending tree's included)."""
        raise NotImplementedError

    def _drop_kv(self, s: S) -> None:
        """Free all of the state's KV (it holds none afterwards)."""
        raise NotImplementedError

    def _drop_pending_kv(self, s: S) -> None:
        """Free the pending tree's KV only (the committed tokens' stays)."""
        raise NotImplementedError

    def _rekeyed(self, old: str, new: str) -> None:
        """A state moved from key `old` to `new` (a session kept as a prefix): for backends that
        name states by key."""

    def _make_room(self, active: list[Any], in_call: set[str]) -> None:
        raise NotImplementedError

    def _run(self, plans: list[Any]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _discard_failed(self, plans: list[Any]) -> None:
        """A call failed: drop whatever KV it may have half written."""
        raise NotImplementedError

    def _checked(self, step: Step, new_session: Callable[[], S]) -> Checked:
        """The step checked against its session (`Checked`): for a session without KV, the longest
        prefix of its tokens held, and a prefill's new tokens cut to what its limit leaves."""
        known = self._sessions.get(step.session_id)
        if known is None and not step.new_tokens:
            raise UnknownSessionError(step.session_id)
        s = known if known is not None else new_session()
        if known is None:
            s.salt = step.salt
        step = Step(
            step.session_id, ints(step.new_tokens), ints(step.node_tokens), ints(step.node_parents),
            step.feed_limit, step.salt,
        )  # fmt: skip
        check_step(step, len(s.pending_tokens), self.vocab_size)
        source, reused = None, 0
        if not s.cached and self.prefix is not None and (s.tokens or step.new_tokens):
            tokens = s.tokens + step.new_tokens
            limit = len(tokens) - (1 if step.new_tokens else 0)  # the last new token is fed: its row
            match = self.prefix.match(tokens, s.salt, limit, exclude=step.session_id)
            self.stats["prefix_queries"] += len(tokens)
            if match is not None:
                source, reused = match.owner, match.length
                self.stats["prefix_hits"] += reused
        if not s.cached:
            s.reused = reused
        partial = False
        if step.feed_limit is not None:
            if s.cached:
                take = step.feed_limit
            else:  # the committed tokens no prefix covers are fed first, whatever the limit
                behind = max(0, len(s.tokens) - reused)
                take = max(0, reused - len(s.tokens)) + max(0, step.feed_limit - behind)
            partial = take < len(step.new_tokens)  # its nodes, if any, ride only in a whole step
            if partial:  # the rest in later steps: no nodes, no rows now
                step.new_tokens, step.node_tokens, step.node_parents = step.new_tokens[:take], [], []
        return Checked(s, known is not None, step, source, reused, partial)

    def _get(self, session_id: str) -> S:
        s = self._sessions.get(session_id)
        if s is None:
            raise UnknownSessionError(session_id)
        return s

    def _record(self, session_id: str, s: S, step: Step, rebuild: bool) -> None:
        """A step ran: its tokens join the session, which becomes the most recently used."""
        s.tokens += step.new_tokens
        s.pending_tokens += step.node_tokens
        s.pending_parents += step.node_parents
        if rebuild:
            self.stats["rebuilds"] += 1
        self._sessions[session_id] = s
        self._sessions.move_to_end(session_id)
        self._indexed(session_id, s)

    def _keep_path(self, session_id: str, s: S, keep: list[int]) -> None:
        """After a commit's KV work: the path joins the committed tokens, the tree is gone."""
        s.tokens += [s.pending_tokens[n] for n in keep]
        s.pending_tokens, s.pending_parents = [], []
        self._sessions.move_to_end(session_id)
        if keep:
            self._indexed(session_id, s)


def ints(xs: Sequence[int]) -> list[int]:
    """Plain ints, so that numpy or tensor scalars never end up in the token lists."""
    return [int(x) for x in xs]


def check_step(step: Step, pending: int, vocab_size: int) -> None:
    """A step a session with `pending` pending nodes can take; ValueError naming what is wrong."""
    if step.new_tokens and pending:
        raise ValueError(f"session {step.session_id!r}: new tokens while a tree is pending; commit first")
    if len(step.node_parents) != len(step.node_tokens):
        raise ValueError("node_parents must have one entry per node token")
    for tok in (*step.new_tokens, *step.node_tokens):
        if not 0 <= tok < vocab_size:
            raise ValueError(f"token {tok} out of range [0, {vocab_size})")
    for i, p in enumerate(step.node_parents):
        if not -1 <= p < pending + i:
            raise ValueError(f"node {i}: parent {p} out of range [-1, {pending + i})")


def check_path(keep: list[int], parents: list[int]) -> None:
    """`keep` must be a root-to-node path through the pending tree, in order."""
    prev = -1
    for n in keep:
        if not 0 <= n < len(parents) or parents[n] != prev:
            raise ValueError(f"keep_nodes {keep} is not a root-to-node path of the pending tree")
        prev = n
