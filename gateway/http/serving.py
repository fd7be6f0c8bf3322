"""Serving a completion: the body becomes GenerateRequests (one per choice), run through the same
`Gateway.generate` as a gRPC call, and their chunks become OpenAI's objects, whole or as
server-sent events (vLLM's `serving_chat.py` / `serving_completion.py`).

A client that disconnects cancels its sessions on every replica, as a cancelled gRPC call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import grpc
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from google.protobuf import json_format

from gateway.api import gateway_pb2
from gateway.http.errors import HTTP_STATUS, ApiError, error_body
from gateway.http.protocol import Body, ChatBody
from gateway.http.tools import (
    TEXT,
    TOOL_PARSERS,
    Call,
    CallReader,
    Content,
    ToolPlan,
    forced_call,
    parser_for_template,
    read_all,
    tool_plan,
)
from gateway.http.translate import choice_requests, generate_request, resume_point

T = TypeVar("T")
ARGUMENT_PIECE = 32  # characters of a streamed call's arguments per delta


class Gateway(Protocol):
    """What the HTTP API needs of gateway.server.GatewayService."""

    metrics: Any

    def authorize(self, authorization: str | None) -> bytes: ...
    def served_model(self) -> Any: ...
    def model_name(self) -> str: ...
    def token_text(self, token_id: int) -> str: ...
    def tool_call_parser(self) -> str: ...
    def generate(
        self, request: Any, deadline: float | None, announce: Any = None, tenant: bytes = b""
    ) -> AsyncIterator[Any]: ...
    def status(self, method: str, session: str, exc: Exception) -> tuple[grpc.StatusCode, str, tuple]: ...
    def answered(
        self, method: str, session: str, code: grpc.StatusCode, start: float, details: str = ""
    ) -> None: ...


def served_parser(gateway: Gateway) -> str | None:
    """The tool-call parser of the served model: --tool-call-parser, or by its chat template."""
    name = gateway.tool_call_parser()
    if name == "auto":
        return parser_for_template(getattr(gateway.served_model().tokenizer, "chat_template", None))
    return name if name in TOOL_PARSERS else None


# ---- responses ---------------------------------------------------------------------------------


def _usage(stats: Sequence[Any]) -> dict[str, Any]:
    """The choices' stats -> `usage`: the prompt counted once (the choices share it, as OpenAI
    counts it), the completions summed."""
    prompt, completion = stats[0].prompt_tokens, sum(s.generated_tokens for s in stats)
    cached = max(s.cached_prompt_tokens for s in stats)  # OpenAI's prompt_tokens_details
    return {
        "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }  # fmt: skip


def _stats(stats: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _tool_calls_finish(finish: str | None) -> str | None:
    """An answer with calls finishes with "tool_calls" (OpenAI's), unless it ran out of tokens."""
    return "tool_calls" if finish == "stop" else finish


class ResponseShape:
    """How one endpoint writes its objects: choices of a whole response and of a stream chunk.
    token_text: a token's text (logprobs asked for), None (not asked for). tools: the chat's
    `tool_plan`: a forced call is answered as `tool_calls`; with "auto" the text is parsed."""

    def __init__(
        self,
        chat: bool,
        session_id: str,
        model: str,
        token_text: Callable[[int], str] | None = None,
        tools: ToolPlan | None = None,
    ) -> None:
        self.chat, self.token_text = chat, token_text
        self.tools = tools if tools is not None else TEXT
        prefix = "chatcmpl" if chat else "cmpl"
        self.id, self.model, self.created = f"{prefix}-{session_id}", model, int(time.time())
        self._offset: dict[int, int] = {}  # completions, per choice: where its next token's text starts
        self._call_text: dict[int, str] = {}  # forced calls, per choice: the text so far (streamed)
        self._readers: dict[int, CallReader] = {}  # "auto", per choice

    def _message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's whole message and finish_reason."""
        calls: list[Call] = []
        content: str | None = text
        if self.tools.use.constrains and finish == "stop":
            call = forced_call(text, self.tools.names)
            calls, content = ([call], None) if call else ([], text)
        elif self.tools.use.parses:
            content, calls = read_all(self.tools, text)
        if not calls:
            return {"role": "assistant", "content": content}, finish
        message = {"role": "assistant", "content": content, "tool_calls": [c.openai() for c in calls]}
        return message, _tool_calls_finish(finish)

    def logprobs(self, entries: Sequence[Any], index: int = 0) -> dict[str, Any] | None:
        """specmesh.v1.TokenLogprob messages -> the choice's `logprobs`, in the endpoint's form:
        chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completions the legacy
        `{tokens, token_logprobs, top_logprobs, text_offset}`."""
        if self.token_text is None:
            return None
        text = self.token_text
        if self.chat:

            def item(token_id: int, logprob: float) -> dict[str, Any]:
                s = text(token_id)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

            content = [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t.token_id, t.logprob) for t in e.top]}
                for e in entries
            ]
            return {"content": content, "refusal": None}
        tokens = [text(e.token_id) for e in entries]
        offsets, at = [], self._offset.get(index, 0)
        for s in tokens:
            offsets.append(at)
            at += len(s)
        self._offset[index] = at
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text(t.token_id): t.logprob for t in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _object(self, kind: str, choices: list[dict], **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices, **more}  # fmt: skip

    def whole(self, choices: Sequence[list[Any]]) -> dict[str, Any]:
        """choices: each choice's GenerateChunks, in order."""
        out, lasts = [], [chunks[-1] for chunks in choices]
        for index, chunks in enumerate(choices):
            text = "".join(c.text for c in chunks)
            logprobs = self.logprobs([e for c in chunks for e in c.logprobs], index)
            choice: dict[str, Any] = {
                "index": index,
                "logprobs": logprobs,
                "finish_reason": lasts[index].finish_reason,
            }
            if self.chat:
                choice["message"], choice["finish_reason"] = self._message(text, choice["finish_reason"])
            else:
                choice["text"] = text
            out.append(choice)
        kind = "chat.completion" if self.chat else "text_completion"
        return self._object(kind, out, usage=_usage([c.stats for c in lasts]), **self._stats(lasts, out))

    def chunk(self, index: int, chunk: Any, first: bool = False) -> tuple[list[dict[str, Any]], bool]:
        """One GenerateChunk of choice `index` as stream events (the last has `stats` when it
        finishes), and whether every text of it has been given out (nothing held back for a call
        that may still come: only then may its events carry a resume point)."""
        finish, text = chunk.finish_reason or None, chunk.text
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        logprobs = self.logprobs(chunk.logprobs, index)
        if self.chat and self.tools.use.parses:
            return self._parsed(index, chunk, first, logprobs)
        choice: dict[str, Any] = {"index": index, "logprobs": logprobs, "finish_reason": finish}
        if self.chat and self.tools.use.constrains:  # the call is sent whole, once it is complete
            so_far = self._call_text[index] = self._call_text.get(index, "") + text
            delta = {"role": "assistant", "content": None} if first else {}
            if finish:
                message, choice["finish_reason"] = self._message(so_far, finish)
                calls = message.get("tool_calls")
                delta |= {"tool_calls": [{"index": 0, **calls[0]}]} if calls else {"content": so_far}
            choice["delta"] = delta
        elif self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice["delta"] = delta if (text or first or not finish) else {}
        else:
            choice["text"] = text
        event = self._object(kind, [choice])
        if finish:
            event["stats"] = _stats(chunk.stats)
        # a forced call's text waits for its end: a resume point before it would lose the call
        return [event], not (self.chat and self.tools.use.constrains) or finish is not None

    def _parsed(
        self, index: int, chunk: Any, first: bool, logprobs: dict | None
    ) -> tuple[list[dict[str, Any]], bool]:
        """ "auto": the chunk's text through the choice's CallReader. Content goes out as it comes;
        a call once it closed, its name first and then its arguments in pieces, as OpenAI
        streams them."""
        reader = self._readers.setdefault(index, CallReader(self.tools))
        finish = chunk.finish_reason or None
        k = reader.calls  # the index of the next call given out
        events = reader.feed(chunk.text) + (reader.close() if finish else [])
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, Content):
                deltas.append({"content": event.text})
                continue
            whole = event.openai()
            whole["function"]["arguments"] = ""
            deltas.append({"tool_calls": [{"index": k, **whole}]})
            for at in range(0, len(event.arguments), ARGUMENT_PIECE):
                piece = event.arguments[at : at + ARGUMENT_PIECE]
                deltas.append({"tool_calls": [{"index": k, "function": {"arguments": piece}}]})
            k += 1
        if first and deltas and "content" in deltas[0]:
            deltas[0] = {"role": "assistant", **deltas[0]}
        elif first:
            deltas.insert(0, {"role": "assistant", "content": None})
        elif not deltas and (finish or logprobs is not None):
            deltas.append({})  # for the finish_reason, or the chunk's logprobs
        if finish is not None and reader.calls:
            finish = _tool_calls_finish(finish)
        out = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = {"index": index, "delta": delta, "logprobs": logprobs if k == 0 else None,
                      "finish_reason": finish if last else None}  # fmt: skip
            event = self._object("chat.completion.chunk", [choice])
            if last and finish:
                event["stats"] = _stats(chunk.stats)
            out.append(event)
        # a resumed stream reads on with a new reader: only from before the first call is that the same
        return out, reader.idle and not reader.calls

    def usage_chunk(self, lasts: Sequence[Any]) -> dict[str, Any]:
        """The usage chunk; with several choices their stats were in each one's last chunk."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        more = {"stats": _stats(lasts[0].stats)} if len(lasts) == 1 else {}
        return self._object(kind, [], usage=_usage([c.stats for c in lasts]), **more)

    @staticmethod
    def _stats(lasts: Sequence[Any], choices: list[dict]) -> dict[str, Any]:
        """One choice: the response's `stats`; several: each choice's own (`choices[i].stats`)."""
        if len(lasts) == 1:
            return {"stats": _stats(lasts[0].stats)}
        for choice, last in zip(choices, lasts, strict=True):
            choice["stats"] = _stats(last.stats)
        return {}


def _sse(obj: Any, event_id: str = "") -> bytes:
    head = f"id: {event_id}\n".encode() if event_id else b""
    return head + b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# ---- disconnects -------------------------------------------------------------------------------


class ClientGone(Exception):
    """The HTTP client disconnected before the answer was ready."""


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`, cancelled (which ends its session everywhere) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        task.cancel()
        watcher.cancel()
        # both unwound before going on: cancelled work may await its cleanup for many loop turns
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        raise ClientGone
    return task.result()


# ---- the endpoints -----------------------------------------------------------------------------


async def models(gateway: Gateway, request: Request) -> Response:
    model = gateway.served_model()
    card = {"id": gateway.model_name(), "object": "model", "created": 0, "owned_by": "specmesh",
            "max_model_len": model.limits.max_context}  # fmt: skip
    return JSONResponse({"object": "list", "data": [card]})


async def completion(gateway: Gateway, request: Request, body: Body) -> Response:
    """POST /v1/completions and /v1/chat/completions."""
    gateway.served_model()  # 503 before anything else while the gateway is not ready
    name = gateway.model_name()
    if body.model != name:
        raise ApiError(404, f"The model `{body.model}` does not exist (this gateway serves `{name}`)",
                       "model", "model_not_found")  # fmt: skip
    tools = tool_plan(body, served_parser(gateway))
    grpc_request = generate_request(body, tools)
    token_text = gateway.token_text if grpc_request.HasField("logprobs") else None
    last_event_id = request.headers.get("last-event-id", "") if body.stream else ""
    resume = resume_point(last_event_id, body.n) if last_event_id else None
    if resume is not None:  # the body says how to answer; the session in Redis what to generate
        grpc_request = gateway_pb2.GenerateRequest(resume=resume)
    tenant = request.state.tenant  # the API key's prefix cache namespace (`_answer`)
    streams = [gateway.generate(r, None, tenant=tenant) for r in choice_requests(grpc_request, body.n)]
    chat = isinstance(body, ChatBody)
    if not body.stream:
        got = await until_disconnect(request, _collect(streams))
        shape = ResponseShape(chat, got[0][-1].session_id, name, token_text, tools)
        return JSONResponse(shape.whole(got))
    # Every choice's first chunk before the response starts: a bad request still gets its status.
    firsts = await until_disconnect(request, _firsts(streams))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    shape = ResponseShape(chat, firsts[0].session_id, name, token_text, tools)
    return StreamingResponse(
        _events(shape, firsts, streams, include_usage, gateway, resume.token_index if resume else 0),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _all(work: Sequence[Awaitable[T]]) -> list[T]:
    """Every result, or the first failure once the others are cancelled (a failed choice or a
    client that left ends every choice's session)."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(streams: Sequence[AsyncIterator[Any]]) -> list[list[Any]]:
    async def one(chunks: AsyncIterator[Any]) -> list[Any]:
        async with contextlib.aclosing(chunks):
            return [c async for c in chunks]

    return await _all([one(s) for s in streams])


async def _firsts(streams: Sequence[AsyncIterator[Any]]) -> list[Any]:
    """Each choice's first chunk; on any failure every stream is closed."""
    try:
        return await _all([anext(s) for s in streams])
    except BaseException:
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
        raise


async def _merged(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, chunk) as each choice's chunks come; a choice's failure ends them all."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, chunks: AsyncIterator[Any]) -> None:
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    await queue.put((index, chunk, None))
            except Exception as exc:
                await queue.put((index, None, exc))
                return
        await queue.put((index, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                index, chunk, exc = await queue.get()
                if exc is not None:
                    raise exc
                if chunk is None:
                    break
                yield index, chunk
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _events(
    shape: ResponseShape,
    firsts: Sequence[Any],
    streams: Sequence[AsyncIterator[Any]],
    include_usage: bool,
    gateway: Gateway,
    start: int = 0,
) -> AsyncIterator[bytes]:
    """Server-sent events: the events of each choice's chunks, each choice's last with its
    finish_reason and `stats`, the usage chunk if asked for, then `data: [DONE]`. A failure after
    the first chunk is an error event. A single choice's events carry `id: <session>:<tokens so
    far>` (from `start`, a resume's index), what a client sends back as Last-Event-ID to resume;
    not while text is held back for a tool call that may still come."""
    lasts: list[Any] = list(firsts)
    received = start

    def sse(events: list[dict[str, Any]], chunk: Any, given_out: bool) -> bytes:
        nonlocal received
        received += len(chunk.token_ids)
        last_id = f"{chunk.session_id}:{received}" if len(firsts) == 1 and given_out else ""
        return b"".join(_sse(e, last_id if k == len(events) - 1 else "") for k, e in enumerate(events))

    for index, first in enumerate(firsts):
        events, given_out = shape.chunk(index, first, first=True)
        yield sse(events, first, given_out)
    going = [i for i, c in enumerate(firsts) if not c.finish_reason]
    rest = _merged([streams[i] for i in going])
    async with contextlib.aclosing(rest):
        try:
            async for k, chunk in rest:
                index = going[k]
                lasts[index] = chunk
                events, given_out = shape.chunk(index, chunk)
                data = sse(events, chunk, given_out)
                if data:  # nothing while a call's text is held back
                    yield data
        except Exception as exc:
            code, details, _ = gateway.status("stream", firsts[0].session_id, exc)
            yield _sse(error_body(HTTP_STATUS.get(code, 500), details))
            yield b"data: [DONE]\n\n"
            return
        finally:
            for i, stream in enumerate(streams):  # the finished ones: their generators' cleanup
                if i not in going:
                    await stream.aclose()
    if include_usage:
        yield _sse(shape.usage_chunk(lasts))
    yield b"data: [DONE]\n\n"
