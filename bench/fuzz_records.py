"""The framing of a decoder fuzz input, shared by `decoder_targets.py` and
`stage_targets.py`: length-prefixed records, the flags byte, and what a crash is."""

from __future__ import annotations

import struct
from typing import Any

from google.protobuf.message import DecodeError

_LENGTH = struct.Struct("<H")
FIX_SIZES = 1
"""Flags bit 0: recompute payload lengths, crc32 and sha256 after parsing."""


def split_records(data: bytes) -> list[bytes]:
    """`data` cut into its length-prefixed records."""
    records = []
    at = 0
    while at + _LENGTH.size <= len(data):
        (length,) = _LENGTH.unpack_from(data, at)
        at += _LENGTH.size
        records.append(data[at : at + length])
        at += length
    return records


def join_records(records: list[bytes]) -> bytes:
    """The input `split_records` cuts into `records` (each under 64 KiB)."""
    return b"".join(_LENGTH.pack(len(r)) + r for r in records)


class Crash(AssertionError):
    """A decoder accepted an input and returned something its header did not promise."""


def flags_of(records: list[bytes]) -> int:
    return records[0][0] if records and records[0] else 0


def parse_or_none(message_type: type[Any], data: bytes) -> Any:
    """The message, or None where the request parser (request_parsing.py) would refuse it."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None
