"""Suffix drafts (specmesh.core.suffix) rule by rule, on small hand-made sequences: the index's
lookup (the longest suffix match, measured back past MAX_KEY up to MAX_MATCH; occurrences latest
first; the context's own end skipped), its token budget and OCCURRENCES cap, the tree built from
the continuations (SuffixDecoding's budget, min_prob, level order, path probabilities), the choice
between proposals and between indexes, the DraftTree it becomes, and the per-session indexes. A
property test checks lookup against a brute force over random small-vocabulary sequences."""

from __future__ import annotations

import random

import pytest
import torch

from specmesh.core.suffix import (
    MAX_KEY,
    MAX_MATCH,
    OCCURRENCES,
    Proposal,
    SessionIndexes,
    SuffixDrafts,
    SuffixIndex,
    best_proposal,
    propose,
    suffix_proposed_tree,
    suffix_tree,
)
from specmesh.core.tree import SamplingMode

# the module doc's worked example: continuations of a 3-token match, alpha 2, min_prob 0.1
WORKED = [[7, 8, 9], [7, 8, 2], [7, 5], [4]]


def index_of(*seqs: list[int], max_tokens: int | None = None) -> SuffixIndex:
    index = SuffixIndex(max_tokens)
    for seq in seqs:
        index.add(seq)
    return index


def held_ids(index: SuffixIndex, ids: list[int]) -> set[int]:
    held = set()
    for i in ids:
        try:
            index.sequence(i)
        except KeyError:
            continue
        held.add(i)
    return held


def depths_of(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def paths_of(p: Proposal) -> list[tuple[int, ...]]:
    """Each node's tokens from the root down (parents come first: level order)."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(p.tokens, p.parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return paths


# --- lookup ---------------------------------------------------------------------------------


def test_lookup_measures_the_longest_match_back_past_max_key() -> None:
    # the key is the last MAX_KEY tokens [4, 5, 6, 7]; the older sequence agrees 7 tokens back
    # (30 != 10 stops it), the newer one 4 (20 != 3)
    index = index_of([10, 1, 2, 3, 4, 5, 6, 7, 8], [20, 4, 5, 6, 7, 9])
    assert index.lookup([30, 1, 2, 3, 4, 5, 6, 7], depth=1) == (7, [(4, [9]), (7, [8])])


def test_lookup_match_is_capped_at_max_match() -> None:
    index = index_of(list(range(60)))
    m, found = index.lookup(list(range(50)), depth=2)
    assert m == MAX_MATCH == 32 and found == [(MAX_MATCH, [50, 51])]


def test_lookup_lists_occurrences_latest_first() -> None:
    # within a sequence the later position first; a newer sequence before an older one
    index = index_of([1, 2, 3, 1, 4], [1, 5])
    assert index.lookup([1], depth=1) == (1, [(1, [5]), (1, [4]), (1, [2])])


def test_lookup_skips_the_context_own_end_and_stops_at_the_sequence_start() -> None:
    # a session's index: its context is the indexed sequence itself; [3, 1, 2, 3] and the last
    # [1, 2, 3] end at the sequence's end (nothing follows): the earlier [1, 2, 3] is found, its
    # match stopping at the sequence's start
    tokens = [1, 2, 3, 1, 2, 3]
    index = index_of(tokens)
    assert index.lookup(tokens, depth=3) == (3, [(3, [1, 2, 3])])
    # only occurrences with nothing after them: no match at all
    assert index_of([1, 2]).lookup([1, 2], depth=4) == (0, [])


def test_lookup_without_a_match_is_empty() -> None:
    index = index_of([1, 2, 3, 4])
    assert index.lookup([9, 8], depth=3) == (0, [])
    assert index.lookup([], depth=3) == (0, [])
    assert SuffixIndex().lookup([1, 2], depth=3) == (0, [])


def test_lookup_cuts_continuations_at_depth_and_stops_at_the_context_start() -> None:
    index = index_of(list(range(1, 11)))
    # 5 tokens (past MAX_KEY): the sequence agrees further back (2), the context has no more
    assert index.lookup([3, 4, 5, 6, 7], depth=2) == (5, [(5, [8, 9])])
    assert index.lookup([3, 4, 5, 6, 7], depth=100) == (5, [(5, [8, 9, 10])])  # to its end
    assert index.lookup([6, 7], depth=0) == (2, [(2, [])])


def test_only_the_latest_occurrences_of_an_n_gram_count() -> None:
    # [5] followed by 1 ten times, then by 2 OCCURRENCES times: only the 2s are left to count
    index = index_of([5, 1] * 10 + [5, 2] * OCCURRENCES)
    m, found = index.lookup([9, 5], depth=1)
    assert m == 1 and len(found) == OCCURRENCES and all(c == [2] for _, c in found)
    # one fewer: the latest 1 is still among them
    index = index_of([5, 1] * 10 + [5, 2] * (OCCURRENCES - 1))
    _, found = index.lookup([9, 5], depth=1)
    assert len(found) == OCCURRENCES and found[-1] == (1, [1])
    # the cap is over the index, not per sequence: a newer sequence pushes an older one's out
    index = index_of([5, 1], *([5, 2] for _ in range(OCCURRENCES)))
    assert [1] not in [c for _, c in index.lookup([5], depth=1)[1]]


# --- the budget -----------------------------------------------------------------------------


def test_the_budget_drops_the_oldest_sequences_whole() -> None:
    index = SuffixIndex(max_tokens=10)
    a = index.add([1, 2, 3, 4, 5])
    index.add([6, 7, 8, 9, 10])  # exactly at the budget: both kept
    assert len(index) == 2 and index.tokens == 10
    index.add([11, 12])  # past it: the oldest leaves whole (not just 2 of its tokens)
    assert len(index) == 2 and index.tokens == 7
    with pytest.raises(KeyError):
        index.sequence(a)
    index.add([13] * 9)  # both older ones leave
    assert len(index) == 1 and index.tokens == 9


def test_the_held_tokens_stay_within_the_budget() -> None:
    rng = random.Random(3)
    index = SuffixIndex(max_tokens=20)
    ids = []
    for _ in range(200):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 15))]
        ids.append(index.add(tokens))
        assert index.sequence(ids[-1]) == tokens  # the newest always stays
        alive = held_ids(index, ids)
        held = [i for i in ids if i in alive]
        assert index.tokens <= 20 and index.tokens == sum(len(index.sequence(i)) for i in held)
        assert held == ids[-len(held) :]  # what left was the oldest


def test_a_sequence_longer_than_the_budget_keeps_its_last_tokens() -> None:
    index = SuffixIndex(max_tokens=5)
    index.add([90, 91])
    seq = index.add(list(range(8)))
    assert len(index) == 1 and index.sequence(seq) == [3, 4, 5, 6, 7] and index.tokens == 5
    assert index.lookup([1, 2], depth=2) == (0, [])  # the dropped head is not indexed
    assert index.lookup([90], depth=1) == (0, [])


def test_removed_sequences_occurrences_are_never_returned() -> None:
    # the older sequence has the longer match ([1, 2, 3] -> 8); once it leaves, only [2, 3] -> 9
    index = index_of([7, 1, 2, 3, 8], [0, 2, 3, 9], max_tokens=9)
    assert index.lookup([1, 2, 3], depth=1) == (3, [(3, [8])])
    index.add([50, 51, 52])
    assert len(index) == 2
    assert index.lookup([1, 2, 3], depth=1) == (2, [(2, [9])])
    assert index.lookup([7, 1], depth=1) == (0, [])


def test_evicted_sequences_leave_no_n_grams_behind() -> None:
    # each token ends at most MAX_KEY n-grams: what is indexed stays bounded by what is held
    index = SuffixIndex(max_tokens=8)
    for i in range(200):
        index.add([4 * i + j for j in range(4)])
    assert index.tokens == 8 and index.keys <= MAX_KEY * index.tokens


def test_remove_adjusts_tokens() -> None:
    index = SuffixIndex()
    a, b = index.add([1, 2, 3]), index.add([4, 5])
    assert index.tokens == 5
    index.remove(a)
    assert index.tokens == 2 and len(index) == 1 and index.sequence(b) == [4, 5]
    assert index.lookup([1, 2], depth=1) == (0, [])


# --- extend ---------------------------------------------------------------------------------


def test_extend_indexes_the_new_positions() -> None:
    index = SuffixIndex()
    seq = index.add([1, 2, 3])
    assert index.lookup([3, 4], depth=2) == (0, [])
    index.extend(seq, [4, 1, 2, 3, 5])
    assert index.sequence(seq) == [1, 2, 3, 4, 1, 2, 3, 5] and index.tokens == 8
    assert index.lookup([3, 4], depth=2) == (2, [(2, [1, 2])])
    assert index.lookup([9, 1, 2, 3], depth=1) == (3, [(3, [5]), (3, [4])])


def test_extend_equals_adding_the_whole_sequence() -> None:
    rng = random.Random(7)
    for _ in range(20):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        cut = rng.randrange(len(tokens) + 1)
        whole, grown = index_of([9, 0, 1]), index_of([9, 0, 1])
        whole.add(tokens)
        grown.extend(grown.add(tokens[:cut]), tokens[cut:])
        assert whole.tokens == grown.tokens
        for end in range(len(tokens) + 1):
            for start in (0, max(0, end - 6)):
                context = tokens[start:end]
                assert whole.lookup(context, 5) == grown.lookup(context, 5), context


# --- suffix_tree ----------------------------------------------------------------------------


def test_suffix_tree_reproduces_the_worked_example() -> None:
    p = suffix_tree(WORKED, match=3, max_nodes=10, alpha=2, min_prob=0.1)
    # best first 7, 8, 9, 2, 5, 4; level order: 7, 4 | 8, 5 | 9, 2 (best first within a level)
    assert p.tokens == [7, 4, 8, 5, 9, 2]
    assert p.parents == [-1, -1, 0, 0, 2, 2]
    assert p.probs == pytest.approx([0.75, 0.25, 0.5, 0.25, 0.25, 0.25])
    assert p.score == pytest.approx(2.25) and p.match == 3


@pytest.mark.parametrize(
    ("match", "max_nodes", "alpha", "nodes"),
    [(3, 10, 1.0, 3), (3, 10, 1.5, 4), (5, 2, 1.0, 2), (8, 8, 1.0, 8), (1, 10, 0.5, 0)],
)
def test_suffix_tree_budget_is_min_of_max_nodes_and_alpha_times_match(
    match: int, max_nodes: int, alpha: float, nodes: int
) -> None:
    # one chain of probability-1 nodes, longer than any budget: the budget alone decides
    p = suffix_tree([list(range(1, 13))], match, max_nodes, alpha, min_prob=0.1)
    assert len(p.tokens) == nodes == min(max_nodes, int(alpha * match))
    assert p.tokens == list(range(1, nodes + 1)) and p.parents == list(range(-1, nodes - 1))


def test_suffix_tree_prunes_nodes_below_min_prob_and_their_descendants() -> None:
    # 3 has path probability 0.1; 4 and 5 under it go on from every occurrence of 3 (a share of
    # 1), but their path probability is 0.1 too
    conts = [[1, 2]] * 9 + [[3, 4, 5]]
    p = suffix_tree(conts, match=10, max_nodes=10, alpha=1.0, min_prob=0.2)
    assert p.tokens == [1, 2] and p.probs == pytest.approx([0.9, 0.9])
    p = suffix_tree(conts, match=10, max_nodes=10, alpha=1.0, min_prob=0.1)  # at least: kept
    assert p.tokens == [1, 3, 2, 4, 5] and p.parents == [-1, -1, 0, 1, 3]
    # everything below min_prob: nothing at all
    assert suffix_tree(conts, match=10, max_nodes=10, alpha=1.0, min_prob=0.95).tokens == []


def test_suffix_tree_of_no_continuations_is_empty() -> None:
    for conts in ([], [[]], [[], []]):
        p = suffix_tree(conts, match=4, max_nodes=8)
        assert p.tokens == p.parents == p.probs == [] and p.score == 0


def test_suffix_tree_rules_hold_on_random_continuations() -> None:
    """Level order, distinct siblings, path probabilities the product of count shares (the share
    of all continuations that start with the path), each >= min_prob, within the budget, and
    best first: no node left out is likelier than one proposed."""
    rng = random.Random(11)
    for _ in range(300):
        conts = [[rng.randrange(4) for _ in range(rng.randrange(0, 6))] for _ in range(rng.randrange(1, 12))]
        match, max_nodes = rng.randrange(1, 12), rng.randrange(1, 16)
        alpha, min_prob = rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.05, 0.1, 0.3])
        p = suffix_tree(conts, match, max_nodes, alpha, min_prob)
        assert all(parent < i for i, parent in enumerate(p.parents))
        depths = depths_of(p.parents)
        assert depths == sorted(depths)
        siblings = list(zip(p.parents, p.tokens, strict=True))
        assert len(set(siblings)) == len(siblings)
        share = {}  # every path in the continuations' trie -> its share of the continuations
        for cont in conts:
            for d in range(1, len(cont) + 1):
                share[tuple(cont[:d])] = share.get(tuple(cont[:d]), 0) + 1 / len(conts)
        paths = paths_of(p)
        assert p.probs == pytest.approx([share[path] for path in paths])
        assert all(q >= min_prob for q in p.probs)
        assert len(p.tokens) <= min(max_nodes, int(alpha * match))
        left_out = [q for path, q in share.items() if path not in set(paths) and q >= min_prob + 1e-9]
        if left_out:  # something proposable was left out: the budget was spent on likelier nodes
            assert len(p.tokens) == min(max_nodes, int(alpha * match))
            assert not p.probs or max(left_out) <= min(p.probs) + 1e-9


def test_a_node_of_path_probability_exactly_min_prob_is_kept() -> None:
    # 5 takes 3 of 10 continuations, 1 under it 1 of those 3: path probability 1/10 = min_prob
    p = suffix_tree([[5, 1]] + [[5, 2]] * 2 + [[6]] * 7, match=10, max_nodes=10, alpha=1.0, min_prob=0.1)
    assert 1 in p.tokens


# --- best_proposal and propose --------------------------------------------------------------

# [2, 3, 4, 5] four times followed by 6, 7, 8, 10 (a token before it that is not 1: match 4)
OTHERS = [[0, 2, 3, 4, 5, 6, 7, 8, 10]] * 4


def test_best_proposal_takes_every_occurrence_when_the_longest_match_says_little() -> None:
    # the 5-token match occurred once, with one token after it: a tree of score 1; every
    # occurrence of its last MAX_KEY tokens: 6, 7, 8, 10 at 4/5 each (budget 4): 3.2
    index = index_of([1, 2, 3, 4, 5, 9], *OTHERS)
    p = best_proposal(index, [1, 2, 3, 4, 5], depth=4, max_nodes=10)
    assert p is not None and p.match == MAX_KEY
    assert p.tokens == [6, 7, 8, 10] and p.score == pytest.approx(3.2)


def test_best_proposal_keeps_the_longest_match_when_it_scores_more() -> None:
    # the 5-token match has 5 tokens after it: a sure chain of 5 (budget 5); every occurrence's
    # tree has a budget of MAX_KEY = 4 nodes, so at most 4
    index = index_of([1, 2, 3, 4, 5, 9, 9, 9, 9, 9], *OTHERS)
    p = best_proposal(index, [1, 2, 3, 4, 5], depth=5, max_nodes=10)
    assert p is not None and p.match == 5
    assert p.tokens == [9] * 5 and p.parents == [-1, 0, 1, 2, 3] and p.score == pytest.approx(5)


def test_best_proposal_with_one_match_length_is_the_longest_tree() -> None:
    index = index_of(*OTHERS)
    p = best_proposal(index, [2, 3, 4, 5], depth=2, max_nodes=10)
    assert p == suffix_tree([[6, 7]] * 4, MAX_KEY, 10)
    assert best_proposal(index, [42], depth=2, max_nodes=10) is None


def test_propose_picks_the_better_scoring_index() -> None:
    short = index_of([3, 8])  # [3] -> 8: a 1-token match, budget 1, score 1
    long = index_of([1, 2, 3, 4, 5, 6])  # [1, 2, 3] -> 4, 5, 6: score 3
    expected = best_proposal(long, [1, 2, 3], depth=3, max_nodes=10)
    assert expected is not None and expected.tokens == [4, 5, 6]
    assert propose([short, long], [1, 2, 3], depth=3, max_nodes=10) == expected
    assert propose([long, short], [1, 2, 3], depth=3, max_nodes=10) == expected
    short_only = propose([short, SuffixIndex()], [1, 2, 3], depth=3, max_nodes=10)
    assert short_only is not None and short_only.tokens == [8]


def test_propose_is_none_when_nothing_matches_or_every_tree_is_empty() -> None:
    a, b = index_of([3, 8]), index_of([1, 2, 3, 4])
    assert propose([a, b], [42, 43], depth=3, max_nodes=10) is None
    assert propose([], [1, 2, 3], depth=3, max_nodes=10) is None
    # matches, but no node reaches min_prob / no budget / nothing after: empty trees -> None
    assert propose([a, b], [1, 2, 3], depth=3, max_nodes=10, min_prob=1.5) is None
    assert propose([a, b], [1, 2, 3], depth=3, max_nodes=0) is None
    assert propose([a, b], [1, 2, 3], depth=0, max_nodes=10) is None


# --- proposed_tree --------------------------------------------------------------------------


def test_proposed_tree_is_a_valid_draft_tree_of_proposed_tokens() -> None:
    p = suffix_tree(WORKED, match=3, max_nodes=10, alpha=2, min_prob=0.1)
    tree = suffix_proposed_tree(p, vocab_size=16)
    assert tree is not None and tree.mode is SamplingMode.PROPOSED
    assert tree.tokens.dtype == tree.parents.dtype == tree.prob_rows.dtype == torch.long
    assert tree.tokens.tolist() == p.tokens and tree.parents.tolist() == p.parents
    assert tuple(tree.draft_probs.shape) == (0, 16) and not tree.has_draft_probs
    assert tree.prob_rows.tolist() == [-1] * 7
    tree.validate(16)  # level order, distinct siblings, no draft rows: accepted
    assert tree.path(4) == [7, 8, 9] and tree.children(-1) == [0, 1]


def test_proposed_trees_of_lookups_always_validate() -> None:
    rng = random.Random(5)
    for _ in range(100):
        index = index_of(*([rng.randrange(3) for _ in range(rng.randrange(1, 30))] for _ in range(3)))
        context = [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
        tree = suffix_proposed_tree(propose([index], context, depth=4, max_nodes=12, alpha=3.0), vocab_size=3)
        if tree is not None:
            tree.validate(3)


def test_proposed_tree_of_no_proposal_is_none() -> None:
    assert suffix_proposed_tree(None, vocab_size=16) is None
    assert suffix_proposed_tree(Proposal([], [], [], match=3), vocab_size=16) is None


# --- SessionIndexes and SuffixDrafts --------------------------------------------------------


def test_session_index_is_extended_while_tokens_continue() -> None:
    sessions = SessionIndexes()
    index = sessions.synced("s", [1, 2, 3])
    assert sessions.synced("s", [1, 2, 3]) is index  # nothing new
    assert sessions.synced("s", [1, 2, 3, 1, 2]) is index  # the same object, grown
    assert index.sequence(0) == [1, 2, 3, 1, 2] and index.tokens == 5
    assert index.lookup([1, 2], depth=2) == (2, [(2, [3, 1])])


def test_session_index_is_rebuilt_when_tokens_do_not_continue() -> None:
    sessions = SessionIndexes()
    index = sessions.synced("s", [1, 2, 3, 4])
    rolled_back = sessions.synced("s", [1, 2, 5])  # a rollback: 3, 4 are gone
    assert rolled_back is not index and rolled_back.sequence(0) == [1, 2, 5] and len(rolled_back) == 1
    assert rolled_back.lookup([9, 2], depth=1) == (1, [(1, [5])])  # not 3
    shorter = sessions.synced("s", [1, 2])  # a prefix of what is indexed: rebuilt too
    assert shorter is not rolled_back and shorter.sequence(0) == [1, 2]
    assert sessions.synced("t", [1, 2]) is not shorter and len(sessions) == 2  # one per session


def test_dropping_a_session_forgets_its_index() -> None:
    sessions = SessionIndexes()
    index = sessions.synced("s", [1, 2, 3])
    sessions.drop("s")
    sessions.drop("never-seen")  # no error
    assert len(sessions) == 0
    assert sessions.synced("s", [1, 2, 3, 4]) is not index


def test_suffix_drafts_teach_the_shared_index_only_finished_outputs_of_non_private_sessions() -> None:
    drafts = SuffixDrafts(max_tokens=100)
    assert drafts.draft("a", [1, 2, 3], depth=3, max_nodes=8, vocab_size=16) is None
    drafts.finish("a", [1, 2, 3, 4, 5, 6])  # its output, not its prompt, goes in
    assert len(drafts.shared) == 1 and drafts.shared.sequence(0) == [4, 5, 6] and len(drafts.sessions) == 0
    tree = drafts.draft("b", [9, 4, 5], depth=3, max_nodes=8, vocab_size=16)
    assert tree is not None and tree.tokens.tolist() == [6]
    drafts.draft("c", [7, 7], depth=3, max_nodes=8, vocab_size=16, private=True)
    drafts.finish("c", [7, 7, 8, 9])
    drafts.finish("b", None)  # unknown tokens: nothing taught
    drafts.finish("never-seen", [1, 2, 3])
    assert len(drafts.shared) == 1


# --- lookup against a brute force -----------------------------------------------------------


def brute_lookup(seqs: list[list[int]], context: list[int], depth: int) -> tuple[int, list]:
    """lookup by its definition, over sequences added in order (no budget). An occurrence counts
    while it is among the latest OCCURRENCES of its last min(m, MAX_KEY) tokens (in the order
    indexed: sequence, then position) and something follows it; m is the longest suffix of the
    context (up to MAX_MATCH) with such an occurrence."""
    order: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for s, seq in enumerate(seqs):
        for end in range(1, len(seq) + 1):
            for k in range(1, min(MAX_KEY, end) + 1):
                order.setdefault(tuple(seq[end - k : end]), []).append((s, end))
    kept = {key: occurrences[-OCCURRENCES:] for key, occurrences in order.items()}

    def agree(s: int, end: int) -> int:  # tokens before `end` agreeing with the context's end
        seq, j = seqs[s], 0
        while j < min(MAX_MATCH, len(context), end) and seq[end - j - 1] == context[-j - 1]:
            j += 1
        return j

    m = 0
    for length in range(1, min(MAX_MATCH, len(context)) + 1):
        key = tuple(context[-min(length, MAX_KEY) :])
        if any(end < len(seqs[s]) and agree(s, end) >= length for s, end in kept.get(key, [])):
            m = length
    if m == 0:
        return 0, []
    key = tuple(context[-min(m, MAX_KEY) :])
    latest = [(s, end) for s, end in reversed(kept[key]) if end < len(seqs[s])]
    return m, [(agree(s, end), seqs[s][end : end + depth]) for s, end in latest]


def random_context(rng: random.Random, seqs: list[list[int]], vocab: int) -> list[int]:
    """The session's case (an indexed sequence itself, or a prefix of one), a passage of one
    after random tokens, or random tokens alone."""
    seq = rng.choice(seqs)
    noise = [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
    start = rng.randrange(len(seq) + 1)
    passage = seq[start : rng.randrange(start, len(seq) + 1)]
    return rng.choice([seq, seq[: rng.randrange(len(seq) + 1)], noise + passage, noise])


@pytest.mark.parametrize("vocab", [1, 2, 3, 6])
def test_lookup_matches_a_brute_force(vocab: int) -> None:
    # vocabularies of 1 and 2 over up to ~150 tokens: n-grams far past OCCURRENCES occurrences
    # (the cap matters) and matches past MAX_MATCH (the all-equal sequences of vocabulary 1)
    rng = random.Random(1000 + vocab)
    for _ in range(150):
        lengths = [rng.randrange(0, 50) for _ in range(rng.randrange(1, 4))]
        seqs = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        index = index_of(*seqs)
        for _ in range(4):
            context, depth = random_context(rng, seqs, vocab), rng.randrange(0, 6)
            m, found = index.lookup(context, depth)
            assert (m, found) == brute_lookup(seqs, context, depth), (seqs, context)
            assert len(found) <= OCCURRENCES and all(len(c) <= depth for _, c in found)
            assert m == max((k for k, _ in found), default=0) <= MAX_MATCH
