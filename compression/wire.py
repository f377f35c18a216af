"""The wire form of a tensor: a `TensorHeader`, then its payload in chunks of at most 1 MiB.

The receiver trusts nothing it is sent. `TensorAssembler` checks the header before it buffers
a byte, stops a stream the moment it runs past the length the header promised, and checks
length and crc32 before decoding, so a hostile or broken peer costs at most `max_bytes` of
memory and never gets a tensor of the wrong shape past it. Every failure is a CodecError.
A zstd-coded payload (`entropy.py`) is decompressed to exactly the size its checked header
promised, never to what the frame would like, so a zip bomb is one more CodecError.

The stream has no end marker: the header's payload_bytes says when the tensor is complete,
so an empty tensor is a header and no chunks at all.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import torch

from swarmpipe.compression import entropy as entropy_stage
from swarmpipe.compression.codec import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOWRANK_RANK,
    DEFAULT_TOPK_FRACTION,
    NEAREST,
    Rounding,
    TensorCodec,
    describe,
    header_dtype,
    numel,
)
from swarmpipe.compression.registry import get_codec
from swarmpipe.compression.state import EncoderState
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

CHUNK_BYTES = 1 << 20
"""Payload bytes per TensorChunk: far under gRPC's 4 MiB default message limit, and small
enough that a receiver checks the length after every MiB."""

DEFAULT_MAX_BYTES = 256 << 20
"""Largest tensor a receiver accepts unless told otherwise, payload or decoded."""


def encode_tensor(
    tensor: torch.Tensor,
    codec: int | str,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    rounding: Rounding = NEAREST,
    entropy: int | str = "none",
    channel_blocks: bool = False,
    centered: bool = False,
    code_max: int = 0,
    topk_fraction: float = DEFAULT_TOPK_FRACTION,
    rank: int = DEFAULT_LOWRANK_RANK,
    state: EncoderState | None = None,
) -> tuple[tensor_pb2.TensorHeader, bytes]:
    """The complete header (crc32 included) and payload of `tensor` under `codec`.

    `codec` is a tensor_pb2.Codec value or a config name ("lossless", "fp16", "bf16", "int8",
    "int4", "topk", "lowrank"); `block_size` and `channel_blocks` (blocks down each channel of
    the last dimension rather than along the flat tensor: far better with outlier channels) and
    `centered` (each block also sends its midpoint: far better for values offset from zero)
    and `code_max` (codes only up to this magnitude: fewer levels, for `entropy` to pack)
    matter only to
    blockwise codecs, and stochastic `rounding` only to int8 and int4 (other
    codecs refuse it). `topk_fraction` is the share of
    entries top-k keeps and `rank` the factor width of low-rank; `state` (an EncoderState the
    caller keeps per link and role) gives those two error feedback and warm starts, and other
    codecs ignore it. `entropy` ("none", "zstd" or a tensor_pb2.Entropy value) passes the
    payload through a lossless stage, kept only where it shrinks it.
    """
    stage = entropy_stage.entropy_enum(entropy)  # an unknown name fails before the work
    header, payload = get_codec(codec).encode(
        tensor,
        block_size=block_size,
        rounding=rounding,
        channel_blocks=channel_blocks,
        centered=centered,
        code_max=code_max,
        topk_fraction=topk_fraction,
        rank=rank,
        state=state,
    )
    header, payload = entropy_stage.compress(header, payload, stage)
    header.crc32 = zlib.crc32(payload)
    return header, payload


def iter_chunks(payload: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """`payload` in pieces of at most `chunk_bytes`, for TensorChunk.data.

    An empty payload yields no chunks: payload_bytes = 0 in the header already says the tensor
    is complete. A payload that fits one chunk is yielded as is, without a copy.
    """
    if chunk_bytes < 1:
        raise CodecError(f"chunk_bytes must be >= 1, not {chunk_bytes}")
    for start in range(0, len(payload), chunk_bytes):
        yield payload[start : start + chunk_bytes]


def check_header(
    header: tensor_pb2.TensorHeader, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> TensorCodec:
    """The codec that decodes `header`, or CodecError saying why the header is unacceptable."""
    codec = get_codec(header.codec)
    codec.check_header(header)
    decoded_bytes = numel(header.shape) * header_dtype(header).itemsize
    if decoded_bytes > max_bytes:
        raise CodecError(
            f"tensor would take {decoded_bytes} bytes decoded, over the limit of {max_bytes} "
            f"({describe(header)})"
        )
    expected = codec.expected_payload_bytes(header)
    # The sent payload is never larger than the codec's, so one limit bounds both.
    entropy_stage.check_sizes(header, expected)
    if expected > max_bytes:
        raise CodecError(
            f"tensor payload is {expected} bytes, over the limit of {max_bytes} "
            f"({describe(header)})"
        )
    return codec


class TensorAssembler:
    """Collects one tensor's chunks as they arrive and decodes them, checking as it goes.

    Build it from the header (which is checked there and then), `add` each chunk, and call
    `finish` once `complete`; each assembler decodes one tensor.
    """

    def __init__(
        self,
        header: tensor_pb2.TensorHeader,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        pin_memory: bool = False,
    ) -> None:
        self._codec = check_header(header, max_bytes=max_bytes)
        self._header = header
        # One uninitialised buffer of the promised size (allowed only after the checks above):
        # chunks are copied straight in, and decoding views it instead of joining chunks.
        # Pinned (page-locked) when the tensor goes on to a GPU: the copy there is then one
        # DMA that runs beside the CPU instead of staging through a pageable bounce buffer.
        self._buffer: torch.Tensor | None = torch.empty(
            header.payload_bytes, dtype=torch.uint8, pin_memory=pin_memory
        )
        self._view = self._buffer.numpy().data
        self._received = 0
        self._crc = 0

    @property
    def header(self) -> tensor_pb2.TensorHeader:
        return self._header

    @property
    def received(self) -> int:
        """Payload bytes added so far."""
        return self._received

    @property
    def complete(self) -> bool:
        """Whether every payload byte the header promised has arrived."""
        return self._received == self._header.payload_bytes

    def add(self, chunk: bytes | bytearray | memoryview) -> None:
        """Append one chunk; CodecError at once if it runs past the promised payload."""
        if self._buffer is None:
            raise CodecError(f"tensor chunk after the tensor was decoded ({self._describe()})")
        data = memoryview(chunk).cast("B")
        end = self._received + data.nbytes
        if end > self._header.payload_bytes:
            raise CodecError(
                f"tensor payload runs to at least {end} bytes but header says "
                f"{self._header.payload_bytes} ({self._describe()})"
            )
        self._view[self._received : end] = data
        self._crc = zlib.crc32(data, self._crc)
        self._received = end

    def finish(self, *, device: torch.device | str | None = None) -> torch.Tensor:
        """The decoded tensor, once length and crc32 check out; `device` as in `decode`."""
        if self._buffer is None:
            raise CodecError(f"tensor was already decoded ({self._describe()})")
        if not self.complete:
            raise CodecError(
                f"tensor payload ended after {self._received} bytes but header says "
                f"{self._header.payload_bytes} ({self._describe()})"
            )
        if self._crc != self._header.crc32:
            raise CodecError(
                f"tensor payload crc32 is {self._crc:#010x} but header says "
                f"{self._header.crc32:#010x}: corrupted in transit ({self._describe()})"
            )
        buffer, self._buffer = self._buffer, None
        self._view.release()
        if self._header.entropy != tensor_pb2.ENTROPY_NONE:
            buffer = entropy_stage.decompress(self._header, buffer)
        return self._codec.decode_owned(self._header, buffer, device=device)

    def _describe(self) -> str:
        return describe(self._header)


def decode_tensor(
    header: tensor_pb2.TensorHeader,
    payload: bytes | bytearray | memoryview,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The tensor a header and its whole payload encode, with every check of TensorAssembler."""
    assembler = TensorAssembler(header, max_bytes=max_bytes)
    size = memoryview(payload).nbytes
    if size != header.payload_bytes:
        raise CodecError(
            f"tensor payload is {size} bytes but header says {header.payload_bytes} "
            f"({describe(header)})"
        )
    assembler.add(payload)
    return assembler.finish(device=device)
