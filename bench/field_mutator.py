"""A structure-aware mutation for the decoder fuzz: one protobuf field of one record changed.

libFuzzer's byte mutations rarely keep a protobuf message parsing, and almost never turn one
field into something hostile that still parses: a shape of three hundred 2**62s, a length of
2**64 - 1, a megabyte name. `mutate_fields` parses one record of an input as the message the
target says it is, changes one field (anywhere in it, nested messages too) to a value picked
from the edges of its type, and puts the record back with its length; the harness uses it for
half the mutations and libFuzzer's own for the rest (`decoder_fuzz_child.py`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from swarmpipe.bench.decoder_targets import join_records, split_records

_LIMITS = {
    FieldDescriptor.CPPTYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.CPPTYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.CPPTYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.CPPTYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.CPPTYPE_ENUM: (-(1 << 31), (1 << 31) - 1),
}
_REPEATS = (1, 2, 65, 300, 2000)
"""How many values a repeated field gets: around the 64-dimension limit, and far past it."""


def _integer(field: Any, old: int, rng: random.Random) -> int:
    low, high = _LIMITS[field.cpp_type]
    candidates = [0, 1, 2, 7, 64, 65, 255, 256, 4096, 1 << 20, 1 << 31, 1 << 32, 1 << 62]
    candidates += [high, high - 1, low, -1, old + 1, old - 1, old * 2, old // 2]
    return min(high, max(low, rng.choice(candidates)))


def _scalar(field: Any, old: Any, rng: random.Random, room: int) -> Any:
    cpp = field.cpp_type
    if cpp in _LIMITS:
        return _integer(field, int(old), rng)
    if cpp == FieldDescriptor.CPPTYPE_BOOL:
        return not old
    if cpp in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        return rng.choice([0.0, -0.0, -1.0, 1e-45, 3.4e38, 1e300, float("inf"), float("nan")])
    size = rng.choice([0, 1, len(old) // 2, len(old) * 2, 100, max(0, room // 2)])
    if cpp == FieldDescriptor.CPPTYPE_STRING and field.type == FieldDescriptor.TYPE_STRING:
        return (old * (size // max(1, len(old)) + 1))[:size] if old else "x" * size
    data = bytes(old) if old else b"\0"
    return (data * (size // len(data) + 1))[:size]


def _zero(field: Any) -> Any:
    """The zero value of a field's type (a repeated field's default_value is a list)."""
    if field.type == FieldDescriptor.TYPE_STRING:
        return ""
    if field.type == FieldDescriptor.TYPE_BYTES:
        return b""
    if field.cpp_type == FieldDescriptor.CPPTYPE_BOOL:
        return False
    if field.cpp_type in (FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE):
        return 0.0
    return 0


def _fields(message: Message) -> Iterator[tuple[Message, Any]]:
    """(message, field) for every field of `message` and of the messages set in it."""
    for field in message.DESCRIPTOR.fields:
        if field.cpp_type != FieldDescriptor.CPPTYPE_MESSAGE:
            yield message, field
            continue
        if field.is_repeated:
            for item in getattr(message, field.name):
                yield from _fields(item)
        elif message.HasField(field.name):
            yield from _fields(getattr(message, field.name))


def _mutate(message: Message, rng: random.Random, room: int) -> bool:
    fields = list(_fields(message))
    if not fields:
        return False
    owner, field = rng.choice(fields)
    if field.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
        return False
    if field.is_repeated:
        values = getattr(owner, field.name)
        if values and rng.random() < 0.3:
            del values[rng.randrange(len(values)) :]
            return True
        old = values[0] if values else _zero(field)
        value = _scalar(field, old, rng, room)
        # No more than fits the room: 2000 copies of a 32 KiB string built 180 MiB of message
        # only to throw it away, which showed as the decoder's peak memory.
        each = len(value) + 2 if isinstance(value, str | bytes) else 10
        values.extend([value] * min(rng.choice(_REPEATS), max(1, room // each)))
        return True
    setattr(owner, field.name, _scalar(field, getattr(owner, field.name), rng, room))
    return True


def mutate_fields(
    data: bytes,
    max_size: int,
    seed: int,
    record_type: Callable[[list[bytes], int], type[Message] | None],
) -> bytes | None:
    """`data` with one field of one message record changed, or None where it has no record
    that parses as its message (the caller then mutates bytes instead)."""
    rng = random.Random(seed)
    records = split_records(data)
    typed = [(i, t) for i in range(len(records)) if (t := record_type(records, i)) is not None]
    if not typed:
        return None
    index, message_type = rng.choice(typed)
    try:
        message = message_type.FromString(records[index])
    except DecodeError:
        return None
    room = max(0, min(max_size - len(data), 0xFFFF - len(records[index])))
    if not _mutate(message, rng, room):
        return None
    record = message.SerializeToString()
    if len(record) > 0xFFFF or len(data) - len(records[index]) + len(record) > max_size:
        return None
    records[index] = record
    return join_records(records)
