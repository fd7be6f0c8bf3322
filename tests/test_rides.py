"""Rides (specmesh.core.rides): the θ a forward's rides are cut at, against a brute force over every
θ; the module doc's worked example and its 1-session / 8-session claims; `Ride.kept` keeping a
tree; calibration (buckets by share or depth, conditional probabilities composing down a path,
hindsight judging of every proposed node, a cut bucket riding again); and, through `verify_steps`,
that sizing changes how many nodes ride, never the seeded text, and every proposal teaches."""

from __future__ import annotations

import random

import pytest

from specmesh.core.adaptive import ForwardCost
from specmesh.core.ngram import NgramIndex
from specmesh.core.rides import (
    DECAY,
    MAX_RIDE_DEPTH,
    NGRAM_PRIOR,
    PRIOR_WEIGHT,
    SUFFIX_BUCKETS,
    Calibration,
    Ride,
    RideSizer,
    bucket,
    ngram_ride,
    sized,
    threshold,
)
from specmesh.core.sampling import SamplingParams
from specmesh.runtime.rounds import VerifyJob, VerifyOutcome, run_ticked, verify_steps
from tests.test_lossless import PARAMS, VOCAB
from tests.test_ngram import HISTORY, ToyVerifier

CPU = {1: 0.031, 2: 0.047, 4: 0.077, 8: 0.185, 16: 0.4}  # llama.cpp-like: rows cost
CPU_8PCT = {**CPU, 16: 0.185 * 1.64}  # the module doc's CPU: a 9th row adds 8 % to 8 rows
FLAT = {1: 0.010, 16: 0.0105}  # GPU-like: rows nearly free
PROHIBITIVE = {1: 0.01, 2: 1.0, 16: 100.0}  # any row past the first costs 100 steps
GRID = [k / 10 for k in range(1, 11)]  # raw estimates drawn from here tie often


def cost(curve: dict[int, float]) -> ForwardCost:
    return ForwardCost(curve, decay=0.0)  # as RideSizer prices


def random_ride(rng: random.Random) -> Ride:
    """A random level-order tree (parents non-decreasing: breadth-first), distinct tokens, raw
    estimates from GRID or uniform, calibrated by a fresh Calibration (each node its parent's times
    its raw share, at most 1)."""
    n = rng.randint(1, 12)
    parents: list[int] = []
    for i in range(n):
        parents.append(rng.randrange(parents[-1] if parents else -1, i))
    raw = [rng.choice(GRID) if rng.random() < 0.5 else rng.random() for _ in range(n)]
    return Calibration().ride("suffix", rng.sample(range(64), n), parents, raw, 64)


def path(ride: Ride, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(ride.tokens[i])
        i = ride.parents[i]
    return out[::-1]


def rate(rides: list[Ride | None], steps: int, rows: int, verify: ForwardCost) -> float:
    """The forward's tokens per second with these rides (the module doc's objective)."""
    probs = [p for r in rides if r is not None for p in r.probs]
    return (steps + sum(probs)) / max(verify(rows + len(probs)), 1e-12)


def brute_best_rate(rides: list[Ride | None], steps: int, rows: int, verify: ForwardCost) -> float:
    """The best rate over every θ: nothing rides, or the nodes of probability >= each candidate."""
    candidates = {p for r in rides if r is not None for p in r.probs}
    cut = [[r.kept(theta) if r is not None else None for r in rides] for theta in candidates]
    return max(rate(rs, steps, rows, verify) for rs in [[None] * len(rides), *cut])


@pytest.mark.parametrize("curve", [CPU, CPU_8PCT, FLAT, {}], ids=["cpu", "cpu8pct", "flat", "unpriced"])
def test_the_chosen_theta_is_the_best_of_every_theta(curve: dict[int, float]) -> None:
    """sized() reaches the brute force's best rate, keeps exactly the nodes at or above θ, and each
    ride it returns is that ride's `kept(θ)`."""
    rng, verify = random.Random(len(curve)), cost(curve)
    for _ in range(400):
        rides = [random_ride(rng) if rng.random() < 0.8 else None for _ in range(rng.randint(1, 6))]
        steps = rng.randint(1, 8)
        rows = steps + rng.randint(0, 8)
        theta = threshold(rides, steps, rows, verify)
        cut = sized(rides, steps, rows, verify)
        assert rate(cut, steps, rows, verify) == pytest.approx(
            brute_best_rate(rides, steps, rows, verify), rel=1e-12
        )
        for r, c in zip(rides, cut, strict=True):
            assert c == (r.kept(theta) if r is not None else None)


def test_a_node_that_only_breaks_even_stays_home() -> None:
    """v(2) = 1.5 v(1): one session's node of p = 0.5 gives exactly the plain rate; a tie keeps the
    fewer rows (nothing rides), a hair more rides."""
    verify = cost({1: 1.0, 2: 1.5})
    even = Ride([3], [-1], [0.5], [5], VOCAB)
    assert threshold([even], 1, 1, verify) == float("inf") and sized([even], 1, 1, verify) == [None]
    more = Ride([3], [-1], [0.5 + 1e-9], [5], VOCAB)
    assert sized([more], 1, 1, verify) == [more]


def test_the_module_docs_worked_example() -> None:
    """One session, v(1..3) = 30 / 45 / 55 ms, a chain calibrated to [0.9, 0.6]: 33 tokens/s
    plain, 42 with one node, 45 with both: both ride. At v(3) = 65 ms the second stays home."""
    chain = Ride([5, 6], [-1, 0], [0.9, 0.6], [10, 11], VOCAB)
    verify = cost({1: 0.030, 2: 0.045, 3: 0.055})
    rates = [rate([chain.kept(t)], 1, 1, verify) for t in (2.0, 0.9, 0.6)]  # none, one, both
    assert [round(r) for r in rates] == [33, 42, 45]
    assert threshold([chain], 1, 1, verify) == 0.6 and sized([chain], 1, 1, verify) == [chain]
    (cut,) = sized([chain], 1, 1, cost({1: 0.030, 2: 0.045, 3: 0.065}))
    assert cut is not None and cut.tokens == [5] and cut.probs == [0.9]


@pytest.mark.parametrize(("p", "rides_alone", "rides_in_8"), [(0.5, False, False), (0.6, True, False),
                         (0.63, True, False), (0.65, True, True), (0.9, True, True)])  # fmt: skip
def test_under_load_only_sure_nodes_ride(p: float, rides_alone: bool, rides_in_8: bool) -> None:
    """The module doc's CPU: alone a node needs p > v(2)/v(1) - 1 = 0.52; with 8 sessions (8 -> 9
    rows: +8 %) it must beat 8 x 0.08 = 0.64, so a node of 0.6 that rides alone stays home."""
    verify = cost(CPU_8PCT)
    alone = sized([Ride([3], [-1], [p], [5], VOCAB)], 1, 1, verify)
    assert (alone[0] is not None) == rides_alone
    many = sized([Ride([3], [-1], [p], [5], VOCAB) for _ in range(8)], 8, 8, verify)
    assert [r is not None for r in many] == [rides_in_8] * 8


def test_kept_nodes_are_a_tree_with_the_same_paths() -> None:
    """Over random trees and every θ: kept() keeps the nodes at or above θ in their order (level
    order stays level order), each with its parent kept and remapped, so every kept node's path
    from the root is the original's; above every probability: None."""
    rng = random.Random(1)
    for _ in range(300):
        ride = random_ride(rng)
        for theta in {0.0, *ride.probs}:
            kept = ride.kept(theta)
            keep = [i for i, p in enumerate(ride.probs) if p >= theta]
            assert kept is not None and kept.tokens == [ride.tokens[i] for i in keep]
            assert kept.probs == [ride.probs[i] for i in keep]
            assert kept.buckets == [ride.buckets[i] for i in keep]
            assert all(-1 <= q < j for j, q in enumerate(kept.parents))  # parents kept, before
            assert kept.parents == sorted(kept.parents)  # breadth-first
            assert [path(kept, j) for j in range(len(keep))] == [path(ride, i) for i in keep]
            kept.tree().validate(64)
        assert ride.kept(max(ride.probs) + 1e-9) is None


def test_a_nodes_probability_is_its_parents_times_its_buckets() -> None:
    """A suffix node's bucket is the tenth of its share of its parent's raw estimate (raw path
    [0.5, 0.25]: share 0.5, bucket 5, not 2); fresh buckets are their prior at the share, so the
    probs are the raw path's, and a child read surer than its parent (share 1.5) joins bucket 9 at
    its parent's probability. Taught, a node's probability is the product of its path's buckets'
    (suffix and n-gram alike), never above its parent's. n-gram nodes bucket by depth, capped."""
    pair = Calibration().ride("suffix", [1, 2], [-1, 0], [0.5, 0.25], VOCAB)
    assert pair.buckets == [5, 5] and pair.probs == [0.5, 0.25]
    tokens, parents, raw = [1, 2, 3, 4, 5], [-1, -1, 0, 1, 2], [0.5, 0.9, 0.4, 0.3, 0.6]
    shares = [0.5, 0.9, 0.8, 0.3 / 0.9, 1.0]  # 0.6 / 0.4 = 1.5, its prior clipped to 1
    ride = Calibration().ride("suffix", tokens, parents, raw, VOCAB)
    assert ride.buckets == [5, 9, 8, 3, 9]
    assert ride.probs == pytest.approx([0.5, 0.9, 0.4, 0.3, 0.4])
    taught = Calibration()
    for b, (tried, accepted) in {3: (5, 4), 5: (6, 1), 8: (2, 2), 9: (9, 3), 10: (8, 2), 11: (4, 3)}.items():
        taught.tried[b], taught.accepted[b] = float(tried), float(accepted)
    q = [taught.probability(b, s) for b, s in zip(ride.buckets, shares, strict=True)]
    ride = taught.ride("suffix", tokens, parents, raw, VOCAB)
    assert ride.probs == pytest.approx([q[0], q[1], q[0] * q[2], q[1] * q[3], q[0] * q[2] * q[4]], rel=1e-12)
    assert all(p < 0 or ride.probs[j] <= ride.probs[p] for j, p in enumerate(parents))
    chain = ngram_ride(taught, [7, 8, 9], VOCAB)
    q = [taught.probability(SUFFIX_BUCKETS + d, NGRAM_PRIOR) for d in range(3)]
    assert chain is not None and chain.probs == pytest.approx([q[0], q[0] * q[1], q[0] * q[1] * q[2]])
    rides = [random_ride(random.Random(k)) for k in range(200)]
    assert all(p < 0 or r.probs[j] <= r.probs[p] for r in rides for j, p in enumerate(r.parents))
    assert [bucket("suffix", k, 1) for k in GRID] == [*range(1, 10), 9]
    assert bucket("suffix", 0.0, 3) == 0 and bucket("suffix", 0.15, 3) == 1
    ngram = [bucket("ngram", 0.5, d) for d in range(1, MAX_RIDE_DEPTH + 4)]
    assert ngram == [*range(SUFFIX_BUCKETS, SUFFIX_BUCKETS + MAX_RIDE_DEPTH), *[ngram[-1]] * 3]


def test_hindsight_judges_exactly_the_nodes_whose_parent_came() -> None:
    """Tree 5, 6 (roots), 7 under 5, 7 under 6, 8 under 5-7; emitted [5, 7]: judged are 5, 6 and
    5-7 (6-7 matches its position but its parent did not come; 5-7-8 is deeper than the step
    went), accepted 5 and 5-7. Emitted [5, 7, 8] then takes 5-7-8 too (decayed counts)."""
    ride = Ride([5, 6, 7, 7, 8], [-1, -1, 0, 1, 2], [0.5] * 5, [0, 1, 2, 3, 4], VOCAB)
    cal = Calibration()
    cal.observe(ride, [5, 7])
    assert cal.tried[:6] == [1, 1, 1, 0, 0, 0] and cal.accepted[:6] == [1, 0, 1, 0, 0, 0]
    cal.observe(ride, [5, 7, 8])
    d = DECAY
    assert cal.tried[:6] == pytest.approx([1 + d, 1 + d, 1 + d, 0, 1, 0])
    assert cal.accepted[:6] == pytest.approx([1 + d, 0, 1 + d, 0, 1, 0])
    cal.observe(ride, [6, 7])  # 6 came: 6-7 judged and accepted, 5's subtree judged only at 5
    assert cal.tried[3] == 1 and cal.accepted[3] == 1 and cal.accepted[0] == pytest.approx(d * (1 + d))
    assert sum(cal.tried[5:]) == 0


def test_calibration_learns_a_buckets_acceptance_in_hindsight() -> None:
    """Suffix nodes read 0.95 (bucket 9) but the target takes 3 in 10: after 2000 steps the bucket
    says ~0.3, untouched buckets keep the raw prior. An n-gram chain whose first node always
    comes and its second never: depth 1 learns ~1, depth 2 (conditional, prior 0.8) ~0."""
    cal = Calibration()
    for i in range(2000):
        ride = cal.ride("suffix", [3], [-1], [0.95], VOCAB)
        cal.observe(ride, [3, 9] if i % 10 in (0, 3, 6) else [9])  # accepted then the next token
    assert cal.probability(9, 0.95) == pytest.approx(0.3, abs=0.05)
    assert cal.ride("suffix", [3], [-1], [0.95], VOCAB).probs[0] == pytest.approx(0.3, abs=0.05)
    assert all(cal.probability(b, 0.42) == 0.42 for b in range(len(cal.tried)) if b != 9)
    assert [b for b, t in enumerate(cal.tried) if t] == [9]

    chain = Calibration()
    once = ngram_ride(chain, [4, 5], VOCAB)
    chain.observe(once, [0, 5])  # depth 1 rejected; depth 2 matches but is not judged
    assert chain.probability(SUFFIX_BUCKETS, 0.8) == pytest.approx(PRIOR_WEIGHT * 0.8 / (PRIOR_WEIGHT + 1))
    assert chain.tried[SUFFIX_BUCKETS + 1] == 0
    for _ in range(500):
        chain.observe(ngram_ride(chain, [4, 5], VOCAB), [4, 0])
    assert chain.probability(SUFFIX_BUCKETS, 0.8) > 0.95  # depth 1: always accepted
    assert chain.probability(SUFFIX_BUCKETS + 1, 0.8) < 0.05  # depth 2: never


def test_a_cut_bucket_is_still_watched_and_rides_again() -> None:
    """The stuck bucket: on a CPU, three rejections of a depth-1 n-gram node cut it (p < 0.52:
    nothing rides). Its proposals are still judged, so steps that emit the (cut) chain raise the
    bucket until it rides again."""
    sizer = RideSizer(CPU)
    cal, ride = sizer.calibration, ngram_ride(sizer.calibration, [4, 5], VOCAB)
    assert ride is not None and sizer.size([ride], 1, 1) == [ride]  # fresh: 0.8 and 0.64 ride
    for _ in range(3):
        cal.observe(ride, [0])
        ride = ngram_ride(cal, [4, 5], VOCAB)
    assert ride is not None and sizer.size([ride], 1, 1) == [None]
    cal.observe(ride, [4, 5, 6])  # the step emitted the cut chain: (1 + 3.2) / 8 > 0.52 rides
    assert sizer.size([ngram_ride(cal, [4, 5], VOCAB)], 1, 1)[0] is not None


def test_an_ngram_ride_is_a_chain_of_falling_probabilities() -> None:
    assert ngram_ride(Calibration(), [], VOCAB) is None
    ride = ngram_ride(Calibration(), [7, 1, 7, 2, 5], VOCAB)
    assert ride is not None and ride.tokens == [7, 1, 7, 2, 5] and ride.parents == [-1, 0, 1, 2, 3]
    assert ride.probs == pytest.approx([NGRAM_PRIOR**d for d in range(1, 6)])  # fresh: the prior
    assert ride.probs == sorted(ride.probs, reverse=True)
    assert ride.buckets == [SUFFIX_BUCKETS + d for d in range(5)]
    ride.tree().validate(VOCAB)


# --- through verify_steps: the toy target of tests/test_ngram.py -------------------------------------


def sized_run(
    params: SamplingParams, seed: int, sizer: RideSizer | None, depth: int = 3
) -> tuple[list[int], VerifyOutcome, list[Ride | None]]:
    """One plain call of 8 steps from HISTORY with n-gram rides of up to `depth` tokens (0: none),
    calibrated by the sizer's calibration and sized by it (None: each rides whole); -> (emitted
    tokens, outcome, each step's ride as proposed, before sizing)."""
    toy, index, proposed = ToyVerifier(), NgramIndex(), []
    calibration = sizer.calibration if sizer is not None else Calibration()

    def ride(before: int, after: list[int], depth: int) -> Ride | None:
        index.sync(toy.tokens[:before])
        proposed.append(ngram_ride(calibration, index.propose(depth, after), VOCAB))
        return proposed[-1]

    job = VerifyJob(
        "s", [HISTORY[-1]], None, params, seed, len(HISTORY), plain_steps=8, ride=ride, lookup_depth=depth
    )
    (outcome,) = run_ticked(verify_steps([job], toy.commit, sizer), toy.forward)
    assert outcome.error is None and outcome.steps == 8
    return [*outcome.plain_tokens, *outcome.verdict.emitted_tokens], outcome, proposed


def step_emitted(outcome: VerifyOutcome) -> list[list[int]]:
    """Each step's emitted tokens (its accepted nodes, then the next token)."""
    tokens, out = [*outcome.plain_tokens, *outcome.verdict.emitted_tokens], []
    for _, accepted in outcome.checked:
        out.append(tokens[: accepted + 1])
        tokens = tokens[accepted + 1 :]
    assert not tokens
    return out


def taught(proposed: list[Ride | None], emitted: list[list[int]]) -> tuple[Calibration, int]:
    """What each step's whole proposal and emitted tokens teach a fresh calibration, and how many
    chain nodes that judges, counted by hand (a node at depth d: the d - 1 tokens above it came)."""
    cal, judged = Calibration(), 0
    for r, e in zip(proposed, emitted, strict=True):
        if r is not None:
            cal.observe(r, e)
            judged += sum(
                d <= len(e) and r.tokens[: d - 1] == e[: d - 1] for d in range(1, len(r.tokens) + 1)
            )
    return cal, judged


@pytest.mark.parametrize("params_name", ["T1.0", "T0.6-topk3"])
def test_sizing_changes_how_many_nodes_ride_never_the_text(params_name: str) -> None:
    """30 seeded calls, each with a fresh CPU sizer: each emits the text of plain steps (the
    proposed-token rule), each step rides exactly what sized() keeps of its proposal at one step
    and one row, fewer nodes ride than unsized, and every step's whole proposal (ridden or cut)
    teaches the calibration with what the step emitted: more nodes are judged than ride."""
    params = PARAMS[params_name]
    sized_nodes = whole_nodes = judged_nodes = 0
    for seed in range(30):
        plain, _, _ = sized_run(params, seed, None, depth=0)
        sizer = RideSizer(CPU)
        tokens, outcome, proposed = sized_run(params, seed, sizer)
        assert tokens[: len(plain)] == plain[: len(tokens)], seed
        kept = [sizer.size([r], 1, 1)[0] for r in proposed]  # each step its own forward
        assert [n for n, _ in outcome.checked] == [len(k.tokens) if k else 0 for k in kept], seed
        nodes, _ = outcome.rides
        assert len(outcome.ride_depths) == nodes and max(outcome.ride_depths) <= 3, seed
        cal, (expected, judged) = sizer.calibration, taught(proposed, step_emitted(outcome))
        assert (cal.tried, cal.accepted) == (expected.tried, expected.accepted), seed
        assert nodes > 0 and judged >= nodes and sum(cal.tried) == pytest.approx(judged, rel=0.05), seed
        sized_nodes, judged_nodes = sized_nodes + nodes, judged_nodes + judged
        whole_nodes += sized_run(params, seed, None)[1].rides[0]
    assert 0 < sized_nodes < whole_nodes and judged_nodes > sized_nodes


def test_a_costly_row_keeps_every_ride_home_and_a_free_one_takes_them_all() -> None:
    """Rows past the first cost 100 steps: no node rides and the text is the plain one, yet every
    proposal is judged. Flat (or unpriced) rows: every node rides, as with no sizer at all."""
    params = PARAMS["T1.0"]
    for seed in range(10):
        plain, _, _ = sized_run(params, seed, None, depth=0)
        costly = RideSizer(PROHIBITIVE)
        tokens, outcome, proposed = sized_run(params, seed, costly)
        assert any(r is not None for r in proposed)  # there were proposals to cut
        assert outcome.rides == (0, 0) and tokens == plain
        expected, judged = taught(proposed, step_emitted(outcome))
        assert sum(costly.calibration.tried) > 0 and costly.calibration.tried == expected.tried, seed
        assert costly.calibration.accepted == expected.accepted and judged > 0, seed
        whole = sized_run(params, seed, None)[1].checked
        for curve in (FLAT, {}):
            assert sized_run(params, seed, RideSizer(curve))[1].checked == whole, seed
