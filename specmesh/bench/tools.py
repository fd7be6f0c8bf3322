"""`specmesh bench tools`: tool calls as an agent sends them, against any OpenAI-compatible server.

Two functions, `get_weather(city, unit)` and `search(query)`, sent as `tools` with `tool_choice`
left out (OpenAI's default, "auto": the model decides). 20 prompts ask for a call, 10 need none.
Each prompt runs whole and streamed (the stream's deltas merged by tool-call index, as the openai
client's users do), greedy. Reported per server: prompts that called, calls whose arguments parse
and validate against the function's schema, prompts that should not call and did not, and
whether whole and streamed gave the same calls, text and finish_reason.
"""

from __future__ import annotations

import json
import time
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "the city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web for a query",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "what to search for"}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

CALL_PROMPTS = [
    "What's the weather in Paris right now, in celsius?",
    "How warm is it in Tokyo today? Use fahrenheit.",
    "Tell me the current weather in Oslo in celsius.",
    "Is it raining in London? Give me the weather in celsius.",
    "Check the weather in New York in fahrenheit please.",
    "What is the temperature in Berlin at the moment (celsius)?",
    "I'm flying to Sydney tomorrow. What's the weather there now, in celsius?",
    "Weather for Cairo, fahrenheit.",
    "Can you look up the weather in Madrid in celsius?",
    "How cold is it in Moscow right now in celsius?",
    "Search the web for the latest Python release notes.",
    "Find recent news about the James Webb Space Telescope.",
    "Look up who won the 2022 FIFA World Cup.",
    "Search for a good recipe for banana bread.",
    "Find the population of Canada with a web search.",
    "Search online for the opening hours of the Louvre.",
    "Look up the definition of speculative decoding on the web.",
    "Search for reviews of the Framework laptop.",
    "Find the current exchange rate from euros to dollars.",
    "Search the web for tips on learning Rust.",
]
TEXT_PROMPTS = [
    "Write a haiku about autumn.",
    "What is 17 times 23?",
    "Translate 'good morning' into French.",
    "Explain what a Python list comprehension is in one sentence.",
    "Write a Python function that reverses a string.",
    "Say hello.",
    "What is the capital of Italy? Answer in one word.",
    "Give me a synonym for 'happy'.",
    "Write one sentence about dogs.",
    "Spell the word 'banana' backwards.",
]


def _valid(name: str, arguments: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(arguments, SCHEMAS[name])
    except (jsonschema.ValidationError, KeyError):
        return False
    return True


def _calls_of_message(message: Any) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def stream_chat(client: Any, kwargs: dict) -> tuple[str, list[dict[str, str]], str | None]:
    """A streamed chat completion as the openai client's users put it together: (its content, its
    calls {"id", "name", "arguments"} merged from their deltas by index, its finish_reason)."""
    content, parts, finish = "", {}, None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for t in delta.tool_calls or []:
            part = parts.setdefault(t.index, {"id": "", "name": "", "arguments": ""})
            part["id"] += t.id or ""
            if t.function is not None:
                part["name"] += t.function.name or ""
                part["arguments"] += t.function.arguments or ""
    return content, [p for _, p in sorted(parts.items())], finish


def _parsed(calls: list[tuple[str, str]]) -> list[tuple[str, Any]]:
    out = []
    for name, arguments in calls:
        try:
            out.append((name, json.loads(arguments)))
        except ValueError:
            out.append((name, None))
    return out


def bench_tools(base_url: str, model: str | None, max_tokens: int, api_key: str = "unused") -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key=api_key, timeout=600, max_retries=0)
    model = model or client.models.list().data[0].id
    rows, start = [], time.perf_counter()
    for kind, prompts in (("call", CALL_PROMPTS), ("text", TEXT_PROMPTS)):
        for prompt in prompts:
            kwargs = dict(model=model, messages=[{"role": "user", "content": prompt}], tools=TOOLS,
                          temperature=0.0, max_tokens=max_tokens)  # fmt: skip
            whole = client.chat.completions.create(**kwargs).choices[0]
            content, stream_calls, stream_finish = stream_chat(client, kwargs)
            calls = _parsed(_calls_of_message(whole.message))
            row = {
                "kind": kind,
                "prompt": prompt,
                "calls": calls,
                "finish_reason": whole.finish_reason,
                "content": whole.message.content,
                "valid": bool(calls) and all(a is not None and _valid(n, a) for n, a in calls),
                "same_streamed": _parsed([(c["name"], c["arguments"]) for c in stream_calls]) == calls
                and stream_finish == whole.finish_reason
                and (content or None) == (whole.message.content or None),
            }
            rows.append(row)
            print(f"{kind:4s} calls={[n for n, _ in calls]} valid={row['valid']} same={row['same_streamed']}"
                  f" | {prompt[:50]}", flush=True)  # fmt: skip
    called = [r for r in rows if r["kind"] == "call"]
    plain = [r for r in rows if r["kind"] == "text"]
    summary = {
        "server": base_url,
        "model": model,
        "call_prompts": len(called),
        "called": sum(bool(r["calls"]) for r in called),
        "called_validly": sum(r["valid"] for r in called),
        "text_prompts": len(plain),
        "text_without_call": sum(not r["calls"] and r["content"] is not None for r in plain),
        "streamed_equal_whole": sum(r["same_streamed"] for r in rows),
        "prompts": len(rows),
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(json.dumps(summary), flush=True)
    return {"summary": summary, "rows": rows}
