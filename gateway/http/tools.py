"""Tools: what `tool_choice` asks of the output, and a model's own tool-call syntax read back out
of its text (vLLM's `--tool-call-parser`).

    plan = tool_plan(body, parser_name)       # ToolUse.TEXT / FORCED / AUTO
    calls = CallReader(plan)                  # AUTO: one per choice
    for piece in text pieces: events = calls.feed(piece)
    events += calls.close()                   # Content(text) and Call(name, arguments) in order

FORCED ("required", a named function) constrains the whole output to one call's JSON
(`call_schema`); AUTO lets the model decide and parses its text: a parser is chosen by the model's
chat template (`parser_for_template`), or by --tool-call-parser. Parsing only reads the text: the
tokens generated are those without tools.

A call is given out once its closing tag has arrived, so that text that turns out not to be a
call (bad JSON, an unknown function) stays text: nothing the model wrote is lost, and the reason
goes to the log. Streamed and whole answers run the same reader over the same text, so they give
the same calls.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar

from gateway.http.errors import ApiError
from gateway.http.protocol import Body, ChatBody, NamedToolChoice, Tool

log = logging.getLogger("specmesh.gateway.http.tools")


class ToolUse(Enum):
    """What `tool_choice` makes of a chat's output."""

    TEXT = "text"  # no tools, or tool_choice "none": text, whatever it says
    FORCED = "forced"  # "required" or a named function: the output is one call's JSON
    AUTO = "auto"  # the default with tools: the model decides, its text is parsed

    @property
    def parses(self) -> bool:
        return self is ToolUse.AUTO

    @property
    def constrains(self) -> bool:
        return self is ToolUse.FORCED


@dataclass(frozen=True)
class ToolPlan:
    use: ToolUse
    tools: tuple[Tool, ...] = ()  # FORCED: the tools one of which is called; AUTO: all of them
    parser: str = ""  # AUTO: the name in TOOL_PARSERS
    parallel: bool = True  # AUTO: several calls in one answer (parallel_tool_calls)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(t.function.name for t in self.tools)


TEXT = ToolPlan(ToolUse.TEXT)


def tool_plan(body: Body, parser: str | None) -> ToolPlan:
    """The body's tools and tool_choice, checked. parser: the tool-call parser of the served model
    (None: it has none, and "auto" is refused)."""
    if not isinstance(body, ChatBody):
        return TEXT
    tools, choice = tuple(body.tools or ()), body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice: needs tools", "tool_choice")
        return TEXT
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise ApiError(400, "tools: function names must be unique", "tools")
    if choice == "none":
        return TEXT
    if choice == "required":
        return ToolPlan(ToolUse.FORCED, tools)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            message = f"tool_choice.function.name: {choice.function.name!r} is not among the tools"
            raise ApiError(400, message, "tool_choice.function.name")
        return ToolPlan(ToolUse.FORCED, tuple(t for t in tools if t.function.name == choice.function.name))
    if parser is None:
        raise ApiError(
            400, "tool_choice: 'auto' needs a tool-call parser for this model's chat template (the "
            "gateway's --tool-call-parser); send 'required' or a named function, or 'none'", "tool_choice",
            "unsupported_value",
        )  # fmt: skip
    return ToolPlan(ToolUse.AUTO, tools, parser, body.parallel_tool_calls is not False)


def forces_call(body: Body) -> bool:
    """Whether the body's tool_choice forces a call (its output is then a call's JSON)."""
    if not isinstance(body, ChatBody) or not body.tools:
        return False
    return body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)


def call_schema(tools: Sequence[Tool]) -> dict[str, Any]:
    """FORCED: the JSON the output must be, {"name": <one of the tools>, "arguments": <its
    parameters>}, written compactly (no whitespace between JSON tokens): the call is parsed, never
    shown, and a model cannot spend its tokens on layout."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


# ---- what a reader gives -------------------------------------------------------------------------


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text of an object

    def openai(self) -> dict[str, Any]:
        """As OpenAI's `tool_calls[i]`, with a new id."""
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


Event = Content | Call


def call_from_json(text: str, names: frozenset[str]) -> Call:
    """{"name": ..., "arguments": {...}} -> a Call; ValueError says why it is not one."""
    try:
        call = json.loads(text)
    except RecursionError:  # not a ValueError: nested deeper than the parser goes
        raise ValueError("nested too deeply") from None
    if not isinstance(call, dict) or set(call) != {"name", "arguments"}:
        raise ValueError('not an object of "name" and "arguments"')
    if not isinstance(call["name"], str) or call["name"] not in names:
        raise ValueError(f"{call['name']!r} is not among the tools")
    if not isinstance(call["arguments"], dict):
        raise ValueError("arguments are not an object")
    try:
        return Call(call["name"], json.dumps(call["arguments"], ensure_ascii=False))
    except RecursionError:
        raise ValueError("arguments nested too deeply") from None


def forced_call(text: str, names: frozenset[str]) -> Call | None:
    """FORCED: the constrained output as a Call; None if it did not finish (max_tokens)."""
    try:
        return call_from_json(text, names)
    except ValueError:
        return None


# ---- parsers -------------------------------------------------------------------------------------


class ToolCallParser:
    """A model family's call syntax: calls written between an opening and a closing tag, the JSON
    of one call between them. `tags`: the pairs read, the one its chat template teaches first. A
    new syntax is a subclass in TOOL_PARSERS."""

    tags: ClassVar[tuple[tuple[str, str], ...]]

    @classmethod
    def matches(cls, chat_template: str) -> bool:
        """Whether a chat template teaches this syntax (`parser_for_template`)."""
        open_tag, close_tag = cls.tags[0]
        return open_tag in chat_template and close_tag in chat_template

    @classmethod
    def call(cls, inside: str, names: frozenset[str]) -> Call:
        """The text between the tags -> a Call; ValueError says why it is not one."""
        return call_from_json(inside.strip(), names)


class HermesParser(ToolCallParser):
    """Hermes style, as Qwen2.5's template asks for it:
    <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>. Qwen2.5-Coder writes the same
    JSON in a ```json fence instead (llama.cpp's Hermes parser reads both): read too; a fence
    whose JSON is not a call of one of the tools stays text."""

    tags = (("<tool_call>", "</tool_call>"), ("```json\n", "\n```"))


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {"hermes": HermesParser}


def parser_for_template(chat_template: str | None) -> str | None:
    """The parser whose syntax the chat template teaches; None if none does."""
    for name, parser in TOOL_PARSERS.items():
        if chat_template and parser.matches(chat_template):
            return name
    return None


class CallReader:
    """One choice's text, read piece by piece into Content and Call events (module docstring).
    Text that may still become a call (an open tag, or the start of one) is held back until it is
    decided. Whitespace next to a call is layout and dropped, except after a call that follows
    content ("see <call> below" keeps "see below" apart); with no call the content is the text
    exactly."""

    def __init__(self, plan: ToolPlan) -> None:
        self._parser = TOOL_PARSERS[plan.parser]
        self._names, self._parallel = plan.names, plan.parallel
        self._held = ""  # text not yet given out
        self._open: tuple[str, str] | None = None  # the tags of the call _held is inside of
        self._space = ""  # trailing whitespace, given out only if content follows
        self._after_call = False  # a call was the last thing read
        self._given = False  # some content has been given out
        self.calls = 0

    @property
    def idle(self) -> bool:
        """Whether all the text fed so far has been given out."""
        return not (self._held or self._open or self._space)

    def feed(self, text: str) -> list[Event]:
        self._held += text
        events: list[Event] = []
        tags = self._parser.tags
        while True:
            if self._open is not None:
                open_tag, close_tag = self._open
                end = self._held.find(close_tag)
                if end < 0:
                    return events
                inside, self._held = self._held[:end], self._held[end + len(close_tag) :]
                self._open = None
                events += self._call(inside, open_tag, close_tag)
                continue
            found = [(at, pair) for pair in tags if (at := self._held.find(pair[0])) >= 0]
            if not found:
                keep = len(self._held) - max(_partial_tag(self._held, open_tag) for open_tag, _ in tags)
                events += self._content(self._held[:keep])
                self._held = self._held[keep:]
                return events
            start, pair = min(found)
            events += self._content(self._held[:start])
            self._held, self._open = self._held[start + len(pair[0]) :], pair

    def close(self) -> list[Event]:
        """The end of the text: what is held is text (a call that never closed did not finish)."""
        if self._open is not None:
            log.info("a tool call did not finish; kept as text", extra={"text": self._held[:200]})
            self._held = self._open[0] + self._held
        events = self._content(self._held)
        self._held, self._open = "", None
        if self._space and not self.calls:
            events.append(Content(self._space))
        self._space = ""
        return events

    def _call(self, inside: str, open_tag: str, close_tag: str) -> list[Event]:
        try:
            call = self._parser.call(inside, self._names)
        except ValueError as exc:
            log.info("the model's tool call text is not a call; kept as text",
                     extra={"reason": str(exc), "text": inside[:200]})  # fmt: skip
            return self._content(open_tag + inside + close_tag)
        self._space, self._after_call = "", True
        if self.calls and not self._parallel:
            log.info("parallel_tool_calls is false: a further call dropped", extra={"function": call.name})
            return []
        self.calls += 1
        return [call]

    def _content(self, text: str) -> list[Event]:
        text, self._space = self._space + text, ""
        if self._after_call and not self._given:  # between calls, or after the first: layout
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body) :]
        if not body:
            return []
        self._after_call, self._given = False, True
        return [Content(body)]


def _partial_tag(text: str, tag: str) -> int:
    """How many of text's last characters could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def read_all(plan: ToolPlan, text: str) -> tuple[str | None, list[Call]]:
    """A whole answer: its content (None if only calls) and its calls."""
    reader = CallReader(plan)
    events = reader.feed(text) + reader.close()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls = [e for e in events if isinstance(e, Call)]
    return (content or None) if calls else content, calls
