"""The decoder fuzz targets that need a stage: its state, a Forward into it, a Reduce among
its replicas (see decoder_targets.py for the input format and what counts as a crash).

They decode for the same small stage (`tiny_runtime`: stage 1 of 2 of a 2-layer model, a
state of ~31 KB), built once per process: what a joiner, the coordinator's checkpoint store
and a replica check a peer's bytes against.
"""

from __future__ import annotations

import asyncio
import weakref
import zlib
from collections.abc import AsyncIterator, Callable
from functools import cache
from typing import Any

from swarmpipe.bench.fuzz_records import FIX_SIZES, Crash, flags_of, parse_or_none, split_records

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
def tiny_runtime(stage: int) -> Any:
    import torch

    from swarmpipe.config import load_config
    from swarmpipe.node.stage_runtime import StageRuntime

    torch.manual_seed(0)
    return StageRuntime(load_config(None, _TINY), stage)


def _closing_with(
    run: Callable[[bytes], bool], loop: asyncio.AbstractEventLoop
) -> Callable[[bytes], bool]:
    """`run`, with `loop` (which it drives, input after input) closed once `run` is dropped.

    A target lives as long as its caller holds it: a fuzz child's whole run, or one test.
    An event loop collected unclosed warns (ResourceWarning, for it and its two self-pipe
    sockets) from whatever code runs at that moment, and under a test module's
    `filterwarnings("error")` that failed an unrelated test."""
    weakref.finalize(run, loop.close)
    return run


def _state_bytes(stage: int) -> int:
    from swarmpipe.node.stage_state import StateReceiver

    runtime = tiny_runtime(stage)
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

    messages = [parse_or_none(state_pb2.StateMessage, r) for r in records[1:]]
    if any(m is None for m in messages):
        return None  # the stream's request parser refuses the call at that message
    if flags_of(records) & FIX_SIZES:
        _fix_state(messages)
    return messages


def state_stream() -> Callable[[bytes], bool]:
    """StateMessages into a joiner's StateReceiver (FetchState, GetCheckpoint), then the
    checked state loaded into a stage, as node/state_transfer.py does."""
    from swarmpipe.node.stage_state import StateReceiver

    runtime = tiny_runtime(1)

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


def checkpoint_stream() -> Callable[[bytes], bool]:
    """StateMessages into the coordinator's checkpoint store (PutCheckpoint), then the
    stored file read back (GetCheckpoint) through a fresh StateStream."""
    import tempfile

    from swarmpipe.storage.checkpoints import CheckpointStore, StateStream, state_messages

    folder = tempfile.TemporaryDirectory(prefix="swarmpipe-fuzz-ckpt-")
    runtime = tiny_runtime(1)
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

    weakref.finalize(run, folder.cleanup)  # removed with the target, not by the collector
    return run


class _Discard:
    def write(self, data: bytes, /) -> int:
        return len(data)


def _discard(manifest: Any) -> _Discard:
    return _Discard()


def checkpoint_file() -> Callable[[bytes], bool]:
    """A checkpoint file's bytes, read as a node restores from its folder."""
    import tempfile
    from pathlib import Path

    from swarmpipe.node.stage_state import StateReceiver
    from swarmpipe.storage.checkpoints import read_checkpoint, state_messages

    folder = tempfile.TemporaryDirectory(prefix="swarmpipe-fuzz-file-")
    path = Path(folder.name) / "step-000000001.ckpt"
    runtime = tiny_runtime(1)

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
            chunks.close()
        receiver.finish()
        return True

    weakref.finalize(run, folder.cleanup)  # removed with the target, not by the collector
    return run


# -- microbatches ------------------------------------------------------------


def forward_request() -> Callable[[bytes], bool]:
    """ForwardMessages into a stage-1 node: read_forward_request, then the checks the Stage
    servicer makes before any compute (node/server.py Forward)."""
    from swarmpipe.compression import get_codec
    from swarmpipe.node.server import (
        decode_labels_and_tokens,
        microbatch_check,
        read_forward_request,
    )
    from swarmpipe.protos import stage_pb2

    runtime = tiny_runtime(1)
    config = runtime.config
    check = microbatch_check(runtime)
    loop = asyncio.new_event_loop()

    async def stream(messages: list[Any]) -> AsyncIterator[Any]:
        for message in messages:
            yield message

    def run(data: bytes) -> bool:
        records = split_records(data)
        messages = [parse_or_none(stage_pb2.ForwardMessage, r) for r in records[1:]]
        if any(m is None for m in messages):
            return False
        if flags_of(records) & FIX_SIZES:
            tensors = [m.tensor for m in messages if m.WhichOneof("kind") == "tensor"]
            chunks = [m.chunk.data for m in messages if m.WhichOneof("kind") == "chunk"]
            for tensor in tensors[:1]:
                tensor.payload_bytes = sum(len(c) for c in chunks)
                tensor.crc32 = zlib.crc32(b"".join(chunks))
        header, activation = loop.run_until_complete(
            read_forward_request(stream(messages), check=check)
        )
        # The servicer's own checks, in its order; each refusal is a PeerError there too.
        if header.gradient_codec:
            get_codec(header.gradient_codec)
        runtime.check_activation(activation, header.sample_count)
        labels, tokens = decode_labels_and_tokens(header, config.model.vocab)
        runtime.check_tokens(tokens)
        if tuple(labels.shape) != (header.sample_count, header.context):
            raise Crash(f"labels of shape {tuple(labels.shape)}")
        return True

    return _closing_with(run, loop)


def reduce_request() -> Callable[[bytes], bool]:
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

    runtime = tiny_runtime(1)
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
        messages = [parse_or_none(stage_pb2.ReduceMessage, r) for r in records[1:]]
        if any(m is None for m in messages):
            return False
        if flags_of(records) & FIX_SIZES:
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

    return _closing_with(run, loop)
