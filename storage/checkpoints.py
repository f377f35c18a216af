"""Stage state streams and the checkpoint store, without torch (the coordinator uses both).

A stage's state travels and rests in one form (protos/state.proto): a
`StateManifest` naming every tensor with its dtype and shape, then the tensors'
raw bytes in manifest order. `StateStream` takes such a stream from an
untrusted sender: it checks the manifest before a byte of payload is accepted
(through a caller's check, e.g. against the locally built stage), refuses bytes
past `payload_bytes`, and checks the sha256 at the end, so a hostile or broken
sender costs the receiver at most what the checked manifest promised.

`CheckpointStore` keeps the last `keep` checkpoints of each stage as files
`<root>/<run_id>/stage-<s>/step-<N>.ckpt` (magic, manifest length, manifest,
payload), each written to a temporary file, fsynced and renamed, so a reader
never sees half of one and a crash leaves the previous one intact.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

from google.protobuf.message import DecodeError

from swarmpipe.errors import PeerError
from swarmpipe.protos import state_pb2, tensor_pb2

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Payload bytes per chunk, as for tensors: far under gRPC's message limit."""

MAX_MANIFEST_BYTES = 16 << 20
"""A manifest lists names and shapes; anything larger is not one."""

MAX_RUN_CONFIG_BYTES = 256 << 10
"""A run config is a few KiB of JSON (more only with many data paths); a manifest claiming more
carries something else, and every receiver refuses it before reading the payload."""

MAX_STATE_BYTES = 64 << 30
"""The largest stage state the coordinator stores (a stage of ~5e9 fp32 parameters with AdamW);
nodes check against their own stage's exact size instead."""

MAX_DIMS = 64
"""Most dimensions a state tensor may have (as compression.codec.MAX_DIMS for tensors). Without
it a manifest of one tensor with 100,000 dimensions of 2**62 (900 KB) took 88 s of CPU to
size, the product growing digit by digit, and its size could not even be formatted into the
error (ValueError past Python's 4300-digit limit): found by the decoder fuzz."""

ITEM_BYTES: dict[int, int] = {
    tensor_pb2.DTYPE_FLOAT32: 4,
    tensor_pb2.DTYPE_FLOAT16: 2,
    tensor_pb2.DTYPE_BFLOAT16: 2,
    tensor_pb2.DTYPE_INT64: 8,
    tensor_pb2.DTYPE_INT32: 4,
}

_MAGIC = b"SWPSTATE"
_LENGTH = struct.Struct("<I")
_FILE_NAME = re.compile(r"step-(\d{1,19})\.ckpt")


def _shown(name: str) -> str:
    """A tensor name for a message: a hostile one can be megabytes long."""
    return repr(name) if len(name) <= 100 else f"{name[:100]!r}... ({len(name)} characters)"


def tensor_bytes(tensor: state_pb2.StateTensor) -> int:
    """Bytes of one manifest entry's payload; PeerError for an unknown dtype or a bad shape."""
    item = ITEM_BYTES.get(tensor.dtype)
    if item is None:
        raise PeerError(f"state tensor {_shown(tensor.name)} has unknown dtype {tensor.dtype}")
    if len(tensor.shape) > MAX_DIMS:
        raise PeerError(
            f"state tensor {_shown(tensor.name)} has {len(tensor.shape)} dimensions, more than "
            f"{MAX_DIMS}"
        )
    n = 1
    for dim in tensor.shape:
        if dim < 0:
            raise PeerError(f"state tensor {_shown(tensor.name)} has a negative dimension")
        n *= dim
    return n * item


def check_manifest(manifest: state_pb2.StateManifest, *, max_bytes: int) -> None:
    """Check a manifest's own consistency: unique names, sizes adding up, under max_bytes."""
    if manifest.payload_bytes > max_bytes:
        raise PeerError(
            f"state payload of {manifest.payload_bytes} bytes is over the limit of {max_bytes}"
        )
    if len(manifest.sha256) != hashlib.sha256().digest_size:
        raise PeerError("the state manifest carries no sha256 digest")
    config_bytes = len(manifest.run_config.encode())
    if config_bytes > MAX_RUN_CONFIG_BYTES:
        raise PeerError(
            f"the state's run config takes {config_bytes} bytes; the limit is "
            f"{MAX_RUN_CONFIG_BYTES}"
        )
    names: set[str] = set()
    total = 0
    for t in manifest.tensors:
        if t.name in names:
            raise PeerError(f"state tensor {_shown(t.name)} appears twice")
        names.add(t.name)
        total += tensor_bytes(t)
        if total > manifest.payload_bytes:
            break
    if total != manifest.payload_bytes:
        raise PeerError(
            f"the manifest's tensors take {total} bytes, not the {manifest.payload_bytes} it says"
        )


def start_digest(manifest: state_pb2.StateManifest) -> hashlib._Hash:
    """A sha256 fed with the manifest (digest field cleared); feed it the payload next."""
    bare = state_pb2.StateManifest()
    bare.CopyFrom(manifest)
    bare.sha256 = b""
    h = hashlib.sha256()
    h.update(bare.SerializeToString(deterministic=True))
    return h


class PayloadSink(Protocol):
    def write(self, data: bytes, /) -> object: ...


class StateStream:
    """Receives one state stream (manifest, then chunks), checking it as it arrives.

    `check` sees the manifest before any payload is accepted and raises
    PeerError to refuse it; `open_sink` is then given the payload size and
    returns where the bytes go (a buffer, a file).
    """

    def __init__(
        self,
        *,
        max_bytes: int,
        check: Callable[[state_pb2.StateManifest], None],
        open_sink: Callable[[state_pb2.StateManifest], PayloadSink],
    ) -> None:
        self._max_bytes = max_bytes
        self._check = check
        self._open_sink = open_sink
        self.manifest: state_pb2.StateManifest | None = None
        self._sink: PayloadSink | None = None
        self._hash: hashlib._Hash | None = None
        self.received = 0

    def add(self, message: state_pb2.StateMessage) -> None:
        kind = message.WhichOneof("kind")
        if kind == "manifest":
            if self.manifest is not None:
                raise PeerError("the state stream carries a second manifest")
            check_manifest(message.manifest, max_bytes=self._max_bytes)
            self._check(message.manifest)
            self.manifest = message.manifest
            self._hash = start_digest(message.manifest)
            self._sink = self._open_sink(message.manifest)
        elif kind == "chunk":
            if self.manifest is None or self._sink is None or self._hash is None:
                raise PeerError("state bytes came before the manifest")
            data = message.chunk.data
            if self.received + len(data) > self.manifest.payload_bytes:
                raise PeerError(
                    f"the state stream runs past the {self.manifest.payload_bytes} bytes "
                    "its manifest promised"
                )
            self._sink.write(data)
            self._hash.update(data)
            self.received += len(data)
        else:
            raise PeerError("empty StateMessage: set manifest or chunk")

    def finish(self) -> state_pb2.StateManifest:
        """The checked manifest, once every byte arrived and the digest matched."""
        if self.manifest is None or self._hash is None:
            raise PeerError("the state stream ended before its manifest")
        if self.received != self.manifest.payload_bytes:
            raise PeerError(
                f"the state stream ended after {self.received} of "
                f"{self.manifest.payload_bytes} bytes"
            )
        if self._hash.digest() != self.manifest.sha256:
            raise PeerError("the state's sha256 does not match its manifest: corrupted in transit")
        return self.manifest


def state_messages(
    manifest: state_pb2.StateManifest, chunks: Iterator[bytes]
) -> Iterator[state_pb2.StateMessage]:
    """The messages of a state stream: the manifest, then each chunk."""
    yield state_pb2.StateMessage(manifest=manifest)
    for chunk in chunks:
        yield state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=chunk))


class CheckpointStore:
    """The last `keep` checkpoints of each stage of one run, as files under `root`."""

    def __init__(self, root: str | Path, run_id: str, *, keep: int = 2) -> None:
        self.root = Path(root)
        self.run_id = run_id
        self.keep = max(1, keep)

    def stage_dir(self, stage: int) -> Path:
        return self.root / self.run_id / f"stage-{stage}"

    def checkpoints(self, stage: int) -> list[tuple[int, Path]]:
        """(step, path) of this stage's checkpoints, oldest first."""
        folder = self.stage_dir(stage)
        if not folder.is_dir():
            return []
        found = []
        for path in folder.iterdir():
            match = _FILE_NAME.fullmatch(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found)

    def latest(self, stage: int) -> tuple[int, Path] | None:
        found = self.checkpoints(stage)
        return found[-1] if found else None

    def receive(self, stage: int, *, max_bytes: int = MAX_STATE_BYTES) -> CheckpointWriter:
        """A writer that streams one checkpoint of `stage` into a temporary file."""
        return CheckpointWriter(self, stage, max_bytes=max_bytes)

    def _commit(self, stage: int, step: int, tmp: Path) -> Path:
        final = self.stage_dir(stage) / f"step-{step:09d}.ckpt"
        newer = [s for s, _ in self.checkpoints(stage) if s > step]
        if len(newer) >= self.keep:
            # Kept, it would be the oldest beyond `keep` and deleted at once: the caller would
            # be told of a file that is not there.
            raise PeerError(
                f"a checkpoint of stage {stage} at step {step} is older than the {self.keep} "
                f"kept here (up to step {max(newer)})"
            )
        os.replace(tmp, final)
        fsync_path(final.parent)
        for _, old in self.checkpoints(stage)[: -self.keep]:
            old.unlink(missing_ok=True)
        return final

    def read(self, path: Path) -> tuple[state_pb2.StateManifest, FileChunks]:
        """A checkpoint's manifest and an iterator over its payload chunks (see read_checkpoint)."""
        return read_checkpoint(path)


class CheckpointWriter:
    """One checkpoint arriving as a state stream, written to a temporary file first."""

    def __init__(self, store: CheckpointStore, stage: int, *, max_bytes: int) -> None:
        self.store = store
        self.stage = stage
        folder = store.stage_dir(stage)
        folder.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".incoming-", dir=folder)
        self._file: BinaryIO = os.fdopen(fd, "wb")
        self._tmp = Path(name)
        self.stream = StateStream(max_bytes=max_bytes, check=self._check, open_sink=self._open)

    def _check(self, manifest: state_pb2.StateManifest) -> None:
        if manifest.run_id != self.store.run_id or manifest.stage != self.stage:
            raise PeerError(
                f"a checkpoint of run {manifest.run_id!r} stage {manifest.stage} does not "
                f"belong in run {self.store.run_id!r} stage {self.stage}"
            )

    def _open(self, manifest: state_pb2.StateManifest) -> PayloadSink:
        head = manifest.SerializeToString(deterministic=True)
        self._file.write(_MAGIC + _LENGTH.pack(len(head)) + head)
        return self._file

    def add(self, message: state_pb2.StateMessage) -> None:
        self.stream.add(message)

    def commit(self) -> Path:
        """Check the digest, make the file durable and put it in place."""
        try:
            manifest = self.stream.finish()
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            return self.store._commit(self.stage, int(manifest.step), self._tmp)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def read_checkpoint(path: Path) -> tuple[state_pb2.StateManifest, FileChunks]:
    """A checkpoint file's manifest and an iterator over its payload chunks (the file stays
    open until the iterator is exhausted or closed). The manifest is only decoded here: feed
    both to a `StateStream` to check it and the payload's length and sha256."""
    f = open(path, "rb")  # closed by the chunk iterator
    try:
        if f.read(len(_MAGIC)) != _MAGIC:
            raise PeerError(f"{path} is not a swarmpipe checkpoint")
        head = f.read(_LENGTH.size)
        if len(head) != _LENGTH.size:
            raise PeerError(f"{path} ends inside its header")
        (length,) = _LENGTH.unpack(head)
        if length > MAX_MANIFEST_BYTES:
            raise PeerError(f"{path} claims a {length}-byte manifest")
        data = f.read(length)
        if len(data) != length:
            raise PeerError(f"{path} ends inside its manifest")
        try:
            manifest = state_pb2.StateManifest.FromString(data)
        except DecodeError as exc:
            raise PeerError(f"{path} has a manifest that does not decode ({exc})") from exc
    except Exception:
        f.close()
        raise
    return manifest, FileChunks(f, int(manifest.payload_bytes))


class FileChunks:
    """A checkpoint file's payload chunks, read as iterated; the file closes at the end, on
    close(), or when the iterator is dropped. (A generator closed or dropped before its first
    chunk never runs its `with`, so a checkpoint refused for its manifest left its file open
    until the collector found it, and a ResourceWarning for whatever ran then.)"""

    def __init__(self, f: BinaryIO, payload_bytes: int) -> None:
        self._f = f
        self._left = payload_bytes

    def __iter__(self) -> FileChunks:
        return self

    def __next__(self) -> bytes:
        if self._left > 0 and not self._f.closed:
            data = self._f.read(min(CHUNK_BYTES, self._left))
            if data:
                self._left -= len(data)
                return data
        self.close()  # the end, or truncated: the reader's length check says so
        raise StopIteration

    def close(self) -> None:
        self._f.close()

    def __del__(self) -> None:
        self.close()


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's entry to disk (a folder: the renames made in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
