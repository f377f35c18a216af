"""The structure-aware mutation: one field changed, the input still parsing, seeded."""

from __future__ import annotations

from swarmpipe.bench.decoder_targets import TARGETS, split_records
from swarmpipe.bench.field_mutator import mutate_fields
from swarmpipe.bench.fuzz_decoders import CORPUS_ROOT
from swarmpipe.protos import state_pb2


def _seed(target: str) -> bytes:
    """The target's first committed seed (built by scripts/gen_fuzz_corpus.py)."""
    return sorted((CORPUS_ROOT / target).glob("seed-*"))[0].read_bytes()


def test_a_mutated_input_still_parses_and_differs() -> None:
    target = TARGETS["tensor-wire"]
    data = _seed("tensor-wire")
    outputs = [mutate_fields(data, 1 << 16, seed, target.record_type) for seed in range(200)]
    assert outputs[:50] == [mutate_fields(data, 1 << 16, s, target.record_type) for s in range(50)]
    changed = [o for o in outputs if o is not None and o != data]
    assert len(changed) > 150
    for output in changed:
        records = split_records(output)
        assert records[0] == split_records(data)[0]  # the flags byte is not a message
        for i, record in enumerate(records):
            message_type = target.record_type(records, i)
            if message_type is not None:
                message_type.FromString(record)
        assert len(output) <= 1 << 16


def test_it_reaches_the_values_byte_mutations_do_not() -> None:
    # A state tensor past 64 dimensions of 2**62: what found check_manifest's ValueError.
    target = TARGETS["checkpoint-stream"]
    data = _seed("checkpoint-stream")
    hostile = 0
    for seed in range(3000):
        output = mutate_fields(data, 1 << 16, seed, target.record_type)
        if output is None:
            continue
        manifest = state_pb2.StateMessage.FromString(split_records(output)[1]).manifest
        hostile += any(len(t.shape) > 64 and max(t.shape) >= 1 << 62 for t in manifest.tensors)
    assert hostile > 0


def test_an_input_without_message_records_is_left_to_byte_mutations() -> None:
    target = TARGETS["checkpoint-file"]
    assert mutate_fields(_seed("checkpoint-file"), 1 << 16, 1, target.record_type) is None
