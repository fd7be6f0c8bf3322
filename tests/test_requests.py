"""gateway.requests on its own: what a GenerateRequest becomes, with a real (tiny) tokenizer and no
servers. The end-to-end refusals are in tests/test_gateway.py (BAD_INPUT)."""

from __future__ import annotations

import json

import pytest

from gateway.config import key_list, parse_config
from gateway.requests import DsiSettings, ModelLimits, parse_generate_request, plan_from_session, stored_plan
from gateway.session_store import Session
from specmesh.bench.tiny import CHAT_TEMPLATE, make_tokenizer
from specmesh.rpc import wire
from specmesh.rpc.proto import load

gateway_pb2, _ = load("gateway")
LIMITS = ModelLimits(vocab_size=100, eos_token_id=2, max_context=256, max_new_tokens_limit=64,
                     default_max_new_tokens=8)  # fmt: skip


def chat_request(*contents: str) -> gateway_pb2.GenerateRequest:
    messages = [gateway_pb2.ChatMessage(role="w1", content=c) for c in contents]
    return gateway_pb2.GenerateRequest(chat=gateway_pb2.ChatPrompt(messages=messages))


def test_a_chat_is_rendered_with_the_template() -> None:
    tokenizer = make_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    plan = parse_generate_request(chat_request("w5 w6"), tokenizer, LIMITS)
    assert tokenizer.decode(plan.prompt_ids) == "w1 w5 w6 w0"


def test_a_chat_that_renders_to_no_tokens_is_refused() -> None:
    """Issue 14, finding 9: it reached the replicas as an empty prompt."""
    tokenizer = make_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{% endfor %}"  # renders nothing
    with pytest.raises(wire.WireError, match="render to no tokens") as error:
        parse_generate_request(chat_request("w5 w6"), tokenizer, LIMITS)
    assert error.value.field == "chat.messages"


def stored_session(plan) -> Session:
    """The session Redis gives back for a plan that committed one token (stored_plan)."""
    stored = stored_plan(plan)
    return Session(
        id="s", tokens=[*plan.prompt_ids, 11], prompt_len=len(plan.prompt_ids), round=1,
        drafter="", verifier="", replica_lengths={}, max_new_tokens=stored["max_new_tokens"],
        sampling=stored["sampling"], speculation=stored["speculation"],
        extra=json.loads(json.dumps(stored["extra"])),  # as Redis gives it back: JSON
    )  # fmt: skip


@pytest.mark.parametrize(
    "speculation",
    [
        gateway_pb2.Speculation(method="chain", depth=3),
        gateway_pb2.Speculation(dsi=True, depth=3, parallel=2),
        gateway_pb2.Speculation(dsi=True),
    ],
    ids=["chain", "dsi", "dsi-gateway-chooses"],
)
def test_what_redis_keeps_of_a_plan_gives_the_plan_back(speculation) -> None:
    """A resume rebuilds the plan from Redis (stored_plan -> plan_from_session), DSI included."""
    request = gateway_pb2.GenerateRequest(
        prompt_token_ids=gateway_pb2.TokenIds(ids=[5, 6, 7]), max_new_tokens=9, speculation=speculation,
        stop=["w9"], sampling=gateway_pb2.Sampling(temperature=0.7, seed=3),
    )  # fmt: skip
    plan = parse_generate_request(request, make_tokenizer(), LIMITS)
    session = stored_session(plan)
    assert plan_from_session(session) == plan
    if plan.dsi is not None:  # a session stored before DSI resume kept only `true`
        session.extra["dsi"] = True
        assert plan_from_session(session).dsi == DsiSettings()


@pytest.mark.parametrize(("asked", "key_private", "private"), [(False, False, False), (True, False, True),
                                                              (False, True, True)])  # fmt: skip
def test_a_private_request_or_a_private_keys_is_private_and_stays_so_on_a_resume(
    asked, key_private, private
) -> None:
    """Its output never teaches other sessions' suffix drafts (GenerateRequest.private, or its key
    in --private-api-keys); a resume elsewhere rebuilds the plan from Redis and keeps it."""
    request = gateway_pb2.GenerateRequest(prompt_token_ids=gateway_pb2.TokenIds(ids=[5, 6]), private=asked)
    plan = parse_generate_request(request, make_tokenizer(), LIMITS, private=key_private)
    assert plan.private is private and plan_from_session(stored_session(plan)).private is private


def test_private_api_keys_must_be_api_keys(capsys) -> None:
    base = ["--verifiers", "127.0.0.1:1", "--api-keys", "a,b"]
    assert key_list(parse_config([*base, "--private-api-keys", " b "]).private_api_keys) == [b"b"]
    with pytest.raises(SystemExit) as exc:
        parse_config([*base, "--private-api-keys", "b,c"])
    assert exc.value.code == 2
    assert "--private-api-keys: every key must also be one of --api-keys" in capsys.readouterr().err
