"""The llama.cpp backend: a GGUF model as it is (quantised weights) behind the `ModelBackend`
interface, through llama-cpp-python's low-level API (one llama_context, many sessions).

Sequences. llama.cpp's KV cache is one pool of cells (`kv_unified`); every cell carries a set of
sequence ids and a position, and a query row attends to the cells of its (first) sequence at
positions up to its own. A session owns one *main* sequence (its committed tokens) and, while a
tree is pending, one *leaf* sequence per leaf of the nodes fed in one call:

  - a node fed in a call belongs to the leaf sequences of the leaves below it (among that call's
    nodes), so it sees its ancestors and no sibling: tree attention without a custom mask;
  - a leaf sequence starts as a copy (`seq_cp`, metadata only) of the sequence that holds its
    anchor's path: the main sequence for nodes under the root, else the leaf sequence of the
    pending node the new nodes hang from, up to that node's position;
  - this call's committed tokens belong to the main sequence and to every leaf sequence anchored
    at the root, so one decode runs prefix tokens and tree together.

`commit` copies the accepted path's cells into the main sequence (`seq_cp` over their positions)
and removes every leaf sequence (`seq_rm`): cells no sequence holds any more are free. Positions
are explicit: committed tokens get their index, a node `committed + depth - 1`.

Prefixes (specmesh.runtime.backend): a kept prefix is the main sequence of the session it was. A
session that starts from a prefix (kept, or a live session's committed tokens) shares its cells:
`seq_cp` of positions [0, length) onto its own main sequence, metadata only. Committed cells are
never written again, so sharing them is safe; a state that goes (or is cut back) leaves its cells
to the sequences that share them. Counting cells, a state counts only the positions past what it
shares (`own_cells`); when the state it shares from goes, it takes the shared part to its count
(conservatively: two that shared the same cells then both count them).

Sequence ids are a pool of `n_seq_max` (at most 256, llama.cpp's limit), shared by all sessions;
KV cells are bounded by `n_ctx`. Both are budgets: when a call needs more than is free, the least
recently used sessions not in the call lose their KV (their tokens and pending tree are kept) and
are re-fed in full by the next call that names them, as the torch backend does.

Cache order (deterministic only). Flash attention sums a row's cells in cache order, and llama.cpp
places a forward's tokens in the first free cells from its search head, which `seq_rm` moves back
to the first cell it frees: a session's next tokens could land before its earlier ones, and its
logits would then depend on what other sessions freed. So a deterministic runner frees no cell:
what would be freed is parked on a reserved sequence, and tokens are appended in position order
after all others. When the log reaches the end of the cache, every session's KV is dropped and
re-fed by its next call (an eviction of all), in order again.

Threads: how llama.cpp's OpenMP workers wait between a forward's steps is chosen per process
before torch or llama.cpp is loaded: specmesh/runtime/threads.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specmesh.runtime.backend import (
    SessionState,
    SessionTable,
    Step,
    check_path,
    ints,
)

MAX_SEQUENCES = 256  # llama.cpp's LLAMA_MAX_SEQ


def llama_cpp_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _lib() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise RuntimeError(
            "the llama.cpp backend needs llama-cpp-python: pip install 'specmesh[llama]' (it builds "
            "llama.cpp from source with cmake and a C++ compiler)"
        ) from exc
    _quiet(llama_cpp)
    return llama_cpp


_LOG_CALLBACK: Any = None  # kept alive: llama.cpp holds the pointer
_GGML_LOG_WARN, _GGML_LOG_ERROR = 3, 4  # enum ggml_log_level


def _quiet(lib: Any) -> None:
    """llama.cpp logs every model load and context creation at length on stderr; keep only its
    warnings and errors (the services log JSON lines there)."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is not None:
        return

    @lib.llama_log_callback
    def callback(level: int, text: bytes, user_data: Any) -> None:
        if level in (_GGML_LOG_WARN, _GGML_LOG_ERROR):
            os.write(2, text)

    _LOG_CALLBACK = callback
    lib.llama_log_set(callback, ctypes.c_void_p(0))


@dataclass(eq=False)
class _Session(SessionState):
    main: int | None = None  # the main sequence id; None: no KV (new or evicted)
    leaves: list[int] = field(default_factory=list)  # leaf sequence ids of the pending tree
    node_seq: list[int] = field(default_factory=list)  # per pending node: a sequence holding its path
    source: _Session | None = None  # the state whose cells [0, shared) it shares
    shared: int = 0
    dependents: dict[int, _Session] = field(default_factory=dict)  # id -> a state sharing its cells

    @property
    def cached(self) -> int:
        return 0 if self.main is None else len(self.tokens) + len(self.pending_tokens)

    @property
    def own_cells(self) -> int:
        return max(0, self.cached - self.shared)

    def share(self, source: _Session | None, length: int) -> None:
        """It shares cells [0, length) of `source` (None: none)."""
        if self.source is not None:
            self.source.dependents.pop(id(self), None)
        self.source, self.shared = source, length if source is not None else 0
        if source is not None:
            source.dependents[id(self)] = self

    def cut(self, length: int) -> None:
        """Its cells past `length` go: what others shared of them becomes theirs."""
        for d in self.dependents.values():
            d.shared = min(d.shared, length)

    def leave(self) -> None:
        """Its cells go: those sharing them share its source's part, if any."""
        for d in list(self.dependents.values()):
            d.share(self.source, min(d.shared, self.shared))
        self.dependents = {}
        self.share(None, 0)


@dataclass
class _Plan:
    """One step laid out as batch rows (before anything changes)."""

    session_id: str
    session: _Session
    step: Step
    causal: list[int]  # tokens fed causally (re-fed committed ones first when rebuilding)
    causal_start: int  # position of causal[0]
    nodes: list[tuple[int, int]]  # (token, parent as a pending index) fed as tree nodes
    first_node: int  # pending index of nodes[0]
    outputs: int  # rows of logits this step returns
    rebuild: bool
    source: str | None = None  # the prefix it starts from: cells [0, causal_start) shared from there

    @property
    def feeds(self) -> bool:
        return bool(self.causal or self.nodes) or self.source is not None


_GGML_TYPE_BF16 = 30  # ggml.h's enum; the binding does not export it


def _load_model(lib: Any, path: str | Path, repack: bool) -> Any:
    """The GGUF file's weights, on the CPU; repack: llama.cpp's repacked weight layouts."""
    model_params = lib.llama_model_default_params()
    model_params.n_gpu_layers = 0
    model_params.use_extra_bufts = repack
    model = lib.llama_model_load_from_file(str(path).encode(), model_params)
    if not model:
        raise ValueError(f"llama.cpp could not load the model {str(path)!r}")
    return model


def _new_context(
    lib: Any, model: Any, *, n_ctx: int, n_batch: int, n_ubatch: int, n_seq_max: int, threads: int,
    type_k: int, type_v: int, flash_attn: bool,
) -> Any:  # fmt: skip
    """A context over `model` whose cells all sequences share (a tree node in several leaf
    sequences), without embeddings or perf counters."""
    params = lib.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch, params.n_ubatch = n_batch, n_ubatch
    params.n_seq_max = n_seq_max
    params.kv_unified = True
    params.n_threads = params.n_threads_batch = threads
    params.embeddings = False
    params.type_k, params.type_v = type_k, type_v
    params.no_perf = True
    off, on = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED, lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    params.flash_attn_type = on if flash_attn else off
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise ValueError("llama.cpp could not create a context (n_ctx, n_seq_max?)")
    return ctx


class LlamaCppRunner(SessionTable[_Session]):
    """Per-session KV in one llama.cpp context; one llama_decode per forward (see the module doc)."""

    def __init__(
        self,
        path: str | Path,
        *,
        n_ctx: int = 16384,
        n_batch: int = 2048,
        n_ubatch: int = 512,
        n_seq_max: int = MAX_SEQUENCES,
        threads: int = 0,
        max_cache_tokens: int | None = None,
        kv_type: str = "f16",
        flash_attn: bool | None = None,
        repack: bool = True,
        deterministic: bool = False,
    ) -> None:
        """kv_type: the KV cache's element type, "f16" (llama.cpp's default, half the memory
        traffic) or "f32" (bit-for-bit comparisons in tests). flash_attn: None is on with an f16
        cache, as llama-server's `auto` on a CPU (docs/decisions.md, "Flash attention": 1-3 %
        faster here), and off with an f32 one, whose V the kernel would cast to f16: without it a
        tree node's logits equal decoding its path to ~1e-7, whatever the cache layout. n_batch:
        rows one forward may take; llama.cpp computes them n_ubatch at a time (llama-server's 512:
        a 1363-token prefill of the 1.5B target took 7.2 ms per token, 7.6 with 2048 in one piece,
        on 2 cores).

        deterministic: a row's logits do not depend on the rows it shares a forward with
        (`specmesh bench invariance`; docs/decisions.md, "Batch invariance"). Every kernel that
        llama.cpp picks by the shape of a forward is avoided: repacked weights (their gemm takes
        4+ rows), the tiled K-quant matmul (8+ rows; GGML_CPU_TILED_MM=0, read once per process),
        attention without flash attention (it sums over every cell in SIMD lanes set by the cell's
        index, masked ones included), and flash attention's split (one row over 512+ cells) and
        tiled (64+ query rows) kernels, which only run where K and V share one f16/f32 type: so V
        is kept in bf16 (an f32 V would be cast to f16 in the graph), K in f16 as by default.
        Every row then takes one kernel that sums the cells it sees in cache order, with an f32
        accumulator (the f16 V path accumulates in f16); the cache is append-only (the module
        docstring, "Cache order"), so that each session's cells stay in position order."""
        lib = self._lib = _lib()
        types = {"f16": lib.GGML_TYPE_F16, "f32": lib.GGML_TYPE_F32, "bf16": _GGML_TYPE_BF16}
        type_k = type_v = types[kv_type]
        if deterministic:
            os.environ["GGML_CPU_TILED_MM"] = "0"
            repack, flash_attn = False, True
            type_k, type_v = types["f16"], types["bf16"]
        if not 1 <= n_seq_max <= MAX_SEQUENCES:
            raise ValueError(f"n_seq_max must be in [1, {MAX_SEQUENCES}], got {n_seq_max}")
        if deterministic and n_seq_max < 2:
            raise ValueError("deterministic: n_seq_max must be at least 2 (one sequence parks cells)")
        lib.llama_backend_init()
        self._model = _load_model(lib, path, repack)
        if flash_attn is None:
            flash_attn = type_v != types["f32"]
        self._ctx = _new_context(
            lib, self._model, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=min(n_ubatch, n_batch),
            n_seq_max=n_seq_max, threads=threads or (os.cpu_count() or 1), type_k=type_k, type_v=type_v,
            flash_attn=flash_attn,
        )  # fmt: skip
        self._memory = lib.llama_get_memory(self._ctx)
        self.vocab_size = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model))
        self.n_ctx = lib.llama_n_ctx(self._ctx)
        self.max_context = min(self.n_ctx, lib.llama_model_n_ctx_train(self._model))
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.device = torch.device("cpu")
        self.max_cache_tokens = min(max_cache_tokens or self.n_ctx, self.n_ctx)
        self._batch = lib.llama_batch_init(n_batch, 0, n_seq_max)
        self._free = list(range(n_seq_max - 1, -1, -1))  # a stack of free sequence ids
        # deterministic: the sequence that parks cells instead of freeing them, and the cells
        # appended since the cache was last emptied (the log's end: nothing is freed before it)
        self._parking = self._free.pop(0) if deterministic else None
        self._appended = 0
        super().__init__()
        self.stats.update(decodes=0, batch_sizes=Counter(), log_restarts=0)

    def close(self) -> None:
        with self._lock:
            if self._ctx:
                self._lib.llama_batch_free(self._batch)
                self._lib.llama_free(self._ctx)
                self._lib.llama_model_free(self._model)
                self._ctx = self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: the library may be gone already
            self.close()

    # ---- mutations -----------------------------------------------------------------------------

    def commit(self, session_id: str, keep_nodes: list[int]) -> None:
        with self._lock:
            s = self._get(session_id)
            keep = ints(keep_nodes)
            check_path(keep, s.pending_parents)
            if s.main is not None and keep:
                c = len(s.tokens)
                self._lib.llama_memory_seq_cp(self._memory, s.node_seq[keep[-1]], s.main, c, c + len(keep))
            self._drop_leaves(s)
            self._keep_path(session_id, s, keep)

    def _truncate_kv(self, s: _Session, length: int) -> None:
        self._drop_leaves(s)
        if s.main is not None:
            self._forget(s.main, length, -1)
            s.cut(length)
            s.shared = min(s.shared, length)

    def _drop_pending_kv(self, s: _Session) -> None:
        self._drop_leaves(s)

    def _discard_failed(self, plans: list[_Plan]) -> None:
        for p in plans:  # whatever the failed decode left is not trusted
            self._drop_kv(p.session)

    # ---- planning ------------------------------------------------------------------------------

    def _plan(self, step: Step) -> _Plan:
        c = self._checked(step, _Session)
        s, step = c.session, c.step
        fresh = s.main is None  # new or evicted: re-feed everything it has past the prefix it takes
        old_nodes = list(zip(s.pending_tokens, s.pending_parents, strict=True)) if fresh else []
        new_nodes = list(zip(step.node_tokens, step.node_parents, strict=True))
        return _Plan(
            session_id=step.session_id,
            session=s,
            step=step,
            causal=(s.tokens + step.new_tokens)[c.reused :] if fresh else step.new_tokens,
            causal_start=c.reused if fresh else len(s.tokens),
            nodes=old_nodes + new_nodes,
            first_node=len(s.pending_tokens) - len(old_nodes),
            outputs=0 if c.partial else (1 if step.new_tokens else 0) + len(new_nodes),
            rebuild=fresh and c.known,
            source=c.source,
        )

    # ---- budgets -------------------------------------------------------------------------------

    def _make_room(self, active: list[_Plan], in_call: set[str]) -> None:
        """Evict least recently used idle sessions until the call's cells and sequences fit
        (deterministic: restart the log first where the call would pass the cache's end)."""
        rows = sum(len(p.causal) + len(p.nodes) for p in active)
        if self._parking is not None and self._appended + rows > self.n_ctx:
            self._restart_log(active)
            rows = sum(len(p.causal) + len(p.nodes) for p in active)
        cells = self.cached_positions() + rows
        seqs = sum(self._seqs_needed(p) for p in active)
        for key, s in self._victims(in_call):
            if cells <= self.max_cache_tokens and seqs <= len(self._free):
                return
            if s.main is not None:
                cells -= s.own_cells
                self._evict(key, s)
        if seqs > len(self._free):
            raise RuntimeError(
                f"this forward needs {seqs} sequences, {len(self._free)} are free "
                f"(n_seq_max {self.n_seq_max})"
            )

    @staticmethod
    def _seqs_needed(p: _Plan) -> int:
        has_child = {parent for _, parent in p.nodes}
        leaves = sum(1 for i in range(len(p.nodes)) if p.first_node + i not in has_child)
        return leaves + (1 if p.session.main is None else 0)

    def _take_seq(self) -> int:
        return self._free.pop()

    def _drop_leaves(self, s: _Session) -> None:
        for seq in s.leaves:
            self._forget(seq)
            self._free.append(seq)
        s.leaves, s.node_seq = [], []

    def _drop_kv(self, s: _Session) -> None:
        self._drop_leaves(s)
        if s.main is not None:
            self._forget(s.main)
            self._free.append(s.main)
            s.main = None
        s.leave()

    def _forget(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Remove `seq` from its cells in [p0, p1); deterministic: park them rather than free them."""
        if self._parking is not None:
            self._lib.llama_memory_seq_cp(self._memory, seq, self._parking, p0, p1)
        self._lib.llama_memory_seq_rm(self._memory, seq, p0, p1)

    def _restart_log(self, active: list[_Plan]) -> None:
        """Deterministic, when this call's rows would pass the cache's end: every session loses its
        KV (tokens and trees are kept), the cache empties, and this call's plans become rebuilds
        that re-feed their sessions from position 0, in order."""
        for key, s in [*self._sessions.items(), *self._kept.items()]:
            self._lose_kv(key, s)
        self._kept.clear()
        for p in active:
            self._drop_kv(p.session)  # a session new in this call is not in the table yet
        self._lib.llama_memory_clear(self._memory, False)
        self._appended = 0
        self.stats["log_restarts"] += 1
        active[:] = [self._plan(p.step) for p in active]  # rebuilds; a new session stays new

    # ---- the model call ------------------------------------------------------------------------

    def _run(self, plans: list[_Plan]) -> list[torch.Tensor]:
        """Lay every plan out as rows, give every row its sequences, decode, split the logits."""
        for p in plans:
            if p.session.main is None:
                p.session.main = self._take_seq()
                if p.source is not None:  # its prefix: the owner's cells, shared
                    owner = self._state(p.source)
                    self._lib.llama_memory_seq_cp(self._memory, owner.main, p.session.main, 0, p.causal_start)
                    p.session.share(owner, p.causal_start)
        self._prefeed_long_prefixes(plans)
        rows: list[tuple[int, int, list[int], bool]] = []  # token, position, sequences, wants logits
        layouts = []
        for p in plans:
            s = p.session
            layout = self._tree_sequences(p)
            layouts.append(layout)
            s.leaves += list(layout.anchors)  # owned from now on: a failed decode frees them too
            for seq, anchor in layout.anchors.items():
                src = s.main if anchor == -1 else s.node_seq[anchor]
                end = -1 if anchor == -1 else len(s.tokens) + self._depth(s, anchor)
                self._lib.llama_memory_seq_cp(self._memory, src, seq, -1, end)
            root_leaves = [seq for seq, anchor in layout.anchors.items() if anchor == -1]
            last = len(p.causal) - 1 if p.outputs else -1  # a prefill's last row wants no logits
            for i, tok in enumerate(p.causal):
                want = i == last and bool(p.step.new_tokens)
                rows.append((tok, p.causal_start + i, [s.main, *root_leaves], want))
            committed = p.causal_start + len(p.causal)
            for i, (tok, _) in enumerate(p.nodes):
                want = p.first_node + i >= len(s.pending_tokens)  # this step's own nodes
                rows.append((tok, committed + layout.depths[i] - 1, layout.node_leaves[i], want))
        logits = self._decode(rows) if rows else np.zeros((0, self.vocab_size), dtype=np.float32)
        out, at = [], 0
        for p in plans:
            out.append(torch.from_numpy(logits[at : at + p.outputs]))
            at += p.outputs
        self.stats["forwards"] += 1
        self.stats["batch_sizes"][len(plans)] += 1
        for p, layout in zip(plans, layouts, strict=True):
            p.session.node_seq = p.session.node_seq[: p.first_node] + layout.node_seq
            self._retire_anchors(p.session, layout)
        return out

    def _prefeed_long_prefixes(self, plans: list[_Plan]) -> None:
        """When the call has more rows than one decode takes (a long prompt, a rebuild), feed the
        committed prefixes first, on their main sequences only, in decodes of n_batch rows: the
        main decode then holds each plan's last committed token and its tree."""
        total = sum(len(p.causal) + len(p.nodes) for p in plans)
        if total <= self.n_batch:
            return
        rows = []
        for p in plans:
            head = p.causal[:-1]
            rows += [(tok, p.causal_start + i, [p.session.main], False) for i, tok in enumerate(head)]
            p.causal_start += len(head)
            p.causal = p.causal[-1:]
        for start in range(0, len(rows), self.n_batch):
            self._decode(rows[start : start + self.n_batch])

    def _retire_anchors(self, s: _Session, layout: _Layout) -> None:
        """A pending leaf that got children this call no longer needs its own sequence: its cells
        are in its children's sequences too. Point its users there and free it (so a tree drafted
        level by level holds one sequence per frontier node, not one per node). Call before the
        step's nodes are added to the pending tree."""
        had_children = set(s.pending_parents)
        replacement: dict[int, int] = {}
        for seq, anchor in layout.anchors.items():
            if anchor != -1 and anchor not in had_children:
                replacement.setdefault(anchor, seq)
        for anchor, seq in replacement.items():
            old = s.node_seq[anchor]  # the anchor's own leaf sequence (it was a leaf)
            s.node_seq = [seq if q == old else q for q in s.node_seq]
            s.leaves.remove(old)
            self._forget(old)
            self._free.append(old)

    def _depth(self, s: _Session, node: int) -> int:
        depth = 0
        while node != -1:
            depth += 1
            node = s.pending_parents[node]
        return depth

    def _tree_sequences(self, p: _Plan) -> _Layout:
        """Leaf sequences for the nodes this call feeds (module docstring)."""
        s, base = p.session, p.first_node
        parents = [parent for _, parent in p.nodes]
        n = len(parents)
        children: dict[int, list[int]] = {}
        for i, parent in enumerate(parents):
            children.setdefault(parent, []).append(base + i)
        depths, anchors_of = [], []
        for parent in parents:
            if parent < base:  # the root or a pending node fed earlier
                depths.append(1 if parent == -1 else self._depth(s, parent) + 1)
                anchors_of.append(parent)
            else:
                depths.append(depths[parent - base] + 1)
                anchors_of.append(anchors_of[parent - base])
        node_leaves: list[list[int]] = [[] for _ in range(n)]
        anchors: dict[int, int] = {}  # leaf sequence -> the node it hangs from (-1 = root)
        for i in range(n - 1, -1, -1):
            if base + i not in children:
                seq = self._take_seq()
                anchors[seq] = anchors_of[i]
                node_leaves[i] = [seq]
            else:
                node_leaves[i] = [q for c in children[base + i] for q in node_leaves[c - base]]
        return _Layout(depths, node_leaves, anchors, [leaves[0] for leaves in node_leaves])

    def _decode(self, rows: list[tuple[int, int, list[int], bool]]) -> np.ndarray:
        """llama_decode over the rows (in chunks of n_batch, a tree never split); -> fp32 logits
        [rows wanting logits, V] in row order."""
        if len(rows) > self.n_batch:
            raise ValueError(
                f"{len(rows)} tokens in one forward; this backend takes at most {self.n_batch} (n_batch)"
            )
        lib, b = self._lib, self._batch
        wanted = 0
        for i, (tok, pos, seqs, want) in enumerate(rows):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = len(seqs)
            for j, seq in enumerate(seqs):
                b.seq_id[i][j] = seq
            b.logits[i] = want
            wanted += want
        b.n_tokens = len(rows)
        self._appended += len(rows)  # each row takes a new cell (a failed decode's too: not reused)
        rc = lib.llama_decode(self._ctx, b)
        self.stats["decodes"] += 1
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} ({len(rows)} tokens)")
        if not wanted:
            return np.zeros((0, self.vocab_size), dtype=np.float32)
        ptr = lib.llama_get_logits(self._ctx)
        floats = ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float))
        view = np.ctypeslib.as_array(floats, (wanted, self.vocab_size))
        return view.astype(np.float32, copy=True)


@dataclass
class _Layout:
    depths: list[int]  # per fed node
    node_leaves: list[list[int]]  # per fed node: the leaf sequences it belongs to
    anchors: dict[int, int]  # leaf sequence -> pending node it hangs from (-1: the root)
    node_seq: list[int]  # per fed node: one sequence holding its path
