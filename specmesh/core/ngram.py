"""N-gram (prompt-lookup) drafts: proposals copied from the session's own tokens, no draft model.

The proposal after tokens t_1..t_n is what followed an earlier occurrence of the longest suffix
of t that occurred before (n-grams of `max_ngram` down to `min_ngram` tokens), as vLLM's `ngram`
proposer, SGLang's n-gram and llama.cpp's lookup decoding do. Of a `max_ngram`-gram's latest
CANDIDATES occurrences it takes the one whose agreement with the end of t runs back furthest (up
to MAX_MATCH tokens; the latest on a tie): where a 3-gram recurs (code's `(self, `), that is the
passage an answer is copying, not the latest place the 3-gram happened to occur. Worked example
(max_ngram 3, depth 3):

    tokens   = [5, 6, 7, 9, 5, 6, 7]
    suffix [5, 6, 7] occurred at 0..2, followed by [9, 5, 6]   -> proposal [9, 5, 6]
    tokens   = [1, 5, 6, 7, 9, 2, 5, 6, 7, 8, 1, 5, 6, 7]
    [5, 6, 7] at 1..3 (after a 1, as the end) and at 6..8      -> proposal [9, 2, 5]

The proposal is a function of the committed tokens, not a sample, so it is verified by the rule of
SamplingMode.PROPOSED (`verification`): the target draws its own token at each position, with the
draw a plain step there would make, and the proposal is kept while it equals those draws. The
emitted tokens are then exactly the plain steps' (lossless by construction; x is kept with
probability p(x), as rejection sampling of a one-hot draft would), so a seeded text does not
depend on which proposals rode. At T = 0 it keeps exactly the target's argmax. A tree is a chain;
no match drafts nothing (the round is a plain step).

`prompt_hit_rate` is the share of the prompt's own positions the lookup would have guessed: what
an adaptive `ngram` request takes as its acceptance before any round ran (a deterministic input,
so a seeded request gives the same text every time).

`NgramIndex` is `propose` kept up to date token by token (a proposal is a few dictionary lookups,
not a scan), and `NgramEstimate` is the default path's per-round evidence: at every position of
the answer, what the lookup would have proposed, checked against the tokens that came. Both are
functions of the tokens alone, so a choice made from them keeps seeded output reproducible, and a
session resumed elsewhere rebuilds them from its tokens.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from specmesh.core.tree import DraftTree, proposed_tree

MAX_NGRAM = 3
MIN_NGRAM = 1
WINDOW = 4096  # tokens searched back from the end: a lookup stays cheap on long sessions
# A proposal's match is measured back from its n-gram, up to MAX_MATCH tokens: an answer that has
# copied its source for 8 tokens or more goes on copying far more often than a fresh 3-token match
# (issue 38, the copying sets' answers: 90-100 % against 47-64 % at the first token). The estimate
# counts matches in these classes (lower bounds, tokens).
MAX_MATCH = 10
# Occurrences of the longest suffix compared by their match (the latest first). Replaying the copying
# sets' answers, 8 chose as well as comparing every occurrence, and as well as n-grams of up to 10
# tokens, which would take 4x the index's memory (docs/decisions.md, "The lookup's source").
CANDIDATES = 8
MATCH_CLASSES = (1, 2, 3, 5, 10)  # few classes: each gathers evidence fast enough to decay


def match_class(n: int) -> int:
    """The index in MATCH_CLASSES of a match of n >= 1 tokens."""
    return next(c for c in range(len(MATCH_CLASSES) - 1, -1, -1) if n >= MATCH_CLASSES[c])


def propose(
    tokens: Sequence[int], depth: int, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM
) -> list[int]:
    """Up to `depth` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` (of max_ngram .. min_ngram tokens); [] when no suffix occurred before."""
    window = list(tokens[-WINDOW:])
    end = len(window)
    for n in range(min(max_ngram, end - 1), min_ngram - 1, -1):
        suffix, last = window[end - n :], window[-1]
        # occurrences ending at e < end (so that window[e] follows them), the latest first: the
        # last token is compared first, the slice only on a hit
        ends = range(end - 1, n - 1, -1)
        found = (e for e in ends if window[e - 1] == last and window[e - n : e] == suffix)
        e = _source(window, found, n, max_ngram)
        if e is not None:
            return window[e : e + depth]
    return []


def _match(seq: Sequence[int], e: int, n: int) -> int:
    """How many tokens before position e agree with the end of seq: the n-gram and on, up to
    MAX_MATCH."""
    end = len(seq)
    while n < MAX_MATCH and e - n > 0 and seq[e - n - 1] == seq[end - n - 1]:
        n += 1
    return n


def _source(seq: Sequence[int], ends: Iterator[int], n: int, max_ngram: int) -> int | None:
    """Of the occurrences of seq's n-token suffix (their ends, the latest first), the one to copy
    from: the latest, or for the longest n-grams the best match of the first CANDIDATES (a shorter
    one's match cannot run past n: the suffix one longer would have occurred)."""
    if n < max_ngram:
        return next(ends, None)
    return max(itertools.islice(ends, CANDIDATES), key=lambda e: _match(seq, e, n), default=None)


def prompt_hit_rate(prompt: Sequence[int], max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> float:
    """The share of the prompt's positions (past its first quarter, so that there is something to
    look up) whose token `propose` on the tokens before it gives first. 0 for short prompts.
    One pass of an `NgramIndex` (what `propose` finds, without its window)."""
    start = max(8, len(prompt) // 4)
    if start >= len(prompt):
        return 0.0
    tokens = [int(t) for t in prompt]
    index = NgramIndex(max_ngram, min_ngram)
    index.extend(tokens[:start])
    hits = 0
    for t in tokens[start:]:
        hits += index.propose(1) == [t]
        index.extend([t])
    return hits / (len(tokens) - start)


def chain_tree(proposal: Sequence[int], vocab_size: int) -> DraftTree | None:
    """The proposal as a chain of proposed tokens; None for an empty proposal."""
    k = len(proposal)
    return proposed_tree(list(proposal), list(range(-1, k - 1)), vocab_size) if k else None


def draft_ngram(tokens: Sequence[int], depth: int, vocab_size: int) -> DraftTree | None:
    """The n-gram drafter's tree after the committed `tokens`: at most `depth` nodes, or None."""
    return chain_tree(propose(tokens, depth), vocab_size)


class NgramIndex:
    """`propose` over the whole sequence (no window), kept up to date: per n, each n-gram's latest
    end (the position of the token that followed it). extend() is O(max_ngram) per token and a
    proposal O(max_ngram) lookups, so a verifier can look up at every step of every session."""

    def __init__(self, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._clear()

    def _clear(self) -> None:
        self.tokens: list[int] = []
        self._ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(self.max_ngram + 1)]
        # per position e: the end before e of the max_ngram-gram that ends at e, or -1 (each
        # such n-gram's occurrences, linked from the latest: `_source`'s candidates)
        self._earlier = array.array("q")

    def extend(self, tokens: Sequence[int]) -> None:
        seq, ends, top = self.tokens, self._ends, self.max_ngram
        for t in tokens:
            i = len(seq)  # t's position: every n-gram ending just before it is followed by t
            for n in range(self.min_ngram, min(top, i) + 1):
                key = tuple(seq[i - n : i])
                if n == top:
                    self._earlier.append(ends[n].get(key, -1))
                ends[n][key] = i
            if i < top:
                self._earlier.append(-1)
            seq.append(int(t))

    def _indexed(self, e: int | None) -> Iterator[int]:
        """The indexed occurrences of a max_ngram-gram from its latest end e (None: it has none),
        the latest first."""
        while e is not None and e >= 0:
            yield e
            e = self._earlier[e]

    def sync(self, tokens: Sequence[int]) -> None:
        """Index exactly `tokens`: extended when they continue what is indexed, else rebuilt (a
        session rolled back or replaced)."""
        if not self.continued_by(tokens):
            self._clear()
        self.extend(tokens[len(self.tokens) :])

    def continued_by(self, tokens: Sequence[int]) -> bool:
        """Whether `tokens` start with every indexed token."""
        n = len(self.tokens)
        return len(tokens) >= n and list(tokens[:n]) == self.tokens

    def propose(self, depth: int, after: Sequence[int] = (), min_ngram: int | None = None) -> list[int]:
        """`lookup`'s proposal alone."""
        return self.lookup(depth, after, min_ngram)[1]

    def lookup(
        self, depth: int, after: Sequence[int] = (), min_ngram: int | None = None
    ) -> tuple[int, list[int]]:
        """(m, proposal): up to `depth` tokens that followed the earlier occurrence `propose`
        takes of the longest suffix (max_ngram down to the index's min_ngram tokens) of the
        indexed tokens + `after` (not indexed: a step's tokens not yet committed), and m, how many
        tokens before that occurrence agree with the end of the sequence (its n-gram and on, up to
        MAX_MATCH); (m, []) when m < min_ngram, (0, []) if nothing occurred. A longer match is a
        better guess: the default path rides only matches as long as its estimate says pay.
        Worked example (max_ngram 3): indexed [1, 5, 6, 7, 9, 1, 5, 6], after [7]: the suffix
        [5, 6, 7] ends at 4 (followed by 9) and the 1 before it agrees too -> (4, [9, 1, 5, ...])."""
        seq = self.tokens if not after else [*self.tokens, *after]
        end, indexed = len(seq), len(self.tokens)
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = seq[end - n :]
            # occurrences followed by an `after` token are not indexed, and are the latest: first
            latest = (e for e in range(end - 1, max(indexed, n) - 1, -1) if seq[e - n : e] == suffix)
            e = self._ends[n].get(tuple(suffix))
            earlier = self._indexed(e) if n == self.max_ngram else [] if e is None else [e]
            e = _source(seq, itertools.chain(latest, earlier), n, self.max_ngram)
            if e is not None:
                m = _match(seq, e, n)
                return (m, seq[e : e + depth]) if m >= (min_ngram or 0) else (m, [])
        return 0, []


@dataclass
class NgramEstimate:
    """What n-gram drafting would have achieved on the tokens from `start` on (the answer, not the
    prompt: a prompt's self-repetition does not predict an answer that copies it): at each
    position, the lookup's proposal of `depth` tokens, checked against the tokens that followed,
    counted apart by the class of its match length m (MATCH_CLASSES: a 1-token match in chat is
    right ~15 % of the time, a 3-token match in an answer that copies its prompt 47-64 %, a match
    of 8 or more tokens there 90-100 %). Counts decay per position, so the estimate follows the
    text (a chat answer that starts quoting its prompt). A function of the tokens alone.

    classes(): per class (its lower bound k), the share of decayed positions whose match falls in
    it (no prior: nothing rides before a match was seen) and alphas[j]: P(proposal token j+1 is
    right | the ones before it were), over those positions."""

    start: int
    depth: int = 8
    decay: float = 0.97  # ~30 positions
    prior_alpha: float = 0.5
    prior_weight: float = 2.0
    index: NgramIndex = field(default_factory=NgramIndex)
    positions: float = 0.0
    proposals: list[float] = field(init=False)  # [class]: decayed positions whose match was in it
    reached: list[list[float]] = field(init=False)  # [class][j]
    tried: list[list[float]] = field(init=False)
    # (position, class, proposal) still matching
    _open: list[tuple[int, int, list[int]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        classes = len(MATCH_CLASSES)
        self.proposals = [0.0] * classes
        self.reached = [[0.0] * self.depth for _ in range(classes)]
        self.tried = [[0.0] * self.depth for _ in range(classes)]

    def sync(self, tokens: Sequence[int]) -> None:
        """Take in `tokens` (the session's, from the first); rebuilt when they do not continue."""
        if not self.index.continued_by(tokens):
            fresh = NgramEstimate(self.start, self.depth, self.decay, self.prior_alpha, self.prior_weight)
            self.__dict__.update(fresh.__dict__)
        for t in tokens[len(self.index.tokens) :]:
            self._add(int(t))

    def _add(self, token: int) -> None:
        i = len(self.index.tokens)  # token's position
        still = []
        for p, c, proposal in self._open:  # proposals made before i, matching up to i
            j = i - p
            self.tried[c][j] += 1.0
            if proposal[j] == token:
                self.reached[c][j] += 1.0
                if j + 1 < len(proposal):
                    still.append((p, c, proposal))
        self._open = still
        if i >= self.start:
            d = self.decay
            self.reached = [[r * d for r in row] for row in self.reached]
            self.tried = [[t * d for t in row] for row in self.tried]
            self.proposals = [c * d for c in self.proposals]
            self.positions = self.positions * d + 1.0
            m, proposal = self.index.lookup(self.depth)
            if proposal:
                c = match_class(m)
                self.proposals[c] += 1.0
                self.tried[c][0] += 1.0
                if proposal[0] == token:
                    self.reached[c][0] += 1.0
                    if len(proposal) > 1:
                        self._open.append((i, c, proposal))
        self.index.extend([token])

    def classes(self) -> dict[int, tuple[float, list[float]]]:
        """Per match class, by its lower bound k (MATCH_CLASSES): (share, alphas), computed once
        for a round's choice; alphas at a depth not yet observed lean on the one above (as
        AdaptivePolicy)."""
        out = {}
        for c, k in enumerate(MATCH_CLASSES):
            alphas, prior = [], self.prior_alpha
            for reached, tried in zip(self.reached[c], self.tried[c], strict=True):
                prior = (reached + self.prior_weight * prior) / (tried + self.prior_weight)
                alphas.append(prior)
            out[k] = (self.proposals[c] / (self.positions + self.prior_weight), alphas)
        return out
