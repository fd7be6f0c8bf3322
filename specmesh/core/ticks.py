"""Columnar data of a tick: every session's part of one message as flat arrays (numpy), never a
Python object per session on the wire (vLLM v1's `SchedulerOutput` and its msgspec buffers are the
model). Model-free and proto-free: specmesh.rpc.ticks puts these on the wire, the replicas and the
gateway read them.

    Ragged.from_lists([[5, 6], [], [7]])     offsets [0, 2, 2, 3], values [5, 6, 7]

`TreeColumns` is a list of DraftTrees in that form: the drafter writes it (`from_trees`), the gateway
relays slices of it without decoding (`take`), the verifier checks it all at once (`check`) and
builds each session's DraftTree (`tree`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specmesh.core.extras import missing
from specmesh.core.tree import DISTRIBUTION_TOLERANCE, DraftTree, SamplingMode

try:
    import torch
except ModuleNotFoundError as exc:  # a gateway-only install: it relays trees, never builds them
    torch = missing(exc)

MODES = (  # wire code = index + 1
    SamplingMode.IID, SamplingMode.WITHOUT_REPLACEMENT, SamplingMode.MTAD, SamplingMode.PROPOSED
)  # fmt: skip
MODE_CODE = {m: i + 1 for i, m in enumerate(MODES)}


class ColumnError(ValueError):
    """A column that cannot be read as sent; `field` names it, `item` the first bad item (or None)."""

    def __init__(self, field: str, problem: str, item: int | None = None) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.item = field, item


@dataclass(frozen=True)
class Ragged:
    """One list per item, flattened: item i is values[offsets[i]:offsets[i + 1]]."""

    offsets: np.ndarray  # int64 [n + 1], offsets[0] = 0, non-decreasing
    values: np.ndarray  # [offsets[-1]]

    @classmethod
    def from_lists(cls, lists: Sequence[Sequence], dtype: type = np.int32) -> Ragged:
        offsets = np.zeros(len(lists) + 1, np.int64)
        np.cumsum([len(x) for x in lists], out=offsets[1:])
        values = np.fromiter((v for x in lists for v in x), dtype, int(offsets[-1]))
        return cls(offsets, values)

    @classmethod
    def empty(cls, n: int, dtype: type = np.int32) -> Ragged:
        return cls(np.zeros(n + 1, np.int64), np.zeros(0, dtype))

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def item(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def lists(self) -> list[list]:
        flat, offsets = self.values.tolist(), self.offsets.tolist()
        return [flat[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]

    def take(self, index: Sequence[int]) -> Ragged:
        """The lists of items `index`, in that order."""
        index = np.asarray(index, np.int64)
        if len(index) == 0:
            return Ragged.empty(0, self.values.dtype.type)
        starts, ends = self.offsets[index], self.offsets[index + 1]
        lengths = ends - starts
        offsets = np.zeros(len(index) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        # positions: for each kept value, its index in `values`
        positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1])
        return Ragged(offsets, self.values[positions])

    def check(self, field: str, n: int) -> None:
        """n items, offsets from 0 to len(values), never decreasing."""
        o = self.offsets
        if len(o) != n + 1:
            raise ColumnError(f"{field}.offsets", f"{len(o)} offsets for {n} items (need n + 1)")
        if o[0] != 0 or o[-1] != len(self.values) or (n and bool((np.diff(o) < 0).any())):
            raise ColumnError(f"{field}.offsets", "must rise from 0 to the number of values")


def item_index(offsets: np.ndarray) -> np.ndarray:
    """For each value of a Ragged, its item: offsets [0, 2, 2, 3] -> [0, 0, 2]."""
    return np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))


class _Problems:
    """Per item the first thing found wrong with its tree (`TreeColumns.check`)."""

    def __init__(self, n: int, field: str) -> None:
        self.found: list[ColumnError | None] = [None] * n
        self._field = field

    def bad(self, mask: np.ndarray, of_item: np.ndarray, name: str, problem: str) -> None:
        """Where `mask` holds, the item (`of_item` of each entry) has `problem` with `name`."""
        if not mask.any():  # the usual case, and np.unique's cost is not small for a tick
            return
        for i in np.unique(of_item[mask]).tolist():
            if self.found[i] is None:
                self.found[i] = ColumnError(f"{self._field}.{name}", problem, i)


@dataclass(frozen=True)
class TreeColumns:
    """DraftTrees, one per item (no tokens: no tree), in columns.

    tokens       Ragged int32    the nodes' tokens, level order
    parents      int32 [nodes]   parent of each node (-1 = root), within its item
    modes        uint8 [n]       MODE_CODE of the sampling mode (0: no tree)
    thresholds   float32 [n]     MTAD's lambda
    prob_rows    int32 [nodes + n]  per item N + 1 entries (root, then each node): its row within
                                 the item's rows, or -1
    item_rows    int64 [n + 1]   item i's rows are rows item_rows[i]..item_rows[i + 1]
    row_ids      Ragged int32    per row: its support's token ids; empty: a dense row
    row_probs    Ragged float32  per row: the support's probabilities, or vocab_size of them
    vocab_size   int
    """

    tokens: Ragged
    parents: np.ndarray
    modes: np.ndarray
    thresholds: np.ndarray
    prob_rows: np.ndarray
    item_rows: np.ndarray
    row_ids: Ragged
    row_probs: Ragged
    vocab_size: int

    def __len__(self) -> int:
        return len(self.tokens)

    @classmethod
    def none(cls, n: int, vocab_size: int = 0) -> TreeColumns:
        """n items with no tree (plain steps)."""
        return cls.from_trees([None] * n, vocab_size)

    @classmethod
    def from_trees(cls, trees: Sequence[DraftTree | None], vocab_size: int) -> TreeColumns:
        """Rows with zeros are sent sparse when that is smaller (top-k and top-p rows);
        both forms rebuild exactly the fp32 row that was sampled from."""
        tokens, parents, modes, thresholds, prob_rows = [], [], [], [], []
        item_rows, ids, probs = [0], [], []
        for tree in trees:
            if tree is None or tree.num_nodes == 0:
                tokens.append([])
                modes.append(0)
                thresholds.append(0.0)
                prob_rows.append(np.full(1, -1, np.int32))
                item_rows.append(item_rows[-1])
                continue
            tokens.append(tree.tokens.tolist())
            parents.append(tree.parents.numpy().astype(np.int32))
            modes.append(MODE_CODE[tree.mode])
            thresholds.append(tree.mtad_threshold)
            prob_rows.append(tree.prob_rows.numpy().astype(np.int32))
            rows = tree.draft_probs.detach().to("cpu", torch.float32).numpy()
            item_rows.append(item_rows[-1] + (rows.shape[0] if tree.has_draft_probs else 0))
            if tree.has_draft_probs:
                for row in rows:
                    support = np.flatnonzero(row)
                    if 2 * len(support) < len(row):
                        ids.append(support.astype(np.int32))
                        probs.append(row[support])
                    else:
                        ids.append(np.zeros(0, np.int32))
                        probs.append(row)
        return cls(
            tokens=Ragged.from_lists(tokens),
            parents=np.concatenate(parents) if parents else np.zeros(0, np.int32),
            modes=np.asarray(modes, np.uint8),
            thresholds=np.asarray(thresholds, np.float32),
            prob_rows=np.concatenate(prob_rows) if prob_rows else np.zeros(0, np.int32),
            item_rows=np.asarray(item_rows, np.int64),
            row_ids=_ragged(ids, np.int32),
            row_probs=_ragged(probs, np.float32),
            vocab_size=int(vocab_size),
        )

    def take(self, index: Sequence[int]) -> TreeColumns:
        """The trees of items `index`, in that order (the gateway relays a drafter's trees to the
        verifiers this way, never decoding them)."""
        index = np.asarray(index, np.int64)
        tokens = self.tokens.take(index)
        node_items = Ragged(self.tokens.offsets, self.parents).take(index)
        pr = Ragged(self.tokens.offsets + np.arange(len(self.tokens) + 1), self.prob_rows).take(index)
        rows = Ragged(self.item_rows, np.arange(self.item_rows[-1], dtype=np.int64)).take(index)
        return TreeColumns(
            tokens=tokens,
            parents=node_items.values,
            modes=self.modes[index],
            thresholds=self.thresholds[index],
            prob_rows=pr.values,
            item_rows=rows.offsets,
            row_ids=self.row_ids.take(rows.values),
            row_probs=self.row_probs.take(rows.values),
            vocab_size=self.vocab_size,
        )

    @classmethod
    def concat(cls, parts: Sequence[TreeColumns]) -> TreeColumns:
        """The items of `parts`, one after the other."""
        if len(parts) == 1:
            return parts[0]
        return cls(
            tokens=_concat([p.tokens for p in parts]),
            parents=np.concatenate([p.parents for p in parts]),
            modes=np.concatenate([p.modes for p in parts]),
            thresholds=np.concatenate([p.thresholds for p in parts]),
            prob_rows=np.concatenate([p.prob_rows for p in parts]),
            item_rows=_concat_offsets([p.item_rows for p in parts]),
            row_ids=_concat([p.row_ids for p in parts]),
            row_probs=_concat([p.row_probs for p in parts]),
            vocab_size=max((p.vocab_size for p in parts), default=0),
        )

    # ---- the verifier's side --------------------------------------------------------------------

    def check(self, n: int, vocab_size: int, field: str = "trees") -> list[ColumnError | None]:
        """Every column the right size, then each item's tree well formed: per item None or the
        first thing wrong with it (a bad tree fails its session alone). What `DraftTree.validate`
        checks, for the whole tick at once."""
        rows = self._check_sizes(n, vocab_size, field)
        problems = _Problems(n, field)
        node_item = item_index(self.tokens.offsets)
        local = np.arange(len(self.tokens.values)) - self.tokens.offsets[node_item]
        parents = self.parents.astype(np.int64)
        self._check_nodes(problems, vocab_size, node_item, local, parents)
        n_rows = np.diff(self.item_rows)
        self._check_prob_rows(problems, node_item, parents, n_rows)
        if rows:
            self._check_rows(problems.found, field, n_rows)
        self._check_modes(problems, node_item, local, parents, n_rows > 0)
        return problems.found

    def _check_sizes(self, n: int, vocab_size: int, field: str) -> int:
        """Every column's size for n items (else the whole tick is refused) -> the tick's rows."""
        self.tokens.check(f"{field}.tokens", n)
        nodes = len(self.tokens.values)
        for name, column, size in (
            ("parents", self.parents, nodes),
            ("modes", self.modes, n),
            ("mtad_thresholds", self.thresholds, n),
            ("prob_rows", self.prob_rows, nodes + n),
            ("item_rows", self.item_rows, n + 1),
        ):
            if len(column) != size:
                raise ColumnError(f"{field}.{name}", f"{len(column)} entries, need {size}")
        rows = int(self.item_rows[-1]) if n else 0
        if n and (self.item_rows[0] != 0 or bool((np.diff(self.item_rows) < 0).any())):
            raise ColumnError(f"{field}.item_rows", "must rise from 0")
        self.row_ids.check(f"{field}.row_ids", rows)
        self.row_probs.check(f"{field}.row_probs", rows)
        if rows and self.vocab_size != vocab_size:
            raise ColumnError(f"{field}.vocab_size", f"the trees were drafted over {self.vocab_size} tokens, "
                              f"this vocabulary has {vocab_size}")  # fmt: skip
        return rows

    def _check_nodes(
        self,
        problems: _Problems,
        vocab_size: int,
        node_item: np.ndarray,
        local: np.ndarray,
        parents: np.ndarray,
    ) -> None:
        """Tokens in the vocabulary, parents before their children, a mode per tree, level order."""
        n = len(self.modes)
        tok = self.tokens.values
        problems.bad(
            (tok < 0) | (tok >= vocab_size), node_item, "tokens", f"tokens must be in [0, {vocab_size})"
        )
        problems.bad((parents < -1) | (parents >= local), node_item, "parents",
                     "parents must come before their children (-1 <= parents[i] < i)")  # fmt: skip
        has_tree = self.tokens.lengths() > 0
        problems.bad(has_tree & ((self.modes < 1) | (self.modes > len(MODES))), np.arange(n), "modes",
                     "must be set to the sampling mode the tree was drafted with")  # fmt: skip
        depth = _depths(parents, self.tokens.offsets)
        if len(tok) > 1:
            same_item = node_item[1:] == node_item[:-1]
            problems.bad(np.concatenate([[False], same_item & (np.diff(depth) < 0)]), node_item, "parents",
                         "nodes must be in level order")  # fmt: skip

    def _check_prob_rows(
        self, problems: _Problems, node_item: np.ndarray, parents: np.ndarray, n_rows: np.ndarray
    ) -> None:
        """Per item N + 1 entries within the item's rows; every node with children has one."""
        n, nodes = len(self.modes), len(self.tokens.values)
        pr_item = item_index(self.tokens.offsets + np.arange(n + 1))
        pr = self.prob_rows.astype(np.int64)
        problems.bad((pr < -1) | (pr >= n_rows[pr_item]), pr_item, "prob_rows",
                     "prob_rows must index the item's rows or be -1")  # fmt: skip
        with_rows = n_rows > 0
        problems.bad(~with_rows[pr_item] & (pr != -1), pr_item, "prob_rows",
                     "must all be -1 when there are no draft_probs")  # fmt: skip
        # the row of each node's parent: prob_rows entry parent + 1 of the item
        pr_start = self.tokens.offsets[:-1] + np.arange(n)
        safe_parent = np.clip(parents, -1, None)
        parent_row = (
            pr[np.clip(pr_start[node_item] + safe_parent + 1, 0, max(len(pr) - 1, 0))] if nodes else pr[:0]
        )
        problems.bad(with_rows[node_item] & (parent_row < 0), node_item, "prob_rows",
                     "every node with children needs its draft distribution")  # fmt: skip

    def _check_modes(
        self,
        problems: _Problems,
        node_item: np.ndarray,
        local: np.ndarray,
        parents: np.ndarray,
        with_rows: np.ndarray,
    ) -> None:
        """What `DraftTree.validate` adds for some modes: chains, distinct siblings, no rows."""
        has_tree = self.tokens.lengths() > 0
        items = np.arange(len(self.modes))
        for mode in MODES:
            of_mode = has_tree & (self.modes == MODE_CODE[mode])
            if not of_mode.any():
                continue
            if mode.chain_only:
                problems.bad(of_mode[node_item] & (parents != local - 1), node_item, "parents",
                             f"a {mode.name} tree must be a chain")  # fmt: skip
            if mode.distinct_siblings:
                repeated = _repeated_siblings(of_mode, node_item, local, parents, self.tokens.values)
                problems.bad(repeated, node_item, "tokens",
                             f"siblings of a {mode.name} tree must carry distinct tokens")  # fmt: skip
            if not mode.samples_drafts:
                problems.bad(of_mode & with_rows, items, "draft_probs",
                             f"a {mode.name} tree carries none (its tokens were not sampled)")  # fmt: skip
            if mode is SamplingMode.MTAD:
                threshold = self.thresholds.astype(np.float64)
                problems.bad(of_mode & ~((threshold >= 0.0) & (threshold <= 1.0)), items, "mtad_thresholds",
                             "must be in [0, 1]")  # fmt: skip

    def _check_rows(self, problems: list[ColumnError | None], field: str, n_rows: np.ndarray) -> None:
        """Every row a distribution over the vocabulary: finite, >= 0, summing to 1; sparse ids in
        range and distinct. The acceptance rules divide by and subtract these rows: a row that is
        not one would bias the output without any error."""
        row_item = item_index(self.item_rows)
        id_len, prob_len = self.row_ids.lengths(), self.row_probs.lengths()
        dense = id_len == 0
        wrong_size = np.where(dense, prob_len != self.vocab_size, prob_len != id_len)
        probs = self.row_probs.values.astype(np.float64)
        ids = self.row_ids.values.astype(np.int64)
        id_row = item_index(self.row_ids.offsets)
        out_of_range = np.zeros(len(n_rows), bool)
        if len(ids):
            np.logical_or.at(out_of_range, row_item[id_row], (ids < 0) | (ids >= self.vocab_size))
            order = np.lexsort((ids, id_row))
            dup = (np.diff(ids[order]) == 0) & (np.diff(id_row[order]) == 0)
            np.logical_or.at(out_of_range, row_item[id_row[order][1:]], dup)
        prob_row = item_index(self.row_probs.offsets)
        finite = np.ones(len(dense), bool)
        np.logical_and.at(finite, prob_row, np.isfinite(probs) & (probs >= 0))
        sums = np.zeros(len(dense))
        np.add.at(sums, prob_row, np.where(np.isfinite(probs), probs, 0.0))
        for i, problem in (
            (np.flatnonzero(out_of_range), "row_ids: token ids must be in the vocabulary and distinct"),
            (row_item[wrong_size], "row_probs: a dense row needs vocab_size values, a sparse one one per id"),
            (row_item[~finite], "row_probs: probabilities must be finite and >= 0"),
            (row_item[np.abs(sums - 1.0) > DISTRIBUTION_TOLERANCE], "row_probs: a row does not sum to 1"),
        ):
            for item in np.unique(i).tolist() if len(i) else ():
                if problems[item] is None:
                    name, _, text = problem.partition(": ")
                    problems[item] = ColumnError(f"{field}.{name}", text, item)

    def dense_rows(self) -> torch.Tensor:
        """Every row of the tick as a dense fp32 [rows, vocab_size] tensor (after `check`)."""
        n_rows = len(self.row_probs)
        out = torch.zeros(n_rows, self.vocab_size)
        if not n_rows:
            return out
        prob_row = item_index(self.row_probs.offsets)
        dense_row = self.row_ids.lengths() == 0
        dense = dense_row[prob_row]
        probs = torch.from_numpy(self.row_probs.values.astype(np.float32))
        if dense.any():
            rows = np.flatnonzero(dense_row)
            out[torch.from_numpy(rows)] = probs[torch.from_numpy(dense)].reshape(len(rows), self.vocab_size)
        if (~dense).any():
            sparse = torch.from_numpy(~dense)
            out[
                torch.from_numpy(prob_row[~dense]), torch.from_numpy(self.row_ids.values.astype(np.int64))
            ] = probs[sparse]
        return out

    def tree(self, i: int, rows: torch.Tensor | None = None) -> DraftTree | None:
        """Item i's DraftTree (None: no tree), after `check`; rows: `dense_rows()`, made once per
        tick by a caller that builds several."""
        start, end = int(self.tokens.offsets[i]), int(self.tokens.offsets[i + 1])
        if start == end:
            return None
        n = end - start
        first, last = int(self.item_rows[i]), int(self.item_rows[i + 1])
        if rows is None and last > first:
            rows = self.take([i]).dense_rows()
            first, last = 0, rows.shape[0]
        pr_start = start + i
        return DraftTree(
            tokens=torch.from_numpy(self.tokens.values[start:end].astype(np.int64)),
            parents=torch.from_numpy(self.parents[start:end].astype(np.int64)),
            mode=MODES[int(self.modes[i]) - 1],
            draft_probs=rows[first:last]
            if rows is not None and last > first
            else torch.zeros(0, self.vocab_size),
            prob_rows=torch.from_numpy(self.prob_rows[pr_start : pr_start + n + 1].astype(np.int64)),
            mtad_threshold=float(self.thresholds[i]),
        )


def _depths(parents: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Depth of every node (1: a child of the root), item by item; chains without a loop."""
    depth = np.zeros(len(parents), np.int64)
    for i in range(len(offsets) - 1):
        start, end = int(offsets[i]), int(offsets[i + 1])
        p = parents[start:end]
        if np.array_equal(p, np.arange(-1, end - start - 1)):
            depth[start:end] = np.arange(1, end - start + 1)
            continue
        local = p.tolist()
        for j, parent in enumerate(local):
            depth[start + j] = 1 if parent < 0 or parent >= j else depth[start + parent] + 1
    return depth


def _repeated_siblings(
    of_mode: np.ndarray, node_item: np.ndarray, local: np.ndarray, parents: np.ndarray, tokens: np.ndarray
) -> np.ndarray:
    """[nodes] True where a node of an item of `of_mode` [n] has an earlier sibling (same item,
    same parent) with its token. Chains have no siblings: only branching items are sorted."""
    branching = np.zeros(len(of_mode), bool)
    branching[node_item[of_mode[node_item] & (parents != local - 1)]] = True
    out = np.zeros(len(tokens), bool)
    nodes = np.flatnonzero(branching[node_item])
    if not len(nodes):
        return out
    item, parent, token = node_item[nodes], parents[nodes], tokens[nodes].astype(np.int64)
    order = np.lexsort((nodes, token, parent, item))  # siblings alike together, the first first
    key = np.stack([item[order], parent[order], token[order]])
    out[nodes[order[1:]]] = (key[:, 1:] == key[:, :-1]).all(axis=0)
    return out


def _ragged(parts: list[np.ndarray], dtype: type) -> Ragged:
    offsets = np.zeros(len(parts) + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype)
    return Ragged(offsets, values)


def _concat_offsets(offsets: Sequence[np.ndarray]) -> np.ndarray:
    out, base = [np.zeros(1, np.int64)], 0
    for o in offsets:
        out.append(o[1:] + base)
        base += int(o[-1])
    return np.concatenate(out)


def _concat(parts: Sequence[Ragged]) -> Ragged:
    return Ragged(_concat_offsets([p.offsets for p in parts]), np.concatenate([p.values for p in parts]))
