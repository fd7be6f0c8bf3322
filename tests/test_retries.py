"""Per-try timeouts and the retry budget (gateway/retries.py)."""

from __future__ import annotations

import time

import pytest

from gateway.retries import RetryBudget, TryTimeouts, forward_seconds

COST = {1: 0.010, 2: 0.012, 4: 0.016, 8: 0.024, 16: 0.040}  # rows -> seconds, as Info reports it


@pytest.mark.parametrize(
    ("rows", "seconds"),
    [(1, 0.010), (3, 0.014), (16, 0.040), (160, 0.400), (0, 0.010)],
)
def test_forward_seconds_interpolates_and_extrapolates_by_rows(rows: int, seconds: float) -> None:
    assert forward_seconds(COST, rows) == pytest.approx(seconds)
    assert forward_seconds({}, rows) == 0.0


def test_a_try_gets_a_multiple_of_its_forwards_but_never_less_than_the_floor() -> None:
    timeouts = TryTimeouts(floor=0.5, factor=10.0, draft_cost=COST, verify_cost=COST)
    assert timeouts.verify(1, 3) == 0.5  # 10 x 16 ms is under the floor
    assert timeouts.verify(150, 10) == pytest.approx(10 * 0.400)  # a resync's prefill earns more
    assert timeouts.draft(1, 4) == 0.5
    assert timeouts.draft(400, 4) == pytest.approx(10 * (0.040 * 400 / 16 + 3 * 0.010))
    assert TryTimeouts(floor=2.0, factor=10.0).verify(1000, 64) == 2.0  # nothing measured: the floor
    # plain decoding of 60 tokens in one call: one more one-row forward per step
    assert timeouts.verify(1, 0, plain_steps=60) == pytest.approx(10 * 60 * 0.010)


def test_the_retry_budget_allows_a_share_of_recent_rounds_plus_a_minimum() -> None:
    budget = RetryBudget(ratio=0.2, minimum=3, window=60.0)
    assert [budget.try_spend() for _ in range(4)] == [True, True, True, False]
    for _ in range(10):
        budget.round_started()
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]  # 3 + 0.2 x 10 = 5 in all


def test_the_retry_budget_forgets_what_left_its_window() -> None:
    budget = RetryBudget(ratio=0.0, minimum=1, window=0.05)
    assert budget.try_spend() and not budget.try_spend()
    time.sleep(0.06)
    assert budget.try_spend()


def test_the_auto_prefill_chunk_costs_sixteen_one_row_forwards_within_bounds() -> None:
    from gateway.retries import MAX_CHUNK, MIN_CHUNK, prefill_chunk

    cpu = {rows: 0.084 + 0.016 * rows for rows in (1, 2, 4, 8, 16)}  # 16 ms a row
    chunk = prefill_chunk(cpu)
    assert 0.084 + 0.016 * chunk == pytest.approx(16 * cpu[1], abs=0.016)
    # the verifier's measurement in a head-of-line run (replicas starting together on 2 cores): its
    # 16-row forward as fast as its 8-row one; the slope of the last two points made it 499 tokens
    busy = {1: 0.076, 2: 0.110, 3: 0.149, 4: 0.127, 5: 0.180, 6: 0.219, 7: 0.236, 8: 0.255, 16: 0.270}
    assert MIN_CHUNK <= prefill_chunk(busy) <= 2 * MIN_CHUNK
    assert prefill_chunk({1: 0.016, 8: 0.0168, 16: 0.0176}) == MAX_CHUNK  # nearly flat: a GPU's
    assert prefill_chunk({1: 0.1, 16: 5.0}) == MIN_CHUNK  # every row costs more than one forward
    assert prefill_chunk({}) == 4 * MIN_CHUNK  # nothing measured
