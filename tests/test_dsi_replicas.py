"""A DSI session's view of its replicas (gateway/dsi.py `_Replicas`), on its own: which verifier
a block goes to, what a call sends, what each replica holds after answers and failures, and what
the commit records. The calls themselves go through real replicas in tests/test_gateway_dsi.py."""

from __future__ import annotations

import asyncio

from gateway.dsi import _Call, _Replicas
from specmesh.rpc.round_client import Role

A, B, C = "10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"


def replicas(held: dict[str, list[int]] | None = None) -> _Replicas:
    return _Replicas(dict(held or {}), answered=lambda call, outcome: None, event=lambda *a, **k: None)


def test_a_block_goes_to_the_free_verifier_that_holds_most_of_its_prefix_then_the_highest() -> None:
    r = replicas({A: [1, 2, 3, 4], B: [1, 2], C: [1, 2, 9]})
    assert r.free_verifier([A, B, C], [1, 2, 3, 4, 5], now=0.0) == A
    assert r.free_verifier([B, C], [1, 2, 3, 4, 5], now=0.0) == C  # a tie at 2: the higher address
    r.calls[_Call(Role.VERIFIER, A, [1, 2, 3], version=0)] = ("loop", "item")  # A is busy with ours
    assert r.free_verifier([A, B, C], [1, 2, 3, 4, 5], now=0.0) == C
    r.cool(C, until=5.0)  # C still runs a call of ours it refused to replace
    assert r.free_verifier([A, B, C], [1, 2, 3, 4, 5], now=1.0) == B
    assert r.free_verifier([A, B, C], [1, 2, 3, 4, 5], now=5.0) == C
    assert r.free_verifier([A], [1], now=0.0) is None


def test_a_call_sends_what_the_replica_lacks_and_it_holds_only_that_until_it_answers() -> None:
    r = replicas({A: [1, 2, 3, 7, 8]})  # it holds speculation a rejection threw away
    assert r.position(A, [1, 2, 3, 4, 5]) == 3  # rolls back to the shared prefix
    assert r.held[A] == [1, 2, 3]
    assert r.position(A, [1, 2, 3]) == 2  # never everything: the last token gives the root
    assert r.position(B, [1, 2]) == 0  # a replica that never held the session gets it all
    r.holds(A, [1, 2, 3, 4, 5, 6])  # a verification answered: its prefix and accepted tokens
    assert r.lengths([1, 2, 3, 4, 9]) == {A: 4, B: 0}  # what each surely holds of the committed
    r.forget(A)  # it answered "resync" or failed: the next call sends everything
    assert r.position(A, [1, 2, 3]) == 0


def test_cancelled_calls_leave_and_their_answers_are_not_taken() -> None:
    """A call in a chunked prefill is a task: cancelling the call cancels it."""

    async def go() -> None:
        r = replicas()
        draft = _Call(Role.DRAFTER, A, [1], version=0)
        verify = _Call(Role.VERIFIER, B, [1], version=0)
        r.calls[draft] = asyncio.ensure_future(asyncio.sleep(60))
        r.calls[verify] = asyncio.ensure_future(asyncio.sleep(60))
        assert (r.in_flight(Role.DRAFTER), r.in_flight(Role.VERIFIER)) == (1, 1)
        tasks = r.chunk_tasks()
        r.cancel_where(lambda call: call.role is Role.DRAFTER)
        await asyncio.sleep(0)
        assert tasks[0].cancelled() and not tasks[1].done()
        assert not r.taken(draft)  # its late answer is dropped
        assert r.taken(verify) and not r.calls
        tasks[1].cancel()

    asyncio.run(go())
