"""The n-gram drafter as a real process (`drafter_service --backend ngram`, no model) beside a
verifier of each backend: the same tokens as the in-process engine, at T=0 the backend's own
greedy decode, and requests it cannot serve refused with the field named."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from specmesh.core.drafting import TreeSpec
from specmesh.core.rounds import Request
from specmesh.core.sampling import SamplingParams
from specmesh.rpc.proto import pb2, pb2_grpc
from specmesh.rpc.round_client import open_channel
from specmesh.runtime.costs import PROBE_ROWS
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.models import load_model
from tests.servers import replica
from tests.test_engine import PROMPT, SPECS
from tests.test_services import LIMIT_FLAGS, Stack, assert_same_generation, remote, running
from tests.tiny_gguf import save_tiny_gguf_pair

pytestmark = pytest.mark.xdist_group("ngram_services")

# a prompt that repeats itself, so that the lookup finds something from the first round on
REPEATING = [*PROMPT, *PROMPT[:4], 30, *PROMPT[:5]]
CASES = {
    "greedy": SamplingParams(0.0, seed=1),
    "sampled": SamplingParams(1.0, seed=7),
    "top_k": SamplingParams(0.8, top_k=5, seed=3),
}


@pytest.fixture(scope="module", params=["torch", "llama.cpp"])
def backend_stack(request, models, tmp_path_factory) -> Iterator[tuple[Stack, SpeculativeEngine]]:
    """An n-gram drafter and a verifier of the backend, and the in-process engine on that target."""
    logs = tmp_path_factory.mktemp(f"ngram-{request.param}")
    if request.param == "torch":
        target = models["target"]
        engine_target = load_model(target, dtype="fp32", device="cpu")
        flags = LIMIT_FLAGS
    else:
        target = save_tiny_gguf_pair(tmp_path_factory.mktemp("ggufs"))["target"]
        engine_target = load_model(target, backend="llama.cpp")
        flags = [*LIMIT_FLAGS, "--backend", "llama.cpp"]
    stack = Stack(
        replica("drafter_service", target, logs / "ngram.log", [*LIMIT_FLAGS, "--backend", "ngram"]),
        replica("verifier_service", target, logs / "verifier.log", flags),
    )
    with running(stack) as s:
        # the engine's draft model is never asked for an n-gram session: the target serves as both
        yield s, SpeculativeEngine(engine_target, engine_target)


@pytest.mark.parametrize("case", list(CASES))
def test_ngram_through_the_services_equals_the_engine(backend_stack, case: str) -> None:
    stack, engine = backend_stack
    request = Request(REPEATING, SPECS["ngram"], CASES[case], 24)
    got = remote(stack, request)
    assert_same_generation(got, engine.generate_many([request])[0])
    assert got.stats.drafted_tokens > 0
    if case == "greedy":  # the backend's own greedy decode
        plain = engine.generate_many([Request(REPEATING, SPECS["none"], CASES[case], 24)])[0]
        assert got.token_ids == plain.token_ids and got.stats.accepted_tokens > 0


def test_the_ngram_drafter_serves_ngram_only(backend_stack) -> None:
    stack, _ = backend_stack

    async def calls() -> tuple[pb2.InfoResponse, grpc.aio.AioRpcError]:
        async with open_channel(stack.drafter.address) as channel:
            stub = pb2_grpc.DrafterStub(channel)
            info = await stub.Info(pb2.InfoRequest())
            spec = TreeSpec("chain", depth=2)
            request = pb2.DraftRequest(session_id="s", new_token_ids=PROMPT)
            request.tree_spec.method, request.tree_spec.depth = spec.method, spec.depth
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Draft(request)
            return info, refused.value

    info, refused = asyncio.run(calls())
    assert info.backend == "ngram" and [c.rows for c in info.forward_cost] == list(PROBE_ROWS)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "tree_spec.method" in refused.details() and "ngram" in refused.details()
