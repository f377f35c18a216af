"""Seeded fuzz inputs for one RPC: random bytes, and a valid request message mutated.

Pure: a method's descriptor and a seed give the same inputs on every machine, so a failure
a run reports is replayed by running it again with its seed. Each input is the list of
messages one call sends (one for a unary request; for a client stream the mutated message
may come after valid ones, so the server meets it mid-stream).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

KINDS = ("random", "truncated", "bit_flips", "huge_length", "bad_varint", "valid")
"""How an input was made, in the order they take turns; `valid` is the unmutated message, a
control that shows the method answers at all."""
RANDOM_MAX_BYTES = 4096
MAX_DEPTH = 3
"""Nested messages filled this deep: enough to reach every field of our protos."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FuzzInput:
    """The messages of one call, how they were made, and whether the server can parse them."""

    kind: str
    """One of KINDS."""
    messages: list[bytes]
    """What the call sends, in order; one message unless the method is client-streaming."""
    parses: bool
    """Whether every message parses as the method's request type (computed locally with the
    same descriptor): when it does not, the only right answer is INVALID_ARGUMENT."""


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _scalar(field: Any, rng: random.Random) -> object:
    # `field: Any`: the stubs type a field as the union of upb's and pure Python's classes.
    t = field.type
    if t == FieldDescriptor.TYPE_BOOL:
        return rng.random() < 0.5
    if t in (FieldDescriptor.TYPE_STRING,):
        return "".join(rng.choice("abcdefghij0123456789-_") for _ in range(rng.randint(1, 12)))
    if t == FieldDescriptor.TYPE_BYTES:
        return rng.randbytes(rng.randint(1, 64))
    if t in (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE):
        return rng.choice([0.5, -1.0, 3.25, 1e6, 1e-3])
    if t == FieldDescriptor.TYPE_ENUM:
        assert field.enum_type is not None
        return rng.choice(field.enum_type.values).number
    signed = t in (
        FieldDescriptor.TYPE_INT32,
        FieldDescriptor.TYPE_INT64,
        FieldDescriptor.TYPE_SINT32,
        FieldDescriptor.TYPE_SINT64,
        FieldDescriptor.TYPE_SFIXED32,
        FieldDescriptor.TYPE_SFIXED64,
    )
    value = rng.choice([1, 2, 7, 100, 4096])
    return -value if signed and rng.random() < 0.3 else value


def fill(message: Message, rng: random.Random, depth: int = 0) -> Message:
    """Set a seeded value in every field (one member of each oneof, one or two elements of
    each repeated field, no map entries), `MAX_DEPTH` messages deep."""
    descriptor = message.DESCRIPTOR
    chosen = {oneof.name: rng.choice([f.name for f in oneof.fields]) for oneof in descriptor.oneofs}
    for field in descriptor.fields:
        oneof = field.containing_oneof
        if oneof is not None and chosen[oneof.name] != field.name:
            continue
        repeated = field.is_repeated
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE
        if (
            is_message
            and field.message_type is not None
            and field.message_type.GetOptions().map_entry
        ):
            continue
        if is_message:
            if depth >= MAX_DEPTH:
                continue
            for _ in range(rng.randint(1, 2) if repeated else 1):
                child = getattr(message, field.name).add() if repeated else None
                if child is None:
                    child = getattr(message, field.name)
                    child.SetInParent()
                fill(child, rng, depth + 1)
        elif repeated:
            getattr(message, field.name).extend(
                _scalar(field, rng) for _ in range(rng.randint(1, 2))
            )
        else:
            setattr(message, field.name, _scalar(field, rng))
    return message


def _length_delimited_numbers(descriptor: Descriptor) -> list[int]:
    numbers = [
        f.number
        for f in descriptor.fields
        if f.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING,
                      FieldDescriptor.TYPE_BYTES)
    ]  # fmt: skip
    return numbers or [1]


def _mutate(kind: str, valid: bytes, descriptor: Descriptor, rng: random.Random) -> bytes:
    if kind == "random":
        # Mostly short, sometimes up to RANDOM_MAX_BYTES: log-uniform lengths.
        return rng.randbytes(int(2 ** rng.uniform(0, RANDOM_MAX_BYTES.bit_length() - 1)))
    if kind == "truncated":
        return valid[: rng.randrange(len(valid))] if len(valid) > 1 else b"\x0a"
    if kind == "bit_flips":
        data = bytearray(valid or b"\x00")
        for _ in range(rng.randint(1, 4)):
            bit = rng.randrange(len(data) * 8)
            data[bit // 8] ^= 1 << (bit % 8)
        return bytes(data)
    if kind == "huge_length":
        # A length-delimited field that promises far more bytes than any message has (up to
        # the largest varint), placed where a parser meets it first, last or in the middle.
        number = rng.choice(_length_delimited_numbers(descriptor))
        length = rng.choice([2**24, 2**31 - 1, 2**32, 2**63, 2**64 - 1])
        field = _varint(number << 3 | 2) + _varint(length) + rng.randbytes(rng.randint(0, 16))
        cut = rng.choice([0, len(valid), rng.randint(0, len(valid))])
        return valid[:cut] + field if cut == len(valid) else field + valid[cut:]
    if kind == "bad_varint":
        # Eleven continuation bytes: longer than any varint may be.
        number = rng.choice([f.number for f in descriptor.fields] or [1])
        return valid + _varint(number << 3) + b"\xff" * 11
    assert kind == "valid"
    return valid


def _parses(request_type: type[Message], data: bytes) -> bool:
    try:
        request_type.FromString(data)
    except DecodeError:
        return False
    return True


def fuzz_inputs(
    request: Descriptor, *, client_streaming: bool, count: int, seed: int
) -> Iterator[FuzzInput]:
    """`count` inputs for a method whose request type is `request`, the same for a seed."""
    request_type = GetMessageClass(request)
    rng = random.Random(f"{seed}:{request.full_name}")
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        valid = fill(request_type(), rng).SerializeToString()
        data = _mutate(kind, valid, request, rng)
        messages = [data]
        if client_streaming and rng.random() < 0.5:
            prefix = fill(request_type(), rng).SerializeToString()
            messages = [prefix] * rng.randint(1, 3) + messages
        yield FuzzInput(
            kind=kind,
            messages=messages,
            parses=all(_parses(request_type, m) for m in messages),
        )
