"""The gateway's OpenAI-compatible HTTP API end to end, driven by the official `openai` client: a real
Redis, a drafter, a verifier and the gateway as processes on tiny random models (tests.servers).

The reference for every answer is the gateway's own gRPC API with the same request: the HTTP API
is a translation of it, so text, tokens, usage and errors must agree.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

import grpc
import httpx2 as httpx  # the openai client's HTTP library
import openai
import pytest
import redis
import torch
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request
from transformers import AutoModelForCausalLM, AutoTokenizer

from gateway.http.serving import ClientGone, until_disconnect
from specmesh.rpc.proto import load
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, replica, session_keys, start_all, stop_all, wait_until
from tests.test_engine import PROMPT

pytestmark = pytest.mark.xdist_group("http")

gateway_pb2, gateway_grpc = load("gateway")

LIMIT = 200
WORDS = " ".join(f"w{t - 4}" for t in PROMPT)  # PROMPT as text in the tiny word-level tokenizer
KEY = "sk-test-key"


@dataclass
class Stack:
    redis: RedisServer
    replicas: list[Server]
    gateway: Server
    http_port: int
    model: str

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


def gateway_server(stack_args: list[str], log, http_port: int, *flags: str) -> Server:
    return Server("gateway", [*stack_args, "--http-port", str(http_port), *flags], log)


@pytest.fixture(scope="module")
def stack(models, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("http-stack")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", models["draft"], logs / "drafter.log")
        ngram = replica("drafter_service", models["target"], logs / "ngram.log", ["--backend", "ngram"])
        verifier = replica("verifier_service", models["target"], logs / "verifier.log")
        args = [
            *("--drafters", drafter.address, "--verifiers", verifier.address),
            *("--ngram-drafters", ngram.address),
            *("--redis-url", redis_server.url, "--max-new-tokens-limit", str(LIMIT)),
            *("--health-interval", "0.2", "--round-timeout", "30", "--served-model-name", "tiny"),
        ]
        http_port = free_port()
        gateway = gateway_server(args, logs / "gateway.log", http_port)
        try:
            start_all(drafter, ngram, verifier, gateway)
            yield Stack(redis_server, [drafter, verifier, ngram], gateway, http_port, "tiny")
        finally:
            stop_all(drafter, ngram, verifier, gateway)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def grpc_request(
    *, prompt: str | None = None, chat: list[dict] | None = None, max_tokens: int = 12, **sampling
) -> gateway_pb2.GenerateRequest:
    request = gateway_pb2.GenerateRequest(max_new_tokens=max_tokens)
    if chat is not None:
        for m in chat:
            request.chat.messages.add(**m)
    else:
        request.prompt = prompt
    request.sampling.temperature = sampling.get("temperature", 1.0)
    if "seed" in sampling:
        request.sampling.seed = sampling["seed"]
    return request


def assert_no_sessions(stack: Stack, raw_redis: redis.Redis) -> None:
    wait_until(lambda: not session_keys(raw_redis), what="the sessions' keys to go")
    for server in stack.replicas:
        wait_until(
            lambda s=server: s.metrics()[("specmesh:num_sessions", ())] == 0, what=f"{server.module} release"
        )


# ---- discovery ---------------------------------------------------------------------------------


def test_models_and_health(stack, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    health = httpx.get(f"{stack.base_url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    # one Date header, the current time (added per response: no timer refreshes it)
    dates = health.headers.get_list("date")
    assert len(dates) == 1 and abs(parsedate_to_datetime(dates[0]).timestamp() - time.time()) < 5, dates


# ---- equality with the gRPC API ----------------------------------------------------------------

# The seeded cases leave the shape to the gateway's default: its choices are reproducible
# (fixed start-up costs and the session's own acceptance, never the clock).
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.8, "seed": 11}}


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_completions_equal_grpc_generate_streamed_and_not(client, stub, sampling: str) -> None:
    params = SAMPLINGS[sampling]
    want = stub.Generate(grpc_request(prompt=WORDS, max_tokens=16, **params), timeout=60)
    whole = client.completions.create(model="tiny", prompt=WORDS, max_tokens=16, **params)
    assert whole.choices[0].text == want.text and whole.choices[0].finish_reason == want.finish_reason
    assert whole.usage.prompt_tokens == want.stats.prompt_tokens == len(PROMPT)
    assert whole.usage.completion_tokens == len(want.token_ids) and whole.usage.total_tokens == len(
        PROMPT
    ) + len(want.token_ids)
    assert whole.model_extra["stats"]["generated_tokens"] == len(want.token_ids)
    events = list(
        client.completions.create(
            model="tiny",
            prompt=WORDS,
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            **params,
        )
    )
    text_events, usage_event = events[:-1], events[-1]
    assert "".join(e.choices[0].text for e in text_events) == want.text
    assert [e.choices[0].finish_reason for e in text_events][-1] == want.finish_reason
    assert all(e.choices[0].finish_reason is None for e in text_events[:-1])
    assert usage_event.choices == [] and usage_event.usage.completion_tokens == len(want.token_ids)


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_completions_equal_grpc_generate_streamed_and_not(client, stub, sampling: str) -> None:
    params = SAMPLINGS[sampling]
    chat = [{"role": "w1", "content": WORDS}, {"role": "w2", "content": "w3 w4"}]
    want = stub.Generate(grpc_request(chat=chat, max_tokens=16, **params), timeout=60)
    whole = client.chat.completions.create(model="tiny", messages=chat, max_completion_tokens=16, **params)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content == want.text
    assert whole.usage.prompt_tokens == want.stats.prompt_tokens
    assert whole.usage.completion_tokens == len(want.token_ids)
    events = list(
        client.chat.completions.create(model="tiny", messages=chat, max_tokens=16, stream=True, **params)
    )
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events) == want.text
    assert events[-1].choices[0].finish_reason == want.finish_reason and events[-1].usage is None


REPEATING = " ".join(["w3 w9 w14 w2 w27 w5"] * 8)  # text an n-gram drafter can copy from


@pytest.mark.parametrize("prompt", [WORDS, REPEATING], ids=["fresh", "repeating"])
def test_a_seed_gives_the_same_text_every_time_whatever_the_load(client, stub, stack, prompt: str) -> None:
    """No speculation field, T = 0.8, a seed: three runs through gRPC and HTTP give one text, the
    third with eight other streams running beside it (the verifier batches them together). On text
    that repeats, every position has an n-gram match to weigh (the tiny model's sampled answer
    does not copy it, so its estimate keeps rides off: the greedy copy in test_gateway is where
    they ride); never a drafter call.

    The other streams have begun before it: a session's start in the same tick as a plain run cuts
    the run to one step (the tick loop's `_plain_steps`), so a start that lands on this request's
    run splits it into more calls, which may ride differently. The text stays the same (rides never
    change it); the counts of a run that starts beside other starts are a function of the timing,
    and so are every run's rides: the verifier sizes them per forward, by the forward's size and what
    its earlier verdicts taught it (specmesh.core.rides), so only the text is compared."""
    params = {"temperature": 0.8, "seed": 5}
    texts = []
    for run in range(3):
        load: list[threading.Thread] = []
        if run == 2:
            begun = [threading.Event() for _ in range(8)]

            def stream(i: int, begins: threading.Event) -> None:
                request = grpc_request(prompt=REPEATING, max_tokens=40, temperature=1.0, seed=i)
                for _ in stub.GenerateStream(request, timeout=60):
                    begins.set()

            load = [threading.Thread(target=stream, args=(i, begun[i])) for i in range(8)]
            for t in load:
                t.start()
            for event in begun:
                assert event.wait(timeout=30)
        response = stub.Generate(grpc_request(prompt=prompt, max_tokens=32, **params), timeout=60)
        texts.append(response.text)
        texts.append(
            client.completions.create(model="tiny", prompt=prompt, max_tokens=32, **params).choices[0].text
        )
        for t in load:
            t.join()
    assert len(set(texts)) == 1, texts
    assert response.stats.draft_calls == 0


def test_speculation_settings_and_stats_travel_in_extra_fields(client, stub) -> None:
    speculation = {"method": "rsd_s", "depth": 3, "beamWidth": 2}
    request = grpc_request(prompt=WORDS, max_tokens=20, temperature=0.0)
    request.speculation.method, request.speculation.depth, request.speculation.beam_width = "rsd_s", 3, 2
    want = stub.Generate(request, timeout=60)
    got = client.completions.create(
        model="tiny", prompt=WORDS, max_tokens=20, temperature=0, extra_body={"speculation": speculation}
    )
    stats = got.model_extra["stats"]
    assert got.choices[0].text == want.text
    assert stats["drafted_tokens"] == want.stats.drafted_tokens > 0
    assert stats["accepted_tokens"] == want.stats.accepted_tokens


def test_stop_strings_and_raw_sse_ends_with_done(stack, stub) -> None:
    full = stub.Generate(grpc_request(prompt=WORDS, max_tokens=12, temperature=0.0), timeout=60)
    stop = f" {full.text.split()[3]}"
    body = {
        "model": "tiny",
        "prompt": WORDS,
        "max_tokens": 12,
        "temperature": 0,
        "stop": stop,
        "stream": True,
    }
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    data = [line for line in lines[:-1] if line.startswith("data: ")]
    ids = [line.removeprefix("id: ") for line in lines if line.startswith("id: ")]
    events = [json.loads(line.removeprefix("data: ")) for line in data]
    # each event's id is "<session>:<tokens so far>", what a client sends as Last-Event-ID to resume
    session = events[0]["id"].removeprefix("cmpl-")
    assert len(ids) == len(events) and all(i.startswith(f"{session}:") for i in ids)
    assert "".join(e["choices"][0]["text"] for e in events) == "".join(f" {w}" for w in full.text.split()[:3])
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and "stats" in events[-1]


# ---- logprobs ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_target(models) -> tuple:
    """The target as transformers runs it, in fp32, and its tokenizer: the logprobs' reference."""
    model = AutoModelForCausalLM.from_pretrained(models["target"], dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(models["target"])


def reference_logprobs(model, prompt: list[int], generated: list[int], temperature: float) -> torch.Tensor:
    """[len(generated), V]: log-softmax of the target's logits / T before each generated token (T = 0:
    the raw log-softmax, the distribution greedy takes the argmax of)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + generated])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def check_logprobs(ref: torch.Tensor, ids: list[int], logprobs: list[float], tops: list[list[tuple]]) -> None:
    """tops: per token, its (token id, logprob) alternatives as the API listed them."""
    assert len(ids) == len(logprobs) == len(tops) == ref.shape[0] > 0
    for k, token in enumerate(ids):
        assert logprobs[k] == pytest.approx(float(ref[k, token]), abs=1e-4), k
        best = ref[k].topk(len(tops[k]))
        assert [t for t, _ in tops[k]] == best.indices.tolist(), k
        assert [v for _, v in tops[k]] == pytest.approx(best.values.tolist(), abs=1e-4), k


# (temperature, seed, speculation): greedy through draft trees, sampled through plain decoding
# (several tokens per Verify call) and through recursive rejection sampling
LOGPROB_CASES = {
    "greedy-chain": (0.0, None, {"method": "chain", "depth": 3}),
    "greedy-none": (0.0, None, {"method": "none"}),
    "t0.8-none": (0.8, 11, {"method": "none"}),
    "t0.8-rsd_c": (0.8, 11, {"method": "rsd_c", "depth": 2, "branching": [2, 2]}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("case", LOGPROB_CASES)
def test_chat_logprobs_are_the_targets_own_log_softmax(client, models, hf_target, case, stream) -> None:
    temperature, seed, speculation = LOGPROB_CASES[case]
    model, tokenizer = hf_target
    messages = [{"role": "user", "content": WORDS}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=10, temperature=temperature, logprobs=True,
                  top_logprobs=3, extra_body={"speculation": speculation})  # fmt: skip
    if seed is not None:
        kwargs["seed"] = seed
    if stream:
        chunks = list(client.chat.completions.create(**kwargs, stream=True))
        content = [
            e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, text = choice.logprobs.content, choice.message.content
    ids = tokenizer.convert_tokens_to_ids([e.token for e in content])
    assert tokenizer.decode(ids, skip_special_tokens=True).strip() == text.strip()
    assert all(e.bytes == list(e.token.encode()) for e in content)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if isinstance(prompt, Mapping) else prompt)
    ref = reference_logprobs(model, prompt, ids, temperature)
    tops = [[(tokenizer.convert_tokens_to_ids(t.token), t.logprob) for t in e.top_logprobs] for e in content]
    check_logprobs(ref, ids, [e.logprob for e in content], tops)
    if temperature == 0:
        assert ids == ref.argmax(-1).tolist()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_completion_logprobs_in_the_legacy_shape(client, hf_target, stream) -> None:
    model, tokenizer = hf_target
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=9, temperature=0.8, seed=5, logprobs=2,
                  extra_body={"speculation": {"method": "chain", "depth": 2}})  # fmt: skip
    if stream:
        parts = [c.choices[0].logprobs for c in client.completions.create(**kwargs, stream=True)]
        parts = [p for p in parts if p is not None]
        tokens = [t for p in parts for t in p.tokens]
        logprobs = [v for p in parts for v in p.token_logprobs]
        top = [d for p in parts for d in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        tokens, logprobs, top, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    ids = tokenizer.convert_tokens_to_ids(tokens)
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
    tops = [[(tokenizer.convert_tokens_to_ids(t), v) for t, v in d.items()] for d in top]
    check_logprobs(reference_logprobs(model, PROMPT, ids, 0.8), ids, logprobs, tops)


def test_grpc_logprobs_match_the_http_ones(client, stub) -> None:
    request = grpc_request(prompt=WORDS, max_tokens=8, temperature=0.8, seed=3)
    request.logprobs = 2
    got = stub.Generate(request, timeout=60)
    assert [e.token_id for e in got.logprobs] == list(got.token_ids)
    assert all(len(e.top) == 2 for e in got.logprobs)
    http = client.completions.create(
        model="tiny", prompt=WORDS, max_tokens=8, temperature=0.8, seed=3, logprobs=2
    )
    assert http.choices[0].logprobs.token_logprobs == pytest.approx([e.logprob for e in got.logprobs])
    plain = stub.Generate(grpc_request(prompt=WORDS, max_tokens=8, temperature=0.8, seed=3), timeout=60)
    assert list(plain.token_ids) == list(got.token_ids) and not plain.logprobs  # asking changes nothing


# ---- n choices -----------------------------------------------------------------------------------


def test_n_choices_are_distinct_seeded_sessions_with_usage_summed(client, stub, stack, raw_redis) -> None:
    speculation = {"method": "chain", "depth": 2}
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": WORDS}], max_tokens=10, temperature=0.8,
                  seed=21, n=3, logprobs=True, extra_body={"speculation": speculation})  # fmt: skip
    unary = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in unary.choices]
    assert [c.index for c in unary.choices] == [0, 1, 2] and len(set(texts)) == 3, texts
    # choice i is the request with seed 21 + i, alone
    for i, text in enumerate(texts):
        alone = client.chat.completions.create(**{**kwargs, "n": 1, "seed": 21 + i})
        assert alone.choices[0].message.content == text
        assert [e.logprob for e in alone.choices[0].logprobs.content] == pytest.approx(
            [e.logprob for e in unary.choices[i].logprobs.content]
        )
    completion = sum(c.model_extra["stats"]["generated_tokens"] for c in unary.choices)
    prompt = unary.choices[0].model_extra["stats"]["prompt_tokens"]
    assert unary.usage.completion_tokens == completion and unary.usage.prompt_tokens == prompt
    assert unary.usage.total_tokens == prompt + completion
    # streamed: the same three texts, each choice's chunks by its index, then the summed usage
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    by_index = [[c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in range(3)]
    streamed = ["".join(c.delta.content or "" for c in choice) for choice in by_index]
    assert streamed == texts
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == completion and not chunks[-1].choices
    assert_no_sessions(stack, raw_redis)


# ---- errors --------------------------------------------------------------------------------------

BASE = {"model": "tiny", "prompt": WORDS, "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "w1", "content": WORDS}], "max_tokens": 4}

# case -> (endpoint, body, status, param)
BAD: dict[str, tuple[str, dict, int, str | None]] = {
    "max-tokens-zero": ("completions", {**BASE, "max_tokens": 0}, 400, "max_tokens"),
    "max-tokens-negative": ("completions", {**BASE, "max_tokens": -5}, 400, "max_tokens"),
    "max-tokens-above-limit": ("completions", {**BASE, "max_tokens": LIMIT + 1}, 400, "max_tokens"),
    "max-tokens-huge": ("completions", {**BASE, "max_tokens": 2**40}, 400, "max_tokens"),
    "max-tokens-string": ("completions", {**BASE, "max_tokens": "8"}, 400, "max_tokens"),
    "max-completion-tokens-zero": ("chat", {**CHAT, "max_tokens": None, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens"),
    "max-tokens-disagree": ("chat", {**CHAT, "max_completion_tokens": 5}, 400, "max_completion_tokens"),
    "temperature-negative": ("completions", {**BASE, "temperature": -0.5}, 400, "temperature"),
    "temperature-string": ("completions", {**BASE, "temperature": "hot"}, 400, "temperature"),
    "top-p-zero": ("completions", {**BASE, "top_p": 0}, 400, "top_p"),
    "top-p-above-one": ("completions", {**BASE, "top_p": 1.5}, 400, "top_p"),
    "top-k-negative": ("completions", {**BASE, "top_k": -3}, 400, "top_k"),
    "seed-negative": ("completions", {**BASE, "seed": -1}, 400, "seed"),
    "n-17": ("completions", {**BASE, "n": 17}, 400, "n"),
    "n-zero": ("chat", {**CHAT, "n": 0}, 400, "n"),
    "stop-empty": ("completions", {**BASE, "stop": [""]}, 400, "stop[0]"),
    "stop-number": ("completions", {**BASE, "stop": 3}, 400, "stop"),
    "stop-too-many": ("completions", {**BASE, "stop": [f"w{i}" for i in range(17)]}, 400, "stop"),
    "stop-too-long": ("completions", {**BASE, "stop": "w1 " * 100}, 400, "stop[0]"),
    "prompt-too-large": ("completions", {**BASE, "prompt": "w1 " * 400_000}, 400, "prompt"),
    "prompt-beyond-context": ("completions", {**BASE, "prompt": "w1 " * 5000}, 400, "prompt"),
    "speculation-depth-3000": ("completions", {**BASE, "speculation": {"method": "mcsd", "depth": 3000,
                               "adaptive": True}}, 400, "speculation.depth"),
    "prompt-missing": ("completions", {"model": "tiny"}, 400, "prompt"),
    "prompt-empty": ("completions", {**BASE, "prompt": ""}, 400, "prompt"),
    "prompt-batch": ("completions", {**BASE, "prompt": ["w1", "w2"]}, 400, "prompt"),
    "prompt-token-outside-vocab": ("completions", {**BASE, "prompt": [5, 10**6]}, 400, "prompt"),
    "prompt-token-negative": ("completions", {**BASE, "prompt": [5, -1]}, 400, "prompt"),
    "prompt-token-above-uint32": ("completions", {**BASE, "prompt": [5, 2**33]}, 400, "prompt"),
    "messages-empty": ("chat", {**CHAT, "messages": []}, 400, "messages"),
    "message-without-role": ("chat", {**CHAT, "messages": [{"content": "w1"}]}, 400, "messages[0].role"),
    "message-image-part": ("chat", {**CHAT, "messages": [{"role": "w1", "content": [{"type": "image_url"}]}]},
                           400, "messages[0].content"),
    "model-unknown": ("completions", {**BASE, "model": "gpt-4"}, 404, "model"),
    "model-missing": ("completions", {"prompt": WORDS}, 400, "model"),
    "unknown-field": ("completions", {**BASE, "best_prompt": 1}, 400, "best_prompt"),
    "frequency-penalty": ("completions", {**BASE, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    "logprobs-21": ("completions", {**BASE, "logprobs": 21}, 400, "logprobs"),
    "logprobs-negative": ("completions", {**BASE, "logprobs": -1}, 400, "logprobs"),
    "logprobs-dsi": ("completions", {**BASE, "logprobs": 1, "speculation": {"dsi": True}}, 400, "logprobs"),
    "top-logprobs-21": ("chat", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "top-logprobs-alone": ("chat", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    "echo": ("completions", {**BASE, "echo": True}, 400, "echo"),
    "stream-options-without-stream": ("completions", {**BASE, "stream_options": {"include_usage": True}}, 400,
                                      "stream_options"),
    "speculation-method": ("completions", {**BASE, "speculation": {"method": "bogus"}}, 400,
                           "speculation.method"),
    "speculation-unknown-field": ("completions", {**BASE, "speculation": {"width": 2}}, 400, "speculation"),
    "speculation-depth-negative": ("completions", {**BASE, "speculation": {"depth": -1}}, 400, "speculation"),
    "speculation-parallel-without-dsi": ("completions", {**BASE, "speculation": {"parallel": 2}}, 400,
                                         "speculation.parallel"),
    # the plain tiny template teaches no tool-call syntax: "auto" (the default with tools) has no parser
    "tools-auto-without-parser": ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]
                                           }, 400, "tool_choice"),
}  # fmt: skip


# OpenAI's `code` of some of the cases above (the others: invalid_value)
CODES = {
    "max-tokens-string": "invalid_type", "temperature-string": "invalid_type", "stop-number": "invalid_type",
    "unknown-field": "unknown_parameter", "prompt-missing": "missing_required_parameter",
    "model-missing": "missing_required_parameter", "model-unknown": "model_not_found",
    "frequency-penalty": "unsupported_parameter", "echo": "unsupported_parameter",
    "message-without-role": "missing_required_parameter", "message-image-part": "invalid_type",
    "prompt-beyond-context": "context_length_exceeded", "tools-auto-without-parser": "unsupported_value",
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_parameters_are_400_naming_the_parameter(stack, raw_redis, case: str) -> None:
    endpoint, body, status, param = BAD[case]
    body = {k: v for k, v in body.items() if v is not None}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    response = httpx.post(f"{stack.base_url}{path}", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}:") or param == "model", error
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == CODES.get(case, "invalid_value"), error
    assert not session_keys(raw_redis)


def test_the_openai_client_raises_its_typed_errors(client) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt=WORDS, max_tokens=0)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=WORDS, max_tokens=2)


def test_invalid_json_is_400(stack) -> None:
    response = httpx.post(
        f"{stack.base_url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and response.json()["error"]["type"] == "invalid_request_error"
    assert response.json()["error"]["code"] == "invalid_json"


def test_unknown_routes_and_methods_answer_in_openais_error_shape(stack) -> None:
    missing = httpx.post(f"{stack.base_url}/v1/embeddings", json={"input": "x"})
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] == "Invalid URL (POST /v1/embeddings)" and error["code"] == "unknown_url"
    wrong = httpx.get(f"{stack.base_url}/v1/chat/completions")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert wrong.json()["error"]["message"].startswith("GET /v1/chat/completions: ")


# ---- disconnects ---------------------------------------------------------------------------------


def finished_requests(stack: Stack) -> float:
    """Requests the gateway ran to their end (any finish reason): a cancelled one is not counted."""
    return sum(
        v for (name, _), v in stack.gateway.metrics().items() if name == "specmesh:request_success_total"
    )


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_session_everywhere(stack, raw_redis, stream: bool) -> None:
    body = {"model": "tiny", "prompt": WORDS, "max_tokens": LIMIT, "temperature": 0, "stream": stream}
    body["speculation"] = {"method": "rsd_c"}  # tree drafts: the slowest rounds, many of them
    started = time.monotonic()
    httpx.post(f"{stack.base_url}/v1/completions", json={**body, "stream": False}, timeout=60)
    uncancelled = time.monotonic() - started  # how long the whole generation takes here, now
    finished = finished_requests(stack)
    with httpx.Client(timeout=60) as http:
        if stream:
            with http.stream("POST", f"{stack.base_url}/v1/completions", json=body) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                session = json.loads(first.removeprefix("data: "))["id"].removeprefix("cmpl-")
                assert raw_redis.exists(f"specmesh:{{{session}}}:meta")
        else:
            with pytest.raises(httpx.ReadTimeout):
                http.post(f"{stack.base_url}/v1/completions", json=body, timeout=uncancelled / 4)
    assert_no_sessions(stack, raw_redis)
    time.sleep(uncancelled)  # an uncancelled generation would have finished by now
    assert finished_requests(stack) == finished  # it was cut short, not run to its end


def test_a_disconnect_waits_for_the_work_to_unwind_before_saying_client_gone() -> None:
    """The work's cleanup may await (a session ending everywhere): `until_disconnect` used to look
    at the cancelled work one loop turn later and, finding it still unwinding, answer a 500 for
    InvalidStateError instead of the client's disconnect."""
    unwound: list[bool] = []

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def work() -> str:
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(0.05)  # cleanup that takes a few turns of the loop
            unwound.append(True)
        return "never"

    async def main() -> None:
        request = Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive)
        with pytest.raises(ClientGone):
            await until_disconnect(request, work())
        assert unwound == [True]  # the session's end had run before the answer

    asyncio.run(main())


# ---- metrics -------------------------------------------------------------------------------------


def test_metrics_show_latency_histograms_and_spec_decode_counters(stack, client, models) -> None:
    # a fixed shape: the default may decode plainly on these tiny models (its choice follows the
    # replicas' start-up costs), and the draft counters must move; 40 tokens, so that the tiny
    # noisy draft surely has some accepted
    speculation = {"speculation": {"method": "chain", "depth": 3}}
    client.completions.create(
        model="tiny", prompt=WORDS, max_tokens=40, temperature=0, extra_body=speculation
    )
    text = httpx.get(f"{stack.base_url}/metrics", timeout=10).text
    scraped = [s for family in text_string_to_metric_families(text) for s in family.samples]
    # one namespace, the served model's name on every sample (the HTTP API's), no _created series
    assert all(s.name.startswith("specmesh:") and s.labels["model_name"] == "tiny" for s in scraped)
    assert not [s.name for s in scraped if s.name.endswith("_created")]
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for s in scraped
    }
    for name in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
    ):
        assert samples[(f"specmesh:{name}_count", ())] > 0, name
    for name in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "generation_tokens"):
        assert samples[(f"specmesh:{name}_total", ())] > 0, name
    assert samples[("specmesh:num_requests_running", ())] == 0
    assert samples[("specmesh:num_requests_waiting", ())] == 0
    # --prefill-chunk auto, from each role's start-up measurement, within its bounds
    for role in ("drafter", "verifier"):
        assert 64 <= samples[("specmesh:prefill_chunk_tokens", (("role", role),))] <= 2048
    assert samples[("specmesh:rpc_requests_total", (("code", "OK"), ("method", "POST /v1/completions")))] > 0
    # a replica's: the same namespace, its model id (InfoResponse.model_id) as model_name
    verifier = stack.replicas[1]
    replica_samples = verifier.samples()
    assert all(s.name.startswith("specmesh:") for s in replica_samples)
    assert {s.labels["model_name"] for s in replica_samples} == {str(models["target"])}
    assert not [s.name for s in replica_samples if s.name.endswith("_created")]
    held = verifier.metrics()
    assert held[("specmesh:verifier_spec_decode_num_draft_tokens_total", ())] > 0
    assert held[("specmesh:num_preemptions_total", ())] == 0  # no cache budget: nothing evicted
    assert held[("specmesh:kv_cache_usage_perc", ())] == 0.0  # no budget to use up
    assert ("specmesh:kv_cache_tokens", ()) in held


# ---- API keys, admission, not ready --------------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(stack, tmp_path_factory) -> Iterator[Server]:
    """A second gateway on the same replicas, with API keys and room for one request at a time."""
    replicas = stack.replicas
    args = [
        *(
            "--drafters",
            replicas[0].address,
            "--verifiers",
            replicas[1].address,
            "--redis-url",
            stack.redis.url,
        ),
        *("--api-keys", f"other,{KEY}", "--max-concurrent-requests", "1", "--served-model-name", "tiny"),
    ]
    server = gateway_server(args, tmp_path_factory.mktemp("guarded") / "gateway.log", free_port())
    start_all(server)
    yield server
    stop_all(server)


def guarded_url(server: Server) -> str:
    return f"http://127.0.0.1:{server.args[server.args.index('--http-port') + 1]}"


def test_api_keys_are_required_on_http_and_grpc(guarded) -> None:
    url = f"{guarded_url(guarded)}/v1/completions"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        response = httpx.post(url, json=BASE, headers=headers, timeout=30)
        assert response.status_code == 401, response.text
        assert response.json()["error"]["type"] == "authentication_error"
    assert (
        httpx.post(url, json=BASE, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    )
    request = grpc_request(prompt=WORDS, max_tokens=3)
    with grpc.insecure_channel(guarded.address) as channel:
        stub = gateway_grpc.GatewayStub(channel)
        with pytest.raises(grpc.RpcError) as keyless:
            stub.Generate(request, timeout=30)
        assert keyless.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert stub.Generate(request, timeout=30, metadata=[("authorization", f"Bearer {KEY}")]).token_ids


def test_past_the_concurrency_limit_a_request_is_refused_at_once_with_429(guarded) -> None:
    client = openai.OpenAI(base_url=f"{guarded_url(guarded)}/v1", api_key=KEY, max_retries=0, timeout=60)
    body = {"model": "tiny", "prompt": WORDS, "max_tokens": LIMIT, "temperature": 0}
    running = client.completions.create(**body, stream=True, extra_body={"speculation": {"method": "rsd_c"}})
    first = next(iter(running))
    start = time.monotonic()
    with pytest.raises(openai.RateLimitError) as refused:
        client.completions.create(**body)
    assert time.monotonic() - start < 2.0
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["type"] == "rate_limit_error"
    running.close()
    assert first.choices[0].text


def test_sixty_four_at_once_with_room_for_eight_serves_eight_and_refuses_the_rest_up_front(
    stack, tmp_path_factory, raw_redis
) -> None:
    """Issue 14, finding 4: past 100 streams the Redis pool raised mid-stream; 256 unary calls got 77
    UNAVAILABLE. With --max-concurrent-requests 8, 64 simultaneous streams: 8 complete, 56 are
    refused before their first chunk with RESOURCE_EXHAUSTED, none fails mid-stream."""
    replicas = stack.replicas
    args = ["--drafters", replicas[0].address, "--verifiers", replicas[1].address]
    args += ["--redis-url", stack.redis.url, "--max-concurrent-requests", "8"]
    server = gateway_server(args, tmp_path_factory.mktemp("capped") / "gateway.log", free_port())
    start_all(server)
    request = grpc_request(prompt=WORDS, max_tokens=LIMIT, temperature=0.0)

    async def one(stub) -> tuple[str, int, float]:
        """-> (final code, chunks received, seconds until the answer or the first chunk)"""
        chunks, start, first = 0, time.monotonic(), None
        try:
            async for _ in stub.GenerateStream(request, timeout=120):
                chunks += 1
                first = first or time.monotonic() - start
        except grpc.aio.AioRpcError as exc:
            return exc.code().name, chunks, first or time.monotonic() - start
        return "OK", chunks, first or 0.0

    async def all_at_once() -> list[tuple[str, int, float]]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = gateway_grpc.GatewayStub(channel)
            return await asyncio.gather(*(one(stub) for _ in range(64)))

    try:
        results = asyncio.run(all_at_once())
    finally:
        stop_all(server)
    served = [r for r in results if r[0] == "OK"]
    refused = [r for r in results if r[0] == "RESOURCE_EXHAUSTED"]
    assert (len(served), len(refused)) == (8, 56), sorted({r[0] for r in results})
    assert all(chunks == 0 and seconds < 2.0 for _, chunks, seconds in refused)  # up front, at once
    assert all(chunks > 0 for _, chunks, _ in served)
    assert not session_keys(raw_redis)


def test_not_ready_is_503(stack, tmp_path_factory) -> None:
    """A gateway whose verifier never answers: /health and generations are 503."""
    dead = f"127.0.0.1:{free_port()}"
    args = ["--verifiers", dead, "--redis-url", stack.redis.url]
    http_port = free_port()
    server = gateway_server(args, tmp_path_factory.mktemp("dead") / "gateway.log", http_port)
    server.start()
    try:
        url = f"http://127.0.0.1:{http_port}"
        wait_until(lambda: _answers(f"{url}/health"), timeout=30, what="the HTTP port")
        assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        response = httpx.post(f"{url}/v1/completions", json=BASE, timeout=10)
        assert response.status_code == 503 and "not ready" in response.json()["error"]["message"]
    finally:
        server.stop()


def _answers(url: str) -> bool:
    try:
        httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return False
    return True


# ---- load ----------------------------------------------------------------------------------------


def test_eight_concurrent_streams_all_complete_and_match(stack, client, stub, raw_redis) -> None:
    """A short form of the load check (specmesh bench http runs it for a minute)."""
    want = stub.Generate(grpc_request(prompt=WORDS, max_tokens=24, temperature=0.0), timeout=60).text
    results: list[str] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            events = client.completions.create(
                model="tiny", prompt=WORDS, max_tokens=24, temperature=0, stream=True
            )
            results.append("".join(e.choices[0].text for e in events))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [] and results == [want] * 8
    assert_no_sessions(stack, raw_redis)
