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

`seed_inputs` builds the valid inputs `scripts/gen_fuzz_corpus.py` commits under
tests/fuzz/corpus/<target>/; each decodes without an error.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

from google.protobuf.message import DecodeError, Message

from swarmpipe.errors import CodecError, PeerError

WIRE_MAX_BYTES = 1 << 20
"""The tensor targets' `max_bytes`: the receiver's declared limit, payload or decoded."""

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


def _flags(records: list[bytes]) -> int:
    return records[0][0] if records and records[0] else 0


def _parse(message_type: type[Any], data: bytes) -> Any:
    """The message, or None where the request parser (request_parsing.py) would refuse it."""
    try:
        return message_type.FromString(data)
    except DecodeError:
        return None


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
        header = _parse(tensor_pb2.TensorHeader, records[1])
        if header is None:
            return False
        chunks = records[2:]
        if _flags(records) & FIX_SIZES:
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
            header = _parse(tensor_pb2.TensorHeader, records[1])
            if header is None:
                return False
            if pinned is not None:
                header.codec = CODECS_BY_NAME[pinned].codec_id
            else:
                header.codec = codecs[_flags(records) % len(codecs)]
            payload = records[2]
            header.payload_bytes = len(payload)
            header.crc32 = zlib.crc32(payload)
            tensor = decode_tensor(header, payload, max_bytes=WIRE_MAX_BYTES)
            _check_decoded(header, tensor, WIRE_MAX_BYTES)
            return True

        return run

    return make


# -- stage state -----------------------------------------------------------

_TINY = [
    "model.n_layers=2",
    "model.d_model=16",
    "model.n_heads=2",
    "model.context=8",
    "model.vocab=256",
    "pipeline.stages=2",
]
"""The stage the state and microbatch targets decode for: small, so a full state is ~20 KB."""


@cache
def _runtime(stage: int) -> Any:
    import torch

    from swarmpipe.config import load_config
    from swarmpipe.node.stage_runtime import StageRuntime

    torch.manual_seed(0)
    return StageRuntime(load_config(None, _TINY), stage)


def _state_bytes(stage: int) -> int:
    from swarmpipe.node.stage_state import StateReceiver

    runtime = _runtime(stage)
    receiver = StateReceiver(
        runtime.module, run_id=runtime.config.run_id, stage=stage, num_stages=2
    )
    return int(receiver._stream._max_bytes)


def _fix_state(messages: list[Any]) -> None:
    """Make a mutated stream's manifest promise what its chunks hold (length, sha256)."""
    from swarmpipe.storage.checkpoints import start_digest

    manifests = [m for m in messages if m.WhichOneof("kind") == "manifest"]
    if not manifests:
        return
    manifest = manifests[0].manifest
    chunks = [m.chunk.data for m in messages if m.WhichOneof("kind") == "chunk"]
    manifest.payload_bytes = sum(len(c) for c in chunks)
    digest = start_digest(manifest)
    for chunk in chunks:
        digest.update(chunk)
    manifest.sha256 = digest.digest()


def _state_messages(records: list[bytes]) -> list[Any] | None:
    from swarmpipe.protos import state_pb2

    messages = [_parse(state_pb2.StateMessage, r) for r in records[1:]]
    if any(m is None for m in messages):
        return None  # the stream's request parser refuses the call at that message
    if _flags(records) & FIX_SIZES:
        _fix_state(messages)
    return messages


def _state_stream() -> Callable[[bytes], bool]:
    """StateMessages into a joiner's StateReceiver (FetchState, GetCheckpoint), then the
    checked state loaded into a stage, as node/state_transfer.py does."""
    from swarmpipe.node.stage_state import StateReceiver

    runtime = _runtime(1)

    def run(data: bytes) -> bool:
        messages = _state_messages(split_records(data))
        if messages is None:
            return False
        receiver = StateReceiver(
            runtime.module, run_id=runtime.config.run_id, stage=1, num_stages=2
        )
        for message in messages:
            receiver.add(message)
        runtime.import_state(receiver.finish())
        return True

    return run


def _checkpoint_stream() -> Callable[[bytes], bool]:
    """StateMessages into the coordinator's checkpoint store (PutCheckpoint), then the
    stored file read back (GetCheckpoint) through a fresh StateStream."""
    import tempfile

    from swarmpipe.storage.checkpoints import CheckpointStore, StateStream, state_messages

    folder = tempfile.TemporaryDirectory(prefix="swarmpipe-fuzz-ckpt-")
    runtime = _runtime(1)
    store = CheckpointStore(folder.name, runtime.config.run_id, keep=1)
    max_bytes = 4 * _state_bytes(1)

    def run(data: bytes) -> bool:
        messages = _state_messages(split_records(data))
        if messages is None:
            return False
        writer = store.receive(1, max_bytes=max_bytes)
        try:
            for message in messages:
                writer.add(message)
        except BaseException:
            writer.abort()
            raise
        path = writer.commit()
        manifest, chunks = store.read(path)
        stream = StateStream(max_bytes=max_bytes, check=lambda m: None, open_sink=_discard)
        for message in state_messages(manifest, chunks):
            stream.add(message)
        stream.finish()
        return True

    run.folder = folder  # type: ignore[attr-defined]  # kept alive with the target
    return run


class _Discard:
    def write(self, data: bytes, /) -> int:
        return len(data)


def _discard(manifest: Any) -> _Discard:
    return _Discard()


def _checkpoint_file() -> Callable[[bytes], bool]:
    """A checkpoint file's bytes, read as a node restores from its folder."""
    import tempfile
    from pathlib import Path

    from swarmpipe.node.stage_state import StateReceiver
    from swarmpipe.storage.checkpoints import read_checkpoint, state_messages

    folder = tempfile.TemporaryDirectory(prefix="swarmpipe-fuzz-file-")
    path = Path(folder.name) / "step-000000001.ckpt"
    runtime = _runtime(1)

    def run(data: bytes) -> bool:
        path.write_bytes(data)
        manifest, chunks = read_checkpoint(path)
        receiver = StateReceiver(
            runtime.module, run_id=runtime.config.run_id, stage=1, num_stages=2
        )
        try:
            for message in state_messages(manifest, chunks):
                receiver.add(message)
        finally:
            chunks.close()  # type: ignore[attr-defined]  # a generator: closes the file
        receiver.finish()
        return True

    run.folder = folder  # type: ignore[attr-defined]
    return run


# -- microbatches ------------------------------------------------------------


def _forward_request() -> Callable[[bytes], bool]:
    """ForwardMessages into a stage-1 node: read_forward_request, then the checks the Stage
    servicer makes before any compute (node/server.py Forward)."""
    from swarmpipe.compression import get_codec
    from swarmpipe.node.server import (
        MAX_SAMPLES_PER_MICROBATCH,
        decode_labels_and_tokens,
        read_forward_request,
    )
    from swarmpipe.protos import stage_pb2

    runtime = _runtime(1)
    config = runtime.config
    loop = asyncio.new_event_loop()

    async def stream(messages: list[Any]) -> AsyncIterator[Any]:
        for message in messages:
            yield message

    def run(data: bytes) -> bool:
        records = split_records(data)
        messages = [_parse(stage_pb2.ForwardMessage, r) for r in records[1:]]
        if any(m is None for m in messages):
            return False
        if _flags(records) & FIX_SIZES:
            tensors = [m.tensor for m in messages if m.WhichOneof("kind") == "tensor"]
            chunks = [m.chunk.data for m in messages if m.WhichOneof("kind") == "chunk"]
            for tensor in tensors[:1]:
                tensor.payload_bytes = sum(len(c) for c in chunks)
                tensor.crc32 = zlib.crc32(b"".join(chunks))
        header, activation = loop.run_until_complete(read_forward_request(stream(messages)))
        # The servicer's own checks, in its order; each refusal is a PeerError there too.
        if not 1 <= header.sample_count <= MAX_SAMPLES_PER_MICROBATCH:
            raise PeerError(f"sample_count {header.sample_count} is out of range")
        if header.context != config.model.context:
            raise PeerError(f"context {header.context} differs from the run's")
        if header.gradient_codec:
            get_codec(header.gradient_codec)
        runtime.check_activation(activation, header.sample_count)
        labels, tokens = decode_labels_and_tokens(header, config.model.vocab)
        runtime.check_tokens(tokens)
        if tuple(labels.shape) != (header.sample_count, header.context):
            raise Crash(f"labels of shape {tuple(labels.shape)}")
        return True

    return run


def _reduce_request() -> Callable[[bytes], bool]:
    """ReduceMessages into a replica (Stage.Reduce): ReplicaSync.receive on a real stage
    context whose plan lists this node and one peer, `n-peer`, as the stage's replicas."""
    from swarmpipe.node.compute import ComputeWorker
    from swarmpipe.node.context import CoordinatorClient, NodeStatus, StageContext
    from swarmpipe.node.links import Links
    from swarmpipe.node.replica_sync import ReplicaSync
    from swarmpipe.node.router import Router
    from swarmpipe.node.transport import LinkStats
    from swarmpipe.protos import control_pb2, stage_pb2
    from swarmpipe.transport.rpc import open_channel

    runtime = _runtime(1)
    loop = asyncio.new_event_loop()

    async def build() -> ReplicaSync:
        stats, links = LinkStats(), Links()
        router = Router("n-self", stats, links)
        plan = control_pb2.Plan(version=1, num_stages=2)
        plan.stages.add()
        replicas = plan.stages.add().replicas
        replicas.add(node_id="n-self", address="127.0.0.1:1")
        replicas.add(node_id="n-peer", address="127.0.0.1:2")
        router.set_plan(plan)
        ctx = StageContext(
            node_id="n-self",
            stage=1,
            config=runtime.config,
            runtime=runtime,
            compute=ComputeWorker(),
            links=links,
            stats=stats,
            router=router,
            coordinator=CoordinatorClient(open_channel("127.0.0.1:1"), "127.0.0.1:1"),
            status=NodeStatus(),
        )
        return ReplicaSync(ctx)

    sync = loop.run_until_complete(build())

    async def stream(messages: list[Any]) -> AsyncIterator[Any]:
        for message in messages:
            yield message

    def run(data: bytes) -> bool:
        records = split_records(data)
        messages = [_parse(stage_pb2.ReduceMessage, r) for r in records[1:]]
        if any(m is None for m in messages):
            return False
        if _flags(records) & FIX_SIZES:
            tensors = [m.tensor for m in messages if m.WhichOneof("kind") == "tensor"]
            chunks = [m.chunk.data for m in messages if m.WhichOneof("kind") == "chunk"]
            for tensor in tensors[:1]:
                tensor.payload_bytes = sum(len(c) for c in chunks)
                tensor.crc32 = zlib.crc32(b"".join(chunks))
        sync._rounds.clear()  # each input a fresh exchange, as each step's is
        loop.run_until_complete(sync.receive(stream(messages)))
        for exchange in sync._rounds.values():
            for flat, _, _ in exchange.contributions.values():
                if flat.shape != (runtime.n_parameters,) or not bool(flat.isfinite().all()):
                    raise Crash(f"a contribution of shape {tuple(flat.shape)} was taken")
        return True

    return run


def _reduce_seeds() -> list[bytes]:
    import torch

    from swarmpipe.compression.wire import encode_tensor
    from swarmpipe.protos import stage_pb2, tensor_pb2

    runtime = _runtime(1)
    gradient = torch.randn(runtime.n_parameters, generator=torch.Generator().manual_seed(3))
    seeds = []
    for codec in ("lossless", "int8", "topk"):
        tensor, payload = encode_tensor(gradient, codec)
        header = stage_pb2.ReduceHeader(step=0, sender_node="n-peer", tokens=64, samples=8)
        messages = [
            stage_pb2.ReduceMessage(header=header),
            stage_pb2.ReduceMessage(tensor=tensor),
            *(
                stage_pb2.ReduceMessage(chunk=tensor_pb2.TensorChunk(data=c))
                for c in _chunks(payload, 4096)
            ),
        ]
        for flags in (0, FIX_SIZES):
            seeds.append(join_records([bytes([flags]), *(m.SerializeToString() for m in messages)]))
    manifest = stage_pb2.ReduceManifest(step=0, sender_node="n-peer", received=["n-peer"])
    seeds.append(
        join_records([b"\0", stage_pb2.ReduceMessage(manifest=manifest).SerializeToString()])
    )
    return seeds


# -- control plane -----------------------------------------------------------


@cache
def _read_messages() -> tuple[type[Message], ...]:
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

    types = _read_messages()

    def run(data: bytes) -> bool:
        records = split_records(data)
        if len(records) < 2:
            return False
        choice = _flags(records) % (len(types) + 1)
        if choice == len(types):
            limit = decode(records[1])
            if limit is not None and not limit >= 0:
                raise Crash(f"link limit {limit} accepted")
            return True
        message = _parse(types[choice], records[1])
        if message is None:
            return False
        message.ByteSize()  # walks every field parsed
        return True

    return run


def _each_record(
    message_type: Callable[[], type[Message]],
) -> Callable[[list[bytes], int], type[Message] | None]:
    """Every record after the flags byte is a `message_type()`."""
    return lambda records, i: message_type() if i else None


def _control_record(records: list[bytes], i: int) -> type[Message] | None:
    types = _read_messages()
    choice = _flags(records) % (len(types) + 1)
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
            make=_state_stream,
            refusals=_refusals(),
            memory_bound=4 << 20,
            record_type=_each_record(_state_type),
        ),
        Target(
            name="checkpoint-stream",
            what="a checkpoint stream into the coordinator's store (PutCheckpoint), read back",
            make=_checkpoint_stream,
            refusals=_refusals(),
            memory_bound=4 << 20,
            record_type=_each_record(_state_type),
        ),
        Target(
            name="checkpoint-file",
            what="a checkpoint file's bytes, restored into a stage",
            make=_checkpoint_file,
            refusals=_refusals(),
            memory_bound=4 << 20,
        ),
        Target(
            name="forward-request",
            what="a Forward call's messages and the servicer's checks before compute",
            make=_forward_request,
            refusals=_refusals(),
            # TensorReader's own limit (node/transport.py MAX_TENSOR_BYTES): the buffer is
            # reserved at the header's size but only touched as far as chunks arrive.
            memory_bound=2 * (256 << 20),
            record_type=_each_record(_forward_type),
        ),
        Target(
            name="reduce-request",
            what="a Reduce call's messages into a replica (ReplicaSync.receive)",
            make=_reduce_request,
            refusals=_refusals(),
            memory_bound=2 * (256 << 20),  # as forward-request: TensorReader's limit
            record_type=_each_record(_reduce_type),
        ),
        Target(
            name="control-messages",
            what="every RPC request and MQTT payload parsed, and link limits decoded",
            make=_control_messages,
            refusals=_refusals(),
            memory_bound=4 << 20,
            record_type=_control_record,
        ),
    ]
}


def _misbehaving(how: str) -> Callable[[], Callable[[bytes], bool]]:
    """A target that crashes, hangs or allocates without bound on its first input of two
    bytes or more: tests/fuzz checks with it that the harness reports each as it should."""

    def make() -> Callable[[bytes], bool]:
        def run(data: bytes) -> bool:
            if len(data) < 2:
                return True
            if how == "crash":
                raise KeyError(data)
            if how == "hang":
                while True:
                    pass
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
        memory_bound=4 << 20,
    )
    for how in ("crash", "hang", "memory")
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


# -- seed inputs -------------------------------------------------------------


def _tensors() -> Iterator[tuple[Any, dict[str, Any]]]:
    """Small tensors and encode_tensor options covering every codec's header fields."""
    import torch

    from swarmpipe.compression.registry import CODECS_BY_NAME

    gen = torch.Generator().manual_seed(22)
    x = torch.randn(4, 24, generator=gen)
    x[1, 3] = 40.0  # an outlier channel
    for name, codec in CODECS_BY_NAME.items():
        yield x, {"codec": name}
        yield x.half() if torch.float16 in codec.dtypes else x, {"codec": name, "entropy": "zstd"}
        if codec.blockwise:
            yield x, {"codec": name, "block_size": 16, "channel_blocks": True}
            yield x + 3, {"codec": name, "block_size": 32, "centered": True, "code_max": 3}
        if name == "lossless":
            yield torch.arange(12, dtype=torch.int64).reshape(3, 4), {"codec": name}
            yield torch.zeros(0, 5), {"codec": name}
        if name == "topk":
            yield x, {"codec": name, "topk_fraction": 0.2}
        if name == "lowrank":
            yield x, {"codec": name, "rank": 2}


def _encoded() -> Iterator[tuple[Any, bytes]]:
    from swarmpipe.compression.wire import encode_tensor

    for tensor, options in _tensors():
        yield encode_tensor(tensor, **options)


def _chunks(payload: bytes, size: int = 64) -> list[bytes]:
    return [payload[i : i + size] for i in range(0, len(payload), size)]


def _state_seed(messages: Iterator[Any], flags: int, chunk: int = 4096) -> bytes:
    from swarmpipe.protos import state_pb2, tensor_pb2

    records = [bytes([flags])]
    for message in messages:
        if message.WhichOneof("kind") == "chunk":
            for piece in _chunks(message.chunk.data, chunk):
                one = state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=piece))
                records.append(one.SerializeToString())
        else:
            records.append(message.SerializeToString())
    return join_records(records)


def _state_seeds() -> list[bytes]:
    from swarmpipe.storage.checkpoints import state_messages

    snapshot = _runtime(1).export_state(node_id="seed").seal()
    return [
        _state_seed(state_messages(snapshot.manifest, snapshot.chunks()), flags)
        for flags in (0, FIX_SIZES)
    ]


def seed_inputs(name: str) -> list[bytes]:
    """Valid inputs of target `name`, each decoded without an error."""
    from swarmpipe.protos import tensor_pb2

    if name == "tensor-wire":
        return [
            join_records([bytes([flags]), h.SerializeToString(), *_chunks(p)])
            for h, p in _encoded()
            for flags in (0, FIX_SIZES)
        ]
    if name == "codec" or name.startswith("codec:"):
        from swarmpipe.compression.registry import CODECS

        codecs = sorted(CODECS)
        pinned = name.partition(":")[2]
        return [
            join_records([bytes([codecs.index(h.codec)]), h.SerializeToString(), p])
            for h, p in _encoded()
            if h.entropy == tensor_pb2.ENTROPY_NONE and pinned in ("", CODECS[h.codec].name)
        ]
    if name in ("state-stream", "checkpoint-stream"):
        return _state_seeds()
    if name == "checkpoint-file":
        return [_checkpoint_file_seed()]
    if name == "forward-request":
        return _forward_seeds()
    if name == "reduce-request":
        return _reduce_seeds()
    if name == "control-messages":
        return _control_seeds()
    if name in HARNESS_CHECKS:
        return [b"\x00"]
    raise ValueError(f"no fuzz target {name!r}")


def _checkpoint_file_seed() -> bytes:
    import tempfile

    from swarmpipe.storage.checkpoints import CheckpointStore, state_messages

    snapshot = _runtime(1).export_state(node_id="seed").seal()
    with tempfile.TemporaryDirectory() as folder:
        store = CheckpointStore(folder, _runtime(1).config.run_id)
        writer = store.receive(1)
        for message in state_messages(snapshot.manifest, snapshot.chunks()):
            writer.add(message)
        return writer.commit().read_bytes()


def _forward_seeds() -> list[bytes]:
    import torch

    from swarmpipe.compression.wire import encode_tensor
    from swarmpipe.node.token_ids import encode_token_ids
    from swarmpipe.protos import stage_pb2, tensor_pb2

    config = _runtime(1).config
    gen = torch.Generator().manual_seed(5)
    seeds = []
    for codec, samples in (("lossless", 2), ("int8", 1), ("bf16", 3)):
        labels = torch.randint(0, 256, (samples, config.model.context), generator=gen)
        header = stage_pb2.MicrobatchHeader(
            microbatch_id=f"mb-{codec}",
            hop=1,
            sample_count=samples,
            context=config.model.context,
            labels=encode_token_ids(labels, config.model.vocab),
        )
        x = torch.randn(samples, config.model.context, config.model.d_model, generator=gen)
        tensor, payload = encode_tensor(x, codec)
        messages = [
            stage_pb2.ForwardMessage(microbatch=header),
            stage_pb2.ForwardMessage(tensor=tensor),
            *(
                stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=c))
                for c in _chunks(payload, 512)
            ),
        ]
        for flags in (0, FIX_SIZES):
            seeds.append(join_records([bytes([flags]), *(m.SerializeToString() for m in messages)]))
    return seeds


def _control_seeds() -> list[bytes]:
    import random

    from swarmpipe.bench.fuzz_inputs import fill
    from swarmpipe.control.link_control import encode

    types = _read_messages()
    rng = random.Random(22)
    seeds = [
        join_records([bytes([i]), fill(t(), rng).SerializeToString()]) for i, t in enumerate(types)
    ]
    seeds.append(join_records([bytes([len(types)]), encode(2e6)]))
    seeds.append(join_records([bytes([len(types)]), encode(None)]))
    return seeds


def input_hash(data: bytes) -> str:
    """The corpus file name of an input (what libFuzzer names them: its sha1)."""
    return hashlib.sha1(data).hexdigest()
