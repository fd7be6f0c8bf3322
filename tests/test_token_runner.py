"""TokenRunner (`Backend.NGRAM`, specmesh.runtime.token_runner) on its own: the session rules every
backend obeys (steps append, pending trees, commit of a kept path, truncate, release, chunked
prefill), its rows of width 0, and its token budget, over which the least recently used idle
sessions are dropped whole (their callers see an unknown session and resend from position 0)."""

from __future__ import annotations

import pytest
import torch

from specmesh.runtime.backend import Step, UnknownSessionError
from specmesh.runtime.token_runner import TokenRunner

VOCAB = 50

# roots 0, 1, 2 (a repeated sibling token); 3 and 4 under 0; 5 under 3
TREE_TOKENS = [5, 17, 5, 40, 41, 7]
TREE_PARENTS = [-1, -1, -1, 0, 0, 3]


def test_rows_have_width_zero_one_per_fed_position() -> None:
    r = TokenRunner(VOCAB)
    assert r.device == torch.device("cpu") and r.max_context is None
    outs = r.forward([Step("a", [1, 2, 3]), Step("b", [4], TREE_TOKENS, TREE_PARENTS)])
    # the row after the last new token, then one per new node: no logits in any of them
    assert [tuple(o.shape) for o in outs] == [(1, 0), (1 + len(TREE_TOKENS), 0)]
    (out,) = r.forward([Step("b", [], [9, 8], [5, 6])])
    assert tuple(out.shape) == (2, 0)
    (out,) = r.forward([Step("a")])  # nothing to feed: no rows and no call
    assert out.shape[0] == 0
    assert r.stats["forwards"] == 2


def test_steps_append_new_tokens_as_plain_ints() -> None:
    r = TokenRunner(VOCAB)
    r.forward([Step("s", [1, 2, 3])])
    r.forward([Step("s", list(torch.tensor([4, 5])))])  # tensor scalars, as a sampler hands them
    tokens = r.committed_tokens("s")
    assert tokens == [1, 2, 3, 4, 5] and all(type(t) is int for t in tokens)
    assert r.committed_length("s") == 5 and r.pending_tokens("s") == [] and r.sessions() == ["s"]
    tokens.append(99)  # a copy: the caller cannot change what the session holds
    assert r.committed_tokens("s") == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("keep", [[0, 3, 5], [0, 4], [2], []])
def test_commit_keeps_a_root_to_node_path_of_the_pending_tree(keep: list[int]) -> None:
    r = TokenRunner(VOCAB)
    r.forward([Step("s", [1, 2], TREE_TOKENS[:3], TREE_PARENTS[:3])])
    # a second level: its parents index the earlier call's nodes first
    r.forward([Step("s", [], TREE_TOKENS[3:], TREE_PARENTS[3:])])
    assert r.pending_tokens("s") == TREE_TOKENS and r.committed_tokens("s") == [1, 2]
    r.commit("s", keep)
    kept = [TREE_TOKENS[i] for i in keep]
    assert r.committed_tokens("s") == [1, 2, *kept] and r.pending_tokens("s") == []
    # the tree is gone: new tokens are allowed and the next tree's nodes start from 0 again
    r.forward([Step("s", [9], [3, 4], [-1, 0])])
    r.commit("s", [0, 1])
    assert r.committed_tokens("s") == [1, 2, *kept, 9, 3, 4]


def test_bad_steps_and_paths_change_nothing() -> None:
    r = TokenRunner(VOCAB)
    r.forward([Step("s", [1, 2, 3], [4, 5], [-1, 0])])
    with pytest.raises(ValueError, match="pending"):
        r.forward([Step("s", [6])])
    with pytest.raises(ValueError, match="parent"):
        r.forward([Step("s", [], [6], [2])])  # only nodes 0 and 1 are pending
    with pytest.raises(ValueError, match="token"):
        r.forward([Step("s", [], [VOCAB], [-1])])
    with pytest.raises(ValueError, match="once"):
        r.forward([Step("s", [], [6], [1]), Step("s", [], [7], [1])])
    with pytest.raises(ValueError, match="path"):
        r.commit("s", [1])  # node 1 is not a root
    with pytest.raises(ValueError, match="path"):
        r.commit("s", [0, 0])
    with pytest.raises(ValueError, match="pending"):  # one bad step rejects the whole batch
        r.forward([Step("new", [1]), Step("s", [9])])
    with pytest.raises(UnknownSessionError):
        r.forward([Step("nobody", [], [1], [-1])])
    with pytest.raises(UnknownSessionError):
        r.commit("nobody", [])
    assert r.sessions() == ["s"] and r.stats["forwards"] == 1
    assert r.committed_tokens("s") == [1, 2, 3] and r.pending_tokens("s") == [4, 5]


def test_truncate_keeps_a_prefix_and_drops_the_tree() -> None:
    r = TokenRunner(VOCAB)
    r.forward([Step("s", [1, 2, 3, 4, 5], [6, 7], [-1, 0])])
    r.commit("s", [0, 1])
    r.forward([Step("s", [8], [9], [-1])])  # a pending tree, thrown away too
    r.truncate("s", 4)
    assert r.committed_tokens("s") == [1, 2, 3, 4] and r.pending_tokens("s") == []
    r.forward([Step("s", [20, 21])])  # new tokens are allowed again
    assert r.committed_tokens("s") == [1, 2, 3, 4, 20, 21]
    for bad in (0, 7):  # at least one token stays, and nothing past what is held
        with pytest.raises(ValueError, match="length"):
            r.truncate("s", bad)
    r.truncate("s", 6)  # to its own length: everything stays
    assert r.committed_tokens("s") == [1, 2, 3, 4, 20, 21]
    with pytest.raises(UnknownSessionError):
        r.truncate("nobody", 1)


def test_chunked_prefill_holds_only_what_was_fed() -> None:
    r = TokenRunner(VOCAB)
    prompt = list(range(1, 11))
    r.forward([Step("s", prompt, feed_limit=4)])
    assert r.committed_tokens("s") == prompt[:4]
    r.forward([Step("s", prompt[4:], [30], [-1], feed_limit=4)])  # partial: its node does not ride
    assert r.committed_length("s") == 8 and r.pending_tokens("s") == []
    (out,) = r.forward([Step("s", prompt[8:], [30], [-1], feed_limit=4)])  # fits: whole
    assert r.committed_tokens("s") == prompt and r.pending_tokens("s") == [30]
    assert tuple(out.shape) == (2, 0)


def test_a_partial_step_returns_no_rows() -> None:
    r = TokenRunner(VOCAB)
    (out,) = r.forward([Step("s", [1, 2, 3, 4, 5], feed_limit=2)])
    assert out.shape[0] == 0  # as ModelRunner: a partial step's rows would follow unfed tokens


def test_release_forgets_the_session_and_keeps_no_prefix() -> None:
    r = TokenRunner(VOCAB)
    tokens = list(range(40))  # over a prefix block: a KV backend could keep it
    r.forward([Step("s", tokens, [1], [-1])])
    r.forward([Step("t", [1])])
    r.release("s")  # keep=True, but there is no KV to keep
    assert r.sessions() == ["t"] and r.committed_tokens("s") is None
    assert r.committed_length("s") is None and r.pending_tokens("s") == []
    assert r.kept_prefixes() == 0 and r.cached_positions() == 1
    r.release("s")  # again, and an unknown id: no-ops
    r.release("nobody")
    # the id starts over with what it is sent, taking nothing from the released tokens
    r.forward([Step("s", [*tokens, 3])])
    assert r.committed_tokens("s") == [*tokens, 3] and r.reused_tokens("s") == 0


def test_no_budget_never_evicts() -> None:
    r = TokenRunner(VOCAB)
    for i in range(20):
        r.forward([Step(f"s{i}", [i] * 10)])
    assert len(r.sessions()) == 20 and r.cached_positions() == 200 and r.stats["evictions"] == 0


def test_budget_counts_committed_and_pending_tokens() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=10)
    r.forward([Step("a", [1, 2, 3], [4, 5], [-1, 0])])  # 3 committed + 2 pending
    r.forward([Step("b", [6, 7, 8, 9, 10])])  # exactly the budget: fits
    assert r.sessions() == ["a", "b"] and r.cached_positions() == 10 and r.stats["evictions"] == 0
    r.forward([Step("b", [11])])  # one over: the idle a goes whole, its tree too
    assert r.sessions() == ["b"] and r.cached_positions() == 6 and r.stats["evictions"] == 1
    assert r.committed_tokens("a") is None and r.pending_tokens("a") == []


def test_least_recently_used_goes_first_and_only_as_many_as_needed() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=12)
    for sid in "abcd":
        r.forward([Step(sid, [1, 2, 3])])
    r.commit("a", [])  # a commit is a use: a becomes the most recent
    assert r.committed_tokens("b") == [1, 2, 3]  # a read is not
    r.forward([Step("e", [4, 5, 6, 7])])  # 16 > 12: b goes (13), then c (10), then it fits
    assert r.sessions() == ["d", "a", "e"]
    assert r.stats["evictions"] == 2 and r.cached_positions() == 10
    r.truncate("d", 3)  # a truncate is a use too: a is now the oldest
    r.forward([Step("f", [8, 9, 10])])  # 13 > 12: a goes
    assert r.sessions() == ["e", "d", "f"] and r.stats["evictions"] == 3


def test_sessions_in_the_call_are_never_evicted() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=6)
    r.forward([Step("a", [1, 2, 3])])
    r.forward([Step("b", [4, 5, 6])])
    # a is the least recently used but in the call: b goes, and the call runs over the budget
    r.forward([Step("a", [], [7, 8, 9, 10], [-1, 0, 1, 2]), Step("c", [11, 12])])
    assert r.sessions() == ["a", "c"] and r.stats["evictions"] == 1
    assert r.cached_positions() == 9
    assert r.pending_tokens("a") == [7, 8, 9, 10] and r.committed_tokens("c") == [11, 12]


def test_a_rejected_batch_evicts_nothing() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=4)
    r.forward([Step("a", [1, 2, 3])])
    with pytest.raises(ValueError, match="token"):
        r.forward([Step("b", [4, 5]), Step("c", [VOCAB])])  # b alone would evict a
    assert r.sessions() == ["a"] and r.stats["evictions"] == 0


def test_truncate_and_release_give_the_budget_back() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=8)
    r.forward([Step("a", [1, 2, 3, 4, 5], [6], [-1])])
    r.truncate("a", 2)  # the cut tokens and the tree no longer count
    assert r.cached_positions() == 2
    r.forward([Step("b", [7, 8, 9, 10, 11, 12])])  # 8: fits
    r.release("b")
    r.forward([Step("c", [1, 2, 3, 4, 5, 6])])  # fits in what b left
    assert r.sessions() == ["a", "c"] and r.stats["evictions"] == 0


def test_an_evicted_session_is_unknown_until_resent_from_the_start() -> None:
    r = TokenRunner(VOCAB, max_cache_tokens=8)
    r.forward([Step("a", [1, 2, 3, 4], [5], [-1])])
    r.forward([Step("b", [6, 7, 8, 9])])  # 9 > 8: a goes
    # what the services read to tell a caller to resync (committed_length None: position 0)
    assert r.committed_tokens("a") is None and r.committed_length("a") is None
    assert r.pending_tokens("a") == [] and r.reused_tokens("a") == 0
    with pytest.raises(UnknownSessionError):
        r.commit("a", [0])
    with pytest.raises(UnknownSessionError):
        r.truncate("a", 2)
    with pytest.raises(UnknownSessionError):
        r.forward([Step("a", [], [6], [0])])
    r.release("a")  # not an error: the session is already gone
    # new tokens start it over from those alone (dropped whole: nothing to rebuild from)
    r.forward([Step("a", [1, 2, 3, 4, 5])])  # 4 + 5 > 8: b goes
    assert r.committed_tokens("a") == [1, 2, 3, 4, 5] and r.sessions() == ["a"]
    assert r.stats["evictions"] == 2 and r.stats["rebuilds"] == 0
