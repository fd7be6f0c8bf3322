"""The torch backend (specmesh.runtime.backend): ONE batched KV store and one-call tree-attention
forwards for a tick of sessions of one Hugging Face causal LM.

One `ModelRunner` wraps one Hugging Face causal LM (Llama, Qwen2, ... with sdpa or eager attention)
and serves many sessions. The drafter and verifier services are thin adapters over it.

Session state
    Every session keeps its committed token list (kept even when its KV is evicted) and, while a
    tree is being drafted or verified, its *pending* tree nodes (tokens + parents). Its KV lives in
    a *slot* of the runner's one store, `[layers, 2 (k/v), slots, kv_heads, capacity, head_dim]`:
    positions [0, length) hold the committed tokens first and the pending nodes after them, in the
    order they were appended. `commit` moves the accepted path's KV right behind the committed
    prefix (a no-op for a chain accepted from its first node) and forgets the other pending nodes.
    The used slots are kept at the front: a released or evicted session's slot takes the last one.
    Slots and capacity grow (x2, x1.5) for every session at once.

Batch layout of one forward (B sessions, Q = longest query, L = longest past + query)
    queries      [B, Q], RIGHT-padded: session b's q_b queries first, then pad. Query j of session
                 b writes its KV at position past_b + j of its slot (pad queries past the session's
                 length, where nothing is read before it is written again).
    keys/values  the store's slots of the batch, positions [0, L): a view when the batch is every
                 used slot, else one gather per layer. Never a copy per session.
    mask         [B, 1, Q, L]: key k is allowed to query j if k <= past_b + j (causal, and a chain
                 of nodes is causal too); a node of a branching tree sees the committed tokens and
                 its ancestors only. bool for sdpa, additive float (0 / dtype min) for eager.
    positions    a committed token its index, a tree node committed + depth - 1 (for a chain, its
                 place in the store).
    rows         only the rows the steps return (the last token's, the new nodes') go through the
                 LM head, gathered from the decoder's output: [sum of rows, V], no padding.

Memory budget
    `max_cache_tokens` bounds the cached positions (committed + pending, all sessions and kept
    prefixes, layers counted once). When a forward would exceed it, kept prefixes go first, then
    the least recently used sessions that are not in the call lose their KV (their tokens and
    pending tree are kept). The next forward that names an evicted session re-prefills its
    committed tokens and pending nodes inside that same batched call. The store's unused capacity
    is not counted.

Kept prefixes (specmesh.runtime.backend) live in a second store of the same layout: a released
session's committed positions are copied there and its slot is freed, so live sessions keep the
front slots (a tick of every session is a view, not a gather). A session that starts from a
prefix (kept, or a live session's) gets its positions copied into its own slot before the
forward: one device copy of `length` positions per layer. The forward attends over a slot's
contiguous positions, so a paged store shared in place would need a paged attention kernel that
transformers' sdpa and eager paths do not have.

A lock serialises `forward`, `commit` and `release`, so one runner may be shared by threads
(the model runs one call at a time anyway). Logits come back on the model's device.
Sliding-window layers are not supported (the explicit 4D mask would override the window).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from specmesh.core.tree import tree_attention_mask, tree_depths
from specmesh.runtime.backend import (
    SessionState,
    SessionTable,
    Step,
    UnknownSessionError,
    check_path,
)
from specmesh.runtime.invariant_ops import batch_invariant

__all__ = ["ModelRunner", "Step", "UnknownSessionError"]  # the last two: runtime.backend, re-exported

_CAPACITY_STEP = 64  # allocation granularity of the store's positions


@dataclass(eq=False)
class _Session(SessionState):
    slot: int = -1  # its slot in the store; -1 = no KV (new or evicted)
    length: int = 0  # positions of the slot holding its KV (committed, then pending)
    chain: bool = True  # its pending nodes are a chain (each the child of the one before)
    kept: bool = False  # a kept prefix: `slot` is in the kept store

    @property
    def cached(self) -> int:
        """Positions with KV: all committed and pending ones, or none (new / evicted)."""
        return self.length if self.slot >= 0 else 0


@dataclass
class _Plan:
    """What one step feeds to the model, in the session's own coordinates."""

    session_id: str
    session: _Session
    step: Step
    past: int  # positions of its slot reused as they are
    query: list[int]  # uncached committed, new tokens, uncached pending nodes, new nodes
    n_causal: int  # of the query, how many are committed tokens (the rest are tree nodes)
    committed: int  # committed tokens once this step's new tokens are in
    rows: int  # trailing query rows returned as logits
    fresh: bool  # the session had no KV: all its tokens are in the query
    rebuild: bool  # fresh because it was evicted
    chain: bool  # its pending nodes, this step's included, are a chain
    parents: list[int] = field(default_factory=list)  # its whole pending tree, this step's included
    source: str | None = None  # the prefix it starts from: positions [0, past) copied from there

    @property
    def feeds(self) -> bool:
        return bool(self.query) or self.source is not None


class _StoreLayer(CacheLayerMixin):
    """One layer's view of the store for one forward: writes the new KV at each session's own
    positions, returns the batch's keys and values [B, kv_heads, L, head_dim]."""

    is_sliding = False

    def __init__(self, kv: torch.Tensor, slots: torch.Tensor | None, write: tuple, length: int) -> None:
        super().__init__()
        # kv [2, slots, kv_heads, capacity, head_dim]; slots None: the batch is slots [0, B) in order
        self._kv, self._slots, self._write, self._length = kv, slots, write, length
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        slot_idx, pos_idx = self._write  # [B, Q] each
        # [B, H, Q, D] -> [B, Q, H, D]: advanced indices (slot, position) first, then heads and dims
        self._kv[0][slot_idx, :, pos_idx] = key_states.transpose(1, 2)
        self._kv[1][slot_idx, :, pos_idx] = value_states.transpose(1, 2)
        if self._slots is None:
            b = key_states.shape[0]
            return self._kv[0, :b, :, : self._length], self._kv[1, :b, :, : self._length]
        return self._kv[0][self._slots, :, : self._length], self._kv[1][self._slots, :, : self._length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1


class ModelRunner(SessionTable[_Session]):
    """One batched KV store and one-call batched tree-attention forwards of one causal LM."""

    def __init__(
        self, model: torch.nn.Module, *, max_cache_tokens: int | None = None, deterministic: bool = False
    ) -> None:
        """deterministic: a row's logits do not depend on the forward it shares (batch-invariant
        matmuls and attention, specmesh.runtime.invariant_ops; sdpa models on the CPU)."""
        cfg = model.config
        self.attn_impl = cfg._attn_implementation
        if self.attn_impl not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self.attn_impl!r} is not supported (sdpa, eager)")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("sliding-window attention layers are not supported")
        if getattr(cfg, "final_logit_softcapping", None):
            raise ValueError("final logit soft-capping is not supported")
        self.model = model.eval()
        # the rows a forward returns go through the LM head alone, gathered from the decoder's output
        self._decoder, self._head = model.get_decoder(), model.get_output_embeddings()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):  # int8 weights: fp32 activations
            self.dtype = torch.float32
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = self._head.out_features  # also for int8 (quantized) heads
        self.max_cache_tokens = max_cache_tokens
        self.deterministic = deterministic
        if deterministic and (self.attn_impl != "sdpa" or self.device.type != "cpu"):
            raise ValueError("deterministic: the torch backend has it for sdpa attention on the CPU only")
        self.max_context = getattr(cfg, "max_position_embeddings", None)
        super().__init__()
        self._kv: torch.Tensor | None = None  # the store [layers, 2, slots, kv_heads, capacity, head_dim]
        self._slots: list[str] = []  # slot -> the session in it; used slots are [0, len)
        self._kept_kv: torch.Tensor | None = None  # the kept prefixes' store, the same layout
        self._kept_slots: list[str] = []
        self.stats.update(
            over_budget=0,  # forwards that exceeded the budget even after evicting everything idle
            query_tokens=0,
            padded_query_tokens=0,
            batch_sizes=Counter(),
        )

    def cache_length(self, session_id: str) -> int:
        s = self._sessions.get(session_id)
        return 0 if s is None or s.slot < 0 else len(s.tokens)

    # ---- mutations -----------------------------------------------------------------------------

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        """Keep the pending nodes `keep_nodes` (a root-to-node path, in order) as committed tokens,
        drop all other pending nodes (KV compaction to prefix + accepted path)."""
        with self._lock, torch.inference_mode():
            s = self._get(session_id)
            keep = [int(n) for n in keep_nodes]
            check_path(keep, s.pending_parents)
            c = len(s.tokens)
            if s.slot >= 0 and keep != list(range(len(keep))):
                src = torch.tensor(keep, device=self.device) + c
                kv = self._kv[:, :, s.slot]  # type: ignore[index]
                kv[:, :, :, c : c + len(keep)] = kv.index_select(3, src)
            self._keep_path(session_id, s, keep)
            s.length, s.chain = c + len(keep), True

    def _truncate_kv(self, s: _Session, length: int) -> None:
        s.length, s.chain = min(s.length, length), True  # positional: later writes go over the rest

    def _drop_kv(self, s: _Session) -> None:
        self._free(s)

    def _drop_pending_kv(self, s: _Session) -> None:
        self._truncate_kv(s, len(s.tokens))

    def _rekeyed(self, old: str, new: str) -> None:
        """A released session's committed positions move to the kept store; its slot is freed."""
        s = self._kept[new]
        kept = self._reserve_kept(len(self._kept_slots) + 1, s.length)
        kept[:, :, len(self._kept_slots), :, : s.length] = self._kv[:, :, s.slot, :, : s.length]  # type: ignore[index]
        length = s.length
        self._free(s)
        s.slot, s.length, s.kept = len(self._kept_slots), length, True
        self._kept_slots.append(new)

    def _discard_failed(self, plans: list[_Plan]) -> None:
        for p in plans:
            if p.fresh:  # a slot may have been taken, but it holds no valid KV
                self._free(p.session)

    # ---- planning ------------------------------------------------------------------------------

    def _plan(self, step: Step) -> _Plan:
        c = self._checked(step, _Session)
        s, step = c.session, c.step
        # A session without KV (new or evicted) re-feeds everything it has after the prefix it
        # takes (copied into its slot); else only this step.
        fresh = s.slot < 0
        causal = (s.tokens + step.new_tokens)[c.reused :] if fresh else list(step.new_tokens)
        old_nodes = s.pending_tokens if fresh else []
        base = len(s.pending_tokens)
        chain = s.chain and all(p == base + i - 1 for i, p in enumerate(step.node_parents))
        return _Plan(
            session_id=step.session_id,
            session=s,
            step=step,
            past=c.reused if fresh else s.cached,
            query=causal + old_nodes + list(step.node_tokens),
            n_causal=len(causal),
            committed=len(s.tokens) + len(step.new_tokens),
            rows=0 if c.partial else (1 if step.new_tokens else 0) + len(step.node_tokens),
            fresh=fresh,
            rebuild=fresh and c.known,
            chain=chain,
            parents=s.pending_parents + list(step.node_parents),
            source=c.source,
        )

    # ---- memory --------------------------------------------------------------------------------

    def _make_room(self, active: list[_Plan], in_call: set[str]) -> None:
        """Evict least recently used idle sessions until the call fits in the budget."""
        if self.max_cache_tokens is None:
            return
        need = self.cached_positions() + sum(
            p.past + len(p.query) if p.fresh else len(p.query) for p in active
        )
        for key, s in self._victims(in_call):
            if need <= self.max_cache_tokens:
                break
            if s.slot >= 0:
                need -= s.cached
                self._evict(key, s)
        if need > self.max_cache_tokens:
            self.stats["over_budget"] += 1

    def _free(self, s: _Session) -> None:
        """Give the state's slot up; the last used slot moves into it (used slots stay in front)."""
        if s.slot < 0:
            return
        kv, slots, states = (
            (self._kept_kv, self._kept_slots, self._kept)
            if s.kept
            else (self._kv, self._slots, self._sessions)
        )
        last = len(slots) - 1
        if s.slot != last:
            moved = states[slots[last]]
            kv[:, :, s.slot] = kv[:, :, last]  # type: ignore[index]
            moved.slot = s.slot
            slots[s.slot] = slots[last]
        slots.pop()
        s.slot, s.length = -1, 0

    def _reserve_kept(self, slots: int, capacity: int) -> torch.Tensor:
        self._kept_kv = _grown(self._kept_kv, slots, capacity, self._store_shape, self.dtype, self.device)
        return self._kept_kv

    def _reserve(self, slots: int, capacity: int) -> torch.Tensor:
        """The store with room for `slots` sessions of `capacity` positions (what it held kept)."""
        self._kv = _grown(self._kv, slots, capacity, self._store_shape, self.dtype, self.device)
        return self._kv

    def _store_shape(self, slots: int, capacity: int) -> tuple[int, ...]:
        return (self.num_layers, 2, slots, self.kv_heads, capacity, self.head_dim)

    # ---- the model call ------------------------------------------------------------------------

    def _run(self, plans: list[_Plan]) -> list[torch.Tensor]:
        for p in plans:
            if p.session.slot < 0:  # a slot at the end of the used ones
                p.session.slot = len(self._slots)
                self._slots.append(p.session_id)
        self._copy_prefixes(plans)
        if all(p.query for p in plans):
            return self._forward_rows(plans)
        for p in plans:  # the others only took a prefix
            if not p.query:
                p.session.length, p.session.chain = p.past, True
        running = [p for p in plans if p.query]
        ran = iter(self._forward_rows(running) if running else [])
        empty = torch.zeros(0, self.vocab_size, device=self.device)
        return [next(ran) if p.query else empty for p in plans]

    def _forward_rows(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """The forward of plans that all have queries: per plan its returned rows."""
        order = sorted(range(len(plans)), key=lambda i: plans[i].session.slot)
        plans_sorted = [plans[i] for i in order]
        n_b = len(plans_sorted)
        q_len = [len(p.query) for p in plans_sorted]
        past = [p.past for p in plans_sorted]
        q_max = max(q_len)
        length = max(a + q for a, q in zip(past, q_len, strict=True))
        kv = self._reserve(len(self._slots), max(a + q_max for a in past))
        slots = [p.session.slot for p in plans_sorted]
        dev = self.device
        ids, pos, allow, write = self._batch_inputs(plans_sorted, q_max, length)
        every_slot = slots == list(range(n_b))  # the front slots in order: a view of the store
        slot_index = None if every_slot else torch.tensor(slots, device=dev)
        cache = Cache(layers=[_StoreLayer(kv[i], slot_index, write, length) for i in range(self.num_layers)])
        # the returned rows: each session's last `rows` queries, through the LM head together
        row_b = torch.repeat_interleave(torch.arange(n_b), torch.tensor([p.rows for p in plans_sorted]))
        row_j = torch.cat([torch.arange(q - p.rows, q) for p, q in zip(plans_sorted, q_len, strict=True)])
        with batch_invariant() if self.deterministic else contextlib.nullcontext():
            hidden = self._decoder(
                input_ids=ids.to(dev),
                attention_mask=self._impl_mask(allow.to(dev)),
                position_ids=pos.to(dev),
                cache=cache,
                use_cache=True,
            ).last_hidden_state
            logits = self._head(hidden[row_b.to(dev), row_j.to(dev)]).float()
        self._count(plans_sorted, q_max)
        for p in plans_sorted:
            p.session.length, p.session.chain = p.past + len(p.query), p.chain
        out = list(logits.split([p.rows for p in plans_sorted]))
        results: list[torch.Tensor] = [torch.empty(0)] * n_b
        for k, i in enumerate(order):
            results[i] = out[k]
        return results

    def _copy_prefixes(self, plans: list[_Plan]) -> None:
        """Each plan that starts from a prefix gets its positions [0, past) from the owner's slot."""
        taking = [p for p in plans if p.source is not None]
        if not taking:
            return
        kv = self._reserve(len(self._slots), max(p.past + len(p.query) for p in plans))
        for p in taking:
            owner = self._state(p.source)  # type: ignore[arg-type]
            store = self._kept_kv if owner.kept else kv
            kv[:, :, p.session.slot, :, : p.past] = store[:, :, owner.slot, :, : p.past]  # type: ignore[index]

    def _batch_inputs(
        self, plans: list[_Plan], q_max: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """input_ids, position_ids [B, Q], the bool mask [B, 1, Q, L] and where each query's KV
        goes (slot, position) [B, Q], for the layout above; per session only what a branching
        tree needs beyond the causal default."""
        n_b = len(plans)
        past = torch.tensor([p.past for p in plans])
        q_len = torch.tensor([len(p.query) for p in plans])
        j = torch.arange(q_max)
        store_pos = past[:, None] + j[None, :]  # [B, Q]: where each query's KV goes
        real = j[None, :] < q_len[:, None]
        ids = torch.zeros(n_b, q_max, dtype=torch.long)
        ids[real] = torch.tensor([t for p in plans for t in p.query])
        pos = store_pos.clone()
        allow = torch.arange(length)[None, None, :] <= store_pos[:, :, None]  # [B, Q, L], causal
        for b, p in enumerate(plans):
            if not p.chain and len(p.query) > p.n_causal:
                self._tree_rows(p, b, pos, allow)
        slot_idx = torch.tensor([p.session.slot for p in plans])[:, None].expand(n_b, q_max)
        return ids, pos, allow.unsqueeze(1), (slot_idx.to(self.device), store_pos.to(self.device))

    @staticmethod
    def _tree_rows(p: _Plan, b: int, pos: torch.Tensor, allow: torch.Tensor) -> None:
        """A branching tree's node rows: position committed + depth - 1; the committed tokens and
        its ancestors (itself included) as keys, no other pending node."""
        parents = torch.tensor(p.parents, dtype=torch.long)
        n_all = len(p.parents)
        n_query_nodes = len(p.query) - p.n_causal
        first = n_all - n_query_nodes  # pending index of the first queried node
        rows = torch.arange(p.n_causal, len(p.query))
        pos[b, rows] = p.committed + tree_depths(parents)[first:] - 1
        ancestors = tree_attention_mask(parents, 0)[first:]  # [queried nodes, n_all]
        allow[b, rows, p.committed :] = False
        allow[b, rows, p.committed : p.committed + n_all] = ancestors

    def _impl_mask(self, allow: torch.Tensor) -> torch.Tensor:
        if self.attn_impl == "sdpa":
            return allow
        # eager adds the mask to the scores, so a bool mask would be silently wrong
        neg = torch.finfo(self.dtype).min
        return torch.zeros(allow.shape, dtype=self.dtype, device=allow.device).masked_fill_(~allow, neg)

    def _count(self, plans: list[_Plan], q_max: int) -> None:
        self.stats["forwards"] += 1
        self.stats["batch_sizes"][len(plans)] += 1
        self.stats["query_tokens"] += sum(len(p.query) for p in plans)
        self.stats["padded_query_tokens"] += q_max * len(plans)


def _grown(
    kv: torch.Tensor | None, slots: int, capacity: int, shape: Any, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """A store [layers, 2, slots, kv_heads, capacity, head_dim] with room for `slots` of `capacity`
    positions, what `kv` held kept (x2 slots, x1.5 capacity at least, when it grows)."""
    have_slots, have_cap = (0, 0) if kv is None else (kv.shape[2], kv.shape[4])
    if kv is not None and slots <= have_slots and capacity <= have_cap:
        return kv
    new_slots = max(slots, 2 * have_slots, 8) if slots > have_slots else have_slots
    new_cap = have_cap
    if capacity > have_cap:
        new_cap = -(-max(capacity, have_cap + have_cap // 2) // _CAPACITY_STEP) * _CAPACITY_STEP
    grown = torch.zeros(shape(new_slots, new_cap), dtype=dtype, device=device)  # zeros: pads must be finite
    if kv is not None:
        grown[:, :, :have_slots, :, :have_cap] = kv
    return grown
