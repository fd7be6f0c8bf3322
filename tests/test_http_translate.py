"""The HTTP front's translation rules on their own, as functions (no server): an OpenAI body -> the
specmesh.v1.GenerateRequest a gRPC client would send (gateway/http/translate.py), the gateway's
field names back to the body's, n choices and Last-Event-ID; errors -> HTTP status and OpenAI's
error body (gateway/http/errors.py); GenerateChunks -> OpenAI's objects (ResponseShape, serving.py).
End to end they are in tests/test_http_api.py, test_structured.py and test_tool_calls.py."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pydantic
import pytest
from google.protobuf import json_format

from gateway.api import gateway_pb2
from gateway.http.errors import (
    HTTP_STATUS,
    ApiError,
    error_body,
    error_response,
    validation_code,
    validation_param,
)
from gateway.http.protocol import Body, ChatBody, CompletionBody
from gateway.http.serving import ResponseShape
from gateway.http.tools import tool_plan
from gateway.http.translate import api_param, choice_requests, generate_request, resume_point

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def completion(**fields: Any) -> CompletionBody:
    return CompletionBody.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields: Any) -> ChatBody:
    return ChatBody.model_validate({"model": "m", "messages": USER, **fields})


def translate(body: Body) -> Any:
    return generate_request(body, tool_plan(body, "hermes"))


def request(**fields: Any) -> Any:
    return json_format.ParseDict(fields, gateway_pb2.GenerateRequest())


# ---- a body's fields -> GenerateRequest ----------------------------------------------------------

T1 = {"temperature": 1.0}  # OpenAI's default; the gRPC API's unset temperature is 0 (greedy)
RF = "response_format"
# case -> (completions body fields, the whole GenerateRequest besides prompt "hi" and sampling T1)
FIELDS: dict[str, tuple[dict, dict]] = {
    "nothing-set": ({}, {}),
    "temperature-0-stays-greedy": ({"temperature": 0.0}, {"sampling": {"temperature": 0.0}}),
    "top-p": ({"top_p": 0.9}, {"sampling": {**T1, "top_p": 0.9}}),
    "top-k": ({"top_k": 40}, {"sampling": {**T1, "top_k": 40}}),
    "top-k-minus-1-is-no-filter": ({"top_k": -1}, {"sampling": {**T1, "top_k": 0}}),
    "seed-0-is-set": ({"seed": 0}, {"sampling": {**T1, "seed": 0}}),
    "seed-largest": ({"seed": 2**64 - 1}, {"sampling": {**T1, "seed": 2**64 - 1}}),
    "max-tokens": ({"max_tokens": 7}, {"max_new_tokens": 7}),
    # in int32, passed on as sent: the gateway refuses what is out of its range, naming the field
    "int32-edges-pass": ({"max_tokens": 2**31 - 1, "top_k": -(2**31)},
                         {"max_new_tokens": 2**31 - 1, "sampling": {**T1, "top_k": -(2**31)}}),
    "stop-string-is-one-sequence": ({"stop": "\n\n"}, {"stop": ["\n\n"]}),
    "stop-list-in-order": ({"stop": ["b", "a"]}, {"stop": ["b", "a"]}),
    "stop-empty-list": ({"stop": []}, {}),
    "cache-salt": ({"cache_salt": "team-a"}, {"cache_salt": "team-a"}),
    # proto JSON: field names and their camelCase JSON names both
    "speculation": ({"speculation": {"method": "rsd_s", "beam_width": 2, "mtadThreshold": 0.5}},
                    {"speculation": {"method": "rsd_s", "beam_width": 2, "mtad_threshold": 0.5}}),
    "logprobs-0-is-asked": ({"logprobs": 0}, {"logprobs": 0}),
    "constraint-regex": ({"constraint": {"regex": "[0-9]+"}}, {"constraint": {"regex": "[0-9]+"}}),
    "json-object": ({RF: {"type": "json_object"}}, {"constraint": {"json_object": True}}),
    "json-schema": ({RF: {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
                    {"constraint": {"json_schema": json.dumps(SCHEMA)}}),
    "json-schema-without-schema-is-any-json": ({RF: {"type": "json_schema", "json_schema": {"name": "x"}}},
                                               {"constraint": {"json_schema": "{}"}}),
    # "text" is no constraint, so specmesh's own may come with it
    "text-format-beside-constraint": ({RF: {"type": "text"}, "constraint": {"lark": "start: /a+/"}},
                                      {"constraint": {"lark": "start: /a+/"}}),
    # accepted and without effect on the request: neutral values, user, n, streaming
    "no-effect": ({"frequency_penalty": 0.0, "presence_penalty": 0, "logit_bias": None, "echo": False,
                   "best_of": 1, "suffix": None, "user": "u1", "n": 16, "stream": True,
                   "stream_options": {"include_usage": True}}, {}),
}  # fmt: skip


@pytest.mark.parametrize("case", FIELDS)
def test_each_completions_field_maps_to_its_grpc_field_and_nothing_else(case: str) -> None:
    fields, want = FIELDS[case]
    assert translate(completion(**fields)) == request(prompt="hi", **{"sampling": T1, **want})


CHAT_FIELDS: dict[str, tuple[dict, dict]] = {
    "max-completion-tokens": ({"max_completion_tokens": 9}, {"max_new_tokens": 9}),
    "both-lengths-agreeing": ({"max_tokens": 9, "max_completion_tokens": 9}, {"max_new_tokens": 9}),
    "logprobs-true-is-0-alternatives": ({"logprobs": True}, {"logprobs": 0}),
    "top-logprobs": ({"logprobs": True, "top_logprobs": 3}, {"logprobs": 3}),
    "logprobs-false": ({"logprobs": False}, {}),
    "forced-call-is-its-schema": ({"tools": [TOOL], "tool_choice": "required"}, {
        "chat": {"messages": USER, "tools_json": json.dumps([TOOL])},
        "constraint": {"json_schema": json.dumps({
            "type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False}})}}),
}  # fmt: skip


@pytest.mark.parametrize("case", CHAT_FIELDS)
def test_each_chat_field_maps_to_its_grpc_field_and_nothing_else(case: str) -> None:
    fields, want = CHAT_FIELDS[case]
    assert translate(chat(**fields)) == request(**{"chat": {"messages": USER}, "sampling": T1, **want})


@pytest.mark.parametrize(
    ("prompt", "field", "value"),
    [("text", "prompt", "text"), (["text"], "prompt", "text"), ([3, 0, 7], "prompt_token_ids", [3, 0, 7]),
     ([[2**32 - 1]], "prompt_token_ids", [2**32 - 1])],
    ids=["string", "one-string", "token-ids", "one-token-list"],
)  # fmt: skip
def test_a_prompt_is_text_or_token_ids_one_at_a_time(prompt: Any, field: str, value: Any) -> None:
    got = translate(completion(prompt=prompt))
    assert got.WhichOneof("input") == field
    assert (got.prompt if field == "prompt" else list(got.prompt_token_ids.ids)) == value


def test_chat_messages_keep_roles_content_and_earlier_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{k: v for k, v in call.items() if k != "type"}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    tool = {"type": "function", "function": {"name": "f", "description": None}}
    got = translate(chat(messages=messages, tools=[tool], tool_choice="none")).chat
    # text parts joined as they are; no content beside calls is ""; a call's type defaults to function
    assert [(m.role, m.content, m.tool_call_id) for m in got.messages] == [
        ("system", "be brief", ""), ("user", "ab", ""), ("assistant", "", ""), ("tool", "sunny", "c1")
    ]  # fmt: skip
    assert [m.tool_calls_json for m in got.messages].count("") == 3
    assert json.loads(got.messages[2].tool_calls_json) == [call]
    assert json.loads(got.tools_json) == [{"type": "function", "function": {"name": "f"}}]  # no nulls


# ---- bodies refused before the gateway sees them -------------------------------------------------

UNSUPPORTED = "unsupported_parameter"
# case -> (body, param, code)
REFUSED: dict[str, tuple[Body, str, str | None]] = {
    "max-tokens-above-int32": (completion(max_tokens=2**31), "max_tokens", None),
    "max-completion-tokens-below-int32": (chat(max_completion_tokens=-(2**31) - 1), "max_completion_tokens",
                                          None),
    "top-k-above-int32": (completion(top_k=2**31), "top_k", None),
    "seed-2^64": (completion(seed=2**64), "seed", None),
    "logprobs-2^32": (completion(logprobs=2**32), "logprobs", None),
    "top-logprobs-negative": (chat(logprobs=True, top_logprobs=-1), "top_logprobs", None),
    "prompt-empty-list": (completion(prompt=[]), "prompt", None),
    "prompt-token-batch": (completion(prompt=[[1], [2]]), "prompt", None),
    "prompt-token-list-above-uint32": (completion(prompt=[[2**32]]), "prompt", None),
    "presence-penalty": (completion(presence_penalty=0.1), "presence_penalty", UNSUPPORTED),
    "logit-bias": (chat(logit_bias={"50256": -100.0}), "logit_bias", UNSUPPORTED),
    "best-of-2": (completion(best_of=2), "best_of", UNSUPPORTED),
    "suffix": (completion(suffix="}"), "suffix", UNSUPPORTED),
    "format-and-constraint": (completion(response_format={"type": "json_object"}, constraint={"regex": "a"}),
                              "constraint", None),
    "constraint-two-kinds": (completion(constraint={"regex": "a", "lark": "b"}), "constraint", None),
    "constraint-schema-not-json-text": (completion(constraint={"json_schema": SCHEMA}), "constraint", None),
    "speculation-wrong-type": (completion(speculation={"depth": "deep"}), "speculation", None),
    "json-schema-missing": (chat(response_format={"type": "json_schema"}), "response_format.json_schema",
                            "missing_required_parameter"),
    "forced-call-and-format": (chat(tools=[TOOL], tool_choice="required", **{RF: {"type": "json_object"}}),
                               "tool_choice", None),
    "forced-call-and-constraint": (chat(tools=[TOOL], constraint={"regex": "a"},
                                        tool_choice={"type": "function", "function": {"name": "f"}}),
                                   "tool_choice", None),
    "content-missing": (chat(messages=[*USER, {"role": "user"}]), "messages[1].content", None),
    "tool-call-id-empty": (chat(messages=[{"role": "tool", "content": "x", "tool_call_id": ""}]),
                           "messages[0].tool_call_id", "missing_required_parameter"),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSED)
def test_a_bad_body_is_a_400_naming_its_field(case: str) -> None:
    body, param, code = REFUSED[case]
    with pytest.raises(ApiError) as refused:
        translate(body)
    assert (refused.value.status, refused.value.param, refused.value.code) == (400, param, code)
    assert str(refused.value).startswith(f"{param}: ")


# ---- the gateway's field names -> the body's -----------------------------------------------------

FORCED = chat(tools=[TOOL], tool_choice="required")
# case -> (WireError.field, body, the body's name for it)
FIELD_NAMES: dict[str, tuple[str, Body, str]] = {
    "length-completions": ("max_new_tokens", completion(), "max_tokens"),
    "length-chat-new": ("max_new_tokens", chat(max_completion_tokens=5), "max_completion_tokens"),
    "length-chat-both": ("max_new_tokens", chat(max_tokens=5, max_completion_tokens=5), "max_tokens"),
    "sampling": ("sampling.top_p", completion(), "top_p"),
    "token-ids": ("prompt_token_ids.ids[1]", completion(prompt=[1, 2]), "prompt"),
    "message": ("chat.messages[2].role", chat(), "messages[2].role"),
    "earlier-call": ("chat.messages[1].tool_calls_json[0].function.arguments", chat(),
                     "messages[1].tool_calls[0].function.arguments"),
    "chat-itself": ("chat", chat(), "messages"),
    "tools": ("chat.tools_json", chat(), "tools"),
    "chat-logprobs-limit": ("logprobs", chat(logprobs=True, top_logprobs=30), "top_logprobs"),
    "completions-logprobs": ("logprobs", completion(logprobs=30), "logprobs"),
    "forced-call": ("constraint.json_schema", FORCED, "tools"),
    "schema": ("constraint.json_schema", chat(response_format={"type": "json_schema",
               "json_schema": {"name": "x", "schema": SCHEMA}}), "response_format.json_schema.schema"),
    "json-object": ("constraint.json_object", chat(**{RF: {"type": "json_object"}}), "response_format"),
    "own-constraint": ("constraint.regex", completion(constraint={"regex": "("}), "constraint.regex"),
    "same-name": ("speculation.depth", completion(), "speculation.depth"),
    "indexed": ("stop[0]", completion(), "stop[0]"),
}  # fmt: skip


@pytest.mark.parametrize("case", FIELD_NAMES)
def test_a_refused_grpc_field_is_named_as_the_body_names_it(case: str) -> None:
    field, body, param = FIELD_NAMES[case]
    assert api_param(field, body) == param


def test_a_bad_constraint_beside_a_text_response_format_is_named_constraint() -> None:
    body = completion(response_format={"type": "text"}, constraint={"regex": "("})
    assert api_param("constraint.regex", body) == "constraint.regex"


# ---- n choices, Last-Event-ID --------------------------------------------------------------------


def test_one_choice_is_the_request_itself() -> None:
    one = translate(completion(seed=3))
    assert choice_requests(one, 1)[0] is one


@pytest.mark.parametrize(
    ("seed", "seeds"), [(5, [5, 6, 7]), (2**64 - 2, [2**64 - 2, 2**64 - 1, 0])], ids=["plain", "wraps"]
)
def test_choice_i_draws_with_seed_plus_i_modulo_2_64(seed: int, seeds: list[int]) -> None:
    original = translate(completion(seed=seed, max_tokens=4))
    choices = choice_requests(original, 3)
    assert [c.sampling.seed for c in choices] == seeds
    for c in choices:  # nothing else differs, and the original keeps its seed
        c.sampling.seed = seed
        assert c == original
    assert original.sampling.seed == seed


def test_unseeded_choices_are_separate_copies_that_leave_the_seed_to_the_gateway() -> None:
    original = translate(completion(max_tokens=4))
    choices = choice_requests(original, 2)
    assert all(c == original and c is not original for c in choices)
    assert not any(c.sampling.HasField("seed") for c in choices)


@pytest.mark.parametrize(
    ("header", "session", "index"),
    [("abc:12", "abc", 12), ("a:b:0", "a:b", 0), ("s:4294967295", "s", 2**32 - 1)],
)
def test_last_event_id_is_the_session_and_the_tokens_received(header: str, session: str, index: int) -> None:
    assert resume_point(header, 1) == gateway_pb2.Resume(session_id=session, token_index=index)


@pytest.mark.parametrize("header", ["abc", ":5", "abc:", "abc:x", "abc:-1", "abc:4294967296"])
def test_a_malformed_last_event_id_is_a_400_naming_it(header: str) -> None:
    with pytest.raises(ApiError) as refused:
        resume_point(header, 1)
    assert (refused.value.status, refused.value.param) == (400, "Last-Event-ID")
    assert str(refused.value).startswith("Last-Event-ID: ")


def test_a_stream_of_several_choices_is_not_resumed() -> None:
    with pytest.raises(ApiError) as refused:
        resume_point("abc:3", 2)
    assert (refused.value.status, refused.value.param) == (400, "n")


def test_a_superscript_digit_in_last_event_id_is_a_400_not_a_crash() -> None:
    # a latin-1 header may carry U+00B2: str.isdigit took it, int() did not (a 500 "internal error")
    with pytest.raises(ApiError):
        resume_point("abc:²", 1)


# ---- errors ----------------------------------------------------------------------------------------


def test_grpc_codes_map_to_http_statuses() -> None:
    C = grpc.StatusCode
    assert HTTP_STATUS == {
        C.INVALID_ARGUMENT: 400, C.FAILED_PRECONDITION: 400, C.OUT_OF_RANGE: 400, C.UNAUTHENTICATED: 401,
        C.PERMISSION_DENIED: 403, C.NOT_FOUND: 404, C.RESOURCE_EXHAUSTED: 429, C.UNAVAILABLE: 503,
        C.ABORTED: 503, C.DEADLINE_EXCEEDED: 504,
    }  # fmt: skip  # INTERNAL, UNKNOWN, CANCELLED, ...: the caller's default, 500


@pytest.mark.parametrize(
    ("status", "message", "kind", "code"),
    [(400, "top_p: must be in (0, 1]", "invalid_request_error", "invalid_value"),
     (400, "prompt: 9 tokens leave no room in the model's context of 8 tokens", "invalid_request_error",
      "context_length_exceeded"),
     (400, "max_tokens: 9 new tokens after a 3-token prompt exceed the model's context of 8 tokens",
      "invalid_request_error", "context_length_exceeded"),
     (401, "no key", "authentication_error", "invalid_api_key"),
     (404, "Invalid URL (GET /x)", "invalid_request_error", "unknown_url"),
     (405, "GET /v1/completions: Method Not Allowed", "invalid_request_error", "method_not_allowed"),
     (429, "busy", "rate_limit_error", "rate_limit_exceeded"),
     (500, "internal error", "server_error", None), (503, "not ready", "server_error", None),
     (504, "deadline", "server_error", None)],
)  # fmt: skip
def test_the_status_decides_the_error_type_and_code(status: int, message: str, kind: str, code: str) -> None:
    assert error_body(status, message) == {
        "error": {"message": message, "type": kind, "param": None, "code": code}
    }


def test_an_explicit_param_and_code_win_over_the_status() -> None:
    error = error_body(404, "The model `x` does not exist", "model", "model_not_found")["error"]
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == ("model", "model_not_found")


@pytest.mark.parametrize(
    ("status", "headers", "retry_after"),
    [(429, None, "1"), (429, {"Retry-After": "7"}, "7"), (503, None, None)],
)
def test_only_a_429_says_when_to_retry(status: int, headers: dict | None, retry_after: str | None) -> None:
    response = error_response(status, "x", headers=headers)
    assert response.status_code == status and response.headers.get("retry-after") == retry_after
    assert json.loads(response.body) == error_body(status, "x")


# case -> (body model, body, the error's param, its code): pydantic's first error, as FastAPI gives it
INVALID: dict[str, tuple[type, dict, str, str]] = {
    "union-member-dropped": (CompletionBody, {"model": "m", "prompt": [1, "a"]}, "prompt", "invalid_type"),
    "literal-member-dropped": (ChatBody, {"model": "m", "messages": USER, "tool_choice": "sometimes"},
                               "tool_choice", "invalid_value"),
    "by-alias": (ChatBody, {"model": "m", "messages": USER, "response_format": {"type": "json_schema",
                 "json_schema": {"name": "x", "schema": 3}}}, "response_format.json_schema.schema",
                 "invalid_type"),
    "nested-unknown-field": (CompletionBody, {"model": "m", "prompt": "hi", "stream_options": {"x": 1}},
                             "stream_options.x", "unknown_parameter"),
    "too-short": (ChatBody, {"model": "m", "messages": [{"role": "u", "tool_calls": [{"id": "c", "function": {
                  "name": "", "arguments": "{}"}}]}]}, "messages[0].tool_calls[0].function.name",
                  "invalid_value"),
}  # fmt: skip


@pytest.mark.parametrize("case", INVALID)
def test_a_body_that_does_not_validate_names_the_field_and_its_code(case: str) -> None:
    model, fields, param, code = INVALID[case]
    with pytest.raises(pydantic.ValidationError) as invalid:
        model.model_validate(fields)
    error = invalid.value.errors()[0]
    assert validation_param(("body", *error["loc"])) == param
    assert validation_code(error["type"]) == code


def test_a_union_members_model_is_no_field_and_the_body_itself_names_none() -> None:
    with pytest.raises(pydantic.ValidationError) as invalid:  # the literal fails, then NamedToolChoice
        chat(tool_choice={"type": "function", "function": {}})
    named = invalid.value.errors()[-1]
    assert validation_param(("body", *named["loc"])) == "tool_choice.function.name"
    assert validation_param(("body",)) is None  # e.g. a JSON array where an object belongs


@pytest.mark.parametrize(
    ("error_type", "code"), [("int_parsing", "invalid_type"), ("bool_type", "invalid_type"),
                             ("greater_than", "invalid_value"), ("extra_forbidden", "unknown_parameter")]
)  # fmt: skip
def test_pydantics_error_type_decides_the_code(error_type: str, code: str) -> None:
    assert validation_code(error_type) == code


# ---- GenerateChunks -> OpenAI's objects ------------------------------------------------------------


def chunk(text: str, finish: str = "", **stats: int) -> Any:
    return gateway_pb2.GenerateChunk(
        text=text, token_ids=[1] * len(text), session_id="s1", finish_reason=finish,
        stats=gateway_pb2.GenerationStats(**stats),
    )  # fmt: skip


@pytest.mark.parametrize("is_chat", [True, False], ids=["chat", "completions"])
def test_a_stream_gives_the_role_first_and_the_finish_and_stats_last(is_chat: bool) -> None:
    shape = ResponseShape(is_chat, "s1", "m")
    chunks = [chunk("He"), chunk("llo"), chunk("", "length", prompt_tokens=4, generated_tokens=5)]
    events = [shape.chunk(0, c, first=k == 0)[0] for k, c in enumerate(chunks)]
    assert all(len(e) == 1 for e in events)
    events = [e[0] for e in events]
    kind, prefix = ("chat.completion.chunk", "chatcmpl") if is_chat else ("text_completion", "cmpl")
    assert {(e["id"], e["object"], e["model"], e["created"]) for e in events} == {
        (f"{prefix}-s1", kind, "m", shape.created)
    }
    choices = [e["choices"] for e in events]
    texts = [{"role": "assistant", "content": "He"}, {"content": "llo"}, {}] if is_chat else ["He", "llo", ""]
    key = "delta" if is_chat else "text"
    assert choices == [[{"index": 0, "logprobs": None, "finish_reason": f, key: t}]
                       for f, t in zip([None, None, "length"], texts, strict=True)]  # fmt: skip
    assert ["stats" in e for e in events] == [False, False, True]
    assert events[-1]["stats"]["generated_tokens"] == 5 and "usage" not in events[-1]


def test_usage_counts_the_prompt_once_sums_the_completions_and_takes_the_most_cached() -> None:
    shape = ResponseShape(False, "s1", "m")
    lasts = [chunk("a", "stop", prompt_tokens=4, generated_tokens=3, cached_prompt_tokens=2),
             chunk("b", "length", prompt_tokens=4, generated_tokens=5, cached_prompt_tokens=3)]  # fmt: skip
    usage = {"prompt_tokens": 4, "completion_tokens": 8, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 3}}  # fmt: skip
    streamed = shape.usage_chunk(lasts)
    assert streamed["choices"] == [] and streamed["usage"] == usage and "stats" not in streamed
    whole = shape.whole([[chunk("x"), lasts[0]], [lasts[1]]])
    assert whole["usage"] == usage and "stats" not in whole  # several choices: each has its own
    assert [(c["text"], c["finish_reason"], c["stats"]["generated_tokens"]) for c in whole["choices"]] == [
        ("xa", "stop", 3), ("b", "length", 5)
    ]  # fmt: skip
    one = shape.usage_chunk(lasts[:1])
    assert one["usage"]["total_tokens"] == 7 and one["stats"]["generated_tokens"] == 3


AUTO = chat(tools=[TOOL])  # the model decides; its text is parsed (hermes)
CALL = '{"name":"f","arguments":{"a":1}}'


@pytest.mark.parametrize(
    ("body", "text", "finish", "want", "content"),
    [(FORCED, CALL, "stop", "tool_calls", None), (FORCED, CALL[:15], "length", "length", CALL[:15]),
     (AUTO, f"<tool_call>{CALL}</tool_call>", "length", "length", None)],
    ids=["forced", "forced-ran-out", "parsed-ran-out"],
)  # fmt: skip
def test_an_answer_with_calls_finishes_with_tool_calls_unless_it_ran_out(
    body: ChatBody, text: str, finish: str, want: str, content: str | None
) -> None:
    shape = ResponseShape(True, "s1", "m", tools=tool_plan(body, "hermes"))
    (choice,) = shape.whole([[chunk(text, finish)]])["choices"]
    message = choice["message"]
    assert (choice["finish_reason"], message["role"], message["content"]) == (want, "assistant", content)
    # a forced call cut short is no call: its JSON is given back as text
    calls = [c["function"] for c in message.get("tool_calls", [])]
    assert calls == ([] if content else [{"name": "f", "arguments": '{"a": 1}'}])
