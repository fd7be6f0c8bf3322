"""The ride replay of `specmesh bench rides`: forwards and costs counted step by step."""

from __future__ import annotations

import random

from specmesh.bench.rides import default_policy, oracle, replay

COST = {r: 1.0 + 0.5 * (r - 1) for r in range(1, 8)}  # a forward of r rows


def test_a_replay_counts_each_step_and_its_rows() -> None:
    """An answer that copies its prompt's first 20 tokens. Plain steps: 20 forwards of one row.
    The oracle: the first token has no match; then the proposals after a 1-token match ([100] at
    the prompt's start) and two 3-token matches are right, 6 tokens each; the last step may
    propose only what is left of the answer (4 tokens and one more)."""
    prompt = list(range(100, 140))
    answer = list(range(100, 120))
    assert replay(prompt, answer, lambda *_: 0, COST) == (20.0, 20)
    assert replay(prompt, answer, oracle(COST), COST) == (1.0 + COST[7] + COST[7] + COST[5], 4)


def test_the_oracle_bounds_a_policy_and_a_blind_ride_costs() -> None:
    """On text that copies in stretches, no rider beats the oracle; on fresh text from a small
    vocabulary (matches everywhere, guesses wrong) riding every proposal costs more than plain
    steps and the default policy keeps to plain steps."""
    rng = random.Random(0)
    passage = [rng.randrange(1000, 5000) for _ in range(300)]
    prompt = [*passage, *(rng.randrange(1000, 5000) for _ in range(20))]
    copying: list[int] = []
    for i in range(0, 200, 25):
        copying += passage[i : i + 20] + [rng.randrange(1000, 5000) for _ in range(5)]
    fresh = [rng.randrange(100, 104) for _ in range(150)]
    for answer in (copying, fresh):
        best = replay(prompt, answer, oracle(COST), COST)[0]
        for rider in (lambda *_: 0, lambda *_: 6, default_policy(COST, 0.0, 4, len(prompt))):
            assert replay(prompt, answer, rider, COST)[0] >= best
    plain = replay(prompt, fresh, lambda *_: 0, COST)[0]
    assert replay(prompt, fresh, lambda *_: 6, COST)[0] > plain
    assert replay(prompt, fresh, default_policy(COST, 0.0, 4, len(prompt)), COST)[0] <= plain
