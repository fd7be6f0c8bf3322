"""Run-ahead's rules on their own (verifier_service/run_ahead.py, specmesh.core.ahead.goes_on):
which call goes on from a step run ahead, what is left of the call after it, and the state the
step ends in. The whole path, through a real verifier: tests/test_services.py."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specmesh.core.ahead import RUN_AHEAD_LOOSE, goes_on
from specmesh.core.sampling import SamplingParams
from specmesh.core.verification import Verdict
from specmesh.rpc.wire import VerifyInput
from specmesh.runtime.rounds import VerifyJob, VerifyOutcome
from verifier_service.run_ahead import AheadState, _settled, after_step

PARAMS = SamplingParams(temperature=1.0, seed=7)
EXPECTED = VerifyInput("s", 12, [5], PARAMS, tree=None, plain_steps=4, lookup_depth=3, max_tokens=20)


@pytest.mark.parametrize("name", RUN_AHEAD_LOOSE)
def test_a_call_goes_on_whatever_its_steps_room_and_rides(name: str) -> None:
    assert goes_on(EXPECTED, replace(EXPECTED, **{name: getattr(EXPECTED, name) + 1}))


@pytest.mark.parametrize(
    "change",
    [
        {"position": 11},  # the caller rolled back
        {"new_tokens": [6]},  # another token fed
        {"params": SamplingParams(temperature=1.0, seed=8)},  # another seed: other draws
        {"stop_token_ids": frozenset({2})},  # it would have stopped elsewhere
        {"top_logprobs": 2},
        {"session_id": "t"},
    ],
)
def test_any_other_difference_rolls_the_step_back(change: dict) -> None:
    assert not goes_on(EXPECTED, replace(EXPECTED, **change))


def _ran(emitted: list[int], steps: int = 1) -> VerifyOutcome:
    verdict = Verdict(accepted_tokens=emitted[:-1], accepted_nodes=list(range(len(emitted) - 1)),
                      next_token=emitted[-1], bonus=True)  # fmt: skip
    return VerifyOutcome(verdict=verdict, steps=steps, emitted=len(emitted))


JOB = VerifyJob("s", [5], None, PARAMS, 7, 13)  # the step ahead: fed 5, one step


def test_what_is_left_of_a_call_after_its_step_ahead() -> None:
    """The step emitted [8, 9] (a ride's 8, then 9): the call goes on fed 9 two positions on,
    with one step fewer and two tokens less of room."""
    rest, done = after_step(EXPECTED, _ran([8, 9]), JOB)
    assert (rest.position, rest.new_tokens, rest.plain_steps, rest.max_tokens) == (14, [9], 3, 18)
    assert not done


@pytest.mark.parametrize(
    ("call", "first", "job"),
    [
        (replace(EXPECTED, plain_steps=1), _ran([8]), JOB),  # its one step was the step ahead
        (replace(EXPECTED, max_tokens=2), _ran([8, 9]), JOB),  # no room left
        (EXPECTED, _ran([8, 2]), replace(JOB, stop_token_ids=frozenset({2}))),  # a stop token
    ],
)
def test_a_step_ahead_that_ends_its_call_leaves_nothing_to_run(call, first, job) -> None:
    assert after_step(call, first, job)[1]


def test_the_state_a_step_ahead_ends_in() -> None:
    first = _ran([8, 9])
    assert _settled(EXPECTED, True, first) is AheadState.TAKEN
    assert _settled(EXPECTED, False, first) is AheadState.DISCARDED  # another call
    assert _settled(replace(EXPECTED, max_tokens=1), True, first) is AheadState.DISCARDED  # no room
    assert _settled(EXPECTED, True, None) is AheadState.LOST  # its run failed or was withdrawn
    assert [s for s in AheadState if s.counted] == [AheadState.TAKEN, AheadState.DISCARDED]
