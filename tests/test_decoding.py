"""`decode` on its own (specmesh/rpc/decoding.py): request bytes -> a message of the class, or an
`Undecodable` whose WireError names the field path: corrupt wire format, invalid UTF-8 in string
fields, unknown fields at any depth (numbers the message lacks, known numbers with the wrong wire
type), more than one member of a top-level oneof; and it never raises. Malformed requests are
hand-written wire bytes. The gateway's answers to such bytes over gRPC are tests/test_gateway.py's."""

from __future__ import annotations

import pytest
from google.protobuf.message import Message

from specmesh.rpc import decoding
from specmesh.rpc.decoding import Undecodable, decode
from specmesh.rpc.proto import load, pb2
from specmesh.rpc.wire import WireError

gw, _ = load("gateway")
VARINT, I64, LEN, SGROUP, EGROUP, I32 = 0, 1, 2, 3, 4, 5


def varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes([*out, n])


def field(number: int, wire_type: int, payload: bytes = b"") -> bytes:
    """One field on the wire: its tag, then the payload (length-prefixed when length-delimited)."""
    length = varint(len(payload)) if wire_type == LEN else b""
    return varint(number << 3 | wire_type) + length + payload


def refusal(cls: type, data: bytes) -> WireError:
    result = decode(cls, data)
    assert isinstance(result, Undecodable), result
    assert str(result.error).startswith(f"{result.error.field}: ")  # servers answer it as it is
    return result.error


# ---- valid requests --------------------------------------------------------------------------------

VALID: dict[str, Message] = {
    "verify": pb2.VerifyRequest(
        session_id="s-ü",
        position=2**40,
        new_token_ids=[0, 7, 2**32 - 1],
        tree=pb2.DraftTree(
            tokens=[3, 4],
            parents=[-1, 0],
            mode=pb2.SAMPLING_MODE_MTAD,
            draft_probs=[pb2.Distribution(token_ids=b"\xff\xfe", probs=b"\x00\x80")],  # bytes: not UTF-8
            prob_rows=[0, -1, -1],
            mtad_threshold=0.25,
        ),
        sampling=pb2.SamplingParams(temperature=0.7, top_k=-1, top_p=0.0, seed=9),
        top_logprobs=0,  # optional: present though zero
        grammar=pb2.Grammar(text="root ::= [a-z]+", start=1),
    ),
    "draft-tick": pb2.DraftTick(
        id=1,
        open=[pb2.TickSession(handle=1, session_id="a"), pb2.TickSession(prefix_salt=b"\xc0")],
        specs=[pb2.TreeSpec(method="rsd_s", depth=3, beam_width=2, mtad_threshold=0.5)],
        flags=b"\x07",
    ),
    "verify-tick": pb2.VerifyTick(trees=pb2.Trees(tokens=pb2.Ragged(offsets=b"\x00" * 8), vocab_size=50)),
    "relay": pb2.VerifyRequestRelay(session_id="r", tree=b"\xff\xff\xff"),  # relayed undecoded
    "generate-chat": gw.GenerateRequest(
        chat=gw.ChatPrompt(messages=[gw.ChatMessage(role="user", content="日本")]),
        max_new_tokens=0,
        stop=["\n", ""],
        constraint=gw.Constraint(json_object=False),
    ),
    "generate-empty-prompt": gw.GenerateRequest(prompt=""),
    "info": pb2.InfoRequest(),
}


@pytest.mark.parametrize("name", list(VALID))
def test_a_valid_message_round_trips_to_an_equal_message(name: str) -> None:
    message = VALID[name]
    decoded = decode(type(message), message.SerializeToString())
    assert type(decoded) is type(message)
    assert decoded == message
    # presence survives too: optionals set to zero (top_logprobs, max_new_tokens) stay set
    assert [f.name for f, _ in decoded.ListFields()] == [f.name for f, _ in message.ListFields()]


def test_the_deserializer_is_decode_bound_to_the_class() -> None:
    deserialize = decoding.decoder(pb2.ReleaseRequest)
    assert deserialize(field(1, LEN, b"s")) == pb2.ReleaseRequest(session_id="s")
    assert str(deserialize(field(2, VARINT, b"\x01")).error).startswith("request: unknown field number 2")


def test_repeated_scalars_are_accepted_packed_and_unpacked() -> None:
    # a repeated varint may arrive as wire type 0 or packed (2): neither is a wrong wire type
    data = field(3, VARINT, b"\x05") + field(3, LEN, b"\x06\x07")
    assert decode(pb2.VerifyRequest, data) == pb2.VerifyRequest(new_token_ids=[5, 6, 7])


def test_every_cut_of_a_valid_request_decodes_its_prefix_or_is_refused_as_corrupt() -> None:
    message = VALID["verify"]
    data = message.SerializeToString()
    fields = [f for f, _ in message.ListFields()]
    # the request's top-level field boundaries: a cut there is the message of the fields before it
    prefixes = {}
    for kept in range(len(fields) + 1):
        prefix = pb2.VerifyRequest()
        prefix.CopyFrom(message)
        for f in fields[kept:]:
            prefix.ClearField(f.name)
        prefixes[prefix.ByteSize()] = prefix
    assert len(prefixes) == len(fields) + 1 and max(prefixes) == len(data)
    for cut in range(len(data)):
        result = decode(pb2.VerifyRequest, data[:cut])
        if cut in prefixes:
            assert result == prefixes[cut], cut
        else:  # inside a field at any depth: the top-level field runs past the request's end
            assert isinstance(result, Undecodable), cut
            assert result.error.field == "request", (cut, result.error)


# ---- corrupt wire format ---------------------------------------------------------------------------

REQ = "request: not a valid specmesh.v1.VerifyRequest: the wire format has "
CORRUPT: dict[str, tuple[bytes, str]] = {
    "varint-over-10-bytes": (
        b"\x10" + b"\xff" * 10 + b"\x01",
        REQ + "a varint longer than 10 bytes at byte 1",
    ),
    "truncated-varint": (b"\x10\x80", REQ + "a truncated varint at byte 1"),
    "wire-type-6": (field(1, LEN, b"s") + b"\x0e", REQ + "wire type 6, which does not exist at byte 3"),
    "group-never-ended": (field(20, SGROUP), REQ + "group 20 never ended at byte 0"),
    "group-ended-as-another": (
        field(20, SGROUP) + field(21, EGROUP),
        REQ + "group 20 ended as group 21 at byte 2",
    ),
    "group-end-never-started": (
        field(20, EGROUP),
        REQ + "an end of group 20 that was never started at byte 0",
    ),
    # the position is the request's, the message the innermost one whose bytes are wrong
    "field-0-in-sampling": (
        field(5, LEN, b"\x00\x01"),
        "sampling: not a valid specmesh.v1.SamplingParams: the wire format has field number 0 at byte 2",
    ),
    # a sub-message ends where its parent says, not at the end of the request
    "past-the-end-of-the-tree": (
        field(4, LEN, b"\x22\x05ab") + field(1, LEN, b"s"),  # draft_probs of 5 bytes, 2 in the tree
        "tree: not a valid specmesh.v1.DraftTree: the wire format has field 4 running past the end "
        "of its message at byte 2",
    ),
    "truncated-in-a-distribution": (
        field(4, LEN, field(4, LEN, b"\x08\x80")),
        "tree.draft_probs[0]: not a valid specmesh.v1.Distribution: the wire format has a truncated "
        "varint at byte 5",
    ),
}


@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_wire_format_names_the_innermost_message_and_the_byte(case: str) -> None:
    data, want = CORRUPT[case]
    assert str(refusal(pb2.VerifyRequest, data)) == f"{want} of the request"


def test_a_diagnosis_protobuf_refuses_but_the_scan_cannot_place_gets_protobufs_words() -> None:
    # 200 nested (well-formed) unknown groups: past protobuf's depth limit, nothing to name
    deep = field(20, SGROUP) * 200 + field(20, EGROUP) * 200
    error = refusal(pb2.VerifyRequest, deep)
    assert error.field == "request"
    assert str(error).startswith("request: not a valid specmesh.v1.VerifyRequest: Error parsing")


def test_the_diagnosis_looks_at_a_bounded_number_of_fields() -> None:
    bad_string = field(1, LEN, b"\xff")
    padding = field(2, VARINT, b"\x01")
    within = padding * (decoding._DIAGNOSE_FIELDS - 1) + bad_string
    assert refusal(pb2.VerifyRequest, within).field == "session_id"
    # one field more: the scan stops and protobuf's message stands (still a refusal)
    beyond = padding + within
    assert refusal(pb2.VerifyRequest, beyond).field == "request"


# ---- invalid UTF-8 ---------------------------------------------------------------------------------

UTF8: dict[str, tuple[type, bytes, str, int]] = {
    "truncated-sequence": (pb2.ReleaseRequest, field(1, LEN, b"ab\xe2\x82"), "session_id", 2),
    # the index counts only that field's occurrences, whatever lies between them
    "second-open-session": (
        pb2.DraftTick,
        field(2, LEN, field(1, VARINT, b"\x01"))
        + field(6, LEN)
        + field(2, LEN, field(7, LEN, field(1, LEN, b"ok\xc3"))),
        "open[1].grammar.text",
        2,
    ),
    "overlong-key": (pb2.VerifyTick, field(2, LEN, field(3, LEN, b"\xc0\xaf")), "open[0].key", 0),
    "tool-call-id-in-chat": (
        gw.GenerateRequest,
        field(3, LEN, field(1, LEN, field(1, LEN, b"user")) + field(1, LEN, field(4, LEN, b"id\xff"))),
        "chat.messages[1].tool_call_id",
        2,
    ),
}


@pytest.mark.parametrize("case", list(UTF8))
def test_invalid_utf8_names_the_string_fields_path_and_byte(case: str) -> None:
    cls, data, path, byte = UTF8[case]
    error = refusal(cls, data)
    assert error.field == path
    assert str(error) == f"{path}: not valid UTF-8 (byte {byte} of the string)"


def test_bytes_fields_are_not_checked_for_utf8_nor_parsed() -> None:
    garbage = b"\xff\xff\xff"  # not UTF-8, not the wire format
    assert decode(pb2.VerifyRequestRelay, field(4, LEN, garbage)).tree == garbage
    assert decode(pb2.Distribution, field(2, LEN, garbage)).probs == garbage
    # the same bytes where a DraftTree is expected are refused
    assert refusal(pb2.VerifyRequest, field(4, LEN, garbage)).field == "tree"


# ---- unknown fields --------------------------------------------------------------------------------

WRONG_WIRE_TYPE: dict[str, tuple[type, bytes, str, str]] = {
    "uint64-as-64-bit": (
        pb2.VerifyRequest,
        field(2, I64, bytes(8)),
        "position",
        "field 2 was sent with wire type 1 (64-bit); specmesh.v1.VerifyRequest.position takes wire type 0",
    ),
    "string-as-group": (
        pb2.ReleaseRequest,
        field(1, SGROUP) + field(1, EGROUP),
        "session_id",
        "field 1 was sent with wire type 3 (group start); specmesh.v1.ReleaseRequest.session_id takes "
        "wire type 2 (length-delimited)",
    ),
    "repeated-message-as-varint": (
        pb2.DraftTick,
        field(6, VARINT, b"\x01"),
        "specs",
        "field 6 was sent with wire type 0 (varint); specmesh.v1.DraftTick.specs takes wire type 2",
    ),
    "double-as-32-bit-in-an-open-session": (
        pb2.VerifyTick,
        field(2, LEN, field(4, LEN, field(3, I32, bytes(4)))),
        "open[0].sampling.top_p",
        "field 3 was sent with wire type 5 (32-bit); specmesh.v1.SamplingParams.top_p takes wire type 1",
    ),
    "bytes-as-varint-in-the-second-distribution": (
        pb2.VerifyRequest,
        field(4, LEN, field(4, LEN) + field(4, LEN, field(2, VARINT, b"\x01"))),
        "tree.draft_probs[1].probs",
        "field 2 was sent with wire type 0 (varint); specmesh.v1.Distribution.probs takes wire type 2",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_WIRE_TYPE))
def test_a_known_field_with_the_wrong_wire_type_is_refused_at_its_path(case: str) -> None:
    cls, data, path, problem = WRONG_WIRE_TYPE[case]
    lenient = cls.FromString(data)
    assert lenient.ByteSize() > 0  # protobuf kept it aside as unknown, the field stayed its default
    error = refusal(cls, data)
    assert error.field == path
    assert str(error).startswith(f"{path}: {problem}")


UNKNOWN_NUMBER: dict[str, tuple[type, bytes, str, str]] = {
    "top-level": (pb2.ReleaseRequest, field(2, VARINT, b"\x01"), "request", "2 (wire type 0 (varint))"),
    "in-an-empty-message": (pb2.InfoRequest, field(1, LEN, b"x"), "request", "1 (wire type 2"),
    "a-group": (pb2.VerifyRequest, field(20, SGROUP) + field(20, EGROUP), "request", "20 (wire type 3"),
    "three-deep": (
        pb2.VerifyTick,
        field(6, LEN, field(7, LEN, field(9, VARINT, b"\x01"))),
        "trees.row_ids",
        "9 (wire type 0",
    ),
    "in-the-third-distribution": (
        pb2.VerifyRequest,
        field(4, LEN, field(4, LEN) * 2 + field(4, LEN, field(3, I32, bytes(4)))),
        "tree.draft_probs[2]",
        "3 (wire type 5 (32-bit))",
    ),
    "after-a-clean-sibling": (
        pb2.DraftTick,
        field(2, LEN, field(7, LEN, field(1, LEN, b"g")))
        + field(2, LEN, field(7, LEN, field(5, VARINT, b"\x01"))),
        "open[1].grammar",
        "5 (wire type 0",
    ),
}


@pytest.mark.parametrize("case", list(UNKNOWN_NUMBER))
def test_a_field_number_the_message_lacks_is_refused_at_any_depth(case: str) -> None:
    cls, data, path, number = UNKNOWN_NUMBER[case]
    error = refusal(cls, data)
    assert error.field == path
    assert str(error).startswith(f"{path}: unknown field number {number}")
    # the message named is the one at that path
    target = cls.DESCRIPTOR
    for part in path.split(".") if path != "request" else ():
        target = target.fields_by_name[part.split("[")[0]].message_type
    assert f"{target.full_name} has no such field" in str(error)


# ---- oneofs ----------------------------------------------------------------------------------------

PROMPT, TOKEN_IDS, CHAT = field(1, LEN, b"w1"), field(2, LEN, field(1, LEN, b"\x01")), field(3, LEN)


def test_all_members_of_a_oneof_are_named_in_declaration_order() -> None:
    error = refusal(gw.GenerateRequest, CHAT + TOKEN_IDS + PROMPT)
    assert str(error) == (
        "prompt: sent together with prompt_token_ids, chat; "
        "send exactly one of prompt, prompt_token_ids, chat (oneof input)"
    )


@pytest.mark.parametrize(
    ("cls", "data", "first", "other"),
    [
        # an empty prompt and an empty chat are still on the wire: the parser would keep the chat
        (gw.GenerateRequest, field(1, LEN) + field(3, LEN), "prompt", "chat"),
        # any message's own oneofs, a false bool member included
        (gw.Constraint, field(3, LEN, b"a") + field(2, VARINT, b"\x00"), "json_object", "regex"),
        (gw.Constraint, field(4, LEN, b"start: x") + field(3, LEN, b"a"), "regex", "lark"),
    ],
    ids=["empty-prompt-and-chat", "false-json-object-and-regex", "lark-and-regex"],
)
def test_two_members_of_a_top_level_oneof_are_refused_empty_or_false_ones_too(
    cls, data, first, other
) -> None:
    error = refusal(cls, data)
    assert error.field == first
    assert str(error).startswith(f"{first}: sent together with {other}; send exactly one of")


def test_one_member_or_optional_sent_twice_is_not_two_members() -> None:
    # the same member (or a proto3 optional, a oneof of one) twice: the last one on the wire wins
    data = PROMPT + field(1, LEN, b"w2") + field(4, VARINT, b"\x03") + field(4, VARINT, b"\x05")
    assert decode(gw.GenerateRequest, data) == gw.GenerateRequest(prompt="w2", max_new_tokens=5)


# ---- never raises ----------------------------------------------------------------------------------


def test_nesting_past_pythons_recursion_limit_is_an_undecodable() -> None:
    deep = field(20, SGROUP) * 5000 + field(20, EGROUP) * 5000
    assert refusal(pb2.VerifyRequest, deep).field == "request"


@pytest.mark.parametrize("cls", [pb2.VerifyRequest, gw.GenerateRequest])
def test_any_single_byte_change_gives_a_message_or_an_undecodable(cls) -> None:
    data = VALID["verify" if cls is pb2.VerifyRequest else "generate-chat"].SerializeToString()
    for i in range(len(data)):
        for byte in (0x00, 0x07, 0x0B, 0x80, 0xFF):
            changed = data[:i] + bytes([byte]) + data[i + 1 :]
            result = decode(cls, changed)  # must not raise
            if isinstance(result, Undecodable):
                assert str(result.error).startswith(f"{result.error.field}: "), (i, byte)
            else:  # what it accepted is a clean message: it decodes again to itself
                assert type(result) is cls and decode(cls, result.SerializeToString()) == result
