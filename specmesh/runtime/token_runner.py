"""The backend with no model (`Backend.NGRAM`): it keeps each session's committed tokens and pending
tree like every backend, and computes nothing. The n-gram drafter (`drafter_service --backend
ngram`) runs on it: its drafts are lookups in those tokens (specmesh.core.ngram), so the session,
position and resync rules of the model services apply to it unchanged.

Its forward returns rows of width 0: there are no logits. A cache budget (`max_cache_tokens`)
counts committed and pending tokens; over it the least recently used sessions are dropped whole
(their callers resync, as after an eviction of any backend).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.runtime.backend import SessionState, SessionTable, Step, check_path, ints


@dataclass(eq=False)
class _Session(SessionState):
    @property
    def cached(self) -> int:
        return len(self.tokens) + len(self.pending_tokens)


@dataclass
class _Plan:
    session_id: str
    session: _Session
    step: Step
    rebuild: bool = False
    source: str | None = None  # never: no prefix cache without KV
    partial: bool = False  # a chunk of its new tokens only: no rows (Backend.forward)

    @property
    def feeds(self) -> bool:
        return bool(self.step.new_tokens or self.step.node_tokens)


class TokenRunner(SessionTable[_Session]):
    """Sessions' tokens, no model. Thread-safe like every backend (one lock)."""

    max_context = None

    def __init__(self, vocab_size: int, max_cache_tokens: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.max_cache_tokens = max_cache_tokens
        self.device = torch.device("cpu")
        super().__init__()

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        with self._lock:
            s = self._get(session_id)
            keep = ints(keep_nodes)
            check_path(keep, s.pending_parents)
            self._keep_path(session_id, s, keep)

    def _plan(self, step: Step) -> _Plan:
        c = self._checked(step, _Session)
        return _Plan(step.session_id, c.session, c.step, partial=c.partial)

    def _truncate_kv(self, s: _Session, length: int) -> None:
        pass  # nothing but the tokens, which truncate cuts

    def _drop_kv(self, s: _Session) -> None:
        pass  # no KV: a released session's tokens go with it

    def _drop_pending_kv(self, s: _Session) -> None:
        pass

    def _make_room(self, active: list[_Plan], in_call: set[str]) -> None:
        if not self.max_cache_tokens:
            return
        needed = sum(len(p.step.new_tokens) + len(p.step.node_tokens) for p in active)
        for sid in list(self._sessions):  # least recently used first
            if self.cached_positions() + needed <= self.max_cache_tokens:
                return
            if sid not in in_call:
                del self._sessions[sid]
                self.stats["evictions"] += 1

    def _run(self, plans: list[_Plan]) -> list[torch.Tensor]:
        self.stats["forwards"] += 1
        return [
            torch.zeros(0 if p.partial else int(bool(p.step.new_tokens)) + len(p.step.node_tokens), 0)
            for p in plans
        ]

    def _discard_failed(self, plans: list[_Plan]) -> None:
        pass  # _run cannot fail half-way
