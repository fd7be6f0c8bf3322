"""Tool calls read out of a model's text (gateway/http/tools.py): what is a call, what stays text,
and the same answer whole or fed in any pieces (the stream)."""

from __future__ import annotations

import json
import random

import pytest

from gateway.http.protocol import ChatBody
from gateway.http.tools import (
    Call,
    CallReader,
    Content,
    HermesParser,
    ToolUse,
    parser_for_template,
    read_all,
    tool_plan,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}},
]


def plan(parallel: bool | None = None):
    body = ChatBody.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
         **({} if parallel is None else {"parallel_tool_calls": parallel})}
    )  # fmt: skip
    return tool_plan(body, "hermes")


def block(name: str, arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


WEATHER = block("get_weather", {"city": "Paris", "unit": "celsius"})
SEARCH = block("search", {"query": "a <tool_call> inside a string"})

BAD_JSON = "<tool_call>\n{not json}\n</tool_call>"
DEEP = "<tool_call>" + "[" * 5000 + "</tool_call>"
FENCED = '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```'
NOT_A_CALL = 'Here:\n```json\n{"name": "Ada", "age": 36}\n```\n'
PYTHON = "```python\ndef f():\n    return 1\n```"
CASES = {
    "plain text": ("Hello  world,\n  nothing to call.\n", "Hello  world,\n  nothing to call.\n", []),
    "one call": (WEATHER, None, ["get_weather"]),
    "text then a call": ("Let me look.\n" + WEATHER + "\n", "Let me look.", ["get_weather"]),
    "two calls": (WEATHER + "\n" + SEARCH, None, ["get_weather", "search"]),
    "bad json stays text": (BAD_JSON, BAD_JSON, []),
    "unknown function stays text": (block("launch", {}), block("launch", {}), []),
    "arguments not an object": (block("search", [1]), block("search", [1]), []),
    "unclosed call stays text": (WEATHER[:-5], WEATHER[:-5], []),
    "a tag's start at the end": ("see <tool_c", "see <tool_c", []),
    "a good call beside a bad one": (WEATHER + "\n<tool_call>{}</tool_call>", "<tool_call>{}</tool_call>",
                                     ["get_weather"]),
    "text on both sides of a call": ("see " + WEATHER + " below", "see below", ["get_weather"]),
    "a name that is not a string": ('<tool_call>{"name": ["f"], "arguments": {}}</tool_call>',
                                    '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>', []),
    "nested deeper than json reads": (DEEP, DEEP, []),
    # Qwen2.5-Coder writes its calls in a json fence rather than the tags its template asks for
    "a call in a json fence": (FENCED, None, ["get_weather"]),
    "a json fence that is no call": (NOT_A_CALL, NOT_A_CALL, []),
    "a python fence": (PYTHON, PYTHON, []),
}  # fmt: skip


@pytest.mark.parametrize("case", CASES)
def test_a_whole_answer(case) -> None:
    text, content, names = CASES[case]
    got_content, calls = read_all(plan(), text)
    assert got_content == content
    assert [c.name for c in calls] == names
    for call in calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_arguments_are_the_models_json_re_written() -> None:
    (call,) = read_all(plan(), SEARCH)[1]
    assert json.loads(call.arguments) == {"query": "a <tool_call> inside a string"}
    openai = call.openai()
    assert openai["type"] == "function" and openai["id"].startswith("call_")
    assert openai["function"] == {"name": "search", "arguments": call.arguments}


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    assert [c.name for c in read_all(plan(parallel=False), WEATHER + SEARCH)[1]] == ["get_weather"]
    assert [c.name for c in read_all(plan(parallel=True), WEATHER + SEARCH)[1]] == ["get_weather", "search"]


def streamed(text: str, cuts: list[int], parallel: bool | None = None) -> tuple[str, list[Call], list]:
    reader = CallReader(plan(parallel))
    events, at = [], 0
    for cut in [*cuts, len(text)]:
        events += reader.feed(text[at:cut])
        at = cut
    events += reader.close()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [e for e in events if isinstance(e, Call)], events


@pytest.mark.parametrize("case", CASES)
def test_any_pieces_give_the_whole_answer(case) -> None:
    """The stream feeds a round's text at a time: cut anywhere, tags included, it is the same."""
    text = CASES[case][0]
    want_content, want_calls = read_all(plan(), text)
    rng = random.Random(hash(case) % 1000)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
        content, calls, _ = streamed(text, cuts)
        assert ((content or None) if calls else content) == want_content
        assert calls == want_calls
    one_by_one = streamed(text, list(range(1, len(text))))
    assert one_by_one[1] == want_calls


def test_content_goes_out_before_the_call_is_decided() -> None:
    """Text is given out as it comes; only what may still become a call is held."""
    reader = CallReader(plan())
    assert reader.feed("Let me") == [Content("Let me")] and reader.idle
    assert reader.feed(" look. <tool") == [Content(" look.")] and not reader.idle
    assert reader.feed("_call>\n{") == [] and not reader.idle
    assert reader.feed('"name": "search", "arguments": {}}\n</tool_call>') == [Call("search", "{}")]
    assert reader.close() == [] and reader.idle


def test_the_parser_is_chosen_by_the_chat_template() -> None:
    assert parser_for_template("... <tool_call>{...}</tool_call> ...") == "hermes"
    assert parser_for_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert parser_for_template(None) is None
    assert HermesParser.matches("<tool_call></tool_call>")


def test_tool_choice_decides_the_use() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    use = {}
    for choice in (None, "auto", "none", "required", {"type": "function", "function": {"name": "search"}}):
        body = ChatBody.model_validate({**base, **({} if choice is None else {"tool_choice": choice})})
        use[json.dumps(choice)] = tool_plan(body, "hermes").use
    assert list(use.values()) == [ToolUse.AUTO, ToolUse.AUTO, ToolUse.TEXT, ToolUse.FORCED, ToolUse.FORCED]
    no_tools = ChatBody.model_validate({"model": "m", "messages": base["messages"]})
    assert tool_plan(no_tools, "hermes").use is ToolUse.TEXT


def chunks(*pieces: str):
    """GenerateChunks of these texts, the last one finished."""
    from gateway.api import gateway_pb2

    return [
        gateway_pb2.GenerateChunk(
            text=p, token_ids=[1], session_id="s", finish_reason="stop" if k == len(pieces) - 1 else ""
        )
        for k, p in enumerate(pieces)
    ]


def test_a_streamed_answer_in_openais_shape_with_resume_points_only_before_its_calls() -> None:
    from gateway.http.serving import ResponseShape

    shape = ResponseShape(True, "s", "m", tools=plan())
    pieces = ("Let me", " look.\n<tool", "_call>\n" + WEATHER[len("<tool_call>\n") :], "\n" + SEARCH, "\n")
    events, resumable = [], []
    for k, chunk in enumerate(chunks(*pieces)):
        out, given_out = shape.chunk(0, chunk, first=k == 0)
        events += out
        resumable.append(given_out)
    assert resumable == [True, False, False, False, False]  # held text, then calls: no resume point
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content") or "" for d in deltas) == "Let me look."
    calls: dict[int, dict] = {}
    for d in deltas:  # merged by index, as the openai client does
        for t in d.get("tool_calls", []):
            call = calls.setdefault(t["index"], {"id": "", "name": "", "arguments": ""})
            call["id"] += t.get("id", "")
            call["name"] += t.get("function", {}).get("name", "")
            call["arguments"] += t.get("function", {}).get("arguments", "")
    assert [c["name"] for c in calls.values()] == ["get_weather", "search"]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [
        {"city": "Paris", "unit": "celsius"},
        {"query": "a <tool_call> inside a string"},
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    finishes = [e["choices"][0]["finish_reason"] for e in events]
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])


def test_a_forced_call_has_no_resume_point_before_it_is_whole() -> None:
    from gateway.http.serving import ResponseShape
    from gateway.http.tools import ToolPlan

    shape = ResponseShape(True, "s", "m", tools=ToolPlan(ToolUse.FORCED, plan().tools))
    resumable = [
        shape.chunk(0, c, first=k == 0)[1]
        for k, c in enumerate(chunks('{"name":"search",', '"arguments":{}}'))
    ]
    assert resumable == [False, True]
