"""A tick's columns and its batched rules: what goes on the wire comes back exactly, a bad item is
named alone, and a session's verdict and draws do not depend on the other sessions of its tick."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from specmesh.core.drafting import TreeSpec, build_tree, draft_many
from specmesh.core.logprobs import TokenLogprob
from specmesh.core.methods import Method
from specmesh.core.ngram import chain_tree
from specmesh.core.sampling import Draws, SamplingParams, uniform_many
from specmesh.core.ticks import MODE_CODE, ColumnError, Ragged, TreeColumns
from specmesh.core.tree import SamplingMode
from specmesh.core.verification import verify_many
from specmesh.rpc import ticks, wire
from specmesh.rpc.ticks import trees_from_proto, trees_to_proto
from tests.toy import ToyModel

VOCAB = 8
DRAFT, TARGET = ToyModel(VOCAB, seed=11, scale=1.0), ToyModel(VOCAB, seed=22, scale=1.5)
SPECS = [
    TreeSpec("chain", depth=3),
    TreeSpec("mcsd", depth=2, branching=(3, 2), replacement=True),
    TreeSpec("mcsd", depth=2, branching=(3, 2), replacement=False),
    TreeSpec("rsd_c", depth=3, branching=(4, 2, 1)),
    TreeSpec("rsd_s", depth=3, beam_width=3),
    TreeSpec("mtad", depth=3, beam_width=4, mtad_threshold=0.2),
]
PARAMS = [
    SamplingParams(1.0),
    SamplingParams(0.6, top_k=3),
    SamplingParams(0.0),
    SamplingParams(1.0, top_p=0.8),
]


def trees(n: int, seed: int = 0) -> list:
    """n trees of every method and sampling (greedy ones carry no draft rows), plain steps and
    n-gram chains (proposed tokens: no rows) between."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        if i % 5 == 4:
            out.append(None)
            continue
        if i % 7 == 6:
            out.append(chain_tree([(i + j * 3) % VOCAB for j in range(1 + i % 3)], VOCAB))
            continue
        context = tuple(range(i % 3))
        out.append(build_tree(SPECS[i % len(SPECS)], DRAFT.next_logits(context), PARAMS[i % len(PARAMS)], g))
    return out


def assert_same_tree(a, b) -> None:
    if a is None or b is None:
        assert a is None and b is None
        return
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert a.mode is b.mode and a.mtad_threshold == pytest.approx(b.mtad_threshold)
    assert torch.equal(a.prob_rows, b.prob_rows)
    assert a.has_draft_probs == b.has_draft_probs
    if a.has_draft_probs:
        assert torch.equal(a.draft_probs, b.draft_probs)  # sparse or dense, the same fp32 rows


def test_ragged_round_trips_and_takes_items_in_any_order() -> None:
    lists = [[5, 6], [], [7], [1, 2, 3]]
    r = Ragged.from_lists(lists)
    assert r.offsets.tolist() == [0, 2, 2, 3, 6] and r.values.tolist() == [5, 6, 7, 1, 2, 3]
    assert r.lists() == lists and r.lengths().tolist() == [2, 0, 1, 3]
    assert r.take([3, 0, 1]).lists() == [[1, 2, 3], [5, 6], []]
    assert r.take([]).lists() == []


def test_trees_come_back_exactly_through_the_wire_and_through_take() -> None:
    sent = trees(20)
    columns = trees_from_proto(trees_to_proto(TreeColumns.from_trees(sent, VOCAB)), len(sent))
    assert columns.check(len(sent), VOCAB) == [None] * len(sent)
    rows = columns.dense_rows()
    for i, tree in enumerate(sent):
        assert_same_tree(columns.tree(i, rows), tree)
        assert_same_tree(columns.tree(i), tree)  # without the tick's rows: its own
    # the gateway relays slices of a drafter's tick to verifiers without decoding them
    index = [7, 2, 4, 19, 0]
    relayed = TreeColumns.concat([columns.take(index[:2]), columns.take(index[2:])])
    assert relayed.check(len(index), VOCAB) == [None] * len(index)
    for j, i in enumerate(index):
        assert_same_tree(relayed.tree(j), sent[i])


def corrupt(columns: TreeColumns, what: str, item: int) -> TreeColumns:
    tokens, parents = columns.tokens.values.copy(), columns.parents.copy()
    probs, modes = columns.row_probs.values.copy(), columns.modes.copy()
    node = int(columns.tokens.offsets[item])
    if what == "tokens":
        tokens[node] = VOCAB
    elif what == "parents":
        parents[node] = 0  # the first node its own parent
    elif what == "row_probs":
        probs[columns.row_probs.offsets[columns.item_rows[item]]] += 0.5
    elif what == "modes":
        modes[item] = 9
    return TreeColumns(
        tokens=Ragged(columns.tokens.offsets, tokens),
        parents=parents,
        modes=modes,
        thresholds=columns.thresholds,
        prob_rows=columns.prob_rows,
        item_rows=columns.item_rows,
        row_ids=columns.row_ids,
        row_probs=Ragged(columns.row_probs.offsets, probs),
        vocab_size=columns.vocab_size,
    )


@pytest.mark.parametrize("what", ["tokens", "parents", "row_probs", "modes"])
def test_a_bad_tree_is_named_alone_and_the_others_of_the_tick_pass(what: str) -> None:
    sent = trees(10)
    bad = 1  # a sampled MCSD tree with draft rows
    assert sent[bad] is not None and sent[bad].has_draft_probs
    problems = corrupt(TreeColumns.from_trees(sent, VOCAB), what, bad).check(len(sent), VOCAB)
    assert [i for i, p in enumerate(problems) if p is not None] == [bad]
    assert problems[bad].field == f"trees.{what}" and problems[bad].item == bad


def test_a_proposed_tree_has_distinct_siblings_and_no_rows_or_named() -> None:
    sent = trees(10)
    columns = TreeColumns.from_trees(sent, VOCAB)
    assert sent[6].mode is SamplingMode.PROPOSED and sent[6].num_nodes == 1 and sent[3].num_nodes > 1
    modes, tokens = columns.modes.copy(), columns.tokens.values.copy()
    # item 0 (a sampled chain) has rows; item 3 (an RSD-C tree) gets two root children alike
    modes[[0, 3]] = MODE_CODE[SamplingMode.PROPOSED]
    first = columns.tokens.offsets[3]
    assert sent[3].parents[:2].tolist() == [-1, -1]
    tokens[first + 1] = tokens[first]
    relabelled = dataclasses.replace(columns, modes=modes, tokens=Ragged(columns.tokens.offsets, tokens))
    problems = relabelled.check(len(sent), VOCAB)
    assert [i for i, p in enumerate(problems) if p is not None] == [0, 3]
    assert problems[0].field == "trees.draft_probs" and problems[3].field == "trees.tokens"


def test_an_mtad_tree_is_a_chain_with_a_threshold_in_range_or_named() -> None:
    sent = trees(10)
    columns = TreeColumns.from_trees(sent, VOCAB)
    assert sent[5].mode is SamplingMode.MTAD and sent[1].num_nodes > sent[1].depths().max()
    modes, thresholds = columns.modes.copy(), columns.thresholds.copy()
    modes[1] = MODE_CODE[SamplingMode.MTAD]  # an MCSD tree: not a chain
    thresholds[[1, 5]] = 1.5
    problems = dataclasses.replace(columns, modes=modes, thresholds=thresholds).check(len(sent), VOCAB)
    assert [i for i, p in enumerate(problems) if p is not None] == [1, 5]
    assert problems[1].field == "trees.parents" and problems[5].field == "trees.mtad_thresholds"


def test_a_column_of_the_wrong_size_refuses_the_tick_naming_it() -> None:
    msg = trees_to_proto(TreeColumns.from_trees(trees(4), VOCAB))
    msg.parents = msg.parents[:-4]
    with pytest.raises(ColumnError, match=r"trees\.parents"):
        trees_from_proto(msg, 4).check(4, VOCAB)
    msg = trees_to_proto(TreeColumns.from_trees(trees(4), VOCAB))
    msg.tokens.offsets = msg.tokens.offsets[:-4]
    with pytest.raises(wire.WireError, match=r"trees\.tokens\.offsets"):
        trees_from_proto(msg, 4)


def verdicts(sent: list, params: list[SamplingParams], keys: list[int]) -> list[tuple]:
    logits = []
    for tree in sent:
        paths = [()] + ([] if tree is None else [tuple(tree.path(i)) for i in range(tree.num_nodes)])
        logits.append(TARGET.logits(paths))
    draws = [Draws.derive(k, 0, "verify") for k in keys]
    out = verify_many(sent, logits, params, draws)
    return [(v.accepted_tokens, v.accepted_nodes, v.next_token, v.bonus) for v in out]


def test_a_sessions_verdict_does_not_depend_on_the_others_in_its_tick() -> None:
    """Batched (one argmax, one vectorized chain test) against each session verified alone."""
    sent = trees(40, seed=3)
    params = [PARAMS[(i * 3) % len(PARAMS)] for i in range(len(sent))]
    keys = list(range(len(sent)))
    together = verdicts(sent, params, keys)
    alone = [verdicts([t], [p], [k])[0] for t, p, k in zip(sent, params, keys, strict=True)]
    assert together == alone
    order = np.random.default_rng(0).permutation(len(sent)).tolist()
    shuffled = verdicts([sent[i] for i in order], [params[i] for i in order], [keys[i] for i in order])
    assert shuffled == [alone[i] for i in order]
    assert any(v[0] for v in alone) and any(not v[3] for v in alone)  # accepts and rejects both


def test_counter_draws_are_the_same_batched_or_one_by_one() -> None:
    streams = [Draws.derive(7, position, "draft") for position in range(5)]
    batched = uniform_many(streams, 3)
    again = [Draws.derive(7, position, "draft") for position in range(5)]
    one_by_one = torch.stack([torch.cat([d.uniform(1), d.uniform(2)]) for d in again])
    assert torch.equal(batched, one_by_one)
    assert all(d.counter == 3 for d in streams)
    assert len({round(float(x), 12) for x in batched.flatten()}) == 15  # distinct streams
    assert Draws.derive(7, 0, "verify").uniform(1) != Draws.derive(7, 0, "draft").uniform(1)


def test_greedy_drafts_carry_no_rows_on_the_wire() -> None:
    g = torch.Generator().manual_seed(0)
    tree = build_tree(TreeSpec("chain", depth=4), DRAFT.next_logits(()), SamplingParams(0.0), g)
    assert tree.mode is SamplingMode.IID and not tree.has_draft_probs
    columns = TreeColumns.from_trees([tree], VOCAB)
    assert len(columns.row_probs.values) == 0 and columns.item_rows.tolist() == [0, 0]


def test_a_ticks_observations_at_once_count_as_one_by_one() -> None:
    """observe_all (a tick's rounds into a histogram) against prometheus_client's own observe."""
    from prometheus_client import CollectorRegistry, Histogram

    from specmesh.rpc.metrics import observe_all

    buckets = (0.001, 0.01, 0.1, 1.0)
    values = [0.0, 0.001, 0.0011, 0.01, 0.5, 1.0, 2.0, 7.5, 0.0005, 0.02]
    one, many = (Histogram(n, "", buckets=buckets, registry=CollectorRegistry()) for n in ("a", "b"))
    for v in values:
        one.observe(v)
    observe_all(many, values)
    observe_all(many, [])

    def samples(h):
        return [(s.name[1:], s.labels, s.value) for s in h.collect()[0].samples if "created" not in s.name]

    assert samples(one) == samples(many)


def drafted(specs: list[TreeSpec], params: list[SamplingParams], keys: list[int]) -> list:
    """draft_many over sessions below contexts of different lengths, driven as a drafter does."""
    contexts = [tuple(range(k % 3)) for k in keys]
    levels = draft_many(specs, params, [Draws.derive(k, 0, "draft") for k in keys])
    asked = next(levels)
    try:
        while True:
            asked = levels.send(
                [
                    DRAFT.next_logits(c)(paths) if paths else None
                    for c, paths in zip(contexts, asked, strict=True)
                ]
            )
    except StopIteration as done:
        return done.value


def test_a_sessions_draft_does_not_depend_on_the_others_in_its_tick() -> None:
    """Chains and RSD-S beams are drafted together over the tick (one warp, one log-softmax, one
    set of truncated Gumbels per level), the other methods tree by tree beside them: every tree,
    greedy or sampled, is the one its session drafts alone, in any order."""
    specs = [*SPECS, TreeSpec("rsd_s", depth=2, beam_width=2), TreeSpec("chain", depth=1)] * 5
    params = [PARAMS[(i * 3) % len(PARAMS)] for i in range(len(specs))]
    keys = list(range(len(specs)))
    together = drafted(specs, params, keys)
    alone = [drafted([s], [p], [k])[0] for s, p, k in zip(specs, params, keys, strict=True)]
    for a, b in zip(together, alone, strict=True):
        assert_same_tree(a, b)
    order = np.random.default_rng(1).permutation(len(specs)).tolist()
    shuffled = drafted([specs[i] for i in order], [params[i] for i in order], [keys[i] for i in order])
    for i, tree in zip(order, shuffled, strict=True):
        assert_same_tree(tree, alone[i])
    beams = [t for s, t in zip(specs, alone, strict=True) if s.method is Method.RSD_S]
    assert {p.greedy for s, p in zip(specs, params, strict=True) if s.method is Method.RSD_S} == {True, False}
    assert len({tuple(t.tokens.tolist()) for t in beams}) > 2  # the seeds make different trees


# ---- the four messages of a tick stream: each one's codec, round trips through bytes -------------


def through_bytes(msg):
    return type(msg).FromString(msg.SerializeToString())


def assert_same_items(a: ticks.TickItems, b: ticks.TickItems) -> None:
    for name in ("handles", "positions", "cancel", "release", "feed"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.new_tokens.lists() == b.new_tokens.lists()


def assert_same_columns(a: TreeColumns, b: TreeColumns, n: int) -> None:
    ra, rb = a.dense_rows(), b.dense_rows()
    for i in range(n):
        assert_same_tree(a.tree(i, ra), b.tree(i, rb))


ITEMS = ticks.TickItems.of(
    [3, 0, 7], [0, 12, 5], [[1, 2, 3], [4], [5, 6]], feed=[2, 0, 0], cancel=[9], release=[4, 5]
)
OPENS = [
    (3, ticks.Opened("s-3", "key", SamplingParams(0.7, top_k=3, seed=5), frozenset({2}), 2, salt=b"x")),
    (7, ticks.Opened("s-7", "", SamplingParams(0.0, seed=1))),
]


def test_a_draft_tick_comes_back_through_its_codec() -> None:
    specs = [SPECS[0], SPECS[4]]
    sent = ticks.DraftTickMessage(
        5,
        OPENS,
        ITEMS,
        specs,
        np.array([1, 0, 1]),
        np.array([ticks.GUESS_NEXT, 0, ticks.SUPERSEDABLE], np.uint8),
    )
    back = ticks.DraftTickMessage.from_proto(through_bytes(sent.to_proto()), VOCAB, wire.Limits())
    assert back.id == 5 and back.opens == OPENS and back.specs == specs
    assert_same_items(back.items, ITEMS)
    assert back.spec_index.tolist() == [1, 0, 1] and back.flags.tolist() == [
        ticks.GUESS_NEXT,
        0,
        ticks.SUPERSEDABLE,
    ]


def test_a_verify_tick_comes_back_through_its_codec() -> None:
    sent_trees = trees(3, seed=4)
    sent = ticks.VerifyTickMessage(
        6, OPENS, ITEMS, TreeColumns.from_trees(sent_trees, VOCAB),
        plain_steps=np.array([1, 4, 1], np.uint8), lookup_depth=np.array([0, 3, 0], np.uint8),
        lookup_min_ngram=np.array([0, 2, 0], np.uint8), max_tokens=np.array([0, 9, 0], np.uint32),
        suffix_rides=np.array([1, 0, 1], np.uint8),
    )  # fmt: skip
    back = ticks.VerifyTickMessage.from_proto(through_bytes(sent.to_proto()), VOCAB)
    assert back.id == 6 and back.opens == OPENS
    assert_same_items(back.items, ITEMS)
    assert_same_columns(back.trees, sent.trees, 3)
    for name in ("plain_steps", "lookup_depth", "lookup_min_ngram", "max_tokens", "suffix_rides"):
        assert np.array_equal(getattr(back, name), getattr(sent, name)), name
    # the optional columns are left out when all zero, and read back as zeros
    zeros = dataclasses.replace(sent, lookup_depth=np.zeros(3, np.uint8), max_tokens=np.zeros(3, np.uint32))
    assert not zeros.to_proto().lookup_depth and not zeros.to_proto().max_tokens
    back = ticks.VerifyTickMessage.from_proto(through_bytes(zeros.to_proto()), VOCAB)
    assert back.lookup_depth.tolist() == [0, 0, 0] and back.max_tokens.tolist() == [0, 0, 0]
    assert back.suffix_rides.tolist() == [1, 0, 1]  # ... and a column left unset reads as zeros
    unset = ticks.VerifyTickMessage.from_proto(
        through_bytes(dataclasses.replace(sent, suffix_rides=np.zeros(0, np.uint8)).to_proto()), VOCAB
    )
    assert unset.suffix_rides.tolist() == [0, 0, 0]


def test_a_bad_opening_refuses_its_handle_alone() -> None:
    msg = ticks.VerifyTickMessage(
        1, OPENS, ITEMS, TreeColumns.none(3, VOCAB), plain_steps=np.ones(3, np.uint8),
        lookup_depth=np.zeros(3, np.uint8), lookup_min_ngram=np.zeros(3, np.uint8),
        max_tokens=np.zeros(3, np.uint32),
    ).to_proto()  # fmt: skip
    msg.open[0].top_logprobs = 99
    back = ticks.VerifyTickMessage.from_proto(msg, VOCAB)
    (h0, bad), (h1, good) = back.opens
    assert (h0, h1) == (3, 7) and isinstance(bad, wire.WireError) and bad.field == "open.top_logprobs"
    assert good == OPENS[1][1]


def test_a_draft_result_comes_back_through_its_codec_its_trees_as_columns() -> None:
    tree = trees(1, seed=2)[0]
    sent = ticks.DraftResultMessage.of(
        8,
        [ticks.DraftAnswer(tree, [1, 2], 3, cached=32), ticks.Prefilled(40, 16), ticks.ItemFailure(3, "bad")],
        VOCAB,
        seconds=0.25,
        prefix_version=4,
        kv_usage=0.5,
    )
    back = ticks.DraftResultMessage.from_proto(through_bytes(sent.to_proto()), 3)
    answer, prefilled, failure = back.outcomes
    assert answer == ticks.DraftAnswer(None, [1, 2], 3, cached=32)  # the tree: back.trees, never decoded
    assert prefilled == ticks.Prefilled(40, 16) and failure == ticks.ItemFailure(3, "bad")
    assert_same_columns(back.trees, TreeColumns.from_trees([tree, None, None], VOCAB), 3)
    assert (back.id, back.seconds, back.prefix_version, back.kv_usage) == (8, 0.25, 4, 0.5)


def test_a_verify_result_comes_back_through_its_codec() -> None:
    logprobs = [TokenLogprob(5, -0.5, ((5, -0.5), (2, -1.25))), TokenLogprob(1, -2.0)]
    sent = ticks.VerifyResultMessage(
        9,
        [
            ticks.VerifyAnswer([4, 5, 1], 1, [0], True, logprobs, (3, 1), cached=16),
            ticks.ItemFailure(9, "resync", True),
            ticks.Prefilled(64),
            ticks.VerifyAnswer([7], 0, [], False),
        ],
        prefix_version=2, kv_usage=0.25, batch_size=3, batch_tokens=11, forward_seconds=0.5,
        queue_seconds=0.125,
    )  # fmt: skip
    assert ticks.VerifyResultMessage.from_proto(through_bytes(sent.to_proto()), 4) == sent
