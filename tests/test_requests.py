"""gateway.requests on its own: what a GenerateRequest becomes, with a real (tiny) tokenizer and no
servers. The end-to-end refusals are in tests/test_gateway.py (BAD_INPUT)."""

from __future__ import annotations

import pytest

from gateway.requests import ModelLimits, parse_generate_request
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
