"""Structured output end to end (issue 26): `response_format` and `constraint` through a real stack
(Redis, a drafter, an n-gram drafter, a verifier, the gateway) on a tiny random pair whose
tokenizer has one token per byte, so that any JSON can be spelt.

The distribution under a grammar is proven lossless in tests/test_lossless.py (chi-square, with
the wrong variants caught); here the whole path must (1) keep every output inside the grammar,
whatever the method, and (2) at temperature 0 equal the target's own constrained greedy decode,
computed in the test with transformers and llguidance directly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import httpx2 as httpx
import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.bench.tiny import save_tiny_pair
from specmesh.bench.tools import stream_chat
from specmesh.rpc.proto import load
from specmesh.stack.ports import free_port
from specmesh.stack.redis_server import RedisServer
from tests.servers import Server, gateway_stub, replica, start_all, stop_all

pytestmark = pytest.mark.xdist_group("structured")
gateway_pb2, _ = load("gateway")

# Bounded on purpose: a random model under a grammar stops only where the grammar makes it
# (llguidance's JSON allows whitespace between tokens unless told otherwise; a random model
# would take it forever).
SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["color", "ok", "n"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
MESSAGES = [{"role": "user", "content": "Give me a color as JSON."}]
SPECS = {
    "none": {"method": "none"},
    "chain": {"method": "chain", "depth": 3},
    "rsd_c": {"method": "rsd_c", "depth": 2, "branching": [2, 2]},
    "rsd_s": {"method": "rsd_s", "depth": 3, "beamWidth": 2},
    "ngram": {"method": "ngram", "depth": 3},
}


@dataclass
class Stack:
    gateway: Server
    http_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory) -> dict:
    return save_tiny_pair(tmp_path_factory.mktemp("byte-models"), byte_level=True)


@pytest.fixture(scope="module")
def stack(byte_models, tmp_path_factory) -> Iterator[Stack]:
    logs = tmp_path_factory.mktemp("structured-stack")
    with RedisServer() as redis_server:
        drafter = replica("drafter_service", byte_models["draft"], logs / "drafter.log")
        ngram = replica("drafter_service", byte_models["target"], logs / "ngram.log", ["--backend", "ngram"])
        verifier = replica("verifier_service", byte_models["target"], logs / "verifier.log")
        http_port = free_port()
        args = [
            *("--drafters", drafter.address, "--verifiers", verifier.address),
            *("--ngram-drafters", ngram.address, "--redis-url", redis_server.url),
            *("--served-model-name", "tiny", "--http-port", str(http_port)),
        ]  # fmt: skip
        gateway = Server("gateway", args, logs / "gateway.log")
        try:
            start_all(drafter, ngram, verifier, gateway)
            yield Stack(gateway, http_port)
        finally:
            stop_all(drafter, ngram, verifier, gateway)


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_json_schema_output_validates_20_of_20(client) -> None:
    """Seeded T = 0.8 through every drafting method: each output parses and fits the schema."""
    finishes = []
    for i in range(20):
        spec = list(SPECS.values())[i % len(SPECS)]
        response = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=80, temperature=0.8, seed=i,
            response_format=json_schema_format(SCHEMA), extra_body={"speculation": spec},
        )  # fmt: skip
        choice = response.choices[0]
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        finishes.append(choice.finish_reason)
    assert finishes == ["stop"] * 20  # each ended on the end-of-sequence token the grammar left


def test_json_object_streamed_is_one_object(client) -> None:
    chunks = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0.8, seed=3, stream=True,
        response_format={"type": "json_object"}, extra_body={"speculation": SPECS["chain"]},
    )  # fmt: skip
    pieces = [c.choices[0] for c in chunks if c.choices]
    text = "".join(p.delta.content or "" for p in pieces)
    if pieces[-1].finish_reason == "stop":  # a random model may fill 200 tokens inside a string
        assert isinstance(json.loads(text), dict)
    else:
        assert text.lstrip().startswith("{")


def constrained_greedy(
    next_logits: Callable[[list[int]], torch.Tensor], tokenizer, grammar: str, eos: int, n: int
) -> list[int]:
    """A target's own greedy decode under the grammar, with llguidance's mask: up to n tokens.
    next_logits(new tokens) -> [V] the logits after the prompt ([] asks for those) and the tokens
    so far, each token passed once."""
    logits = next_logits([])
    vocab = logits.shape[-1]
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar)
    out: list[int] = []
    while len(out) < n:
        bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:vocab]
        token = int(logits.masked_fill(torch.from_numpy(~bits.astype(bool)), -math.inf).argmax())
        out.append(token)
        assert matcher.consume_token(token)
        if token == eos:
            break
        logits = next_logits([token])
    return out


def transformers_logits(model_dir, prompt: list[int]) -> Callable[[list[int]], torch.Tensor]:
    """next_logits for constrained_greedy: transformers in fp32, the whole sequence each time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    seen = list(prompt)

    def next_logits(new: list[int]) -> torch.Tensor:
        seen.extend(new)
        with torch.no_grad():
            return model(torch.tensor([seen])).logits[0, -1]

    return next_logits


@pytest.mark.parametrize("method", list(SPECS))
def test_greedy_under_a_regex_equals_the_targets_constrained_greedy(stack, byte_models, method) -> None:
    regex = r"[a-f]{3}-[0-9]{2,5}( [a-f]+){1,3}"
    request = gateway_pb2.GenerateRequest(prompt="id: ", max_new_tokens=40)
    request.constraint.regex = regex
    request.speculation.method = SPECS[method]["method"]
    request.speculation.depth = SPECS[method].get("depth", 0)
    with gateway_stub(stack.gateway.address) as stub:
        got = stub.Generate(request, timeout=60)
    tokenizer = AutoTokenizer.from_pretrained(byte_models["target"])
    prompt = tokenizer("id: ")["input_ids"]
    grammar = llguidance.LLMatcher.grammar_from_regex(regex)
    next_logits = transformers_logits(byte_models["target"], prompt)
    want = constrained_greedy(next_logits, tokenizer, grammar, tokenizer.eos_token_id, 40)
    assert list(got.token_ids) == want
    if got.finish_reason == "stop":
        assert re.fullmatch(regex, got.text), got.text


def test_logprobs_under_a_grammar_are_of_the_masked_distribution(client) -> None:
    """A constrained token's alternatives are all allowed: the first token of an object is `{`."""
    response = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, temperature=0.8, seed=1, logprobs=True, top_logprobs=5,
        response_format=json_schema_format(SCHEMA),
    )  # fmt: skip
    first = response.choices[0].logprobs.content[0]
    assert first.token == "{" and first.logprob == pytest.approx(0.0, abs=1e-6)
    assert [t.token for t in first.top_logprobs] == ["{"]  # nothing else has probability


BAD = {
    "schema-not-a-schema": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}},
                            "response_format.json_schema.schema"),
    "json-schema-missing": ({"type": "json_schema"}, "response_format.json_schema"),
    "type-unknown": ({"type": "xml"}, "response_format.type"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_bad_response_format_is_400_naming_it(stack, case) -> None:
    fmt, param = BAD[case]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, "response_format": fmt}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_bad_regex_over_grpc_is_invalid_argument(stack) -> None:
    request = gateway_pb2.GenerateRequest(prompt="id: ", max_new_tokens=4)
    request.constraint.regex = "[a-"
    with gateway_stub(stack.gateway.address) as stub, pytest.raises(grpc.RpcError) as error:
        stub.Generate(request, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith("constraint.regex:"), error.value.details()


# ---- tools -------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"],
                       "additionalProperties": False},
    },
}  # fmt: skip
TOOLS = {t["function"]["name"]: t for t in (WEATHER, TIME)}


def check_call(call) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    parameters = TOOLS[call.function.name]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), parameters)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_named_tool_choice_is_answered_with_a_valid_call(client, stream) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=120, temperature=0.8, tools=[WEATHER, TIME],
                  tool_choice=choice, extra_body={"speculation": SPECS["chain"]})  # fmt: skip
    for seed in range(4):
        if stream:
            chunks = [
                c for c in client.chat.completions.create(**kwargs, seed=seed, stream=True) if c.choices
            ]
            deltas = [c.choices[0].delta for c in chunks]
            assert all(not d.content for d in deltas)  # a forced call sends no content
            calls = [t for d in deltas for t in d.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        else:
            answer = client.chat.completions.create(**kwargs, seed=seed).choices[0]
            assert answer.message.content is None
            calls, finish = answer.message.tool_calls, answer.finish_reason
        assert finish == "tool_calls" and len(calls) == 1
        assert calls[0].function.name == "get_weather"
        check_call(calls[0])


def test_required_calls_one_of_the_tools_and_the_call_can_be_answered(client) -> None:
    names = set()
    for seed in range(6):
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
            tools=[WEATHER, TIME], tool_choice="required",
        ).choices[0]  # fmt: skip
        assert answer.finish_reason == "tool_calls"
        check_call(answer.message.tool_calls[0])
        names.add(answer.message.tool_calls[0].function.name)
    call = answer.message.tool_calls[0]
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = client.chat.completions.create(
        model="tiny",
        messages=follow_up,
        max_tokens=4,
        temperature=0,
        tools=[WEATHER, TIME],
        tool_choice="none",
    )
    assert again.choices[0].message.content is not None and not again.choices[0].message.tool_calls
    assert names <= set(TOOLS)


# tool_choice "auto" (the default with tools): the byte pair's template teaches Hermes-style calls,
# so the gateway parses them. A random model writes no call by itself: a regex makes it write one
# (or a broken one), through the same path a real model's text takes.
CALL = (
    r'<tool_call>\n\{"name":"get_weather","arguments":\{"city":"(Paris|Oslo)","days":[1-7]\}\}\n</tool_call>'
)
TIME_CALL = r'<tool_call>\n\{"name":"get_time","arguments":\{"utc":(true|false)\}\}\n</tool_call>'
HI = [{"role": "user", "content": "hi"}]  # the byte pair's context is 256 tokens
# The two calls' text is 158-160 bytes by the draws (Paris or Oslo, true or false), then the
# end-of-sequence token: 164 fits every draw, and the 91-token prompt with it fits the context.
AUTO = dict(model="tiny", messages=HI, max_tokens=164, temperature=0.9, tools=[WEATHER, TIME])


def auto_answer(client, regex: str, seed: int, stream: bool, **more) -> tuple[str | None, list, str]:
    """(content, [(name, arguments as a dict)], finish_reason), whole or accumulated from a stream
    as the openai client's users do (deltas merged by tool call index)."""
    kwargs = {**AUTO, "seed": seed, "extra_body": {"constraint": {"regex": regex}}, **more}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]
        for c in choice.message.tool_calls or []:
            check_call(c)
        return choice.message.content, calls, choice.finish_reason
    content, parts, finish = stream_chat(client, kwargs)
    assert all(p["id"].startswith("call_") for p in parts)
    calls = [(p["name"], json.loads(p["arguments"])) for p in parts]
    return content or None, calls, finish


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_auto_reads_the_models_calls_whole_or_streamed_alike(client, stream) -> None:
    regex = rf"Ok\.\n{CALL}\n{TIME_CALL}"
    for seed in range(3):
        content, calls, finish = auto_answer(client, regex, seed, stream)
        assert (content, finish) == ("Ok.", "tool_calls")
        assert [name for name, _ in calls] == ["get_weather", "get_time"]
        assert (content, calls, finish) == auto_answer(client, regex, seed, not stream)
        one = auto_answer(client, regex, seed, stream, parallel_tool_calls=False)
        assert one == (content, calls[:1], finish)


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_auto_keeps_a_broken_call_as_text(client, stream) -> None:
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \[(1|2)\]\}\n</tool_call>'
    content, calls, finish = auto_answer(client, regex, 0, stream)
    assert calls == [] and finish == "stop"
    assert re.fullmatch(regex, content), content


def test_greedy_with_tools_auto_is_the_targets_own_greedy(stack, byte_models) -> None:
    """Parsing only reads the text: the tokens are the target's greedy decode of the prompt the
    template writes with the tools."""
    tokenizer = AutoTokenizer.from_pretrained(byte_models["target"])
    prompt = tokenizer.apply_chat_template(
        HI, tools=[WEATHER, TIME], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    next_logits = transformers_logits(byte_models["target"], list(prompt))
    want, logits = [], next_logits([])
    for _ in range(24):
        want.append(int(logits.argmax()))
        logits = next_logits(want[-1:])
    body = {**AUTO, "temperature": 0, "max_tokens": 24, "logprobs": True}
    for spec in ("none", "chain", "rsd_s"):
        body["speculation"] = SPECS[spec]
        response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=60).json()
        tokens = [t["token"] for t in response["choices"][0]["logprobs"]["content"]]
        assert tokens == [tokenizer.decode([w]) for w in want], spec
        assert response["choices"][0]["message"]["content"] == tokenizer.decode(want), spec


def test_auto_answers_can_be_followed_by_tool_messages(client) -> None:
    answer = client.chat.completions.create(
        **{**AUTO, "seed": 1, "extra_body": {"constraint": {"regex": CALL}}}
    )
    call = answer.choices[0].message.tool_calls[0]
    follow_up = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    again = client.chat.completions.create(**{**AUTO, "messages": follow_up, "max_tokens": 8, "seed": 2})
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


BROKEN_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": "{utc"}}]}  # fmt: skip
BAD_TOOLS = {
    "unknown-function": ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                         "tool_choice.function.name"),
    "choice-without-tools": ({"tool_choice": "required"}, "tool_choice"),
    "duplicate-names": ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    "bad-parameters": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
                        "tool_choice": "required"}, "tools"),
    "tool-without-name": ({"tools": [{"type": "function", "function": {"parameters": {}}}]},
                          "tools[0].function.name"),
    "tool-message-without-call-id": ({"messages": [*MESSAGES, {"role": "tool", "content": "sunny"}]},
                                     "messages[1].tool_call_id"),
    "call-arguments-not-json": ({"messages": [*MESSAGES, BROKEN_CALL]},
                                "messages[1].tool_calls[0].function.arguments"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_TOOLS)
def test_bad_tools_are_400_naming_the_field(stack, case) -> None:
    extra, param = BAD_TOOLS[case]
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(f"{stack.base_url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
