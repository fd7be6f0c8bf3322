"""Long prompts through the gateway: chunked prefill as tick work, prefixes kept across requests,
routing by cached prefix (issue: "Long prompts and whole conversations").

A stack of real processes on a tiny pair with a 1,024-token context: Redis, a drafter, an n-gram
drafter, two verifiers whose forwards cost 4 ms a row (`--forward-ms-per-row`: a 300-token prompt
fed in one call takes 1.2 s, in chunks of 32 0.13 s each), and three gateways on them:
  chunked   --prefill-chunk 32, a round timeout of 0.8 s, API keys "ka" and "kb"
  whole     --prefill-chunk 0 (a prompt in one call), the same round timeout
  patient   --prefill-chunk 32, a per-try timeout of 0.5 s (floor; factor 1), no round timeout to speak of
References: the target's own greedy decode (HF generate) of the same saved model.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import requests
import torch

from specmesh.bench.tiny import save_tiny_pair
from specmesh.core.drafting import TreeSpec
from specmesh.rpc.proto import load
from specmesh.runtime.models import load_model
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, redis_client, replica, start_all, stop_all, wait_until
from tests.test_engine import SPECS
from tests.test_gateway import speculation

pytestmark = pytest.mark.xdist_group("prefill")

gateway_pb2, gateway_grpc = load("gateway")

CONTEXT = 1024
CHUNK = 32
ROUND_TIMEOUT = 0.8
LONG = 300  # a prompt whose one-call prefill (1.2 s) cannot fit in the round timeout
KEYS = ("ka", "kb")
PER_TRY = 1.0  # the patient gateway's per-try timeout: a few chunks' forwards; a prefill takes 10


@dataclass
class Stack:
    redis: RedisServer
    drafter: Server
    ngram: Server
    verifiers: list[Server]
    chunked: Server
    whole: Server
    patient: Server

    def http(self, gateway: Server) -> str:
        port = gateway.args[gateway.args.index("--http-port") + 1]
        return f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # eos=False: no stop token, so every generation runs to its length, as the HF reference does
    return save_tiny_pair(tmp_path_factory.mktemp("models"), eos=False, max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def target(pair) -> torch.nn.Module:
    return load_model(pair["target"], dtype="fp32", device="cpu").model


@pytest.fixture(scope="module")
def stack(pair, tmp_path_factory) -> Iterator[Stack]:
    from specmesh.stack.ports import free_port

    logs = tmp_path_factory.mktemp("prefill-stack")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", pair["draft"], logs / "drafter.log")
        ngram = replica("drafter_service", pair["target"], logs / "ngram.log", ["--backend", "ngram"])
        costly = ["--forward-ms-per-row", "4", "--max-cache-tokens", "8000"]
        verifiers = [
            replica("verifier_service", pair["target"], logs / f"verifier-{i}.log", costly) for i in range(2)
        ]
        common = [
            *("--drafters", drafter.address, "--ngram-drafters", ngram.address),
            *("--verifiers", ",".join(v.address for v in verifiers), "--redis-url", redis_server.url),
            *("--health-interval", "0.2", "--round-timeout", str(ROUND_TIMEOUT), "--max-attempts", "5"),
            *("--max-new-tokens-limit", "64"),
        ]
        chunked = Server(
            "gateway",
            [
                *common,
                "--prefill-chunk",
                str(CHUNK),
                "--api-keys",
                ",".join(KEYS),
                "--http-port",
                str(free_port()),
            ],
            logs / "chunked.log",
        )
        whole = Server("gateway", [*common, "--prefill-chunk", "0"], logs / "whole.log")
        per_try = ["--try-timeout-floor", str(PER_TRY), "--try-timeout-factor", "1"]
        patient = Server(
            "gateway",
            [*common, "--round-timeout", "30", "--prefill-chunk", str(CHUNK), *per_try],
            logs / "patient.log",
        )
        servers = [drafter, ngram, *verifiers, chunked, whole, patient]
        try:
            start_all(*servers)
            yield Stack(redis_server, drafter, ngram, verifiers, chunked, whole, patient)
        finally:
            stop_all(*servers)


@torch.inference_mode()
def greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy decode, every token its argmax (HF generate's min_new_tokens would
    forbid the config's end-of-sequence token, which this stack never stops at)."""
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def prompt_of(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 97) for _ in range(n)]


def request(
    prompt: list[int], n: int, spec: TreeSpec | None = None, cache_salt: str = ""
) -> gateway_pb2.GenerateRequest:
    r = gateway_pb2.GenerateRequest(prompt_token_ids=gateway_pb2.TokenIds(ids=prompt), max_new_tokens=n)
    r.sampling.temperature = 0.0
    if spec is not None:
        r.speculation.CopyFrom(speculation(spec))
    r.cache_salt = cache_salt
    return r


def generate(
    gateway: Server, req: gateway_pb2.GenerateRequest, key: str = "ka"
) -> gateway_pb2.GenerateResponse:
    with grpc.insecure_channel(gateway.address) as channel:
        stub = gateway_grpc.GatewayStub(channel)
        return stub.Generate(req, timeout=120, metadata=[("authorization", f"Bearer {key}")])


def total(servers: list[Server], name: str) -> float:
    return sum(s.metrics().get((name, ()), 0.0) for s in servers)


# ---- chunked prefill ---------------------------------------------------------------------------


def test_a_prompt_whose_prefill_cannot_fit_in_a_round_answers_in_chunks(stack, target) -> None:
    prompt = prompt_of(LONG, 1)
    fed = total(stack.verifiers, "specmesh:prefill_tokens_total")
    out = generate(stack.chunked, request(prompt, 8, TreeSpec("none")))
    assert list(out.token_ids) == greedy(target, prompt, 8)
    # fed in chunks of at most 32 by the limited call (its last chunk runs whole, the round's tokens)
    assert total(stack.verifiers, "specmesh:prefill_tokens_total") - fed >= LONG - CHUNK - 1


def test_a_call_that_cannot_fit_fails_at_once_saying_why(stack) -> None:
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as failed:
        generate(stack.whole, request(prompt_of(LONG, 2), 4, TreeSpec("none")))
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "cannot fit" in failed.value.details() and "--prefill-chunk" in failed.value.details()
    assert time.monotonic() - start < 3 * ROUND_TIMEOUT  # one try, not --max-attempts of them


# ---- prefixes kept across requests --------------------------------------------------------------

METHODS = ["none", "chain", "mcsd_wor", "rsd_s", "mtad", "ngram"]


@pytest.mark.parametrize("gateway", ["patient", "chunked"])
def test_a_prefill_waiting_behind_another_is_not_taken_for_a_slow_replica(stack, target, gateway) -> None:
    """Three long prompts at once on two verifiers: two share one, and the second waits for the
    first's chunks (the oldest prefill is fed first). Its per-try timeout (1 s, patient) and its
    round timeout (0.8 s, chunked) run from each chunk's send, not from its queueing: no failover,
    where it used to move the session to the other verifier (a prefill started over there) with
    every chunk it waited for, or take its verifier out of the pool as hung (the routing
    benchmark's first turns: 8 system prompts of 1.5k tokens on two verifiers, 60 s timeouts)."""
    server = getattr(stack, gateway)
    prompts = [prompt_of(LONG, 100 + i + (10 if gateway == "chunked" else 0)) for i in range(3)]
    moved = server.metrics().get(("specmesh:failovers_total", (("role", "verifier"),)), 0.0)
    outs: dict[int, gateway_pb2.GenerateResponse] = {}

    def run(i: int) -> None:
        outs[i] = generate(server, request(prompts[i], 4))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for i, prompt in enumerate(prompts):
        assert list(outs[i].token_ids) == greedy(target, prompt, 4)
    now = server.metrics().get(("specmesh:failovers_total", (("role", "verifier"),)), 0.0)
    assert now == moved


@pytest.mark.parametrize("method", METHODS)
def test_every_method_from_a_cached_prefix_emits_what_it_emits_from_scratch(stack, target, method) -> None:
    spec = SPECS[method]
    prompt = prompt_of(120, METHODS.index(method) + 10)
    first = generate(stack.chunked, request(prompt, 16, spec))
    want = greedy(target, prompt, 16)
    assert list(first.token_ids) == want
    again = generate(stack.chunked, request(prompt, 16, spec))  # its KV was kept, and routed to
    assert list(again.token_ids) == want
    assert again.stats.cached_prompt_tokens >= len(prompt) - 16
    # the next turn of a conversation: everything the first held, then new tokens
    longer = [*prompt, *first.token_ids, *prompt_of(20, 99)]
    third = generate(stack.chunked, request(longer, 16, spec))
    assert list(third.token_ids) == greedy(target, longer, 16)
    assert third.stats.cached_prompt_tokens >= len(prompt) + 15


def test_api_keys_and_cache_salts_never_share_a_prefix(stack) -> None:
    prompt = prompt_of(100, 30)
    generate(stack.chunked, request(prompt, 4, TreeSpec("none")), key="ka")
    other_key = generate(stack.chunked, request(prompt, 4, TreeSpec("none")), key="kb")
    salted = generate(stack.chunked, request(prompt, 4, TreeSpec("none"), cache_salt="x"), key="ka")
    same = generate(stack.chunked, request(prompt, 4, TreeSpec("none")), key="ka")
    assert other_key.stats.cached_prompt_tokens == 0 and salted.stats.cached_prompt_tokens == 0
    assert same.stats.cached_prompt_tokens >= 96
    assert list(other_key.token_ids) == list(salted.token_ids) == list(same.token_ids)


def test_prompts_that_start_together_take_the_first_ones_prefill(stack, target) -> None:
    """Three requests with one long prompt at once: the oldest prefill is fed first, so the later
    two wait for its chunks and start from its live session (a conversation's shared system
    prompt, 4 users at once). When a prompt's first chunk went beside the ticks in flight as a
    session's start, all three prefilled it side by side (cached: a chunk or two each)."""
    prompt = prompt_of(LONG, 7)
    outs: dict[int, gateway_pb2.GenerateResponse] = {}

    def run(i: int) -> None:
        outs[i] = generate(stack.chunked, request(prompt, 4, TreeSpec("none"), cache_salt="together"))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]
    threads[0].start()
    time.sleep(0.2)  # its placement is in Redis: the others are routed to its verifier
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    cached = sorted(outs[i].stats.cached_prompt_tokens for i in range(3))
    assert cached[0] < CHUNK and cached[1] >= LONG - CHUNK, cached  # one prefilled it, the others took it
    for i in range(3):
        assert list(outs[i].token_ids) == greedy(target, prompt, 4)


def test_each_turn_of_a_conversation_goes_to_the_verifier_that_holds_its_history(stack) -> None:
    """Six conversations of three turns, each turn a new session: the gateway places it on the
    verifier whose kept prefix holds the turn before (without routing by prefix, the least loaded
    replica, ties broken by a hash of the session: half of them would miss)."""
    histories = [prompt_of(140, 80 + c) for c in range(6)]
    for turn in range(3):
        for c, history in enumerate(histories):
            out = generate(stack.chunked, request(history, 6, TreeSpec("none"), cache_salt="routing"))
            if turn:  # all it held of the turn before: the prompt and the answer but its last token
                assert out.stats.cached_prompt_tokens >= len(history) - 8 - 1, (turn, c)
            history += [*out.token_ids, *prompt_of(8, 90 + 10 * c + turn)]


def test_the_http_usage_says_the_cached_prompt_tokens(stack) -> None:
    body = {"model": "x", "prompt": " ".join(f"w{t - 4}" for t in prompt_of(90, 40)), "max_tokens": 3,
            "temperature": 0}  # fmt: skip
    headers = {"Authorization": "Bearer ka"}
    url = f"{stack.http(stack.chunked)}/v1/completions"
    body["model"] = requests.get(
        f"{stack.http(stack.chunked)}/v1/models", headers=headers, timeout=10
    ).json()["data"][0]["id"]
    first = requests.post(url, json=body, headers=headers, timeout=60).json()
    second = requests.post(url, json=body, headers=headers, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 80
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_replicas_and_gateways_say_their_queue_kv_use_and_prefix_hits(stack) -> None:
    """The gauges an endpoint picker scores by (waiting requests, KV cache usage) on the replicas
    and the gateway, and vLLM's prefix-cache counters on the replicas."""
    prompt = prompt_of(100, 70)
    for _ in range(2):  # the second starts from the first's kept prefix
        generate(stack.chunked, request(prompt, 4, TreeSpec("none")))
    wait_until(lambda: sum(v.metrics()[("specmesh:num_sessions", ())] for v in stack.verifiers) == 0)
    verifiers = [v.metrics() for v in stack.verifiers]
    usage = [m[("specmesh:kv_cache_usage_perc", ())] for m in verifiers]
    assert 0 < max(usage) < 1  # kept prefixes hold KV under the 8000-position budget
    generate(stack.chunked, request(prompt_of(20, 71), 2, TreeSpec("none")))  # a tick: the gateway hears
    gateway = stack.chunked.metrics()
    after = [v.metrics()[("specmesh:kv_cache_usage_perc", ())] for v in stack.verifiers]
    # the mean of what the verifiers' last tick results said: each as it was at its last tick (a
    # release since may have kept or dropped a prefix), so within a few sessions' positions
    assert gateway[("specmesh:kv_cache_usage_perc", ())] == pytest.approx(sum(after) / 2, abs=400 / 8000)
    assert gateway[("specmesh:num_requests_waiting", ())] == 0
    assert all(m[("specmesh:num_requests_waiting", ())] == 0 for m in verifiers)
    hits = sum(m[("specmesh:prefix_cache_hits_total", ())] for m in verifiers)
    queries = sum(m[("specmesh:prefix_cache_queries_total", ())] for m in verifiers)
    assert 0 < hits < queries


# ---- faults -------------------------------------------------------------------------------------


def test_a_client_that_leaves_mid_prefill_stops_its_chunks(stack) -> None:
    fed = total(stack.verifiers, "specmesh:prefill_tokens_total")
    with grpc.insecure_channel(stack.chunked.address) as channel:
        stub = gateway_grpc.GatewayStub(channel)
        call = stub.GenerateStream(
            request(prompt_of(LONG, 50), 4, TreeSpec("none")), metadata=[("authorization", "Bearer ka")]
        )
        time.sleep(0.5)  # about 4 of its 10 chunks
        call.cancel()
    for v in stack.verifiers:
        wait_until(lambda v=v: v.metrics()[("specmesh:num_sessions", ())] == 0, what="the session released")
    stopped = total(stack.verifiers, "specmesh:prefill_tokens_total") - fed
    time.sleep(0.6)
    assert total(stack.verifiers, "specmesh:prefill_tokens_total") - fed == stopped < LONG - CHUNK


def test_a_verifier_killed_mid_prefill_moves_the_session_and_the_stream_is_unchanged(stack, target) -> None:
    prompt = prompt_of(LONG, 60)
    got: dict = {}

    def run() -> None:
        got["out"] = generate(stack.chunked, request(prompt, 8, TreeSpec("none")))

    thread = threading.Thread(target=run)
    thread.start()
    with redis_client(stack.redis.url) as r:

        def placed() -> str | None:
            for key in r.scan_iter(match="specmesh:{*}:meta", count=1000):
                return r.hget(key, "verifier")
            return None

        wait_until(lambda: placed() is not None, what="the session placed")
        address = placed()
    time.sleep(0.4)  # a few chunks in
    victim = next(v for v in stack.verifiers if v.address == address)
    victim.kill()
    try:
        thread.join(timeout=60)
        assert list(got["out"].token_ids) == greedy(target, prompt, 8)
    finally:
        victim.start()
        victim.wait_serving()
