"""The public API's messages (proto/specmesh/v1/gateway.proto) and the stats that fill them."""

from __future__ import annotations

from google.protobuf import json_format

from gateway.api import gateway_pb2, gateway_pb2_grpc, stats_to_proto
from specmesh.core.stats import GenerationStats


def test_request_fields_and_json_form():
    request = json_format.ParseDict(
        {
            "prompt": "def f():",
            "max_new_tokens": 16,
            "stop": ["\n\n"],
            "sampling": {"temperature": 0.7, "top_k": 5, "top_p": 0.9, "seed": 3},
            "speculation": {"method": "rsd_s", "depth": 3, "beam_width": 2},
        },
        gateway_pb2.GenerateRequest(),
    )
    assert request.WhichOneof("input") == "prompt"
    assert request.sampling.HasField("seed") and request.sampling.seed == 3
    assert request.speculation.method == "rsd_s"
    chat = gateway_pb2.GenerateRequest(
        chat=gateway_pb2.ChatPrompt(messages=[gateway_pb2.ChatMessage(role="user", content="hi")])
    )
    assert chat.WhichOneof("input") == "chat"
    ids = gateway_pb2.GenerateRequest(prompt_token_ids=gateway_pb2.TokenIds(ids=[1, 2]))
    assert ids.WhichOneof("input") == "prompt_token_ids"
    assert not gateway_pb2.GenerateRequest().sampling.HasField("seed")  # unset: the gateway draws one


def test_service_and_response_fields():
    methods = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name
    assert not methods["Generate"].server_streaming and methods["GenerateStream"].server_streaming
    for message in (gateway_pb2.GenerateResponse, gateway_pb2.GenerateChunk):
        assert {"text", "token_ids", "finish_reason", "stats"} <= set(message.DESCRIPTOR.fields_by_name)
    assert hasattr(gateway_pb2_grpc, "GatewayStub") and hasattr(gateway_pb2_grpc, "GatewayServicer")


def test_stats_to_proto():
    stats = GenerationStats.for_round(
        drafted_tokens=4,
        accepted_tokens=2,
        tree_depth=3,
        draft_seconds=0.1,
        verify_seconds=0.2,
        total_seconds=0.5,
    ) + GenerationStats.for_round(drafted_tokens=4, accepted_tokens=0, tree_depth=3, total_seconds=0.1)
    message = stats_to_proto(stats, prompt_tokens=7, generated_tokens=4)
    assert (message.target_calls, message.rounds, message.drafted_tokens, message.accepted_tokens) == (
        2,
        2,
        8,
        2,
    )
    assert message.block_efficiency == 2.0
    assert list(message.acceptance_per_depth) == [0.5, 0.5, 0.0]
    assert abs(message.network_seconds - 0.3) < 1e-9
    assert (message.prompt_tokens, message.generated_tokens) == (7, 4)
