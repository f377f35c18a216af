"""The decoders `swarmpipe bench fuzz-decoders` fuzzes: one function of bytes per target.

Each target turns fuzzer bytes into what a peer could send one of our decoders, runs that
decoder and the checks our servicers make right after it, and checks what comes out. An
input may fail only with the errors the target names (`Target.refusals`, the types the
caller of that decoder catches and turns into INVALID_ARGUMENT or a log line); any other
exception, or an accepted input whose result breaks the header's promise (shape, dtype,
size), is a crash. Hangs and memory are bounded by the harness (`decoder_fuzz_child.py`).

An input is a list of records, each a 2-byte little-endian length and that many bytes (a
last record cut short is taken as it is), so mutations that grow or shrink one message do
not shift the others. The first record of most targets is a flags byte: bit 0 asks the
target to recompute the sizes and digests a mutated message would otherwise fail (payload
length, crc32, sha256), so the fuzzer gets past them into the decoding itself.

`decoder_seeds.seed_inputs` builds the valid inputs `scripts/gen_fuzz_corpus.py` commits under
tests/fuzz/corpus/<target>/; each decodes without an error.
"""

from __future__ import annotations

import hashlib
import mmap
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from google.protobuf.message import Message

from swarmpipe.bench.fuzz_records import (
    FIX_SIZES,
    Crash,
    flags_of,
    join_records,
    parse_or_none,
    split_records,
)
from swarmpipe.errors import CodecError, PeerError

__all__ = [
    "FIX_SIZES",
    "TARGETS",
    "Crash",
    "Target",
    "flags_of",
    "get_target",
    "input_hash",
    "join_records",
    "parse_or_none",
    "split_records",
]

WIRE_MAX_BYTES = 1 << 20
"""The tensor targets' `max_bytes`: the receiver's declared limit, payload or decoded."""

MAX_INPUT_BYTES = 64 << 10
"""Longest input the fuzzer makes: past every seed (a stage's state is ~31 KB)."""
PARSED_BYTES_PER_INPUT_BYTE = 64
"""What a decoder may hold per byte of its input: protobuf's parsed form of a packed
repeated field is 8 bytes per 1-byte element, and a stream's manifest is held a few times
(parsed, copied for its digest, serialized again). The state and control targets' bound is
this times MAX_INPUT_BYTES (4 MiB): their own limits (a ~31 KB state) are far smaller."""
MESSAGE_BOUND = PARSED_BYTES_PER_INPUT_BYTE * MAX_INPUT_BYTES


@dataclass(frozen=True, slots=True)
class Target:
    """One fuzz target: `make()` builds its function of bytes once per process."""

    name: str
    what: str
    make: Callable[[], Callable[[bytes], bool]]
    refusals: tuple[type[BaseException], ...]
    """Exceptions that mean "refused, as documented"; anything else is a crash."""
    memory_bound: int
    """Bytes one input may make the process allocate: derived from the limits the decoder
    is given (a tensor's `max_bytes`, a stage's state size)."""
    record_type: Callable[[list[bytes], int], type[Message] | None] = lambda records, i: None
    """The protobuf message type of record `i` of an input, for `mutate_fields`; None for a
    record of raw bytes (a chunk, the flags byte)."""


# -- tensors ---------------------------------------------------------------


def _check_decoded(header: Any, tensor: Any, max_bytes: int) -> None:
    from swarmpipe.compression.codec import header_dtype

    if tuple(tensor.shape) != tuple(header.shape):
        raise Crash(f"decoded shape {tuple(tensor.shape)} but header says {list(header.shape)}")
    if tensor.dtype != header_dtype(header):
        raise Crash(f"decoded dtype {tensor.dtype} but header says {header.dtype}")
    if tensor.numel() * tensor.element_size() > max_bytes:
        raise Crash(f"decoded {tensor.numel()} elements past max_bytes {max_bytes}")
    if not tensor.is_contiguous() and tensor.numel():
        raise Crash("decoded tensor is not contiguous")


def _tensor_wire() -> Callable[[bytes], bool]:
    """Header, chunks: TensorAssembler, as a node's Forward, Reduce and gradient reader."""
    from swarmpipe.compression.wire import TensorAssembler
    from swarmpipe.protos import tensor_pb2

    def run(data: bytes) -> bool:
        records = split_records(data)
        if len(records) < 2:
            return False
        header = parse_or_none(tensor_pb2.TensorHeader, records[1])
        if header is None:
            return False
        chunks = records[2:]
        if flags_of(records) & FIX_SIZES:
            header.payload_bytes = sum(len(c) for c in chunks)
            header.crc32 = zlib.crc32(b"".join(chunks))
        assembler = TensorAssembler(header, max_bytes=WIRE_MAX_BYTES)
        for chunk in chunks:
            assembler.add(chunk)
        tensor = assembler.finish()
        _check_decoded(header, tensor, WIRE_MAX_BYTES)
        return True

    return run


def _codec(pinned: str | None = None) -> Callable[[], Callable[[bytes], bool]]:
    """One header and payload for a chosen codec (the flags byte picks it unless `pinned`),
    its sizes and crc32 always made to agree: the codec's own decoding under mutation."""

    def make() -> Callable[[bytes], bool]:
        from swarmpipe.compression.registry import CODECS, CODECS_BY_NAME
        from swarmpipe.compression.wire import decode_tensor
        from swarmpipe.protos import tensor_pb2

        codecs = sorted(CODECS)

        def run(data: bytes) -> bool:
            records = split_records(data)
            if len(records) < 3:
                return False
            header = parse_or_none(tensor_pb2.TensorHeader, records[1])
            if header is None:
                return False
            if pinned is not None:
                header.codec = CODECS_BY_NAME[pinned].codec_id
            else:
                header.codec = codecs[flags_of(records) % len(codecs)]
            payload = records[2]
            header.payload_bytes = len(payload)
            header.crc32 = zlib.crc32(payload)
            tensor = decode_tensor(header, payload, max_bytes=WIRE_MAX_BYTES)
            _check_decoded(header, tensor, WIRE_MAX_BYTES)
            return True

        return run

    return make


# -- control plane -----------------------------------------------------------


@cache
def read_message_types() -> tuple[type[Message], ...]:
    """Every message a server or daemon parses from a peer: each RPC's request (both
    services, health), what a node reads back from a peer's stream, and the MQTT payloads."""
    from google.protobuf.message_factory import GetMessageClass

    from swarmpipe.protos import control_pb2, coordinator_pb2, stage_pb2

    found: dict[str, type[Message]] = {}
    for module in (coordinator_pb2, stage_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                for descriptor in (method.input_type, method.output_type):
                    found[descriptor.full_name] = GetMessageClass(descriptor)
    for message_type in (
        control_pb2.Plan,
        control_pb2.StepState,
        control_pb2.Presence,
        control_pb2.Telemetry,
    ):
        found[message_type.DESCRIPTOR.full_name] = message_type
    return tuple(found[name] for name in sorted(found))


def _control_messages() -> Callable[[bytes], bool]:
    """Every request and MQTT payload type parsed (the flags byte picks one), and a link
    limit decoded as a node does (control/link_control.py)."""
    from swarmpipe.control.link_control import decode

    types = read_message_types()

    def run(data: bytes) -> bool:
        records = split_records(data)
        if len(records) < 2:
            return False
        choice = flags_of(records) % (len(types) + 1)
        if choice == len(types):
            setting = decode(records[1])
            if setting is not None:
                for name, value, least in (
                    ("link limit", setting.limit, 0.0),
                    ("link delay", setting.latency_ms, 0.0),
                    ("compute slowdown", setting.slowdown, 1.0),
                ):
                    if value is not None and not value >= least:
                        raise Crash(f"{name} {value} accepted")
            return True
        message = parse_or_none(types[choice], records[1])
        if message is None:
            return False
        message.ByteSize()  # walks every field parsed
        return True

    return run


def _stage(name: str) -> Callable[[], Callable[[bytes], bool]]:
    """The make function `name` of stage_targets.py, imported when called (it imports this
    module for its framing, and builds a stage)."""

    def make() -> Callable[[bytes], bool]:
        from swarmpipe.bench import stage_targets

        made: Callable[[bytes], bool] = getattr(stage_targets, name)()
        return made

    return make


def _each_record(
    message_type: Callable[[], type[Message]],
) -> Callable[[list[bytes], int], type[Message] | None]:
    """Every record after the flags byte is a `message_type()`."""
    return lambda records, i: message_type() if i else None


def _control_record(records: list[bytes], i: int) -> type[Message] | None:
    types = read_message_types()
    choice = flags_of(records) % (len(types) + 1)
    return types[choice] if i == 1 and choice < len(types) else None


def _header_type() -> type[Message]:
    from swarmpipe.protos import tensor_pb2

    return tensor_pb2.TensorHeader


def _state_type() -> type[Message]:
    from swarmpipe.protos import state_pb2

    return state_pb2.StateMessage


def _forward_type() -> type[Message]:
    from swarmpipe.protos import stage_pb2

    return stage_pb2.ForwardMessage


def _reduce_type() -> type[Message]:
    from swarmpipe.protos import stage_pb2

    return stage_pb2.ReduceMessage


def _refusals(*extra: type[BaseException]) -> tuple[type[BaseException], ...]:
    return (PeerError, CodecError, *extra)


TARGETS: dict[str, Target] = {
    t.name: t
    for t in [
        Target(
            name="tensor-wire",
            what="a tensor's header and chunks through TensorAssembler",
            make=_tensor_wire,
            refusals=_refusals(),
            memory_bound=4 * WIRE_MAX_BYTES,
            record_type=lambda r, i: _header_type() if i == 1 else None,
        ),
        Target(
            name="codec",
            what="each codec's decoding of a mutated header and payload",
            make=_codec(),
            refusals=_refusals(),
            memory_bound=4 * WIRE_MAX_BYTES,
            record_type=lambda r, i: _header_type() if i == 1 else None,
        ),
        Target(
            name="state-stream",
            what="a stage's state stream into a joiner (FetchState), loaded into the stage",
            make=_stage("state_stream"),
            refusals=_refusals(),
            memory_bound=MESSAGE_BOUND,
            record_type=_each_record(_state_type),
        ),
        Target(
            name="checkpoint-stream",
            what="a checkpoint stream into the coordinator's store (PutCheckpoint), read back",
            make=_stage("checkpoint_stream"),
            refusals=_refusals(),
            memory_bound=MESSAGE_BOUND,
            record_type=_each_record(_state_type),
        ),
        Target(
            name="checkpoint-file",
            what="a checkpoint file's bytes, restored into a stage",
            make=_stage("checkpoint_file"),
            refusals=_refusals(),
            memory_bound=MESSAGE_BOUND,
        ),
        Target(
            name="forward-request",
            what="a Forward call's messages and the servicer's checks before compute",
            make=_stage("forward_request"),
            refusals=_refusals(),
            # TensorReader's own limit (node/transport.py MAX_TENSOR_BYTES): the buffer is
            # reserved at the header's size but only touched as far as chunks arrive.
            memory_bound=2 * (256 << 20),
            record_type=_each_record(_forward_type),
        ),
        Target(
            name="reduce-request",
            what="a Reduce call's messages into a replica (ReplicaSync.receive)",
            make=_stage("reduce_request"),
            refusals=_refusals(),
            memory_bound=2 * (256 << 20),  # as forward-request: TensorReader's limit
            record_type=_each_record(_reduce_type),
        ),
        Target(
            name="control-messages",
            what="every RPC request and MQTT payload parsed, and link limits decoded",
            make=_control_messages,
            refusals=_refusals(),
            memory_bound=MESSAGE_BOUND,
            record_type=_control_record,
        ),
    ]
}


def _misbehaving(how: str) -> Callable[[], Callable[[bytes], bool]]:
    """A target that crashes, hangs or allocates without bound on its first input of two
    bytes or more, or leaks (each such input touches 64 MiB more of memory it reserved
    before the caps): tests/fuzz checks with it that the harness reports each as it
    should."""

    def make() -> Callable[[bytes], bool]:
        # Mapped now, before the address-space cap, and not touched: only the RSS watch
        # can see it fill (as a decoder's memory would that a library reserved early).
        reserve = mmap.mmap(-1, 8 << 30 if how == "leak" else 4096)
        touched = [0]

        def run(data: bytes) -> bool:
            if len(data) < 2:
                return True
            if how == "crash":
                raise KeyError(data)
            if how == "hang":
                while True:
                    pass
            if how == "leak":
                at, touched[0] = touched[0], touched[0] + (64 << 20)
                reserve[at : touched[0] : 4096] = b"\1" * (16 << 10)
                return True
            import torch

            torch.ones(64 << 30, dtype=torch.uint8)  # 64 GiB, touched: a bomb
            return True

        return run

    return make


HARNESS_CHECKS: dict[str, Target] = {
    f"misbehave-{how}": Target(
        name=f"misbehave-{how}",
        what=f"a target that {how}es, to check the harness",
        make=_misbehaving(how),
        refusals=_refusals(),
        memory_bound=MESSAGE_BOUND,
    )
    for how in ("crash", "hang", "memory", "leak")
}
"""Targets that misbehave on purpose; never part of a fuzz run."""


def codec_target(name: str) -> Target:
    """The codec target pinned to one codec, for per-codec figures."""
    base = TARGETS["codec"]
    return Target(
        name=f"codec:{name}",
        what=f"the {name} codec's decoding",
        make=_codec(name),
        refusals=base.refusals,
        memory_bound=base.memory_bound,
        record_type=base.record_type,
    )


def get_target(name: str) -> Target:
    """A target by name (`codec:int8` pins the codec target to one codec)."""
    from swarmpipe.compression.registry import CODECS_BY_NAME

    if name.startswith("codec:") and name.removeprefix("codec:") in CODECS_BY_NAME:
        return codec_target(name.removeprefix("codec:"))
    try:
        return TARGETS[name] if name in TARGETS else HARNESS_CHECKS[name]
    except KeyError:
        known = ", ".join([*TARGETS, *(f"codec:{c}" for c in CODECS_BY_NAME)])
        raise ValueError(f"no fuzz target {name!r}; choose one of {known}") from None


def input_hash(data: bytes) -> str:
    """The corpus file name of an input (what libFuzzer names them: its sha1)."""
    return hashlib.sha1(data).hexdigest()
