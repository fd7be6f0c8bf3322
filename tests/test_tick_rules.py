"""A tick loop's rules for what a tick takes, on their own (specmesh/rpc/tick_client.py): the
chunked-prefill budget (`_budgeted`), the plain steps of a tick that starts a session or feeds a
chunk (`_plain_steps`), the relay of drafted trees to a verify tick without decoding them
(`_relay`), and a drafted chain's suffix (`TreeRef.chain_suffix`). The loop's paths through real
replicas are tests/test_services.py's and tests/test_prefill.py's."""

from __future__ import annotations

import numpy as np
import pytest

from specmesh.core.ngram import chain_tree
from specmesh.core.sampling import SamplingParams
from specmesh.core.ticks import TreeColumns
from specmesh.rpc.tick_client import TreeRef, _budgeted, _plain_steps, _relay, _Work
from specmesh.rpc.ticks import Opened

VOCAB = 50
SESSION = Opened("s", "", SamplingParams())


def work(new: int, *, position: int = 5, limited: bool = False, since: float = 0.0, steps: int = 1,
         tree: TreeRef | None = None) -> _Work:  # fmt: skip
    w = _Work(SESSION, position, list(range(new)), lambda _: None, tree=tree, plain_steps=steps)
    w.limited, w.since = limited, since
    return w


def refs(*chains: list[int]) -> list[TreeRef]:
    columns = TreeColumns.from_trees([chain_tree(c, VOCAB) for c in chains], VOCAB)
    return [TreeRef(columns, i) for i in range(len(chains))]


def test_whole_items_always_go_and_limited_ones_share_what_they_leave_oldest_first() -> None:
    rounds = [work(3), work(2, tree=refs([1, 2, 3, 4])[0])]  # 3 + 2 new tokens, 4 nodes: 9 rows
    old, young, last = (
        work(40, limited=True, since=1.0),
        work(40, limited=True, since=2.0),
        work(5, limited=True, since=3.0),
    )
    taken, waiting = _budgeted(64, [young, *rounds, last, old])
    assert taken == [*rounds, old, young] and waiting == [last]  # 64 - 9 = 55: 40 to the oldest, 15 next
    assert (old.feed, young.feed) == (40, 15)


def test_limited_items_get_at_least_a_quarter_of_the_budget() -> None:
    big = [work(30) for _ in range(4)]  # 120 rows, past the budget of 64
    chunk = work(100, limited=True)
    taken, waiting = _budgeted(64, [*big, chunk])
    assert taken == [*big, chunk] and not waiting and chunk.feed == 16


def test_no_budget_feeds_everything_and_no_limited_item_changes_nothing() -> None:
    chunk, plain = work(500, limited=True), work(1)
    taken, waiting = _budgeted(0, [plain, chunk])
    assert taken == [plain, chunk] and not waiting and chunk.feed == 500
    queue = [work(3), work(4)]
    assert _budgeted(8, queue) == (queue, [])


def test_a_tick_that_starts_a_session_or_feeds_a_chunk_asks_one_step_of_every_plain_run() -> None:
    runs = [work(1, steps=4), work(1, steps=300)]
    assert _plain_steps(runs) == [4, 255]  # as asked, within the column's uint8
    assert _plain_steps([*runs, work(7, position=0)]) == [
        1,
        1,
        1,
    ]  # a start: its first token waits for no run
    assert _plain_steps([*runs, work(7, limited=True)]) == [1, 1, 1]  # a chunk: likewise


def test_relayed_trees_are_the_drafters_columns_in_the_ticks_order_with_plain_items_between() -> None:
    a, b, c = refs([1, 2], [3, 4, 5], [6])
    d = refs([7, 8])[0]  # another drafter result's columns
    relayed = _relay([b, None, a, d, None, None, c])
    want = [[3, 4, 5], [], [1, 2], [7, 8], [], [], [6]]
    assert [relayed.tokens.item(i).tolist() for i in range(7)] == want
    assert relayed.vocab_size == VOCAB
    assert _relay([]).tokens.lengths().tolist() == []
    assert _relay([None, None]).tokens.lengths().tolist() == [0, 0]


def test_a_chain_suffix_drops_the_decided_nodes_and_keeps_the_rest_whole() -> None:
    chain = refs([1, 2, 3, 4, 5], [9])[0]
    assert (chain.nodes, chain.depth, chain.tokens) == (5, 5, [1, 2, 3, 4, 5])
    rest = chain.chain_suffix(2)
    assert (rest.nodes, rest.depth, rest.tokens) == (3, 3, [3, 4, 5])
    assert np.array_equal(rest.columns.parents, [-1, 0, 1])
    for skip in (0, 5):
        with pytest.raises(ValueError, match="skip must be in"):
            chain.chain_suffix(skip)
