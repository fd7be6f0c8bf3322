"""The torch backend (specmesh.runtime.backend): per-session KV caches and batched tree-attention
forwards for one Hugging Face causal LM.

One `ModelRunner` wraps one Hugging Face causal LM (Llama, Qwen2, ... with sdpa or eager attention)
and serves many sessions. The drafter and verifier services are thin adapters over it.

Session state
    Every session keeps its committed token list (kept even when its KV is evicted) and, while a
    tree is being drafted or verified, its *pending* tree nodes (tokens + parents). Its KV lives in
    one tensor per session, `[layers, 2 (k/v), kv_heads, capacity, head_dim]`, holding the
    committed tokens first and the pending nodes after them, in the order they were appended.
    `commit` moves the accepted path's KV right behind the committed prefix (a no-op for a chain
    accepted from its first node) and forgets the other pending nodes; capacity grows by 1.5x.

Batch layout of one forward (B sessions, P = max reused KV length, Q = max query length)
    keys/values  [B, kv_heads, P + Q, head_dim], per layer, in one buffer `[layers, 2, B, ...]`:
        slots [0, past_b)        session b's cached KV (committed, then pending nodes): RIGHT-padded
        slots [past_b, P)        zeros, never attended
        slots [P, P + Q)         this call's queries, RIGHT-aligned (LEFT-padded): session b's
                                 queries are in the last Q_b slots, pad slots first
    input_ids / position_ids [B, Q]: pad queries are token 0 at position 0 and attend only to
    themselves (so no row is fully masked); their outputs and KV are thrown away.
    Right-aligned queries put every session's returned rows at the end of the query block, so the
    LM head runs on the last max(R_b) positions only (`logits_to_keep`), not on every prefill token.
    Mask [B, 1, Q, P + Q]: bool for sdpa (True = attend), additive float (0 / dtype min) for eager.
    Positions are explicit: committed tokens get their index, tree nodes `prefix_len + depth - 1`.

Cost per call
    B > 1: every session's cached KV is copied once into the padded buffer (the model's cache
    layer then writes the new KV into the same buffer, no concatenation), and each session's new KV
    (Q_b positions) is copied back into its own tensor. Padding costs compute: every session is
    padded to the longest past and the longest query, so mixing a long prefill with small trees
    in one call is wasteful; batch similar steps together.
    B = 1: no copy at all; the session's own tensor is the cache buffer and the new KV is written
    straight into it.

Memory budget
    `max_cache_tokens` bounds the cached positions (committed + pending, all sessions, layers
    counted once). When a forward would exceed it, the least recently used sessions that are not in
    the call lose their KV (their tokens and pending tree are kept). The next forward that names an
    evicted session re-prefills its committed tokens and pending nodes inside that same batched
    call. The transient batch buffer and unused capacity are not counted.

A lock serialises `forward`, `commit` and `release`, so one runner may be shared by threads
(the model runs one call at a time anyway). Logits come back on the model's device.
Sliding-window layers are not supported (the explicit 4D mask would override the window).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specmesh.core.tree import accepted_cache_indices, tree_attention_mask, tree_position_ids
from specmesh.runtime.backend import (
    SessionState,
    SessionTable,
    Step,
    UnknownSessionError,
    check_path,
)

__all__ = ["ModelRunner", "Step", "UnknownSessionError"]  # the last two: runtime.backend, re-exported

_CAPACITY_STEP = 64  # allocation granularity of a session's KV tensor, in positions


@dataclass
class _Session(SessionState):
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim]; None = no KV

    @property
    def cached(self) -> int:
        """Positions with KV: all committed and pending ones, or none (new / evicted)."""
        return len(self.tokens) + len(self.pending_tokens) if self.kv is not None else 0


@dataclass
class _Plan:
    """What one step feeds to the model, in the session's own coordinates."""

    session_id: str
    session: _Session
    step: Step
    past: int  # cached positions reused as they are
    query: list[int]  # uncached committed, new tokens, uncached pending nodes, new nodes
    positions: torch.Tensor  # [Q_b]
    mask: torch.Tensor  # bool [Q_b, past + Q_b]
    rows: int  # trailing query rows returned as logits
    fresh: bool  # the session had no KV: all its tokens are in the query
    rebuild: bool  # fresh because it was evicted

    @property
    def feeds(self) -> bool:
        return bool(self.query)


class _BufferLayer(CacheLayerMixin):
    """One layer's view of the batch buffer: writes the new KV in place, returns the whole span."""

    is_sliding = False

    def __init__(self, kv: torch.Tensor, start: int, end: int) -> None:
        super().__init__()
        self._kv, self._start, self._end = kv, start, end  # kv: [2, B, kv_heads, >= end, head_dim]
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if key_states.shape[-2] != self._end - self._start or key_states.shape[1] != self._kv.shape[2]:
            raise RuntimeError(f"unexpected key shape {tuple(key_states.shape)} for the runner's KV layout")
        self._kv[0, :, :, self._start : self._end].copy_(key_states)
        self._kv[1, :, :, self._start : self._end].copy_(value_states)
        return self._kv[0, :, :, : self._end], self._kv[1, :, :, : self._end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._end, 0

    def get_seq_length(self) -> int:
        return self._start

    def get_max_length(self) -> int:
        return -1


class ModelRunner(SessionTable[_Session]):
    """Per-session KV caches and one-call batched tree-attention forwards of one causal LM."""

    def __init__(self, model: torch.nn.Module, *, max_cache_tokens: int | None = None) -> None:
        cfg = model.config
        self.attn_impl = cfg._attn_implementation
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self.attn_impl!r} is not supported (sdpa, eager)")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("sliding-window attention layers are not supported")
        self.model = model.eval()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = model.get_output_embeddings().out_features  # also for int8 (quantized) heads
        self.max_cache_tokens = max_cache_tokens
        self.max_context = getattr(cfg, "max_position_embeddings", None)
        super().__init__()
        self.stats.update(
            over_budget=0,  # forwards that exceeded the budget even after evicting everything idle
            query_tokens=0,
            padded_query_tokens=0,
            batch_sizes=Counter(),
        )

    def cache_length(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None or s.kv is None else len(s.tokens)

    # ---- mutations -----------------------------------------------------------------------------

    def release(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        """Keep the pending nodes `keep_nodes` (a root-to-node path, in order) as committed tokens,
        drop all other pending nodes (KV compaction to prefix + accepted path)."""
        with self._lock, torch.inference_mode():
            s = self._get(session_id)
            keep = [int(n) for n in keep_nodes]
            check_path(keep, s.pending_parents)
            if s.kv is not None and keep != list(range(len(keep))):
                c = len(s.tokens)
                src = accepted_cache_indices(c, keep)[c:].to(s.kv.device)
                s.kv[:, :, :, c : c + len(keep)] = s.kv.index_select(3, src)
            self._keep_path(session_id, s, keep)

    def _truncate_kv(self, s: _Session, length: int) -> None:
        pass  # KV slots are positional: the next forward writes over those past the new length

    def _discard_failed(self, plans: list[_Plan]) -> None:
        for p in plans:
            if p.fresh:  # a tensor may have been allocated, but it holds no valid KV
                p.session.kv = None

    # ---- planning ------------------------------------------------------------------------------

    def _plan(self, step: Step) -> _Plan:
        s, known, step = self._checked(step, _Session)
        # A session without KV (new or evicted) re-feeds everything it has; else only this step.
        fresh = s.kv is None
        old_tokens = s.tokens if fresh else []
        old_nodes = s.pending_tokens if fresh else []
        committed = len(s.tokens) + len(step.new_tokens)
        parents = torch.tensor(s.pending_parents + list(step.node_parents), dtype=torch.long)
        n_causal = len(old_tokens) + len(step.new_tokens)
        first_node = len(s.pending_tokens) - len(old_nodes)  # pending nodes already cached
        positions = torch.cat(
            [
                torch.arange(committed - n_causal, committed),
                tree_position_ids(parents, committed)[first_node:],
            ]
        )
        mask = _step_mask(s.cached, n_causal, tree_attention_mask(parents, committed)[first_node:])
        return _Plan(
            session_id=step.session_id,
            session=s,
            step=step,
            past=s.cached,
            query=old_tokens + list(step.new_tokens) + old_nodes + list(step.node_tokens),
            positions=positions,
            mask=mask,
            rows=(1 if step.new_tokens else 0) + len(step.node_tokens),
            fresh=fresh,
            rebuild=fresh and known,
        )

    # ---- memory --------------------------------------------------------------------------------

    def _make_room(self, active: list[_Plan], in_call: set[str]) -> None:
        """Evict least recently used idle sessions until the call fits in the budget."""
        if self.max_cache_tokens is None:
            return
        need = self.cached_positions() + sum(len(p.query) for p in active)
        for sid, s in self._sessions.items():  # least recently used first
            if need <= self.max_cache_tokens:
                break
            if sid not in in_call and s.kv is not None:
                need -= s.cached
                s.kv = None
                self.stats["evictions"] += 1
        if need > self.max_cache_tokens:
            self.stats["over_budget"] += 1

    def _reserve(self, s: _Session, length: int) -> torch.Tensor:
        """The session's KV tensor with room for `length` positions (its cached KV preserved)."""
        cap = 0 if s.kv is None else s.kv.shape[3]
        if length > cap:
            new_cap = -(-max(length, cap + cap // 2) // _CAPACITY_STEP) * _CAPACITY_STEP
            kv = self._new_kv(new_cap)
            if s.cached:
                kv[:, :, :, : s.cached] = s.kv[:, :, :, : s.cached]
            s.kv = kv
        return s.kv

    def _new_kv(self, length: int, batch: int | None = None) -> torch.Tensor:
        """[layers, 2, (batch,) kv_heads, length, head_dim]; zeroed when batched, else uninitialised."""
        if batch is None:
            shape, make = (self.num_layers, 2, self.kv_heads, length, self.head_dim), torch.empty
        else:
            shape, make = (self.num_layers, 2, batch, self.kv_heads, length, self.head_dim), torch.zeros
        return make(shape, dtype=self.dtype, device=self.device)

    # ---- the model call ------------------------------------------------------------------------

    def _run(self, plans: list[_Plan]) -> list[torch.Tensor]:
        n_b, p_max, q_max = len(plans), max(p.past for p in plans), max(len(p.query) for p in plans)
        if n_b == 1:  # write straight into the session's own tensor, no copies
            buf = self._reserve(plans[0].session, p_max + q_max).unsqueeze(2)
        else:
            buf = self._new_kv(p_max + q_max, batch=n_b)  # zeros: padded slots must be finite
            for b, p in enumerate(plans):
                if p.past:
                    buf[:, :, b, :, : p.past] = p.session.kv[:, :, :, : p.past]
        ids, pos, allow = self._batch_inputs(plans, p_max, q_max)
        cache = Cache(layers=[_BufferLayer(buf[i], p_max, p_max + q_max) for i in range(self.num_layers)])
        r_max = max(p.rows for p in plans)
        logits = self.model(
            input_ids=ids.to(self.device),
            attention_mask=self._impl_mask(allow.to(self.device)),
            position_ids=pos.to(self.device),
            past_key_values=cache,
            use_cache=True,
            # An index tensor, not an int: transformers then gathers the last rows into a fresh
            # tensor. With an int it slices a strided view, on which the bf16 CPU GEMM of the
            # 152k-row LM head runs ~40x slower (450 ms instead of 10 ms for one row).
            logits_to_keep=torch.arange(q_max - r_max, q_max, device=self.device),
        ).logits
        if n_b > 1:
            self._scatter_new_kv(plans, buf, p_max, q_max)
        self._count(plans, q_max)
        return [logits[b, r_max - p.rows :].float() for b, p in enumerate(plans)]

    def _batch_inputs(
        self, plans: list[_Plan], p_max: int, q_max: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, position_ids [B, Q] and the bool mask [B, 1, Q, P + Q] of the layout above."""
        n_b = len(plans)
        ids = torch.zeros(n_b, q_max, dtype=torch.long)
        pos = torch.zeros(n_b, q_max, dtype=torch.long)
        allow = torch.zeros(n_b, 1, q_max, p_max + q_max, dtype=torch.bool)
        for b, p in enumerate(plans):
            off = q_max - len(p.query)  # left padding of the queries
            ids[b, off:] = torch.tensor(p.query)
            pos[b, off:] = p.positions
            allow[b, 0, off:, : p.past] = p.mask[:, : p.past]
            allow[b, 0, off:, p_max + off :] = p.mask[:, p.past :]
            pad = torch.arange(off)
            allow[b, 0, pad, p_max + pad] = True  # pad rows see only themselves: no fully masked row
        return ids, pos, allow

    def _impl_mask(self, allow: torch.Tensor) -> torch.Tensor:
        if self.attn_impl == "sdpa":
            return allow
        # eager adds the mask to the scores, so a bool mask would be silently wrong
        neg = torch.finfo(self.dtype).min
        return torch.zeros(allow.shape, dtype=self.dtype, device=allow.device).masked_fill_(~allow, neg)

    def _scatter_new_kv(self, plans: list[_Plan], buf: torch.Tensor, p_max: int, q_max: int) -> None:
        for b, p in enumerate(plans):
            q = len(p.query)
            kv = self._reserve(p.session, p.past + q)
            kv[:, :, :, p.past : p.past + q] = buf[:, :, b, :, p_max + q_max - q : p_max + q_max]

    def _count(self, plans: list[_Plan], q_max: int) -> None:
        self.stats["forwards"] += 1
        self.stats["batch_sizes"][len(plans)] += 1
        self.stats["query_tokens"] += sum(len(p.query) for p in plans)
        self.stats["padded_query_tokens"] += q_max * len(plans)


def _step_mask(past: int, n_causal: int, node_rows: torch.Tensor) -> torch.Tensor:
    """Bool [Q_b, past + Q_b] in the session's own coordinates (cached KV, then the queries).

    The session's logical sequence is committed tokens then pending nodes, and both the cache and
    the queries keep that order, so causal rows are a shifted lower triangle and node rows are the
    tree mask rows of the new nodes (prefix = every committed token, including this call's).
    """
    width = past + n_causal + node_rows.shape[0]
    causal = torch.ones(n_causal, width, dtype=torch.bool).tril(past)
    return torch.cat([causal, node_rows], dim=0)
