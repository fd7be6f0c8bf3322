"""Request bytes -> message, strictly: what every specmesh server's handlers are given.

protobuf's own parser is lenient where a server must not be. `decode` refuses, with a WireError
whose message starts with the field path (INVALID_ARGUMENT, counted like any other answer):

- bytes that are not the message at all: corrupt wire format, invalid UTF-8 in a string field
  (named by its path: `chat.messages[0].role`), which grpc's own deserializer turned into an
  uncounted UNKNOWN;
- unknown fields, at any depth: a known field number sent with the wrong wire type
  (`max_new_tokens` as bytes became its default), or a number the message does not have (a
  field from a newer .proto would otherwise be dropped without a word; docs/decisions.md);
- more than one member of a oneof, on the raw bytes of the top-level message (`prompt` and
  `chat`: the parser keeps the last one on the wire). Nested oneofs are not scanned (the APIs
  have none).

`decode` never raises: grpc calls it as the handlers' request_deserializer, so what it cannot
decode comes back as an `Undecodable`, which `specmesh.rpc.server.rpc` answers with its error.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf import message as pb_message
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.unknown_fields import UnknownFieldSet

from specmesh.rpc.wire import WireError

__all__ = ["Undecodable", "decode", "decoder"]

_VARINT, _I64, _LEN, _SGROUP, _EGROUP, _I32 = 0, 1, 2, 3, 4, 5
_WIRE_TYPES = {
    _VARINT: "varint",
    _I64: "64-bit",
    _LEN: "length-delimited",
    _SGROUP: "group start",
    _EGROUP: "group end",
    _I32: "32-bit",
}
_FIXED_SIZE = {_I64: 8, _I32: 4}
_F = FieldDescriptor
# fields a refused request's diagnosis looks at (~30 ms of Python), then protobuf's own words
_DIAGNOSE_FIELDS = 50_000
_TYPE_WIRE = {
    **dict.fromkeys((_F.TYPE_DOUBLE, _F.TYPE_FIXED64, _F.TYPE_SFIXED64), _I64),
    **dict.fromkeys((_F.TYPE_FLOAT, _F.TYPE_FIXED32, _F.TYPE_SFIXED32), _I32),
    **dict.fromkeys((_F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_MESSAGE), _LEN),
    _F.TYPE_GROUP: _SGROUP,
}  # every other type is a varint


@dataclass(frozen=True)
class Undecodable:
    """What a handler gets for request bytes `decode` refused; `error` says why."""

    error: WireError


def decoder(cls: type) -> Any:
    """A request_deserializer for messages of `cls` that never raises (see `decode`)."""
    return functools.partial(decode, cls)


def decode(cls: type, data: bytes) -> Any:
    """data -> a message of `cls`, or an Undecodable naming what is wrong (module docstring)."""
    try:
        msg = cls.FromString(data)
    except pb_message.DecodeError as exc:
        return Undecodable(_why_not(cls.DESCRIPTOR, data, exc))
    except Exception as exc:  # e.g. the recursion limit; never grpc's UNKNOWN
        return Undecodable(WireError("request", f"not a valid {cls.DESCRIPTOR.full_name}: {exc}"))
    try:
        _check_oneofs(cls.DESCRIPTOR, data)
        if _has_unknown(cls, msg, data):
            _check_unknown(msg, "")
    except WireError as exc:
        return Undecodable(exc)
    return msg


# ---- unknown fields ----------------------------------------------------------------------------


def _has_unknown(cls: type, msg: Any, data: bytes) -> bool:
    """Whether `msg` (parsed from `data`) holds unknown fields at any depth: a copy without them
    serializes shorter. Microseconds, where walking every sub-message takes a millisecond on a
    Verify request with hundreds of draft distributions."""
    bare = cls.FromString(data)
    bare.DiscardUnknownFields()
    return bare.ByteSize() != msg.ByteSize()


def _check_unknown(msg: Any, path: str) -> None:
    """Raises a WireError for the first unknown field of `msg`, at any depth."""
    desc = msg.DESCRIPTOR
    for unknown in UnknownFieldSet(msg):
        number, wire_type = unknown.field_number, unknown.wire_type
        sent = f"wire type {wire_type} ({_WIRE_TYPES.get(wire_type, '?')})"
        field = desc.fields_by_number.get(number)
        if field is not None:
            want = _TYPE_WIRE.get(field.type, _VARINT)
            raise WireError(
                _join(path, field.name),
                f"field {number} was sent with {sent}; {field.full_name} takes wire type {want} "
                f"({_WIRE_TYPES[want]})",
            )
        raise WireError(
            path or "request",
            f"unknown field number {number} ({sent}): {desc.full_name} has no such field "
            "(a client built from a newer .proto?)",
        )
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        name = _join(path, field.name)
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    _check_unknown(item, f"{name}[{key!r}]")
        elif field.is_repeated:
            for i, item in enumerate(value):
                _check_unknown(item, f"{name}[{i}]")
        else:
            _check_unknown(value, name)


# ---- oneofs ------------------------------------------------------------------------------------


def _check_oneofs(desc: Descriptor, data: bytes) -> None:
    shadow = _oneof_shadow(desc)
    if shadow is None:
        return
    sent = {f.name for f, values in shadow.FromString(data).ListFields() if values}
    for oneof in desc.oneofs:
        names = [f.name for f in oneof.fields if f.name in sent]
        if len(names) > 1:
            alternatives = ", ".join(f.name for f in oneof.fields)
            raise WireError(
                names[0],
                f"sent together with {', '.join(names[1:])}; send exactly one of {alternatives} "
                f"(oneof {oneof.name})",
            )


@functools.cache
def _oneof_shadow(desc: Descriptor) -> Any:
    """A message class that reads `desc`'s bytes with the members of its oneofs (those of more
    than one member: a proto3 `optional` is a oneof of one) as plain repeated fields, everything
    else unknown: which members the bytes hold, parsed at protobuf's speed (a Python scan of 4 MB
    of tiny fields takes half a second). None: no such oneof."""
    members = [f for o in desc.oneofs if len(o.fields) > 1 for f in o.fields]
    if not members:
        return None
    proto = descriptor_pb2.FileDescriptorProto(
        name=f"specmesh/shadow/{desc.full_name}.proto", package="specmesh.shadow", syntax="proto3"
    )
    shadow = proto.message_type.add(name=desc.name)
    for f in members:
        if f.type in (_F.TYPE_MESSAGE, _F.TYPE_STRING, _F.TYPE_BYTES):
            kind = _F.TYPE_BYTES  # the same wire type, no nested type (nor UTF-8 check) needed
        else:
            kind = _F.TYPE_INT32 if f.type == _F.TYPE_ENUM else f.type
        shadow.field.add(name=f.name, number=f.number, type=kind, label=_F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    return message_factory.GetMessageClass(pool.Add(proto).message_types_by_name[desc.name])


# ---- the wire format ---------------------------------------------------------------------------


class _Corrupt(Exception):
    def __init__(self, pos: int, problem: str) -> None:
        super().__init__(f"{problem} at byte {pos} of the request")


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    start, value, shift = pos, 0, 0
    while pos < end:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise _Corrupt(start, "a varint longer than 10 bytes")
    raise _Corrupt(start, "a truncated varint")


def _fields(data: bytes, pos: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """The fields of one message in data[pos:end]: (number, wire type, value start, value end);
    raises _Corrupt where the bytes are not the wire format."""
    while pos < end:
        tag_at = pos
        number, wire_type, pos = _tag(data, pos, end)
        start, pos = _skip(data, pos, end, number, wire_type, tag_at)
        yield number, wire_type, start, pos


def _tag(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    tag, after = _varint(data, pos, end)
    if tag >> 3 == 0:
        raise _Corrupt(pos, "field number 0")
    return tag >> 3, tag & 7, after


def _skip(data: bytes, pos: int, end: int, number: int, wire_type: int, tag_at: int) -> tuple[int, int]:
    """The start and end of the value of field `number`, whose tag ends at `pos` (a
    length-delimited value starts after its length)."""
    start = pos
    if wire_type == _VARINT:
        _, pos = _varint(data, pos, end)
    elif wire_type in _FIXED_SIZE:
        pos += _FIXED_SIZE[wire_type]
    elif wire_type == _LEN:
        size, start = _varint(data, pos, end)
        pos = start + size
    elif wire_type == _SGROUP:  # proto2 groups: parsed as unknown fields, stepped over here
        while True:
            if pos >= end:
                raise _Corrupt(tag_at, f"group {number} never ended")
            inner_at = pos
            inner, inner_type, pos = _tag(data, pos, end)
            if inner_type == _EGROUP:
                if inner != number:
                    raise _Corrupt(inner_at, f"group {number} ended as group {inner}")
                break
            _, pos = _skip(data, pos, end, inner, inner_type, inner_at)
    elif wire_type == _EGROUP:
        raise _Corrupt(tag_at, f"an end of group {number} that was never started")
    else:
        raise _Corrupt(tag_at, f"wire type {wire_type}, which does not exist")
    if pos > end:
        raise _Corrupt(tag_at, f"field {number} running past the end of its message")
    return start, pos


def _why_not(desc: Descriptor, data: bytes, exc: Exception) -> WireError:
    """The first problem in bytes protobuf could not parse, named by its field path if it has one."""
    try:
        found = _first_problem(desc, data, 0, len(data), "", [_DIAGNOSE_FIELDS])
    except (RecursionError, _OverBudget):
        found = None
    if found is not None:
        return found
    return WireError("request", f"not a valid {desc.full_name}: {exc}")


class _OverBudget(Exception):
    pass


def _first_problem(
    desc: Descriptor, data: bytes, pos: int, end: int, path: str, budget: list[int]
) -> WireError | None:
    counts: dict[int, int] = {}
    try:
        for number, wire_type, start, stop in _fields(data, pos, end):
            budget[0] -= 1
            if budget[0] < 0:
                raise _OverBudget
            field = desc.fields_by_number.get(number)
            if field is None or wire_type != _LEN or field.type not in (_F.TYPE_STRING, _F.TYPE_MESSAGE):
                continue
            name = _join(path, field.name)
            if field.is_repeated:
                name = f"{name}[{counts.get(number, 0)}]"
                counts[number] = counts.get(number, 0) + 1
            if field.type == _F.TYPE_STRING:
                try:
                    data[start:stop].decode()
                except UnicodeDecodeError as bad:
                    return WireError(name, f"not valid UTF-8 (byte {bad.start} of the string)")
            else:
                found = _first_problem(field.message_type, data, start, stop, name, budget)
                if found is not None:
                    return found
    except _Corrupt as corrupt:
        return WireError(path or "request", f"not a valid {desc.full_name}: the wire format has {corrupt}")
    return None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
