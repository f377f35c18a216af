"""The fuzz's inputs: the same for a seed, every kind made, and `parses` told truly."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from google.protobuf.message import DecodeError

from swarmpipe.bench.fuzz_inputs import KINDS, fill, fuzz_inputs
from swarmpipe.bench.rpc_fuzzer import check_target
from swarmpipe.errors import ConfigError
from swarmpipe.protos import coordinator_pb2, stage_pb2, state_pb2


def _parses(message_type: type, data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except DecodeError:
        return False
    return True


@pytest.mark.parametrize(
    ("message_type", "streaming"),
    [
        (coordinator_pb2.JoinRequest, False),
        (stage_pb2.ForwardMessage, True),
        (state_pb2.StateMessage, True),
    ],
)
def test_inputs_are_seeded_and_say_whether_they_parse(message_type: type, streaming: bool) -> None:
    def make(seed: int) -> list:
        return list(
            fuzz_inputs(message_type.DESCRIPTOR, client_streaming=streaming, count=60, seed=seed)
        )

    inputs = make(7)
    assert inputs == make(7)
    assert inputs != make(8)
    assert Counter(i.kind for i in inputs) == {kind: 60 // len(KINDS) for kind in KINDS}
    for data in inputs:
        assert data.parses == all(_parses(message_type, m) for m in data.messages)
        assert len(data.messages) == 1 or streaming
    assert all(i.parses for i in inputs if i.kind == "valid")
    assert all(not i.parses for i in inputs if i.kind in ("huge_length", "bad_varint"))
    assert sum(not i.parses for i in inputs) > len(inputs) // 2


def test_fill_sets_nested_fields() -> None:
    message = fill(stage_pb2.ForwardMessage(), random.Random(0))
    assert message.WhichOneof("kind") is not None
    assert message.ByteSize() > 0


def test_only_loopback_is_a_target() -> None:
    check_target("127.0.0.1:5000")
    for target in ("10.0.0.1:5000", "localhost:5000", "[::1]:5000", "example.com:443"):
        with pytest.raises(ConfigError):
            check_target(target)
