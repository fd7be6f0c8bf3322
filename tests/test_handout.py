"""The two small pieces both kinds of rounds share (gateway/env.py): `Handout`, the committed
pieces on their way to the client's stream, and `SlowPaths`, a run's tasks. On a real event loop,
without replicas."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.env import GatewayError, Handout, Piece, SlowPaths


def piece(*tokens: int) -> Piece:
    return Piece(list(tokens), "", None)


def test_pieces_come_out_in_order_and_an_error_after_the_pieces_before_it() -> None:
    async def go() -> None:
        loop, out = asyncio.get_running_loop(), Handout()
        out.put(piece(1))
        out.put(piece(2))
        out.put(ValueError("stopped"))
        out.put(piece(3))  # after the error: never handed out by a run, which ends at the error
        assert (await out.get(loop)).token_ids == [1]
        assert (await out.get(loop)).token_ids == [2]
        with pytest.raises(ValueError, match="stopped"):
            await out.get(loop)

    asyncio.run(go())


def test_a_waiting_get_wakes_on_the_next_piece_and_times_out_without_one() -> None:
    async def go() -> None:
        loop, out = asyncio.get_running_loop(), Handout()
        loop.call_later(0.01, out.put, piece(7))
        assert (await out.get(loop, lambda: 5.0)).token_ids == [7]
        started = loop.time()
        with pytest.raises(GatewayError) as late:
            await out.get(loop, lambda: 0.05)
        assert late.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and loop.time() - started >= 0.04
        out.put(piece(8))  # a piece that comes after the timeout is still there for the next get
        assert (await out.get(loop, lambda: 5.0)).token_ids == [8]

    asyncio.run(go())


def test_a_timeout_that_raises_ends_the_wait_with_its_error() -> None:
    def passed() -> float:
        raise GatewayError(grpc.StatusCode.DEADLINE_EXCEEDED, "the client's deadline has passed")

    async def go() -> None:
        with pytest.raises(GatewayError, match="client's deadline"):
            await Handout().get(asyncio.get_running_loop(), passed)

    asyncio.run(go())


def test_a_slow_paths_error_stops_the_run_and_cancel_waits_for_all_of_them() -> None:
    async def go() -> None:
        stopped: list[BaseException] = []
        slow = SlowPaths(stopped.append)
        ran: list[str] = []

        async def fails() -> None:
            raise GatewayError(grpc.StatusCode.UNAVAILABLE, "no healthy verifier replica")

        async def waits() -> None:
            try:
                await asyncio.sleep(60)
            finally:
                ran.append("cleaned up")

        async def done() -> None:
            ran.append("done")

        slow.spawn(fails())
        slow.spawn(done())
        slow.spawn(waits())
        await asyncio.sleep(0.01)
        assert [(e.code, str(e)) for e in stopped] == [
            (grpc.StatusCode.UNAVAILABLE, "no healthy verifier replica")
        ]
        assert ran == ["done"]
        other = asyncio.ensure_future(asyncio.sleep(60))
        await slow.cancel(other)
        assert ran == ["done", "cleaned up"] and other.cancelled()
        assert len(stopped) == 1  # a cancelled task is no error

    asyncio.run(go())
