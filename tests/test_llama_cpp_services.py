"""drafter_service and verifier_service on the llama.cpp backend (`--backend llama.cpp`), real
processes on the tiny GGUF pair: the same tokens as the in-process engine on llama.cpp runners,
at T=0 the backend's own greedy decode, and a killed replica recovered by resync."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import llguidance
import pytest
import torch

from specmesh.core.rounds import Request
from specmesh.core.sampling import SamplingParams
from specmesh.core.stats import GenerationResult
from specmesh.runtime.engine import SpeculativeEngine
from specmesh.runtime.models import load_model
from specmesh.runtime.runner import Step
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, replica, start_all, stop_all
from tests.test_engine import PROMPT, SPECS
from tests.test_gateway import EOS, gateway_grpc, make_request
from tests.test_services import (
    LIMIT_FLAGS,
    RESTART_REQUEST,
    Stack,
    assert_same_generation,
    kill_restart_and_finish,
    remote,
    running,
)
from tests.test_structured import constrained_greedy
from tests.tiny_gguf import save_tiny_gguf_pair

pytestmark = pytest.mark.xdist_group("llama_services")

LLAMA_FLAGS = [*LIMIT_FLAGS, "--backend", "llama.cpp"]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return save_tiny_gguf_pair(tmp_path_factory.mktemp("ggufs"))


@pytest.fixture(scope="module")
def llama_stack(ggufs, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("llama-stack")
    stack = Stack(
        replica("drafter_service", ggufs["draft"], logs / "drafter.log", LLAMA_FLAGS),
        replica("verifier_service", ggufs["target"], logs / "verifier.log", LLAMA_FLAGS),
    )
    with running(stack) as s:
        yield s


@pytest.fixture(scope="module")
def llama_reference(ggufs) -> Callable[[Request], GenerationResult]:
    """The in-process engine on llama.cpp runners of the same files."""
    draft = load_model(ggufs["draft"], backend="llama.cpp")
    target = load_model(ggufs["target"], backend="llama.cpp")
    engine = SpeculativeEngine(draft, target)
    return lambda request: engine.generate_many([request])[0]


@pytest.mark.parametrize("method", ["none", "chain", "mcsd_iid", "mcsd_wor", "rsd_c", "rsd_s", "mtad"])
def test_greedy_through_the_services_is_the_backends_own_greedy_decode(
    llama_stack, llama_reference, method: str
) -> None:
    greedy = SamplingParams(0.0, seed=1)
    got = remote(llama_stack, Request(PROMPT, SPECS[method], greedy, 24))
    plain = llama_reference(Request(PROMPT, SPECS["none"], greedy, 24))
    assert got.token_ids == plain.token_ids
    assert_same_generation(got, llama_reference(Request(PROMPT, SPECS[method], greedy, 24)))
    if method != "none":
        assert got.stats.accepted_tokens > 0


@pytest.mark.parametrize("method", ["chain", "mcsd_wor", "rsd_s"])
def test_seeded_sampling_through_the_services_equals_the_engine(llama_stack, llama_reference, method) -> None:
    request = Request(PROMPT, SPECS[method], SamplingParams(1.0, top_k=20, seed=11), 24)
    assert_same_generation(remote(llama_stack, request), llama_reference(request))


@pytest.mark.parametrize("victim", ["verifier", "drafter"])
def test_a_killed_and_restarted_replica_is_recovered_by_resync(
    llama_stack, llama_reference, victim: str
) -> None:
    result, resyncs = kill_restart_and_finish(llama_stack, victim, RESTART_REQUEST)
    assert resyncs == 1
    assert result.token_ids == llama_reference(RESTART_REQUEST).token_ids


# ---- the gateway over llama.cpp replicas ----------------------------------------------------------


@pytest.fixture(scope="module")
def gateway_stub(llama_stack, tmp_path_factory) -> Iterator:
    logs = tmp_path_factory.mktemp("llama-gateway")
    with RedisServer() as redis_server:
        args = [
            *("--drafters", llama_stack.drafter.address, "--verifiers", llama_stack.verifier.address),
            *("--redis-url", redis_server.url, "--health-interval", "0.2", "--round-timeout", "30"),
        ]
        gateway = Server("gateway", args, logs / "gateway.log")
        try:
            start_all(gateway)  # it loads the tokenizer from the GGUF the verifier names
            with grpc.insecure_channel(gateway.address) as channel:
                yield gateway_grpc.GatewayStub(channel)
        finally:
            stop_all(gateway)


@pytest.mark.parametrize("method", ["none", "chain", "mcsd_iid", "mcsd_wor", "rsd_c", "rsd_s", "mtad"])
def test_gateway_greedy_is_the_backends_own_greedy_decode(gateway_stub, llama_reference, method) -> None:
    request = make_request(SPECS[method], max_new_tokens=20)
    reply = gateway_stub.Generate(request, timeout=60)
    plain = llama_reference(Request(PROMPT, SPECS["none"], SamplingParams(0.0), 20, stop_token_ids=(EOS,)))
    assert list(reply.token_ids) == plain.token_ids


@pytest.mark.parametrize("method", ["none", "chain", "rsd_s"])
def test_gateway_greedy_under_a_regex_is_the_backends_constrained_greedy(gateway_stub, ggufs, method) -> None:
    """Structured output on the llama.cpp backend: the target's greedy decode under the grammar,
    computed here with the llama.cpp runner and llguidance directly."""
    regex = r"w[0-9](,w[0-9]){2,5}\."  # no space: the tiny vocabulary writes it with byte tokens
    request = make_request(SPECS[method], max_new_tokens=24)
    request.constraint.regex = regex
    reply = gateway_stub.Generate(request, timeout=60)
    target = load_model(ggufs["target"], backend="llama.cpp")
    runner = target.open_runner()

    def next_logits(new: list[int]) -> torch.Tensor:  # the runner keeps the context: only new tokens
        return runner.forward([Step("reference", new_tokens=new or list(PROMPT))])[0][-1]

    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    want = constrained_greedy(next_logits, target.tokenizer, grammar, EOS, 24)
    assert list(reply.token_ids) == want
    assert want[-1] == EOS  # the regex completed and only the end of sequence was left
