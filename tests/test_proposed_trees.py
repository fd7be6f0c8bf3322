"""Trees of proposed tokens (SamplingMode.PROPOSED that branch: a suffix-tree drafter's).

The rule walks the tree along the target's own draws, each row drawn with the first draw of its
position's stream (the rows of one depth share it). Shown here: two-token outputs keep the target's
distribution (a chi-square test that two wrong walks fail), a seeded text is the plain steps' text
token for token (a test that draws by row instead of by depth fails), temperature 0 follows the
argmax path, chains keep their old verdicts and draws, repeated siblings are refused, and a
branching tree crosses the wire (one Verify's tree and a tick's columns).
"""

from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from specmesh.core import verification
from specmesh.core.ngram import chain_tree
from specmesh.core.rounds import verify_round, verify_rounds
from specmesh.core.sampling import Draws, SamplingParams, per_position_many, sample_rows, warp, warp_rows
from specmesh.core.ticks import TreeColumns
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.core.verification import Verdict, verify_many, verify_tree
from specmesh.rpc import wire
from specmesh.rpc.flags import Limits
from specmesh.rpc.ticks import trees_from_proto, trees_to_proto
from tests.stats import chi_square_pvalue
from tests.test_lossless import (
    P_VALUE_THRESHOLD,
    PARAMS,
    SAMPLES,
    TARGET,
    VOCAB,
    exact_two_token_distribution,
)
from tests.toy import ToyModel

# What the lookup proposes: a noisy copy of the target, so that its proposals are often (not
# always) what the target draws, at the first child and at the others.
LOOKUP = ToyModel(VOCAB, seed=33, scale=1.5, base=TARGET)


def proposed_tree(tokens: list[int], parents: list[int]) -> DraftTree:
    """Proposed tokens (no draft rows), validated."""
    tree = DraftTree(
        tokens=torch.tensor(tokens),
        parents=torch.tensor(parents),
        mode=SamplingMode.PROPOSED,
        draft_probs=torch.zeros(0, VOCAB),
        prob_rows=torch.full((len(tokens) + 1,), -1),
    )
    tree.validate(VOCAB)
    return tree


def top(path: tuple[int, ...], k: int) -> list[int]:
    return LOOKUP.row(path).topk(k).indices.tolist()


@functools.cache
def proposal(context: tuple[int, ...]) -> DraftTree:
    """A branching proposal, a function of the tokens: the lookup's two best tokens a, b under the
    root; a's two best a1, a2 and b's best b1 under them; a1's best under a1 (three positions).

        tokens   [a, b, a1, a2, b1, a11]   parents [-1, -1, 0, 0, 1, 2]
    """
    a, b = top(context, 2)
    a1, a2 = top((*context, a), 2)
    (b1,) = top((*context, b), 1)
    (a11,) = top((*context, a, a1), 1)
    return proposed_tree([a, b, a1, a2, b1, a11], [-1, -1, 0, 0, 1, 2])


def target_rows(tree: DraftTree | None, context: tuple[int, ...]) -> torch.Tensor:
    """[N + 1, V]: the target's logits after the context (the root), then after each node."""
    nodes = 0 if tree is None else tree.num_nodes
    return TARGET.logits([context, *((*context, *tree.path(i)) for i in range(nodes))])


def streams(key: int, positions, kind: str = "derived") -> list[Draws]:
    """Fresh "verify" streams of seed `key` at these positions (or generators seeded from them)."""
    if kind == "generator":
        return [Draws.from_generator(torch.Generator().manual_seed(key * 64 + n)) for n in positions]
    return [Draws.derive(key, n, "verify") for n in positions]


# --- an independent statement of the rule, and wrong ones -------------------------------------

Descend = Callable[[list[int], list[int], torch.Tensor, int], int | None]


def by_the_draw(kids: list[int], tokens: list[int], q: torch.Tensor, y: int) -> int | None:
    """The rule: the child whose token is the target's draw y (q: the row's warped distribution)."""
    return next((c for c in kids if tokens[c] == y), None)


def by_the_argmax(kids: list[int], tokens: list[int], q: torch.Tensor, y: int) -> int | None:
    """WRONG: the child whose token is the target's most likely one, whatever was drawn."""
    best = int(q.argmax())
    return next((c for c in kids if tokens[c] == best), None)


def walk_rule(descend: Descend) -> Callable:
    """A `_verify_proposals`, session by session and unvectorized: the draws of the positions
    (each row drawn with its depth's), then the walk that `descend` picks the children of."""

    def verify(trees, logits, params, draws) -> list[Verdict]:
        out = []
        for tree, rows, p, d in zip(trees, logits, params, draws, strict=True):
            tokens = [] if tree is None else tree.tokens.tolist()
            parents = [] if tree is None else tree.parents.tolist()
            depth = [0]
            for parent in parents:
                depth.append(depth[parent + 1] + 1)
            u = per_position_many([d], [max(depth) + 1])
            q = warp(rows, p)
            y = sample_rows(q, u[depth].unsqueeze(-1))[:, 0].tolist()
            node, accepted = -1, []
            while True:
                kids = [c for c, parent in enumerate(parents) if parent == node]
                child = descend(kids, tokens, q[node + 1], y[node + 1])
                if child is None:
                    out.append(Verdict([tokens[n] for n in accepted], accepted, y[node + 1], bonus=not kids))
                    break
                node = child
                accepted.append(node)
        return out

    return verify


# --- lossless -------------------------------------------------------------------------------------


@functools.cache
def rows_of(context: tuple[int, ...]) -> torch.Tensor:
    """The target rows of the proposal after `context`."""
    return target_rows(proposal(context), context)


def two_token_run(params: SamplingParams, samples: int) -> tuple[Counter, Counter]:
    """The first two tokens of `samples` seeded generations with a proposal every round, all the
    sessions of a round verified in one tick (`verify_rounds`, as the verifier does). -> (counts of
    the two tokens, counts of the rounds' accepted nodes: which branch was walked)."""
    outs: list[list[int]] = [[] for _ in range(samples)]
    walked: Counter = Counter()
    running = list(range(samples))
    while running:
        trees = [proposal(tuple(outs[seed])) for seed in running]
        logits = [rows_of(tuple(outs[seed])) for seed in running]
        n = len(running)
        lengths = [len(outs[seed]) for seed in running]
        verdicts = verify_rounds(trees, logits, [params] * n, running, lengths, [None] * n)
        for seed, verdict in zip(running, verdicts, strict=True):
            walked[tuple(verdict.accepted_nodes)] += 1
            outs[seed] += verdict.emitted_tokens
        running = [seed for seed in running if len(outs[seed]) < 2]
    return Counter(tuple(out[:2]) for out in outs), walked


def two_token_pvalue(params: SamplingParams, samples: int = SAMPLES) -> tuple[float, Counter]:
    counts, walked = two_token_run(params, samples)
    return chi_square_pvalue(counts, exact_two_token_distribution(params)), walked


@pytest.mark.parametrize("params_name", ["T1.0", "T0.6-topk3", "T1.0-topp0.8"])
def test_branching_proposals_keep_the_target_distribution(params_name: str) -> None:
    p_value, walked = two_token_pvalue(PARAMS[params_name])
    assert p_value > P_VALUE_THRESHOLD, f"proposed trees @ {params_name}: p = {p_value:.3g}"
    # every way through the tree is walked, often: stopped at the root (a recovered token), down
    # the first child and down the second, to a leaf (a bonus)
    total = sum(walked.values())
    share = {path: walked[path] / total for path in [(), (0,), (1,), (1, 4), (0, 2, 5)]}
    assert all(s > 0.01 for s in share.values()), (share, walked)


@pytest.mark.parametrize(
    ("wrong", "patch"),
    [
        ("argmax descent", lambda m: m.setattr(verification, "_verify_proposals", walk_rule(by_the_argmax))),
        (
            "one draw for every row",
            lambda m: m.setattr(
                verification,
                "per_position_many",
                lambda streams, lengths: torch.cat(
                    [d.uniform(1).repeat(n) for d, n in zip(streams, lengths, strict=True)]
                ),
            ),
        ),
    ],
)
def test_the_same_test_fails_a_wrong_walk(
    wrong: str, patch: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    patch(monkeypatch)
    p_value, _ = two_token_pvalue(PARAMS["T1.0"], SAMPLES // 5)
    assert p_value < P_VALUE_THRESHOLD, f"{wrong}: p = {p_value:.3g}"


def test_the_unvectorized_rule_passes_and_gives_the_same_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule stated session by session (`walk_rule(by_the_draw)`) is the harness's control: it
    gives the vectorized verdicts exactly, so the wrong walks above differ from it in their
    descent alone."""
    sessions = [(proposal(ctx), ctx) for ctx in [(), (1,), (2, 3), (4,), (5, 6, 7)]]
    sessions += [(None, (0,)), (chain_tree([1, 2, 3], VOCAB), (3,))]
    for params_name in ("T1.0", "T0.6-topk3", "T1.0-topp0.8"):
        for key in range(40):
            trees = [t for t, _ in sessions]
            logits = [target_rows(t, ctx) for t, ctx in sessions]
            params = [PARAMS[params_name]] * len(trees)
            positions = [len(ctx) for _, ctx in sessions]
            expected = walk_rule(by_the_draw)(trees, logits, params, streams(key, positions))
            assert verify_many(trees, logits, params, streams(key, positions)) == expected
    monkeypatch.setattr(verification, "_verify_proposals", walk_rule(by_the_draw))
    assert two_token_pvalue(PARAMS["T1.0"], SAMPLES // 5)[0] > P_VALUE_THRESHOLD


# --- the seeded text ------------------------------------------------------------------------------


def seeded_text(params: SamplingParams, seed: int, n: int, propose: bool) -> tuple[list[int], Counter]:
    """n tokens of one seeded session, round after round (a proposal each round, or plain steps),
    each round verified with the draws of its position. -> (tokens, accepted nodes per round)."""
    out: list[int] = []
    walked: Counter = Counter()
    while len(out) < n:
        context = tuple(out)
        tree = proposal(context) if propose else None
        verdict = verify_round(tree, target_rows(tree, context), params, seed, len(out))
        walked[tuple(verdict.accepted_nodes)] += 1
        out += verdict.emitted_tokens
    return out[:n], walked


def texts_agree(params: SamplingParams, seeds: range, n: int = 16) -> tuple[list[int], Counter]:
    """Per seed whether the text with proposals is the plain steps' text; and the paths walked."""
    walked: Counter = Counter()
    same = []
    for seed in seeds:
        plain, _ = seeded_text(params, seed, n, propose=False)
        ridden, paths = seeded_text(params, seed, n, propose=True)
        same.append(ridden == plain)
        walked += paths
    return same, walked


@pytest.mark.parametrize("params_name", ["T1.0", "T0.6-topk3", "T1.0-topp0.8"])
def test_a_seeded_text_is_the_plain_steps_text_with_or_without_proposals(params_name: str) -> None:
    same, walked = texts_agree(PARAMS[params_name], range(40))
    assert all(same), [seed for seed, s in enumerate(same) if not s]
    # the proposals rode, down every branch
    assert min(walked[path] for path in [(1,), (1, 4), (0, 3), (0, 2, 5)]) >= 5, walked


def test_the_seeded_text_test_fails_rows_drawn_by_index_not_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drawing row i + 1 with position offset i + 1 (its index) instead of node i's depth keeps
    every path's draws independent, so the distribution holds, but the text is no longer the
    plain steps' one: only this test can see it."""
    monkeypatch.setattr(
        verification, "_position_offsets", lambda t: list(range(1 if t is None else t.num_nodes + 1))
    )
    same, _ = texts_agree(PARAMS["T1.0"], range(20))
    assert not all(same)


# --- temperature 0 --------------------------------------------------------------------------------


def test_greedy_follows_the_argmax_path_through_the_tree() -> None:
    #            0  1  2  3  4      node 1 (token 2) has children 3, 4; node 0 (token 1) child 5
    tree = proposed_tree([1, 2, 3, 4, 5], [-1, -1, 1, 1, 0])
    logits = torch.zeros(6, VOCAB)

    def argmax(*best: int) -> torch.Tensor:
        rows = logits.clone()
        for row, token in enumerate(best):
            rows[row, token] = 5.0
        return rows

    greedy = SamplingParams(0.0)
    # root -> 2 (node 1, the second child); node 1's row (2) -> 4 (node 3); node 3 is a leaf
    v = verify_tree(tree, argmax(2, 0, 4, 0, 6), greedy, None)
    assert (v.accepted_tokens, v.accepted_nodes, v.next_token, v.bonus) == ([2, 4], [1, 3], 6, True)
    # node 1's argmax is none of its children: recovered
    v = verify_tree(tree, argmax(2, 0, 7), greedy, None)
    assert (v.accepted_tokens, v.accepted_nodes, v.next_token, v.bonus) == ([2], [1], 7, False)
    # the first child, then its child 5, a leaf
    v = verify_tree(tree, argmax(1, 5, 0, 0, 0, 3), greedy, None)
    assert (v.accepted_tokens, v.accepted_nodes, v.next_token, v.bonus) == ([1, 5], [0, 4], 3, True)
    # the root's argmax no child has
    v = verify_tree(tree, argmax(0), greedy, None)
    assert (v.accepted_tokens, v.accepted_nodes, v.next_token, v.bonus) == ([], [], 0, False)


def test_greedy_proposals_emit_the_targets_greedy_decode() -> None:
    text, walked = seeded_text(SamplingParams(0.0), 0, 40, propose=True)
    assert text == TARGET.greedy((), 40)
    assert sum(walked.values()) < 30 and any(path[:1] == (1,) for path in walked), walked


# --- chains as before -----------------------------------------------------------------------------


def chain_rule_before(trees, logits, params, draws) -> list[Verdict]:
    """`_verify_proposals` as it was when proposals were chains (a copy)."""
    lengths = [0 if t is None else t.num_nodes for t in trees]
    u = per_position_many(draws, [n + 1 for n in lengths])
    rows = torch.cat(logits)
    q = warp_rows(rows, [p for p, n in zip(params, lengths, strict=True) for _ in range(n + 1)])
    drawn = sample_rows(q, u.unsqueeze(-1))[:, 0].tolist()
    out, at = [], 0
    for tree, n in zip(trees, lengths, strict=True):
        proposed = tree.tokens.tolist() if tree is not None else []
        y = drawn[at : at + n + 1]
        kept = next((j for j in range(n) if proposed[j] != y[j]), n)
        out.append(Verdict(proposed[:kept], list(range(kept)), y[kept], bonus=kept == n))
        at += n + 1
    return out


@pytest.mark.parametrize("kind", ["derived", "generator"])
def test_chains_and_plain_steps_keep_their_verdicts_and_draws(kind: str) -> None:
    """A tick of chains and plain steps: the verdicts and what each stream drew are the old
    rule's; with derived streams, also beside branching trees in the same tick."""
    g = torch.Generator().manual_seed(0)
    for key in range(30):
        lengths = torch.randint(0, 5, (8,), generator=g).tolist()
        chains = [
            chain_tree(torch.randint(0, VOCAB, (n,), generator=g).tolist(), VOCAB) if n else None
            for n in lengths
        ]
        contexts = [tuple(torch.randint(0, VOCAB, (b % 3,), generator=g).tolist()) for b in range(8)]
        logits = [target_rows(t, ctx) for t, ctx in zip(chains, contexts, strict=True)]
        params = [PARAMS[name] for name in ("T1.0", "T0.6-topk3", "T1.0-topp0.8", "T0.6")] * 2
        old, new = streams(key, range(8), kind), streams(key, range(8), kind)
        expected = chain_rule_before(chains, logits, params, old)
        assert verify_many(chains, logits, params, new) == expected
        assert [d.counter for d in new] == [d.counter for d in old]
        if kind == "generator":
            assert [float(d.uniform(1)) for d in new] == [float(d.uniform(1)) for d in old]
            continue
        trees = [proposal(ctx) for ctx in contexts[:3]]
        mixed = verify_many(
            [*trees, *chains],
            [*map(rows_of, contexts[:3]), *logits],
            params[:3] + params,
            streams(key + 100, range(3)) + streams(key, range(8)),
        )
        assert mixed[3:] == expected


def test_a_chain_proposal_is_still_plain_steps_text() -> None:
    """The old property, through the new code: a chain's emitted tokens are the plain steps'."""
    for seed in range(30):
        plain, _ = seeded_text(PARAMS["T1.0"], seed, 8, propose=False)
        out: list[int] = []
        while len(out) < 8:
            context = tuple(out)
            path = top(context, 1)
            for _ in range(2):
                path += top((*context, *path), 1)
            tree = chain_tree(path, VOCAB)
            verdict = verify_round(tree, target_rows(tree, context), PARAMS["T1.0"], seed, len(out))
            out += verdict.emitted_tokens
        assert out[:8] == plain


# --- refused and carried ---------------------------------------------------------------------------


def test_repeated_siblings_are_refused_and_cousins_may_repeat() -> None:
    proposed_tree([3, 4, 4, 3], [-1, -1, 0, 1])  # 4 under 3 and 4 under 4: cousins, not siblings
    with pytest.raises(ValueError, match=r"tokens: siblings of a PROPOSED tree must carry distinct tokens"):
        proposed_tree([3, 3, 5], [-1, -1, 0])
    with pytest.raises(ValueError, match=r"nodes 2 and 4, children of node 0, both carry 6"):
        proposed_tree([3, 4, 6, 5, 6], [-1, -1, 0, 0, 0])
    # with draft rows still refused, branching or not
    tree = proposal(())
    rows = torch.full((1, VOCAB), 1.0 / VOCAB)
    with_rows = dataclasses.replace(tree, draft_probs=rows, prob_rows=torch.tensor([0, 0, 0, 0, -1, -1, -1]))
    with pytest.raises(ValueError, match="draft_probs: a PROPOSED tree carries none"):
        with_rows.validate(VOCAB)


def test_repeated_siblings_are_refused_on_the_wire() -> None:
    bad = DraftTree(
        tokens=torch.tensor([3, 4, 6, 6]),
        parents=torch.tensor([-1, -1, 0, 0]),
        mode=SamplingMode.PROPOSED,
        draft_probs=torch.zeros(0, VOCAB),
        prob_rows=torch.full((5,), -1),
    )
    with pytest.raises(wire.WireError, match=r"^tree\.tokens: siblings of a PROPOSED tree"):
        wire.tree_from_proto(wire.tree_to_proto(bad), VOCAB, Limits())
    sent = [proposal(()), bad, chain_tree([1, 1, 1], VOCAB), None, proposal((2,))]
    problems = TreeColumns.from_trees(sent, VOCAB).check(len(sent), VOCAB)
    assert [i for i, p in enumerate(problems) if p is not None] == [1]
    assert problems[1].field == "trees.tokens" and "distinct tokens" in str(problems[1])
    # a branching proposal with rows is named for them
    rows = torch.full((1, VOCAB), 1.0 / VOCAB)
    with_rows = dataclasses.replace(
        sent[0], draft_probs=rows, prob_rows=torch.tensor([0, 0, 0, 0, -1, -1, -1])
    )
    problems = TreeColumns.from_trees([with_rows, sent[4]], VOCAB).check(2, VOCAB)
    assert problems[0] is not None and problems[0].field == "trees.draft_probs" and problems[1] is None


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (
        torch.equal(a.tokens, b.tokens)
        and torch.equal(a.parents, b.parents)
        and a.mode is b.mode
        and torch.equal(a.prob_rows, b.prob_rows)
        and not b.has_draft_probs
    )


def test_a_branching_proposal_crosses_the_wire_and_verifies_the_same() -> None:
    tree = proposal((5,))
    params = SamplingParams(1.0, top_k=5, seed=7)
    request = wire.verify_request("s", 3, [1, 2, 5], params, wire.tree_to_proto(tree))
    v = wire.parse_verify_request(request, VOCAB, Limits())  # as a Verify call is read and checked
    assert v.tree is not None and same_tree(tree, v.tree)
    sent = [tree, None, chain_tree([1, 2], VOCAB), proposal(())]
    columns = trees_from_proto(trees_to_proto(TreeColumns.from_trees(sent, VOCAB)), len(sent))
    assert columns.check(len(sent), VOCAB) == [None] * len(sent)
    relayed = TreeColumns.concat([columns.take([3]), columns.take([0])])  # the gateway's relay
    assert relayed.check(2, VOCAB) == [None, None]
    for got, want in [(columns.tree(0), tree), (columns.tree(3), sent[3]), (relayed.tree(1), tree)]:
        assert got is not None and same_tree(want, got)
        wire.check_verify_input(dataclasses.replace(v, tree=got), Limits())
        logits = target_rows(want, ())
        assert verify_round(got, logits, params, 7, 3) == verify_round(want, logits, params, 7, 3)
