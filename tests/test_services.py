"""drafter_service and verifier_service as real processes on tiny random models, driven over gRPC.

Module-scoped stacks keep the process start-ups few: `stack` (shared by most tests; its limits are
the *_LIMIT constants below), `restart_stack` (its replicas get killed) and one slow verifier for
the shutdown test. References come from the in-process SpeculativeEngine on the same saved models.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from specmesh.core.rounds import Pipelining, Request
from specmesh.core.sampling import SamplingParams, warp
from specmesh.core.stats import GenerationResult
from specmesh.core.ticks import TreeColumns
from specmesh.core.tree import DraftTree, SamplingMode
from specmesh.rpc import wire
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.round_client import (
    Placement,
    RemoteSession,
    RoundClient,
    generate_remote,
    needs_resync,
    open_channel,
)
from specmesh.rpc.tick_client import ItemError, Role, TickLoop, Timing, Verified
from specmesh.rpc.ticks import ItemFailure, TickItems, VerifyResultMessage, VerifyTickMessage
from specmesh.rpc.ticks import Opened as TickOpened
from specmesh.runtime.costs import PROBE_ROWS
from specmesh.runtime.models import load_model
from specmesh.stack.ports import free_port
from tests.servers import Server, grpcurl, replica, start_all, stop_all, wait_until
from tests.test_engine import PROMPT, SPECS, VOCAB

# one worker runs this module, so pytest -n 2 starts its servers once (--dist loadgroup)
pytestmark = pytest.mark.xdist_group("services")

MAX_DEPTH, MAX_BRANCHING, MAX_BEAM, MAX_NODES = 6, 4, 4, 32
MAX_MESSAGE = 1024 * 1024
LIMIT_FLAGS = [
    *("--max-depth", str(MAX_DEPTH), "--max-branching", str(MAX_BRANCHING)),
    *("--max-beam-width", str(MAX_BEAM), "--max-tree-nodes", str(MAX_NODES)),
    *("--max-message-bytes", str(MAX_MESSAGE), "--max-batch-size", "8"),
]
GREEDY = SamplingParams(0.0, seed=1)


# ---- processes ---------------------------------------------------------------------------------


@dataclass
class Stack:
    drafter: Server
    verifier: Server


def make_stack(models: dict[str, Path], logs: Path, verifier_flags: Sequence[str] = ()) -> Stack:
    flags = [*LIMIT_FLAGS, "--reflection"]  # for grpcurl (off by default)
    return Stack(
        replica("drafter_service", models["draft"], logs / "drafter.log", flags),
        replica("verifier_service", models["target"], logs / "verifier.log", [*flags, *verifier_flags]),
    )


@contextlib.contextmanager
def running(s: Stack) -> Iterator[Stack]:
    try:
        start_all(s.drafter, s.verifier)
        yield s
    finally:
        stop_all(s.drafter, s.verifier)


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory) -> Iterator[Stack]:
    # a generous batching window, so that concurrent Verify calls reliably meet in one forward
    with running(make_stack(models, tmp_path_factory.mktemp("stack"), ["--max-wait-ms", "20"])) as s:
        yield s


@pytest.fixture(scope="module")
def restart_stack(models, tmp_path_factory) -> Iterator[Stack]:
    with running(make_stack(models, tmp_path_factory.mktemp("restart"))) as s:
        yield s


# ---- client helpers ----------------------------------------------------------------------------


class Stubs:
    """Channels, stubs (single calls) and tick loops (rounds) to one stack, inside one event loop."""

    def __init__(self, s: Stack) -> None:
        self.channels = [open_channel(s.drafter.address), open_channel(s.verifier.address)]
        self.drafter = pb2_grpc.DrafterStub(self.channels[0])
        self.verifier = pb2_grpc.VerifierStub(self.channels[1])
        self.drafter_loop = TickLoop(self.channels[0], Role.DRAFTER, s.drafter.address)
        self.verifier_loop = TickLoop(self.channels[1], Role.VERIFIER, s.verifier.address)

    @property
    def loops(self) -> tuple[TickLoop, TickLoop]:
        return self.drafter_loop, self.verifier_loop

    async def __aenter__(self) -> Stubs:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.sleep(0.05)  # releases queued on the loops go out first
        for loop in self.loops:
            await loop.close()
        for channel in self.channels:
            await channel.close()


def remote(s: Stack, r: Request, pipelining: Pipelining = Pipelining.OFF) -> GenerationResult:
    args = (r.prompt_ids, r.spec, r.params, r.max_new_tokens, r.stop_token_ids)
    return asyncio.run(generate_remote(s.drafter.address, s.verifier.address, *args, pipelining=pipelining))


def batches_above_one(server: Server) -> float:
    """Forwards that held more than one session (from the specmesh:batch_size histogram)."""
    m = server.metrics()
    return m[("specmesh:batch_size_count", ())] - m[("specmesh:batch_size_bucket", (("le", "1.0"),))]


def assert_same_generation(got: GenerationResult, want: GenerationResult) -> None:
    assert got.token_ids == want.token_ids
    for name in ("rounds", "drafted_tokens", "accepted_tokens", "accepted_per_depth", "draft_calls"):
        assert getattr(got.stats, name) == getattr(want.stats, name), name


# ---- discovery, health, info -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["drafter", "verifier"])
def test_grpcurl_lists_the_service_through_reflection_and_health_is_serving(stack, kind: str) -> None:
    address, service = getattr(stack, kind).address, f"specmesh.v1.{kind.capitalize()}"
    assert {service, "grpc.health.v1.Health"} <= set(grpcurl(address, "list").stdout.split())
    described = grpcurl(address, "describe", service).stdout
    assert "rpc Release" in described and "rpc Info" in described
    for name in ("", service):
        checked = grpcurl("-d", f'{{"service": "{name}"}}', address, "grpc.health.v1.Health/Check")
        assert '"status": "SERVING"' in checked.stdout


def test_info_reports_model_tokenizer_and_limits(stack, models) -> None:
    async def info() -> list[pb2.InfoResponse]:
        async with Stubs(stack) as stubs:
            return [await stubs.drafter.Info(pb2.InfoRequest()), await stubs.verifier.Info(pb2.InfoRequest())]

    fingerprint = load_model(models["target"], dtype="fp32", device="cpu").tokenizer_fingerprint
    limits = dict(max_depth=MAX_DEPTH, max_branching=MAX_BRANCHING, max_beam_width=MAX_BEAM)
    limits.update(max_tree_nodes=MAX_NODES, max_message_bytes=MAX_MESSAGE, max_batch_size=8)
    for reply, model in zip(asyncio.run(info()), (models["draft"], models["target"]), strict=True):
        assert (reply.model_id, reply.vocab_size, reply.dtype, reply.device) == (
            str(model),
            VOCAB,
            "float32",
            "cpu",
        )
        assert reply.tokenizer_fingerprint == fingerprint
        assert {name: getattr(reply, name) for name in limits} == limits
        # measured at start-up, what the adaptive policy decides from
        assert [c.rows for c in reply.forward_cost] == list(PROBE_ROWS)
        assert all(c.seconds > 0 for c in reply.forward_cost)


def test_a_model_drafter_leaves_ngram_to_the_ngram_drafters(stack) -> None:
    """`drafter_service --backend ngram` drafts method ngram (tests/test_ngram_services.py)."""

    async def call() -> grpc.aio.AioRpcError:
        async with open_channel(stack.drafter.address) as channel:
            request = pb2.DraftRequest(session_id="s", new_token_ids=PROMPT)
            request.tree_spec.method, request.tree_spec.depth = "ngram", 2
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pb2_grpc.DrafterStub(channel).Draft(request)
            return refused.value

    refused = asyncio.run(call())
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree_spec.method" in refused.details() and "--backend ngram" in refused.details()


# ---- equality with the in-process engine -------------------------------------------------------

CASES = {
    "chain-greedy": ("chain", GREEDY),
    "mcsd_wor-greedy": ("mcsd_wor", GREEDY),
    "chain-top_k": ("chain", SamplingParams(1.0, top_k=5, seed=11)),
    "mcsd_iid-top_k": ("mcsd_iid", SamplingParams(0.8, top_k=10, seed=5)),
    "rsd_c-sampled": ("rsd_c", SamplingParams(1.0, seed=4)),
    "rsd_s-top_p": ("rsd_s", SamplingParams(1.0, top_p=0.9, seed=3)),
    "mtad-sampled": ("mtad", SamplingParams(1.0, seed=8)),
    "none-sampled": ("none", SamplingParams(1.0, seed=2)),
}


@pytest.mark.parametrize("pipelining", [Pipelining.OFF, Pipelining.ON])
@pytest.mark.parametrize("case", list(CASES))
def test_services_equal_the_in_process_engine(stack, reference, case: str, pipelining: Pipelining) -> None:
    """Pipelined rounds (a pre-draft beside every Verify) give the same tokens and rounds; only
    the draft forwards differ (each tree's likely leaf runs too)."""
    method, params = CASES[case]
    request = Request(PROMPT, SPECS[method], params, 16)
    got, want = remote(stack, request, pipelining), reference(request)
    if pipelining is Pipelining.OFF:
        assert_same_generation(got, want)
    else:
        assert got.token_ids == want.token_ids
        assert (got.stats.rounds, got.stats.accepted_tokens) == (
            want.stats.rounds,
            want.stats.accepted_tokens,
        )


@pytest.fixture(scope="module")
def self_drafting(models, tmp_path_factory) -> Iterator[Stack]:
    """The target drafts for itself: greedy pre-drafts always apply, sampled ones often do."""
    logs = tmp_path_factory.mktemp("self-drafting")
    s = Stack(
        replica("drafter_service", models["target"], logs / "drafter.log", LIMIT_FLAGS),
        replica("verifier_service", models["target"], logs / "verifier.log", LIMIT_FLAGS),
    )
    with running(s):
        yield s


def test_pre_drafts_that_apply_are_used_and_the_tokens_are_the_serial_ones(self_drafting, reference) -> None:
    async def run(request: Request, pipelining: Pipelining) -> RemoteSession:
        async with Stubs(self_drafting) as stubs:
            session = RemoteSession(*stubs.loops, request, pipelining=pipelining)
            await session.run()
            await session.release()
            return session

    greedy = Request(PROMPT, SPECS["chain"], GREEDY, 40)
    piped = asyncio.run(run(greedy, Pipelining.ON))
    assert piped.generated == reference(greedy).token_ids  # the target's greedy decode
    assert piped.pre_drafts == {None: 1, True: piped.stats.rounds - 1}  # every later tree pre-drafted
    sampled = Request(PROMPT, SPECS["chain"], SamplingParams(0.5, seed=1), 40)
    piped, serial = asyncio.run(run(sampled, Pipelining.ON)), asyncio.run(run(sampled, Pipelining.OFF))
    assert piped.generated == serial.generated
    assert piped.pre_drafts[True] > 0 and piped.pre_drafts[False] > 0  # the guessed token can miss


def test_a_speculative_draft_only_continues_what_the_drafter_holds(stack) -> None:
    """A pre-draft overtaken by the real Draft would roll the session back onto a guess: the
    drafter answers it `superseded` and leaves the session as it was."""
    spec, held = SPECS["chain"], len(PROMPT)

    async def run() -> tuple[pb2.DraftResponse, pb2.DraftResponse]:
        async with Stubs(stack) as stubs:
            await stubs.drafter.Draft(wire.draft_request("overtaken", 0, PROMPT, GREEDY, spec))
            stale = wire.draft_request("overtaken", 2, [5, 6], GREEDY, spec, speculative=True)
            refused = await stubs.drafter.Draft(stale)
            after = await stubs.drafter.Draft(wire.draft_request("overtaken", held, [7], GREEDY, spec))
            await stubs.drafter.Release(pb2.ReleaseRequest(session_id="overtaken"))
            return refused, after

    refused, after = asyncio.run(run())
    assert refused.superseded and not refused.HasField("tree")
    assert after.tree_nodes == spec.depth  # continued from `held`: no resync was asked for


def test_concurrent_sessions_equal_sequential_ones_and_share_forwards(stack, reference) -> None:
    requests = [
        Request(PROMPT, SPECS["rsd_s"], SamplingParams(1.0, seed=1), 14),
        Request(PROMPT[:3], SPECS["chain"], GREEDY, 12),
        Request([7, 7, 7, 1], SPECS["mcsd_wor"], SamplingParams(0.8, top_k=10, seed=5), 14),
        Request([3, 1, 4, 1, 5], SPECS["mtad"], SamplingParams(1.0, seed=8), 12),
    ]
    sequential = [remote(stack, r) for r in requests]
    before = batches_above_one(stack.verifier), batches_above_one(stack.drafter)

    async def together() -> list[GenerationResult]:
        async with Stubs(stack) as stubs:
            sessions = [RemoteSession(*stubs.loops, r) for r in requests]
            results = await asyncio.gather(*(s.run() for s in sessions))
            await asyncio.gather(*(s.release() for s in sessions))
            return results

    # Merging is opportunistic (a Verify goes straight to an idle model): up to three concurrent
    # runs, each of them equal to the sessions run alone, until both services have merged.
    for _ in range(3):
        concurrent = asyncio.run(together())
        for request, alone, with_others in zip(requests, sequential, concurrent, strict=True):
            assert with_others.token_ids == alone.token_ids == reference(request).token_ids
        if batches_above_one(stack.verifier) > before[0] and batches_above_one(stack.drafter) > before[1]:
            break
    assert batches_above_one(stack.verifier) > before[0]  # Verify calls of different sessions merged
    assert batches_above_one(stack.drafter) > before[1]  # and so did tree levels


def verify_tick(
    tick_id: int, opens: list, handles: list[int], positions: list[int], new: list, trees: list,
    release: list[int] | None = None,
):  # fmt: skip
    n = len(handles)
    return VerifyTickMessage(
        tick_id, opens, TickItems.of(handles, positions, new, release=release or []),
        TreeColumns.from_trees(trees, VOCAB), plain_steps=np.ones(n, np.uint8),
        lookup_depth=np.zeros(n, np.uint8), lookup_min_ngram=np.zeros(n, np.uint8),
        max_tokens=np.zeros(n, np.uint32),
    ).to_proto()  # fmt: skip


def test_a_bad_item_fails_alone_and_the_others_in_its_tick_go_on(stack) -> None:
    """One VerifyTick of three sessions, the middle one's tree outside the vocabulary: that item
    alone gets INVALID_ARGUMENT naming the field; the others decode what they decode alone, and the
    next tick (the bad session's included, now valid) goes on from there without a resync."""
    bad_tree = DraftTree(
        tokens=torch.tensor([VOCAB + 3]),
        parents=torch.tensor([-1]),
        mode=SamplingMode.IID,
        draft_probs=torch.zeros(0, VOCAB),
        prob_rows=torch.tensor([-1, -1]),
    )
    opens = [(h, TickOpened(f"bad-item-{h}", f"key-{h}", GREEDY)) for h in range(4)]

    async def run() -> tuple:
        async with Stubs(stack) as stubs:
            call = stubs.verifier.Ticks()
            await call.write(verify_tick(1, opens[3:], [3], [0], [PROMPT], [None]))  # alone
            alone = await call.read()
            await call.write(
                verify_tick(2, opens[:3], [0, 1, 2], [0] * 3, [PROMPT] * 3, [None, bad_tree, None])
            )
            mixed = VerifyResultMessage.from_proto(await call.read(), 3).outcomes
            n = len(PROMPT)
            nxt = [mixed[0].tokens[0], mixed[2].tokens[0]]
            await call.write(
                verify_tick(3, [], [0, 1, 2], [n, 0, n], [nxt[:1], PROMPT, nxt[1:2]], [None] * 3)
            )
            after = VerifyResultMessage.from_proto(await call.read(), 3).outcomes
            await call.write(verify_tick(4, [], [], [], [], [], release=[0, 1, 2, 3]))
            await call.done_writing()
            return VerifyResultMessage.from_proto(alone, 1).outcomes, mixed, after

    (alone,), mixed, after = asyncio.run(run())
    error = mixed[1]
    assert isinstance(error, ItemFailure) and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert error.message.startswith("trees.tokens") and "Traceback" not in error.message
    assert mixed[0].tokens == mixed[2].tokens == alone.tokens  # items 0 and 2, as alone
    assert not any(isinstance(o, ItemFailure) for o in after)
    assert after[0].tokens == after[2].tokens and after[1].tokens == alone.tokens  # the bad one: untouched


# ---- sessions: release, resync, restarts --------------------------------------------------------


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.8, top_k=20, seed=7)], ids=["greedy", "seeded"])
def test_plain_steps_in_one_call_equal_one_call_per_token_and_stop_at_a_stop_token(
    stack, params: SamplingParams
) -> None:
    """VerifyRequest.plain_steps: 4 tokens per call give the tokens of 12 one-token calls (each
    step's randomness is its position's); the verifier holds all but the last; a stop token ends
    the call early."""

    async def decode(session_id: str, steps: int, total: int, stops: Sequence[int] = ()) -> list[list[int]]:
        calls, tokens, position, new = [], [], 0, list(PROMPT)
        async with Stubs(stack) as stubs:
            while len(tokens) < total:
                request = wire.verify_request(session_id, position, new, params, None, steps, stops)
                reply = await stubs.verifier.Verify(request)
                emitted = [*reply.plain_token_ids, reply.next_token]
                assert not reply.accepted_token_ids
                calls.append(emitted)
                tokens += emitted
                position, new = position + len(new) + len(reply.plain_token_ids), [reply.next_token]
                if stops:
                    break
            # the verifier holds what it said: one more step from there continues the session
            await stubs.verifier.Verify(wire.verify_request(session_id, position, new, params, None))
            await stubs.verifier.Release(pb2.ReleaseRequest(session_id=session_id))
        return calls

    one = asyncio.run(decode("plain-1", 1, 12))
    four = asyncio.run(decode("plain-4", 4, 12))
    expected = [t for call in one for t in call]
    assert [len(c) for c in one] == [1] * 12 and [len(c) for c in four] == [4, 4, 4]
    assert [t for call in four for t in call] == expected
    k = next((i for i in range(1, 12) if expected[i] not in expected[:i]), 0)  # a token not seen before
    stopped = asyncio.run(decode("plain-stop", 12, 12, stops=[expected[k]]))
    assert stopped == [expected[: k + 1]]


def test_n_gram_rides_in_plain_steps_give_the_plain_tokens(stack) -> None:
    """VerifyRequest.lookup_depth: a prompt that holds its own greedy continuation once, then its
    start again; calls of 4 steps whose n-gram proposals (up to 3 tokens; any match, or 3-token
    matches only) ride in the steps give the greedy tokens of one-token plain calls, and the replies
    count the rides. max_tokens bounds what a call emits, rides included."""

    async def decode(
        session_id: str, prompt: list[int], steps: int, lookup: int, total: int, min_ngram: int = 0,
        max_tokens: int = 0,
    ) -> tuple:  # fmt: skip
        tokens, position, new, rides = [], 0, list(prompt), [0, 0]
        async with Stubs(stack) as stubs:
            while len(tokens) < total:
                request = wire.verify_request(
                    session_id, position, new, GREEDY, None, steps, lookup_depth=lookup,
                    lookup_min_ngram=min_ngram, max_tokens=max_tokens,
                )  # fmt: skip
                reply = await stubs.verifier.Verify(request)
                emitted = [*reply.plain_token_ids, *reply.accepted_token_ids, reply.next_token]
                assert not max_tokens or len(emitted) <= max_tokens
                tokens += emitted
                rides = [rides[0] + reply.ride_nodes, rides[1] + reply.ride_accepted]
                position, new = position + len(new) + len(emitted) - 1, [reply.next_token]
            await stubs.verifier.Release(pb2.ReleaseRequest(session_id=session_id))
        return tokens[:total], rides

    first, _ = asyncio.run(decode("rides-0", list(PROMPT), 1, 0, 16))
    prompt = [*PROMPT, *first, *PROMPT]  # the lookup proposes `first` again after PROMPT
    plain, none = asyncio.run(decode("rides-1", prompt, 1, 0, 24))
    ridden, rides = asyncio.run(decode("rides-2", prompt, 4, 3, 24))
    assert ridden == plain and none == [0, 0]
    assert rides[0] > 0 and 0 <= rides[1] <= rides[0]
    long_only, long_rides = asyncio.run(decode("rides-3", prompt, 4, 3, 24, min_ngram=3))
    bounded, bounded_rides = asyncio.run(decode("rides-4", prompt, 4, 3, 24, max_tokens=3))
    assert long_only == bounded == plain
    assert 0 < long_rides[0] <= rides[0] and bounded_rides[0] > 0


def ahead_steps(server: Server) -> tuple[float, float]:
    """(taken, discarded): plain steps run ahead of their call (--run-ahead)."""
    m = server.metrics()
    name = "specmesh:verifier_ahead_steps_total"
    return m.get((name, (("outcome", "taken"),)), 0.0), m.get((name, (("outcome", "discarded"),)), 0.0)


def test_a_step_run_ahead_is_taken_by_the_call_that_goes_on_and_rolled_back_by_one_that_does_not(
    stack,
) -> None:
    """--run-ahead (on by default): after a call of 4 plain steps the verifier decodes the next
    step while the answer travels. A call that goes on from there takes it: 4 steps, or 1 (the
    step is the whole call); either way the tokens are those of one-token calls, which run none.
    A call that changes its n-gram rides takes it too, greedy or sampled: a step emits the tokens
    a plain step draws whatever rode in it; also when it comes at once, maybe before the step's
    forward started (it waits for it: its first step rides as the step did, whatever the timing,
    so a seed's stats are reproducible). A call that rolls the session back (DSI's kind) with
    other sampling gets what a fresh session gets from the same tokens; a Release right after a
    call leaves no session behind."""
    params, other = SamplingParams(0.8, top_k=20, seed=7), SamplingParams(0.8, top_k=20, seed=8)
    greedy = SamplingParams(0.0, seed=7)
    n = len(PROMPT)

    async def call(
        stubs: Stubs, sid: str, position: int, new: list[int], p: SamplingParams, steps: int = 4,
        rides: tuple[int, int] = (0, 0),
    ) -> list[int]:  # fmt: skip
        request = wire.verify_request(
            sid, position, new, p, None, steps, lookup_depth=rides[0], lookup_min_ngram=rides[1]
        )
        reply = await stubs.verifier.Verify(request)
        return [*reply.plain_token_ids, reply.next_token]

    def forwards() -> float:
        return stack.verifier.metrics()[("specmesh:forward_seconds_count", ())]

    async def ran(since: float, count: int) -> None:
        """Until `count` forwards since `since`: the step run ahead has had its forward."""
        deadline = time.monotonic() + 10
        while forwards() < since + count:
            assert time.monotonic() < deadline, "the step run ahead never ran"
            await asyncio.sleep(0.01)

    async def run() -> tuple:
        async with Stubs(stack) as stubs:
            ref, position, new = [], 0, list(PROMPT)
            while len(ref) < 16:  # one token per call: no step runs ahead of these
                ref += await call(stubs, "ahead-ref", position, new, params, 1)
                position, new = position + len(new), ref[-1:]
            since = forwards()
            first = await call(stubs, "ahead-a", 0, list(PROMPT), params)
            await ran(since, 4 + 1)  # its 4 steps, then the step ahead
            since = forwards()
            taken = await call(stubs, "ahead-a", n + 3, first[3:], params)
            await ran(since, 3 + 1)  # 3 steps of its own
            rolled = await call(stubs, "ahead-a", n + 1, first[1:2], other)  # drops first[2:] and the ahead
            fresh = await call(stubs, "ahead-b", 0, [*PROMPT, *first[:2]], other)
            since = forwards()
            one = await call(stubs, "ahead-c", 0, list(PROMPT), params)
            await ran(since, 4 + 1)
            one += await call(stubs, "ahead-c", n + 3, one[3:], params, 1)  # the step alone
            one += await call(stubs, "ahead-c", n + 4, one[4:], params)
            greedy_ref, position, new = [], 0, list(PROMPT)
            while len(greedy_ref) < 16:
                greedy_ref += await call(stubs, "ahead-gref", position, new, greedy, 1)
                position, new = position + len(new), greedy_ref[-1:]
            counts = ahead_steps(stack.verifier)
            runs = (
                ("ahead-g", greedy, greedy_ref, True),
                ("ahead-s", params, ref, True),
                ("ahead-now", params, ref, False),
            )
            for sid, p, want, wait in runs:
                since = forwards()
                got = await call(stubs, sid, 0, list(PROMPT), p, rides=(3, 1))
                if wait:
                    await ran(since, 4 + 1)
                got += await call(stubs, sid, n + len(got) - 1, got[-1:], p)  # no rides now
                assert got == want[: len(got)], sid
                counts, was = ahead_steps(stack.verifier), counts
                assert counts[0] == was[0] + 1, sid  # taken
            for sid in (
                "ahead-ref",
                "ahead-a",
                "ahead-b",
                "ahead-c",
                "ahead-gref",
                "ahead-g",
                "ahead-s",
                "ahead-now",
            ):
                await stubs.verifier.Release(pb2.ReleaseRequest(session_id=sid))
        return ref, first, taken, rolled, fresh, one

    def sessions() -> float:
        return stack.verifier.metrics()[("specmesh:num_sessions", ())]

    held, before = sessions(), ahead_steps(stack.verifier)
    ref, first, taken, rolled, fresh, one = asyncio.run(run())
    after = ahead_steps(stack.verifier)
    assert len(first) == len(taken) == 4 and [*first, *taken] == ref[:8]
    assert one == ref[:9] and rolled == fresh
    assert after[0] - before[0] >= 2  # ahead-a's and ahead-c's second calls took their steps
    assert after[1] - before[1] >= 1  # the rolled-back call did not
    wait_until(lambda: sessions() == held, 10)  # the last steps ran or were taken back: released


def test_release_forgets_the_session_and_the_next_round_resyncs(stack, reference) -> None:
    request = Request(PROMPT, SPECS["rsd_c"], SamplingParams(1.0, seed=21), 14)

    async def run() -> tuple[GenerationResult, int, list[bool], grpc.aio.AioRpcError]:
        async with Stubs(stack) as stubs:
            session = RemoteSession(*stubs.loops, request)
            await session.step()
            released = [
                (await stubs.verifier.Release(pb2.ReleaseRequest(session_id=session.id))).released,
                (await stubs.verifier.Release(pb2.ReleaseRequest(session_id=session.id))).released,
            ]
            stale = wire.verify_request(session.id, len(PROMPT), [5], session.client.params, None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stubs.verifier.Verify(stale)
            result = await session.run()
            await session.release()
            return result, session.resyncs, released, err.value

    result, resyncs, released, error = asyncio.run(run())
    assert released == [True, False]
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and needs_resync(error)
    assert error.details().startswith("session_id: ")
    assert resyncs == 1
    assert result.token_ids == reference(request).token_ids


def test_a_round_retried_after_a_lost_verify_gives_the_same_tokens(stack, reference) -> None:
    request = Request(PROMPT, SPECS["mcsd_iid"], SamplingParams(1.0, seed=41), 16)

    async def run() -> GenerationResult:
        async with Stubs(stack) as stubs, open_channel(f"127.0.0.1:{free_port()}") as nowhere:
            session = RemoteSession(*stubs.loops, request, timeout=10)
            await session.step()
            session.verifier = TickLoop(
                nowhere, Role.VERIFIER, "nowhere"
            )  # its draft succeeds, its verification fails
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await session.step()
            assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
            await session.verifier.close()
            session.verifier = stubs.verifier_loop  # retry the round: the drafter gets everything again
            result = await session.run()
            await session.release()
            return result

    assert asyncio.run(run()).token_ids == reference(request).token_ids


RESTART_REQUEST = Request(PROMPT, SPECS["rsd_s"], SamplingParams(1.0, top_k=20, seed=31), 24)


def kill_restart_and_finish(stack: Stack, victim: str, request: Request) -> tuple[GenerationResult, int]:
    """Three rounds, then SIGKILL and restart one replica, then the rest of the generation on
    the restarted one; -> (result, resyncs). Shared by every backend's services tests."""
    server = getattr(stack, victim)

    async def run() -> tuple[GenerationResult, int]:
        async with Stubs(stack) as stubs:
            session = RemoteSession(*stubs.loops, request)
            for _ in range(3):
                await session.step()
            assert not session.done and session.resyncs == 0
            server.kill()
            server.start()
            await asyncio.to_thread(server.wait_serving)
            async with Stubs(stack) as fresh:  # the gateway would pick a replica anew
                setattr(session, victim, getattr(fresh, f"{victim}_loop"))
                result = await session.run()
                await session.release()
            return result, session.resyncs

    return asyncio.run(run())


@pytest.mark.parametrize("victim", ["verifier", "drafter"])
def test_a_killed_and_restarted_replica_is_recovered_by_resync(restart_stack, reference, victim: str) -> None:
    result, resyncs = kill_restart_and_finish(restart_stack, victim, RESTART_REQUEST)
    assert resyncs == 1
    assert result.token_ids == reference(RESTART_REQUEST).token_ids


@pytest.fixture(scope="module")
def slow(models, tmp_path_factory) -> Iterator[Stack]:
    """Replicas whose every forward takes 800 ms: a call can be cancelled while its forward runs."""
    logs, flags = tmp_path_factory.mktemp("slow"), ["--forward-latency-ms", "800"]
    s = Stack(
        replica("drafter_service", models["draft"], logs / "drafter.log", flags),
        replica("verifier_service", models["target"], logs / "verifier.log", flags),
    )
    with running(s):
        yield s


def requests_counted(server: Server, method: str, code: str) -> float:
    return server.metrics().get(("specmesh:rpc_requests_total", (("code", code), ("method", method))), 0.0)


@pytest.mark.parametrize("kind", ["drafter", "verifier"])
def test_a_release_that_overtook_a_cancelled_start_leaves_no_session(slow, kind: str) -> None:
    """A caller cancels a call that starts a session, then releases it; the Release can reach the
    replica before the call has begun (it finds nothing), and the call's forward then creates the
    session. CI saw such a verifier session leak once in 160 tiny-deadline gateway requests. Here
    the order is forced: Release first, then the start, cancelled while its (slowed) forward runs."""
    server: Server = getattr(slow, kind)
    session = f"overtaken-{kind}"
    if kind == "drafter":  # one level: the builder has no next level at which to notice the cancel
        request = wire.draft_request(session, 0, PROMPT, GREEDY, dataclasses.replace(SPECS["chain"], depth=1))
    else:
        request = wire.verify_request(session, 0, PROMPT, GREEDY, None)

    async def run() -> bool:
        async with open_channel(server.address) as channel:
            stub = pb2_grpc.DrafterStub(channel) if kind == "drafter" else pb2_grpc.VerifierStub(channel)
            released = (await stub.Release(pb2.ReleaseRequest(session_id=session))).released
            task = asyncio.ensure_future((stub.Draft if kind == "drafter" else stub.Verify)(request))
            await asyncio.sleep(0.3)  # inside the 800 ms forward: too late to withdraw the step
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return released

    forwards = server.metrics().get(("specmesh:forward_seconds_count", ()), 0.0)
    assert asyncio.run(run()) is False
    wait_until(
        lambda: server.metrics()[("specmesh:forward_seconds_count", ())] > forwards, what="the forward"
    )
    time.sleep(1.0)  # the forward and its commit end; before the fix the session stayed for good
    assert server.metrics()[("specmesh:num_sessions", ())] == 0


def test_a_cancelled_round_cancels_its_replica_call(slow) -> None:
    """With per-try timeouts (as the gateway runs rounds), cancelling the round cancelled only the
    wait: the verification ran on and answered OK to nobody, possibly after the session's Release.
    Now the item is cancelled on the replica too, which forgets the session it started."""
    client = RoundClient("cancelled-round", GREEDY, SPECS["none"])

    async def run() -> None:
        async with open_channel(slow.verifier.address) as channel:
            loop = TickLoop(channel, Role.VERIFIER, slow.verifier.address)
            placement = Placement(loop, per_try=lambda *_: 0.1)
            task = asyncio.ensure_future(client.round(PROMPT, placement))
            await asyncio.sleep(0.3)  # the verification's forward runs
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await asyncio.sleep(1.0)  # past the forward's end
            await loop.close()

    asyncio.run(run())
    assert slow.verifier.metrics()[("specmesh:num_sessions", ())] == 0


def test_a_try_waits_for_a_replica_that_answers_at_its_usual_pace(slow) -> None:
    """A replica that is slow because the whole host is (replicas sharing two cores, a prefill
    chunk in its forward) was left for a spare every per-try timeout: in the routing benchmark 59
    failovers, each one starting a session's prefill over elsewhere. A try now waits PACE_TRIPS of
    the replica's recent round trips; one that has given no answer yet still leaves after the
    per-try timeout (the replica may be stuck)."""
    patience = 0.3  # against an 800 ms forward
    timing = Timing(patience=patience, spare=lambda: True)

    async def verify(loop: TickLoop, session: str, timed: bool) -> object:
        opened = TickOpened(session, session, GREEDY)
        try:
            return await loop.verify(opened, 0, PROMPT, None, timing=timing if timed else None)
        except ItemError as error:
            return error

    async def run() -> tuple[object, object]:
        async with open_channel(slow.verifier.address) as channel:
            loop = TickLoop(channel, Role.VERIFIER, slow.verifier.address)
            unknown = await verify(loop, "pace-0", True)  # no round trip seen yet: the floor
            await verify(loop, "pace-1", False)  # one answered tick: the pace is ~0.8 s
            assert loop.pace > 2 * patience
            known = await verify(loop, "pace-2", True)
            for session in ("pace-0", "pace-1", "pace-2"):
                loop.release(session)
            await asyncio.sleep(1.0)
            await loop.close()
            return unknown, known

    unknown, known = asyncio.run(run())
    assert isinstance(unknown, ItemError) and unknown.per_try, unknown
    assert isinstance(known, Verified), known


@pytest.mark.parametrize("limited", [None, 1.0], ids=["whole", "limited"])
def test_a_session_start_ends_the_plain_runs_in_flight_after_their_step(slow, limited) -> None:
    """Head of line: a plain run of 4 steps that a prefill chunk joins would hold its stream's
    tokens for 4 chunk forwards (6.1 s on this CPU for a 1.3k-token prompt's chunks). A tick that
    starts a session or feeds a chunk now ends the runs in flight after their current step; the
    run's tokens are those 4 steps would have begun with.

    limited: a conversation's next turn is longer than the tick budget and all cached but a few
    tokens. Kept back behind the run, its first token waited for all 4 steps (1.3x llama-server's
    time to first token on turns 2-6 of 4 conversations at once): it goes beside as a whole start
    does. (Behind another prefill it waits, the oldest first: tests/test_prefill.py, "together".)"""
    name = "whole" if limited is None else "limited"  # ids of their own: `slow` is the module's

    async def run() -> tuple[list[int], list[int]]:
        async with open_channel(slow.verifier.address) as channel:
            loop = TickLoop(channel, Role.VERIFIER, slow.verifier.address)
            loop.max_tick_tokens = 0 if limited is None else 4  # a start of PROMPT is limited
            runs = {}
            for session in ("yields", "alone"):
                opened = TickOpened(f"{name}-{session}", session, GREEDY)
                first = await loop.verify(opened, 0, PROMPT, None)
                position = len(PROMPT)
                run = asyncio.ensure_future(loop.verify(opened, position, first.tokens, None, plain_steps=4))
                if session == "yields":
                    await asyncio.sleep(0.3)  # inside the run's first step
                    turn = TickOpened(f"{name}-starts", "starts", GREEDY)
                    started = asyncio.ensure_future(loop.verify(turn, 0, PROMPT, None, limited=limited))
                runs[session] = (await run).tokens
            await started
            for session in ("yields", "alone", "starts"):
                loop.release(f"{name}-{session}")
            await asyncio.sleep(1.0)
            await loop.close()
            return runs["yields"], runs["alone"]

    yielded, alone = asyncio.run(run())
    assert len(alone) == 4
    assert 1 <= len(yielded) < 4 and yielded == alone[: len(yielded)]


@pytest.mark.parametrize("steps", [1, 4])
def test_a_session_start_goes_beside_only_a_plain_run_of_several_steps(slow, steps) -> None:
    """Beside a tick of one forward, a start took a forward of its own where the next tick's would
    have taken it too: DSI's first call to each verifier is a start, and DSI 4x4 at 32 sessions ran
    32 % more verifier forwards. It goes beside a run of several steps only (the test above), and
    otherwise in the next tick."""

    async def run() -> tuple[int, int]:
        async with open_channel(slow.verifier.address) as channel:
            loop = TickLoop(channel, Role.VERIFIER, slow.verifier.address)
            opened = TickOpened(f"runs-{steps}", f"runs-{steps}", GREEDY)
            first = await loop.verify(opened, 0, PROMPT, None)
            ticks = loop.ticks
            run = asyncio.ensure_future(
                loop.verify(opened, len(PROMPT), first.tokens, None, plain_steps=steps)
            )
            await asyncio.sleep(0.3)  # inside the run's first forward
            start = TickOpened(f"starts-{steps}", f"starts-{steps}", GREEDY)
            started = asyncio.ensure_future(loop.verify(start, 0, PROMPT, None))
            await asyncio.sleep(0.2)
            sent = loop.ticks - ticks  # the run's, and the start's if it went beside
            await asyncio.gather(run, started)
            total = loop.ticks - ticks
            for session in (f"runs-{steps}", f"starts-{steps}"):
                loop.release(session)
            await asyncio.sleep(1.0)
            await loop.close()
            return sent, total

    sent, total = asyncio.run(run())
    assert sent == (2 if steps > 1 else 1) and total >= 2, (sent, total)


async def refused_after_sigterm(stub: pb2_grpc.VerifierStub) -> grpc.aio.AioRpcError:
    """The error a new RPC gets once the server has taken the signal (polled: it may take a moment)."""
    for _ in range(100):
        try:
            await stub.Info(pb2.InfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error
        await asyncio.sleep(0.1)
    pytest.fail("the server kept accepting new RPCs after SIGTERM")


def test_busy_session_is_aborted_and_sigterm_lets_in_flight_work_finish(models, tmp_path) -> None:
    # A 3 s forward keeps a lone Verify in flight long enough to overlap with the rest (a lone
    # Verify does not wait in the batcher: nothing could join it).
    flags = ["--forward-latency-ms", "3000"]
    verifier = replica("verifier_service", models["target"], tmp_path / "slow.log", flags)
    start_all(verifier)
    request = wire.verify_request("slow", 0, PROMPT, GREEDY, None)

    async def run() -> tuple[pb2.VerifyResponse, grpc.aio.AioRpcError, grpc.aio.AioRpcError]:
        async with open_channel(verifier.address) as channel:
            stub = pb2_grpc.VerifierStub(channel)
            first = asyncio.ensure_future(stub.Verify(request))
            await asyncio.sleep(1.0)
            with pytest.raises(grpc.aio.AioRpcError) as busy:
                await stub.Verify(request)
            verifier.proc.send_signal(signal.SIGTERM)
            refused = await refused_after_sigterm(stub)
            return await first, busy.value, refused

    try:
        finished, busy, refused = asyncio.run(run())
        assert verifier.proc.wait(timeout=30) == 0
    finally:
        verifier.stop()
    assert busy.code() == grpc.StatusCode.ABORTED and busy.details().startswith("session_id: ")
    assert finished.batch_size == 1 and finished.queue_seconds < 0.5  # it went to the model at once
    assert finished.forward_seconds > 2.0  # and finished after the SIGTERM
    assert finished.batch_tokens == len(PROMPT)  # the rows of its forward: the prompt, no tree
    # gRPC core refuses calls that arrive during shutdown as UNAVAILABLE or, on a live connection, CANCELLED
    assert refused.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    log = verifier.log.read_text()
    assert '"msg": "stopping"' in log and '"msg": "stopped"' in log


def test_a_lone_verify_does_not_wait_and_the_cost_curve_floors_its_forward(models, tmp_path) -> None:
    """Continuous batching: with nothing known to be coming a Verify goes to the model at once,
    whatever --max-wait-ms says (the old rule held it 500 ms here). The benchmark cost curve makes
    its forward last at least fixed + per-row x rows."""
    flags = ["--max-wait-ms", "500", "--forward-latency-ms", "20", "--forward-ms-per-row", "5"]
    verifier = replica("verifier_service", models["target"], tmp_path / "verifier.log", flags)
    start_all(verifier)

    async def run() -> list[pb2.VerifyResponse]:
        async with open_channel(verifier.address) as channel:
            stub = pb2_grpc.VerifierStub(channel)
            first = await stub.Verify(wire.verify_request("lone", 0, PROMPT, GREEDY, None))
            second = await stub.Verify(
                wire.verify_request("lone", len(PROMPT), [first.next_token], GREEDY, None)
            )
            return [first, second]

    try:
        replies = asyncio.run(run())
    finally:
        verifier.stop()
    for reply, rows in zip(replies, (len(PROMPT), 1), strict=True):
        assert reply.queue_seconds < 0.1
        assert reply.forward_seconds >= 0.020 + 0.005 * rows - 1e-4


def test_metrics_are_namespaced_carry_the_model_and_count_evicted_sessions(models, tmp_path) -> None:
    """A cache budget of 10 positions holds one 7-token prompt: a second session evicts the first
    (`specmesh:num_preemptions_total`, vLLM's name), and the usage gauge is held / budget."""
    verifier = replica(
        "verifier_service", models["target"], tmp_path / "verifier.log", ["--max-cache-tokens", "10"]
    )
    start_all(verifier)

    async def run() -> None:
        async with open_channel(verifier.address) as channel:
            stub = pb2_grpc.VerifierStub(channel)
            for session in ("first", "second"):
                await stub.Verify(wire.verify_request(session, 0, PROMPT, GREEDY, None))

    try:
        before = verifier.metrics()
        asyncio.run(run())
        samples = verifier.samples()
        after = verifier.metrics()
    finally:
        verifier.stop()
    assert all(s.name.startswith("specmesh:") for s in samples)
    assert {s.labels["model_name"] for s in samples} == {str(models["target"])}  # Info's model_id
    assert not [s.name for s in samples if s.name.endswith("_created")]
    assert before[("specmesh:num_preemptions_total", ())] == 0
    assert after[("specmesh:num_preemptions_total", ())] == 1
    held = after[("specmesh:kv_cache_tokens", ())]
    assert held == len(PROMPT) and after[("specmesh:kv_cache_usage_perc", ())] == held / 10
    assert after[("specmesh:num_sessions", ())] == 2  # an evicted session keeps its tokens, not its KV


# ---- bad input ---------------------------------------------------------------------------------


def base_draft(session_id: str) -> pb2.DraftRequest:
    return wire.draft_request(session_id, 0, PROMPT, SamplingParams(1.0, top_k=5, seed=1), SPECS["chain"])


def base_verify(session_id: str, tree: pb2.DraftTree) -> pb2.VerifyRequest:
    return wire.verify_request(session_id, 0, PROMPT, SamplingParams(1.0, top_k=5, seed=1), tree)


def chain_tree(n: int) -> pb2.DraftTree:
    """A valid chain of n nodes with uniform draft distributions."""
    return wire.tree_to_proto(
        DraftTree(
            tokens=torch.arange(n) % VOCAB,
            parents=torch.arange(n) - 1,
            mode=SamplingMode.IID,
            draft_probs=torch.full((n, VOCAB), 1.0 / VOCAB),
            prob_rows=torch.cat([torch.arange(n), torch.tensor([-1])]),
        )
    )


def _field(request, path: str):
    *parents, name = path.split(".")
    for part in parents:
        request = getattr(request, part)
    return request, name


def put(path: str, value) -> Callable:
    return lambda r: setattr(*_field(r, path), value)


def put_item(path: str, index: int, value) -> Callable:
    return lambda r: getattr(*_field(r, path)).__setitem__(index, value)


def clear(path: str) -> Callable:
    def mutate(r) -> None:
        message, name = _field(r, path)
        message.ClearField(name)

    return mutate


def spec(**values) -> Callable:
    """Replace the tree spec with these raw fields (no client-side TreeSpec validation)."""
    return lambda r: r.tree_spec.CopyFrom(pb2.TreeSpec(**values))


def first_distribution(probs: bytes | None = None, drop_last: bool = False) -> Callable:
    """Make tree.draft_probs[0] dense with these bytes, or drop its last probability."""

    def mutate(r) -> None:
        d = r.tree.draft_probs[0]
        d.probs = d.probs[:-4] if drop_last else probs
        if not drop_last:
            d.token_ids = b""

    return mutate


def token_outside_support(r) -> None:
    """Make the first drafted token one its (sparse, top-k) draft row gives p = 0."""
    support = set(np.frombuffer(r.tree.draft_probs[0].token_ids, "<i4").tolist())
    r.tree.tokens[0] = min(set(range(VOCAB)) - support)


def proposed(chain: bool) -> Callable:
    """Relabel the tree as proposed tokens (SamplingMode.PROPOSED): a chain that keeps its draft
    rows, or one without rows that branches into two siblings alike (node 2 hangs from node 0 and
    takes node 1's token)."""

    def mutate(r) -> None:
        r.tree.mode = pb2.SAMPLING_MODE_PROPOSED
        if not chain:
            r.tree.ClearField("draft_probs")
            r.tree.prob_rows[:] = [-1] * len(r.tree.prob_rows)
            r.tree.parents[2] = 0
            r.tree.tokens[2] = r.tree.tokens[1]

    return mutate


TINY_CONTEXT = 256  # the tiny models' max_position_embeddings

# id -> (rpc, mutation of a valid request, what the INVALID_ARGUMENT message starts with)
BAD_INPUT: dict[str, tuple[str, Callable, str]] = {
    "draft-empty-new-tokens": ("Draft", clear("new_token_ids"), "new_token_ids: "),
    "verify-empty-new-tokens": ("Verify", clear("new_token_ids"), "new_token_ids: "),
    "empty-session-id": ("Verify", put("session_id", ""), "session_id: "),
    "draft-token-outside-vocab": ("Draft", put_item("new_token_ids", 6, VOCAB), "new_token_ids[6]: "),
    "verify-token-outside-vocab": ("Verify", put_item("new_token_ids", 0, 10**6), "new_token_ids[0]: "),
    "tree-token-outside-vocab": ("Verify", put_item("tree.tokens", 1, VOCAB), "tree.tokens: "),
    "tree-parent-after-child": ("Verify", put_item("tree.parents", 0, 1), "tree.parents: "),
    "tree-dense-size": ("Verify", first_distribution(bytes(4 * (VOCAB - 1))), "tree.draft_probs[0].probs: "),
    "tree-sparse-size": ("Verify", first_distribution(drop_last=True), "tree.draft_probs[0].probs: "),
    "tree-prob-rows-size": ("Verify", lambda r: r.tree.prob_rows.pop(), "tree.prob_rows: "),
    "tree-vocab-size": ("Verify", put("tree.vocab_size", VOCAB + 1), "tree.vocab_size: "),
    "tree-mode-unset": ("Verify", put("tree.mode", 0), "tree.mode: "),
    "tree-node-count-limit": (
        "Verify",
        lambda r: r.tree.CopyFrom(chain_tree(MAX_NODES + 1)),
        "tree.tokens: ",
    ),
    "tree-depth-limit": ("Verify", lambda r: r.tree.CopyFrom(chain_tree(MAX_DEPTH + 1)), "tree.parents: "),
    "spec-depth-limit": ("Draft", spec(method="chain", depth=MAX_DEPTH + 1), "tree_spec.depth: "),
    "spec-branching-limit": (
        "Draft",
        spec(method="mcsd", depth=2, branching=[MAX_BRANCHING + 1, 1]),
        "tree_spec.branching: ",
    ),
    "spec-beam-width-limit": (
        "Draft",
        spec(method="rsd_s", depth=2, beam_width=MAX_BEAM + 1),
        "tree_spec.beam_width: ",
    ),
    "spec-node-count-limit": (
        "Draft",
        spec(method="mcsd", depth=3, branching=[4, 4, 4]),
        "tree_spec: 84 tree nodes",
    ),
    "spec-unknown-method": ("Draft", spec(method="beam", depth=2), "tree_spec.method: "),
    "draft-negative-temperature": ("Draft", put("sampling.temperature", -0.5), "sampling.temperature: "),
    "verify-negative-temperature": ("Verify", put("sampling.temperature", -1.0), "sampling.temperature: "),
    "top-p-zero": ("Draft", put("sampling.top_p", 0.0), "sampling.top_p: "),
    "top-p-above-one": ("Verify", put("sampling.top_p", 1.5), "sampling.top_p: "),
    "top-k-negative": ("Draft", put("sampling.top_k", -1), "sampling.top_k: "),
    # issue 14, finding 5: draft rows that are not distributions, a token the draft could not draw
    "tree-row-all-zero": ("Verify", first_distribution(bytes(4 * VOCAB)), "tree.draft_probs[0]: sums to 0"),
    "tree-row-sums-to-1e30": (
        "Verify",
        first_distribution(np.full(VOCAB, 1e30 / VOCAB, "<f4").tobytes()),
        "tree.draft_probs[0]: sums to 1e+30",
    ),
    "tree-token-with-p-zero": ("Verify", token_outside_support, "tree.tokens[0]: "),
    # proposed tokens (n-gram chains): a chain, and tokens only
    "proposed-tree-with-rows": ("Verify", proposed(chain=True), "tree.draft_probs: "),
    "proposed-tree-repeating-a-sibling": ("Verify", proposed(chain=False), "tree.tokens: "),
    # issue 14, finding 3: a session longer than the model's context
    "draft-beyond-context": (
        "Draft",
        lambda r: r.new_token_ids.extend([1] * TINY_CONTEXT),
        "new_token_ids: position + new tokens",
    ),
    "verify-beyond-context": (
        "Verify",
        lambda r: r.new_token_ids.extend([1] * 15_000),
        "new_token_ids: position + new tokens",
    ),
    # plain decoding of several tokens per call: never with a tree, within the limit
    "plain-steps-with-a-tree": ("Verify", put("plain_steps", 2), "plain_steps: "),
    "plain-steps-limit": (
        "Verify",
        lambda r: (r.ClearField("tree"), setattr(r, "plain_steps", wire.MAX_PLAIN_STEPS + 1)),
        "plain_steps: ",
    ),
    "stop-token-outside-vocab": ("Verify", lambda r: r.stop_token_ids.append(VOCAB), "stop_token_ids[0]: "),
    # n-gram rides: plain steps only, within --max-depth
    "lookup-with-a-tree": ("Verify", put("lookup_depth", 2), "lookup_depth: "),
    "lookup-limit": (
        "Verify",
        lambda r: (r.ClearField("tree"), setattr(r, "lookup_depth", MAX_DEPTH + 1)),
        "lookup_depth: ",
    ),
    "lookup-min-ngram-without-lookup": (
        "Verify",
        lambda r: (r.ClearField("tree"), setattr(r, "lookup_min_ngram", 2)),
        "lookup_min_ngram: ",
    ),
    "lookup-min-ngram-limit": (
        "Verify",
        lambda r: (r.ClearField("tree"), setattr(r, "lookup_depth", 2), setattr(r, "lookup_min_ngram", 17)),
        "lookup_min_ngram: ",
    ),
    "max-tokens-with-a-tree": ("Verify", put("max_tokens", 3), "max_tokens: "),
    # suffix rides: plain steps only
    "suffix-rides-with-a-tree": ("Verify", put("suffix_rides", True), "suffix_rides: "),
}


@pytest.fixture(scope="module")
def donor_tree(stack) -> pb2.DraftTree:
    """A real chain tree with sparse (top-k) distributions, to corrupt."""

    async def draft() -> pb2.DraftTree:
        async with Stubs(stack) as stubs:
            reply = await stubs.drafter.Draft(base_draft("donor"))
            await stubs.drafter.Release(pb2.ReleaseRequest(session_id="donor"))
            return reply.tree

    tree = asyncio.run(draft())
    assert tree.draft_probs[0].token_ids  # sparse
    return tree


@pytest.fixture(scope="module")
def good_reference(reference) -> GenerationResult:
    return reference(Request(PROMPT, SPECS["chain"], GREEDY, 12))


def attack_during_a_good_session(
    stack: Stack, donor: pb2.DraftTree, rpc: str, mutate: Callable
) -> tuple[GenerationResult, int, list[grpc.aio.AioRpcError]]:
    """Send the bad request three times (twice under the good session's own id) while a good
    session generates. -> (good result, its resync count, the errors)."""

    def bad_request(session_id: str):
        request = base_draft(session_id) if rpc == "Draft" else base_verify(session_id, donor)
        mutate(request)
        return request

    async def run() -> tuple[GenerationResult, int, list[grpc.aio.AioRpcError]]:
        async with Stubs(stack) as stubs:
            good = RemoteSession(*stubs.loops, Request(PROMPT, SPECS["chain"], GREEDY, 12))
            method = stubs.drafter.Draft if rpc == "Draft" else stubs.verifier.Verify

            async def attack() -> list[grpc.aio.AioRpcError]:
                errors = []
                for target in (good.id, "bad", good.id):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await method(bad_request(target))
                    errors.append(err.value)
                    await asyncio.sleep(0.005)
                return errors

            result, errors = await asyncio.gather(good.run(), attack())
            await good.release()
            return result, good.resyncs, errors

    return asyncio.run(run())


def test_base_requests_of_the_bad_input_cases_are_valid(stack, donor_tree) -> None:
    async def run() -> None:
        async with Stubs(stack) as stubs:
            await stubs.drafter.Draft(base_draft("valid"))
            await stubs.verifier.Verify(base_verify("valid", donor_tree))
            for stub in (stubs.drafter, stubs.verifier):
                await stub.Release(pb2.ReleaseRequest(session_id="valid"))

    asyncio.run(run())


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_naming_the_field_and_other_sessions_are_unaffected(
    stack, donor_tree, good_reference, case: str
) -> None:
    rpc, mutate, message = BAD_INPUT[case]
    result, resyncs, errors = attack_during_a_good_session(stack, donor_tree, rpc, mutate)
    for error in errors:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error.details()
        assert error.details().startswith(message), error.details()
        assert "Traceback" not in error.details()
    assert resyncs == 0  # the good session's state on both replicas was never touched
    assert result.token_ids == good_reference.token_ids


def test_an_oversized_message_is_refused_by_grpc_and_other_sessions_are_unaffected(
    stack, donor_tree, good_reference
) -> None:
    # gRPC refuses it before any handler runs: RESOURCE_EXHAUSTED, not INVALID_ARGUMENT
    huge = first_distribution(bytes(MAX_MESSAGE + 1024))
    result, resyncs, errors = attack_during_a_good_session(stack, donor_tree, "Verify", huge)
    for error in errors:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in error.details()
    assert resyncs == 0
    assert result.token_ids == good_reference.token_ids


def test_a_session_serves_only_the_caller_with_its_key_and_errors_do_not_tell_its_length(
    stack, donor_tree
) -> None:
    """Issue 14, finding 5: a Verify for another caller's session id changed that session's output
    (182 of 205 attempts), and error details told its length."""
    owner, thief = wire.session_metadata("owner-key"), wire.session_metadata("thief-key")
    sid = "owned-session"

    async def run() -> dict[str, object]:
        async with Stubs(stack) as stubs:
            out: dict[str, object] = {}
            first = await stubs.verifier.Verify(base_verify(sid, donor_tree), metadata=owner)
            await stubs.drafter.Draft(base_draft(sid), metadata=owner)
            for name, metadata in (("thief", thief), ("keyless", ())):
                for kind, call, request in (
                    ("verify", stubs.verifier.Verify, base_verify(sid, donor_tree)),
                    ("draft", stubs.drafter.Draft, base_draft(sid)),
                ):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(request, metadata=metadata)
                    out[f"{name}-{kind}"] = err.value
            request = pb2.ReleaseRequest(session_id=sid)
            out["thief-release"] = (await stubs.verifier.Release(request, metadata=thief)).released
            ahead = wire.verify_request(sid, 200, [1], GREEDY, None)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stubs.verifier.Verify(ahead, metadata=owner)
            out["resync"] = err.value
            # the owner's session is intact: it continues where it was (no resync asked)
            held = len(PROMPT) + len(first.accepted_token_ids)
            params = SamplingParams(1.0, top_k=5, seed=1)
            step = wire.verify_request(sid, held, [first.next_token], params, None)
            await stubs.verifier.Verify(step, metadata=owner)
            out["owner-release"] = (await stubs.verifier.Release(request, metadata=owner)).released
            await stubs.drafter.Release(request, metadata=owner)
            return out

    out = asyncio.run(run())
    for name in ("thief-verify", "thief-draft", "keyless-verify", "keyless-draft"):
        error = out[name]
        assert error.code() == grpc.StatusCode.PERMISSION_DENIED, (name, error.details())
        assert error.details().startswith("session_id: ") and not any(c.isdigit() for c in error.details())
    assert out["thief-release"] is False and out["owner-release"] is True
    resync = out["resync"]
    assert resync.code() == grpc.StatusCode.FAILED_PRECONDITION and needs_resync(resync)
    assert resync.details() == (  # and not how many tokens the replica holds
        f"position: 200 is past what this replica holds of session {sid!r}; "
        "resend all its committed tokens with position 0"
    )


def test_a_call_that_arrives_after_its_sessions_release_is_refused(stack) -> None:
    """The gateway's Release can overtake a call it sent just before (gRPC does not order two
    calls, and the call's cancel may come later still). The late call would make the session anew
    and nobody would release it: CI saw a verifier keep one. A Release with a session key closes
    the id for that key on the replica; another key's session of the same id is another session."""
    owner, other = wire.session_metadata("k-owner"), wire.session_metadata("k-other")
    request = wire.verify_request("late", 0, PROMPT, GREEDY, None)

    async def run() -> tuple[bool, grpc.aio.AioRpcError, bool]:
        async with Stubs(stack) as stubs:
            release = pb2.ReleaseRequest(session_id="late")
            released = (await stubs.verifier.Release(release, metadata=owner)).released
            with pytest.raises(grpc.aio.AioRpcError) as late:
                await stubs.verifier.Verify(request, metadata=owner)
            await stubs.verifier.Verify(request, metadata=other)  # someone else's session "late"
            released_other = (await stubs.verifier.Release(release, metadata=other)).released
            return released, late.value, released_other

    released, late, released_other = asyncio.run(run())
    assert released is False and released_other is True
    assert late.code() == grpc.StatusCode.FAILED_PRECONDITION and not needs_resync(late)
    assert late.details() == "session_id: session 'late' was released on this replica"
    wait_until(lambda: stack.verifier.metrics()[("specmesh:num_sessions", ())] == 0, what="no session held")


# ---- wire encoding -----------------------------------------------------------------------------


FILTERS = [
    SamplingParams(1.0),
    SamplingParams(0.7, top_k=9),
    SamplingParams(1.0, top_p=0.8),
    SamplingParams(0.0),
]


@pytest.mark.parametrize("params", FILTERS, ids=["dense", "top_k", "top_p", "greedy"])
def test_distributions_round_trip_bit_exact_and_sparse_when_filtered(params: SamplingParams) -> None:
    torch.manual_seed(0)
    for row in warp(torch.randn(5, VOCAB) * 3, params):
        msg = wire.encode_distribution(row)
        assert bool(msg.token_ids) == (params != FILTERS[0]) == bool((row == 0).any())
        back = wire.decode_distribution(msg, VOCAB, "p")
        assert back.dtype == torch.float32 and torch.equal(back.view(torch.int32), row.view(torch.int32))


def test_a_relayed_tree_is_the_drafters_bytes_and_the_verifier_reads_the_same_request() -> None:
    """The gateway's round client passes a tree on undecoded (DraftResponseRelay,
    VerifyRequestRelay): the same bytes on the wire as DraftResponse and VerifyRequest."""
    tree = chain_tree(3)
    drafted = pb2.DraftResponse(tree=tree, draft_calls=3, tree_nodes=3, tree_depth=3).SerializeToString()
    relayed = pb2.DraftResponseRelay.FromString(drafted)
    assert relayed.tree == tree.SerializeToString() and relayed.tree_nodes == 3
    args = ("s", 4, [1, 2], GREEDY)
    plain, relay = wire.verify_request(*args, tree), wire.verify_request(*args, relayed.tree)
    assert isinstance(relay, pb2.VerifyRequestRelay)
    assert relay.SerializeToString() == plain.SerializeToString()
