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
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

import torch


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
    call's, in order). New tokens are only allowed when the session has no pending nodes."""

    session_id: str
    new_tokens: list[int] = field(default_factory=list)
    node_tokens: list[int] = field(default_factory=list)
    node_parents: list[int] = field(default_factory=list)


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
        then one row per new node."""
        ...

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        """Keep the pending nodes `keep_nodes` (a root-to-node path, in order) as committed
        tokens; drop every other pending node."""
        ...

    def truncate(self, session_id: str, length: int) -> None:
        """Keep the first `length` committed tokens and drop the pending tree (a caller that
        speculated past what turned out true rolls the session back)."""
        ...

    def release(self, session_id: str) -> None: ...


@dataclass
class SessionState:
    """What every backend keeps of a session besides its KV: committed tokens (kept when the KV is
    evicted) and the pending tree. Backends subclass it with where the KV lives."""

    tokens: list[int] = field(default_factory=list)
    pending_tokens: list[int] = field(default_factory=list)
    pending_parents: list[int] = field(default_factory=list)

    @property
    def cached(self) -> int:
        """Positions holding KV (0: none, the session is new or evicted)."""
        raise NotImplementedError


S = TypeVar("S", bound=SessionState)


class StepPlan(Protocol):
    """What a backend's plan of one step must say, for `SessionTable.forward`."""

    session_id: str
    session: Any
    step: Step
    rebuild: bool  # the session had lost its KV and is re-fed in full

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
        self._lock = threading.RLock()  # forward, commit and release run one at a time
        self.stats: dict[str, Any] = {"forwards": 0, "rebuilds": 0, "evictions": 0}

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
        """Positions currently holding KV over all sessions (what `max_cache_tokens` bounds)."""
        return sum(s.cached for s in self._sessions.values())

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
                self._make_room(active, set(ids))
                try:
                    results = self._run(active)
                except BaseException:
                    self._discard_failed(active)
                    raise
                for p in active:
                    self._record(p.session_id, p.session, p.step, p.rebuild)
            it = iter(results)
            empty = torch.zeros(0, self.vocab_size, device=self.device)
            return [next(it) if p.feeds else empty for p in plans]

    def truncate(self, session_id: str, length: int) -> None:
        with self._lock:
            s = self._get(session_id)
            if not 0 < length <= len(s.tokens):
                raise ValueError(f"length: {length} is not in [1, {len(s.tokens)}] committed tokens")
            self._truncate_kv(s, length)
            s.tokens = s.tokens[:length]
            s.pending_tokens, s.pending_parents = [], []
            self._sessions.move_to_end(session_id)

    def _plan(self, step: Step) -> StepPlan:
        raise NotImplementedError

    def _truncate_kv(self, s: S, length: int) -> None:
        """Drop the KV of every position from `length` on (the pending tree's included)."""
        raise NotImplementedError

    def _make_room(self, active: list[Any], in_call: set[str]) -> None:
        raise NotImplementedError

    def _run(self, plans: list[Any]) -> list[torch.Tensor]:
        raise NotImplementedError

    def _discard_failed(self, plans: list[Any]) -> None:
        """A call failed: drop whatever KV it may have half written."""
        raise NotImplementedError

    def _checked(self, step: Step, new_session: Callable[[], S]) -> tuple[S, bool, Step]:
        """The step's session (a new one for a first step), whether it was known, and the step
        with plain ints, checked against the session."""
        known = self._sessions.get(step.session_id)
        if known is None and not step.new_tokens:
            raise UnknownSessionError(step.session_id)
        s = known if known is not None else new_session()
        step = Step(step.session_id, ints(step.new_tokens), ints(step.node_tokens), ints(step.node_parents))
        check_step(step, len(s.pending_tokens), self.vocab_size)
        return s, known is not None, step

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

    def _keep_path(self, session_id: str, s: S, keep: list[int]) -> None:
        """After a commit's KV work: the path joins the committed tokens, the tree is gone."""
        s.tokens += [s.pending_tokens[n] for n in keep]
        s.pending_tokens, s.pending_parents = [], []
        self._sessions.move_to_end(session_id)


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
