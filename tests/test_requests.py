"""gateway.requests on its own: what a GenerateRequest becomes, with a real (tiny) tokenizer and no
servers. The end-to-end refusals are in tests/test_gateway.py (BAD_INPUT)."""

from __future__ import annotations

import json

import pytest

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
    stored = stored_plan(plan)
    session = Session(
        id="s", tokens=[*plan.prompt_ids, 11], prompt_len=len(plan.prompt_ids), round=1,
        drafter="", verifier="", replica_lengths={}, max_new_tokens=stored["max_new_tokens"],
        sampling=stored["sampling"], speculation=stored["speculation"],
        extra=json.loads(json.dumps(stored["extra"])),  # as Redis gives it back: JSON
    )  # fmt: skip
    assert plan_from_session(session) == plan
    if plan.dsi is not None:  # a session stored before DSI resume kept only `true`
        session.extra["dsi"] = True
        assert plan_from_session(session).dsi == DsiSettings()
