"""Suffix drafts (SuffixDecoding, Oliaro et al.; the `suffix` speculator of Arctic Inference): token
trees looked up in what was generated before, no model.

A `SuffixIndex` holds token sequences: one session's own (its prompt and output), or the finished
outputs of many sessions (the global index: a token budget, the oldest sequence leaves first). It
answers what a suffix tree over them would: for the end of a context, the longest suffix that
occurred before, and what followed each occurrence. It is not stored as a tree: each n-gram
(n <= MAX_KEY) keeps its latest OCCURRENCES, and the subtree below a match is built when asked.
Memory is O(tokens) (a suffix trie of depth D holds up to D nodes per token: MAX_KEY entries a
token here). Counts are over the latest occurrences only: recent outputs weigh most.

`suffix_tree` builds a proposal from the continuations: their trie with counts, a node's
probability the share of its parent's occurrences that go on through it (the product down its
path), expanded best-first while that probability is at least `min_prob`, up to
min(max_nodes, alpha * match) nodes: SuffixDecoding's rule, the tree grows with the match. Worked
example (alpha 2, min_prob 0.1), continuations of a 3-token match:

    [7, 8, 9], [7, 8, 2], [7, 5], [4]     counts: 7 -> 3/4, 4 -> 1/4; under 7: 8 -> 2/3, 5 -> 1/3
    best first: 7 (.75), 8 (.5), then 9, 2, 5 and 4 (.25 each): six nodes = 2 * 3, the budget

The score, the sum of the nodes' probabilities (2.25 above), is the tokens the proposal is
expected to have accepted if the counts are the truth: `propose` keeps the better of the session's
and the global index's proposals by it. Proposals are verified by SamplingMode.PROPOSED (the
target's own draw at each position, a child kept when it equals it), so what is proposed, and so
what other sessions generated, never changes the output's distribution, only how fast it comes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.core.drafting import TreeSpec
from specmesh.core.methods import Method
from specmesh.core.ngram import draft_ngram
from specmesh.core.tree import DraftTree, proposed_tree

MAX_KEY = 4  # the longest n-gram indexed: a match is found by its last MAX_KEY tokens ...
MAX_MATCH = 32  # ... and measured back from there up to this many tokens
OCCURRENCES = 32  # latest occurrences kept per n-gram: the counts' sample
ALPHA = 1.0  # nodes per matched token (Arctic Inference's max_spec_factor)
MIN_PROB = 0.1  # a node's path probability below this is not proposed (min_token_prob)
SHARED_TOKENS = 262144  # finished outputs' tokens a replica keeps by default (~300 bytes each)


class SuffixIndex:
    """Token sequences and the latest occurrences of each of their n-grams (n = 1..MAX_KEY).
    max_tokens: a budget; adding past it drops the oldest sequences whole (None: no budget)."""

    def __init__(self, max_tokens: int | None = None) -> None:
        self.max_tokens = max_tokens
        self.tokens = 0  # held, over every sequence
        self._seqs: OrderedDict[int, list[int]] = OrderedDict()  # id -> tokens, the oldest first
        # n-gram -> its occurrences, (sequence id << 32) | end: the n-gram ends just before position
        # `end` of the sequence (one int, not a tuple: a third of the memory)
        self._ends: dict[tuple[int, ...], deque[int]] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def keys(self) -> int:
        """N-grams indexed (with `tokens`, what the index's memory grows with)."""
        return len(self._ends)

    def add(self, tokens: Sequence[int]) -> int:
        """A new sequence (its id), indexed; the oldest leave while the budget is passed (a sequence
        longer than the whole budget keeps its last max_tokens tokens)."""
        if self.max_tokens is not None:
            tokens = tokens[max(0, len(tokens) - self.max_tokens) :]
            while self._seqs and self.tokens + len(tokens) > self.max_tokens:
                self.remove(next(iter(self._seqs)))
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self._seqs[seq_id] = []
        self.extend(seq_id, tokens)
        return seq_id

    def extend(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Append to sequence `seq_id` (a session's index grows with its output)."""
        seq, ends, tag = self._seqs[seq_id], self._ends, seq_id << 32
        for t in tokens:
            seq.append(int(t))
            end = len(seq)
            for n in range(1, min(MAX_KEY, end) + 1):
                key = tuple(seq[end - n :])
                q = ends.get(key)
                if q is None:
                    q = ends[key] = deque(maxlen=OCCURRENCES)
                q.append(tag | end)
        self.tokens += len(tokens)

    def remove(self, seq_id: int) -> None:
        """Drop a sequence and its occurrences (an n-gram left with none is dropped too)."""
        seq, ends, tag = self._seqs.pop(seq_id), self._ends, seq_id << 32
        self.tokens -= len(seq)
        for end in range(1, len(seq) + 1):
            for n in range(1, min(MAX_KEY, end) + 1):
                key = tuple(seq[end - n : end])
                q = ends.get(key)
                if q is not None and (tag | end) in q:
                    q.remove(tag | end)
                    if not q:
                        del ends[key]

    def sequence(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    def lookup(self, context: Sequence[int], depth: int) -> tuple[int, list[tuple[int, list[int]]]]:
        """(m, [(match, continuation)]): m, the longest suffix of `context` that occurred (up to
        MAX_MATCH tokens), and per occurrence of its last min(m, MAX_KEY) tokens, how many tokens
        before it agree with the context and the up to `depth` tokens that followed it; (0, [])
        when nothing occurred. Occurrences with nothing after them yet (the context's own end, in
        a session's index) are skipped."""
        for n in range(min(MAX_KEY, len(context)), 0, -1):
            q = self._ends.get(tuple(context[len(context) - n :]))
            if not q:
                continue
            found = []
            for entry in reversed(q):  # the latest first
                seq, end = self._seqs[entry >> 32], entry & 0xFFFFFFFF
                if end < len(seq):
                    found.append((_match(seq, end, context, n), seq[end : end + depth]))
            if found:
                return max(m for m, _ in found), found
        return 0, []


def _match(seq: list[int], end: int, context: Sequence[int], n: int) -> int:
    """How many tokens before position `end` of seq agree with the end of context (n known to)."""
    while n < MAX_MATCH and end - n > 0 and n < len(context) and seq[end - n - 1] == context[-n - 1]:
        n += 1
    return n


@dataclass(frozen=True)
class Proposal:
    """A looked-up tree, level order: tokens [N], parents [N] (-1: a child of the root), probs [N]
    (each node's path probability under the counts); score = sum(probs)."""

    tokens: list[int]
    parents: list[int]
    probs: list[float]
    match: int

    @property
    def score(self) -> float:
        return sum(self.probs)


def suffix_tree(
    continuations: Sequence[Sequence[int]], match: int, max_nodes: int, alpha: float = ALPHA,
    min_prob: float = MIN_PROB,
) -> Proposal:  # fmt: skip
    """The proposal from the continuations of one match (module doc): at most
    min(max_nodes, alpha * match) nodes, each of path probability >= min_prob."""
    children: list[dict[int, int]] = [{}]  # trie node -> {token: child}; node 0 is the root
    counts, token_of, parent_of, depth_of = [len(continuations)], [-1], [-1], [0]
    for cont in continuations:
        node = 0
        for t in cont:
            child = children[node].get(t)
            if child is None:
                child = children[node][t] = len(counts)
                children.append({})
                counts.append(0)
                token_of.append(t)
                parent_of.append(node)
                depth_of.append(depth_of[node] + 1)
            counts[child] += 1
            node = child
    budget = min(max_nodes, int(alpha * match))
    heap = [(-counts[c] / counts[0], c) for c in children[0].values()]
    heapq.heapify(heap)
    chosen: list[tuple[int, float]] = []
    while heap and len(chosen) < budget:
        neg, node = heapq.heappop(heap)
        if -neg < min_prob:
            break
        chosen.append((node, -neg))
        for c in children[node].values():
            # the shares' product down the path telescopes to the node's count over the root's
            # (computed so, a share of exactly min_prob is not rounded below it)
            heapq.heappush(heap, (-counts[c] / counts[0], c))
    chosen.sort(key=lambda x: depth_of[x[0]])  # level order (stable: best first within a level)
    at = {node: i for i, (node, _) in enumerate(chosen)}
    return Proposal(
        tokens=[token_of[node] for node, _ in chosen],
        parents=[at.get(parent_of[node], -1) for node, _ in chosen],
        probs=[p for _, p in chosen],
        match=match,
    )


def best_proposal(
    index: SuffixIndex, context: Sequence[int], depth: int, max_nodes: int, alpha: float = ALPHA,
    min_prob: float = MIN_PROB,
) -> Proposal | None:  # fmt: skip
    """The index's best proposal after `context`: from the occurrences of the longest match, or
    from every occurrence of its last n-gram (more of them, so a wider, surer tree where the
    longest match happened once), whichever scores more; None when nothing matched."""
    m, found = index.lookup(context, depth)
    if not found:
        return None
    longest = suffix_tree([c for k, c in found if k == m], m, max_nodes, alpha, min_prob)
    key = min(m, MAX_KEY)
    if all(k == m for k, _ in found):
        return longest
    every = suffix_tree([c for _, c in found], key, max_nodes, alpha, min_prob)
    return max(longest, every, key=lambda p: p.score)


def propose(
    indexes: Sequence[SuffixIndex], context: Sequence[int], depth: int, max_nodes: int,
    alpha: float = ALPHA, min_prob: float = MIN_PROB,
) -> Proposal | None:  # fmt: skip
    """The best-scoring proposal of the indexes (a session's own, the global one); None when none
    matched or every tree came out empty."""
    proposals = [best_proposal(i, context, depth, max_nodes, alpha, min_prob) for i in indexes]
    return max((p for p in proposals if p is not None and p.tokens), key=lambda p: p.score, default=None)


def suffix_proposed_tree(proposal: Proposal | None, vocab_size: int) -> DraftTree | None:
    """The proposal as a tree of proposed tokens; None for no proposal."""
    if proposal is None or not proposal.tokens:
        return None
    return proposed_tree(proposal.tokens, proposal.parents, vocab_size)


class SessionIndexes:
    """Each session's own SuffixIndex, kept in step with its tokens (extended as they grow, rebuilt
    when they do not continue what is indexed: a rollback, a resync)."""

    def __init__(self) -> None:
        self._held: dict[str, SuffixIndex] = {}

    def synced(self, session_id: str, tokens: Sequence[int]) -> SuffixIndex:
        index = self._held.get(session_id)
        if index is not None:
            seq = index.sequence(0)
            if len(tokens) >= len(seq) and list(tokens[: len(seq)]) == seq:
                index.extend(0, tokens[len(seq) :])
                return index
        index = self._held[session_id] = SuffixIndex()
        index.add(tokens)
        return index

    def drop(self, session_id: str) -> None:
        self._held.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._held)


class SuffixDrafts:
    """What a replica holds for `suffix` drafts: each session's own index, and the shared index
    of finished outputs (a token budget). A session's output goes into the shared index when it
    ends (`finish`), unless the session is private: its text then never reaches another
    session's drafts."""

    def __init__(self, max_tokens: int) -> None:
        self.shared = SuffixIndex(max_tokens)
        self.sessions = SessionIndexes()
        self._prompts: dict[str, tuple[int, bool]] = {}  # session -> (prompt length, teaches)

    def draft(
        self, session_id: str, tokens: Sequence[int], depth: int, max_nodes: int, vocab_size: int,
        private: bool = False,
    ) -> DraftTree | None:  # fmt: skip
        """The tree after the session's committed `tokens` (its first call's are its prompt)."""
        self._prompts.setdefault(session_id, (len(tokens), not private))
        own = self.sessions.synced(session_id, tokens)
        return suffix_proposed_tree(propose([own, self.shared], tokens, depth, max_nodes), vocab_size)

    def finish(self, session_id: str, tokens: Sequence[int] | None) -> None:
        """The session ended here with these committed tokens (None: unknown); its output teaches
        the shared index unless it is private."""
        prompt, teaches = self._prompts.pop(session_id, (0, False))
        self.sessions.drop(session_id)
        if teaches and tokens is not None and len(tokens) > prompt:
            self.shared.add(tokens[prompt:])


def lookup_tree(
    drafts: SuffixDrafts, session_id: str, tokens: Sequence[int], spec: TreeSpec, vocab_size: int,
    private: bool = False,
) -> DraftTree | None:  # fmt: skip
    """A model-free method's tree after the session's committed `tokens`: ngram's chain from them
    alone, or suffix's tree from them and what `drafts` learnt; None when nothing matched."""
    if spec.method is Method.SUFFIX:
        return drafts.draft(session_id, tokens, spec.depth, spec.max_nodes, vocab_size, private)
    return draft_ngram(tokens, spec.depth, vocab_size)
