"""The DSI coordinator (specmesh.core.dsi): its rules, and that its output is the target's
distribution whatever order the verdicts arrive in.

The losslessness test runs the coordinator in virtual time with random draft and verification
latencies (so blocks resolve before, after and during the drafting of their successors) on the
toy pair of tests/test_lossless.py, and compares three-token outputs with the exactly enumerated
q(x1) q(x2|x1) q(x3|x1,x2). A coordinator that keeps a block's bonus token while a younger block,
whose verification decides the same position, is in flight fails the same test.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specmesh.core.drafting import TreeSpec
from specmesh.core.dsi import (
    Block,
    DsiState,
    Outcome,
    Resolution,
    acceptance_from_blocks,
    choose_shape,
    iid_latency,
    simulate,
)
from specmesh.core.rounds import draft_round, verify_round
from specmesh.core.sampling import SamplingParams
from tests.stats import chi_square_pvalue
from tests.test_lossless import DRAFT, P_VALUE_THRESHOLD, SAMPLES, TARGET, VOCAB

# ---- the rules ---------------------------------------------------------------------------------


def test_full_acceptance_under_a_younger_block_drops_the_bonus() -> None:
    s = DsiState([7])
    a = s.add([1, 2], s.version)
    b = s.add([3], s.version)
    assert (a.start, b.start) == (1, 3)
    res = s.finish(a.id, Outcome(accepted=2, next_token=9))
    assert res.emitted == [1, 2] and not res.restart and s.blocks == [b]
    res = s.finish(b.id, Outcome(accepted=1, next_token=5))
    assert res.emitted == [3, 5] and res.restart  # nothing younger: the bonus is committed
    assert s.committed == [7, 1, 2, 3, 5] and s.context() == s.committed


def test_a_rejection_cancels_every_younger_block_and_stales_drafts() -> None:
    s = DsiState([7])
    version = s.version
    a, b, c = (s.add([t], version) for t in (1, 2, 3))
    assert s.finish(c.id, Outcome(1, 0)).emitted == []  # waits for the older blocks
    res = s.finish(a.id, Outcome(accepted=0, next_token=4))
    assert res.emitted == [4] and res.cancelled == [b, c] and res.restart
    assert s.add([5], version) is None  # drafted from the speculation that was thrown away
    assert s.finish(b.id, Outcome(1, 0)) == Resolution()  # a cancelled block's verdict is ignored


def test_verdicts_cascade_in_draft_order() -> None:
    s = DsiState([])
    a, b, c = (s.add([t, t], s.version) for t in (1, 2, 3))
    assert s.finish(b.id, Outcome(2, 0)).emitted == []
    assert s.finish(c.id, Outcome(1, 8)).emitted == []
    res = s.finish(a.id, Outcome(2, 0))
    assert res.emitted == [1, 1, 2, 2, 3, 8]  # a, b (bonuses dropped), then c's rejection
    assert [blk.id for blk, _ in res.resolved] == [a.id, b.id, c.id]


def test_an_impossible_verdict_is_refused() -> None:
    s = DsiState([])
    a = s.add([1], s.version)
    with pytest.raises(ValueError, match="accepted"):
        s.finish(a.id, Outcome(accepted=2, next_token=0))


# ---- the coordinator in virtual time -----------------------------------------------------------


def test_a_perfect_drafter_hides_verification() -> None:
    # Every block accepted, SP large enough: only the first verification is exposed.
    r = iid_latency(1.0, lookahead=5, sp=4, draft_seconds=0.1, verify_seconds=1.0, n_tokens=200)
    blocks = 200 // 5
    assert r.latency == pytest.approx(blocks * 0.5 + 1.0, abs=0.5 + 1e-9)
    assert r.max_parallel >= 2


def test_every_rejection_exposes_one_draft_and_one_forward() -> None:
    # Every draft rejected: after each rejection the drafter restarts from the recovered token, and
    # its block waits for it (the paper hides that draft behind a target-only forward; we do not,
    # docs/decisions.md).
    r = iid_latency(0.0, lookahead=1, sp=1, draft_seconds=0.1, verify_seconds=1.0, n_tokens=200)
    assert r.latency == pytest.approx(200 * (1.0 + 0.1))


def test_more_parallel_verifications_pay_only_while_the_drafter_is_ahead() -> None:
    # A fast drafter (2.5 ms a token against a 30 ms target, DSI's Vicuna rows): SP 3 beats SP 1.
    one = iid_latency(0.8, 3, 1, 0.0025, 0.030, n_tokens=400).latency
    three = iid_latency(0.8, 3, 3, 0.0025, 0.030, n_tokens=400).latency
    assert three < 0.8 * one
    # A drafter as slow as the target: there is never a second block to verify.
    slow = [iid_latency(0.8, 3, sp, 0.030, 0.030, n_tokens=400) for sp in (1, 3)]
    assert slow[0].latency == slow[1].latency and slow[1].max_parallel == 1


def test_choose_shape_takes_the_fastest_and_the_fewest_replicas() -> None:
    fast = choose_shape(0.8, 0.0025, lambda rows: 0.030, parallels=range(1, 4))
    assert fast.parallel > 1
    # with a drafter as slow as the target, extra replicas buy nothing: one is chosen
    assert choose_shape(0.8, 0.030, lambda rows: 0.030, parallels=range(1, 4)).parallel == 1
    # a fixed parallel is kept; the shape's prediction is its own simulation's
    shape = choose_shape(0.8, 0.0025, lambda rows: 0.030, parallels=[2], lookaheads=[4])
    assert (shape.lookahead, shape.parallel) == (4, 2)
    assert shape.seconds_per_token == pytest.approx(
        sum(iid_latency(0.8, 4, 2, 0.0025, 0.030, 96, seed).latency for seed in range(3)) / (3 * 96)
    )


def test_without_drafting_ahead_the_coordinator_runs_sis_schedule() -> None:
    # Every block accepted: SI commits lookahead + 1 tokens per draft-then-verify round, on one
    # worker however many there are.
    r = iid_latency(1.0, lookahead=4, sp=3, draft_seconds=0.1, verify_seconds=1.0, n_tokens=200, ahead=False)
    assert r.latency == pytest.approx(200 / 5 * (4 * 0.1 + 1.0))
    assert r.max_parallel == 1 and r.target_forwards == 200 / 5


def test_with_one_verifier_sis_schedule_is_never_slower() -> None:
    # One verifier: working ahead saves a draft per fully accepted block but loses its bonus
    # token. The real pair on 2 cores (21 ms a draft, 260 ms a forward): SI's schedule is faster.
    real = choose_shape(0.7, 0.021, lambda rows: 0.26, parallels=[1], lookaheads=[3], sequential=True)
    assert (real.parallel, real.ahead) == (1, False)
    assert real.seconds_per_token < iid_latency(0.7, 3, 1, 0.021, 0.26, 96).latency / 96
    # A drafter as slow as the target: each verdict comes before the block drafted ahead, which
    # is restarted, so both schedules take the same time; the tie goes to SI's.
    slow = choose_shape(0.7, 0.26, lambda rows: 0.26, parallels=[1], lookaheads=[3], sequential=True)
    ahead = sum(iid_latency(0.7, 3, 1, 0.26, 0.26, 96, seed).latency for seed in range(3)) / (3 * 96)
    assert slow.seconds_per_token == pytest.approx(ahead)
    assert not slow.ahead
    # More verifiers with a fast drafter: DSI proper.
    assert choose_shape(0.8, 0.0025, lambda rows: 0.030, parallels=range(1, 4), sequential=True).parallel > 1
    # A faster CPU (26 ms a draft, 140 ms a forward) at T=0's acceptance: drafting ahead is
    # predicted faster, unless a forward beside a draft is measured 20 % slower than alone.
    kw = {"parallels": [1], "lookaheads": [3], "sequential": True}
    assert choose_shape(0.95, 0.026, lambda rows: 0.14, **kw).ahead
    assert not choose_shape(0.95, 0.026, lambda rows: 0.14, overlap_slowdown=1.2, **kw).ahead
    # Without the candidate (the request fixed parallel) it stays ahead.
    assert choose_shape(0.7, 0.021, lambda rows: 0.26, parallels=[1], lookaheads=[3]).ahead


@pytest.mark.parametrize("a,lookahead", [(0.3, 1), (0.7, 4), (0.95, 8)])
def test_acceptance_from_blocks_inverts_the_truncated_geometric_mean(a: float, lookahead: int) -> None:
    mean = sum(a**i for i in range(1, lookahead + 1))
    assert acceptance_from_blocks(mean, lookahead) == pytest.approx(a, abs=1e-6)


# ---- lossless ----------------------------------------------------------------------------------


class BonusKeepingState(DsiState):
    """WRONG: commits a fully accepted block's bonus token although the next block, drafted from
    the same position, is in flight, and then applies that block's verdict after it."""

    def finish(self, block_id: int, outcome: Outcome) -> Resolution:
        res = Resolution()
        if all(b.id != block_id for b in self.blocks):
            return res
        self.outcomes[block_id] = outcome
        while self.blocks and self.blocks[0].id in self.outcomes:
            head = self.blocks.pop(0)
            out = self.outcomes.pop(head.id)
            kept = [*head.tokens[: out.accepted], out.next_token]
            res.emitted += kept
            self.committed += kept
            if out.accepted < len(head.tokens) or not self.blocks:
                res.cancelled, self.blocks = self.blocks, []
                self.outcomes.clear()
                res.restart = True
                self.version += 1
        return res


def _exact_three_tokens(params: SamplingParams) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {}
    q0 = TARGET.dist((), params).double()
    for a in range(VOCAB):
        q1 = TARGET.dist((a,), params).double()
        for b in range(VOCAB):
            q2 = TARGET.dist((a, b), params).double()
            for c in range(VOCAB):
                out[(a, b, c)] = float(q0[a] * q1[b] * q2[c])
    return out


def _dsi_samples(
    params: SamplingParams, lookahead: int, sp: int, new_state=DsiState
) -> tuple[Counter, Counter]:
    """SAMPLES three-token DSI generations on the toy pair with random latencies; the outputs,
    and how often verdicts were full / rejections and runs had several verifications at once."""
    rng = random.Random(0)
    spec = TreeSpec("chain", depth=lookahead)
    paths = Counter()
    counts: Counter = Counter()
    session = 0  # the seed of the current generation

    # Seeded as the services are: each draft and each verification from (session seed, the
    # position of its block's root), so a block drafted again at the same position after a
    # rejection reuses the numbers of the cancelled one, exactly as in the gateway.
    def draft(context: list[int], k: int):
        tree = draft_round(spec, DRAFT.next_logits(tuple(context)), params, session, len(context))
        return tree.tokens.tolist(), tree

    def verify(prefix: list[int], block: Block) -> Outcome:
        tree = block.draft
        rows = [tuple(prefix)] + [(*prefix, *tree.path(i)) for i in range(tree.num_nodes)]
        v = verify_round(tree, TARGET.logits(rows), params, session, block.start)
        full = len(v.accepted_tokens) == len(block.tokens)
        counts["full" if full else "rejected"] += 1
        return Outcome(len(v.accepted_tokens), v.next_token)

    for _ in range(SAMPLES):
        session = rng.getrandbits(62)
        r = simulate(
            [], 3, lookahead, sp, draft, verify,
            lambda: rng.expovariate(1 / 0.4), lambda: rng.expovariate(1.0), new_state,
        )  # fmt: skip
        paths[tuple(r.tokens)] += 1
        counts["parallel"] += r.max_parallel > 1
    return paths, counts


@pytest.mark.parametrize("lookahead,sp", [(1, 2), (2, 3)])
def test_dsi_is_lossless(lookahead: int, sp: int) -> None:
    params = SamplingParams(temperature=1.0)
    paths, counts = _dsi_samples(params, lookahead, sp)
    assert chi_square_pvalue(paths, _exact_three_tokens(params)) > P_VALUE_THRESHOLD
    # both verdicts happened often, and so did several verifications in flight at once
    assert counts["full"] > 0.1 * SAMPLES and counts["rejected"] > 0.1 * SAMPLES
    assert counts["parallel"] > 0.2 * SAMPLES


def test_keeping_the_bonus_under_a_younger_block_is_caught() -> None:
    params = SamplingParams(temperature=1.0)
    paths, _ = _dsi_samples(params, 1, 2, new_state=BonusKeepingState)
    assert chi_square_pvalue(paths, _exact_three_tokens(params)) < P_VALUE_THRESHOLD
