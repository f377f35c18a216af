"""The zstd entropy stage: exact w.r.t. the codec alone, shrinks what it can, refuses bad frames."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
import zstandard

from swarmpipe.compression import (
    CODECS_BY_NAME,
    TensorAssembler,
    check_header,
    decode_tensor,
    encode_tensor,
    get_codec,
    iter_chunks,
)
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")


def _compressible() -> torch.Tensor:
    # An activation after ReLU: half zeros, the rest repeating values.
    g = torch.Generator().manual_seed(0)
    return torch.randn(64, 256, generator=g).relu().mul_(4).round_().div_(4)


def _zstd(x: torch.Tensor, codec: str = "lossless") -> tuple[tensor_pb2.TensorHeader, bytes]:
    header, payload = encode_tensor(x, codec, entropy="zstd")
    assert header.entropy == tensor_pb2.ENTROPY_ZSTD
    return header, payload


def _with_payload(header: tensor_pb2.TensorHeader, payload: bytes) -> tensor_pb2.TensorHeader:
    """`header` claiming `payload` (length and crc), everything else kept."""
    forged = tensor_pb2.TensorHeader()
    forged.CopyFrom(header)
    forged.payload_bytes = len(payload)
    forged.crc32 = zlib.crc32(payload)
    return forged


@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_zstd_round_trip_is_exactly_the_codec_alone(codec: str, dtype: torch.dtype) -> None:
    x = _compressible().to(dtype).t()  # non-contiguous too
    plain_header, plain = encode_tensor(x, codec)
    header, payload = _zstd(x, codec)
    assert header.raw_payload_bytes == len(plain) == plain_header.payload_bytes
    assert header.payload_bytes == len(payload) < len(plain)
    assert header.crc32 == zlib.crc32(payload)
    assert zstandard.ZstdDecompressor().decompress(payload) == plain
    y = decode_tensor(header, payload)
    assert torch.equal(y, decode_tensor(plain_header, plain))
    assert y.shape == x.shape and y.dtype == x.dtype
    # Chunked, as on the wire.
    assembler = TensorAssembler(header)
    for chunk in iter_chunks(payload, 100):
        assembler.add(chunk)
    assert torch.equal(assembler.finish(), y)


def test_a_compressible_tensor_shrinks_a_lot() -> None:
    header, payload = _zstd(torch.zeros(256, 1024))
    assert len(payload) * 100 < header.raw_payload_bytes


def test_zstd_is_dropped_where_it_does_not_shrink() -> None:
    noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=torch.Generator())
    x = noise.view(torch.float32)  # random bits do not compress
    for tensor in (x, torch.empty(0), torch.tensor(1.5)):
        header, payload = encode_tensor(tensor, "lossless", entropy="zstd")
        assert header.entropy == tensor_pb2.ENTROPY_NONE
        assert header.raw_payload_bytes == 0
        assert (header, payload) == encode_tensor(tensor, "lossless")


def test_entropy_can_be_named_by_enum_value() -> None:
    x = _compressible()
    assert encode_tensor(x, "int8", entropy=tensor_pb2.ENTROPY_ZSTD) == _zstd(x, "int8")
    assert encode_tensor(x, "int8", entropy=0) == encode_tensor(x, "int8")


@pytest.mark.parametrize("bad", ["gzip", "", 2, -1])
def test_unknown_entropy_stages_are_codec_errors(bad: int | str) -> None:
    with pytest.raises(CodecError, match="unknown entropy"):
        encode_tensor(torch.ones(3), "lossless", entropy=bad)
    header, payload = encode_tensor(torch.ones(3), "lossless")
    header.entropy = bad if isinstance(bad, int) and bad >= 0 else 7
    with pytest.raises(CodecError, match="unknown entropy enum value"):
        decode_tensor(header, payload)


def test_codec_decode_refuses_an_entropy_coded_payload() -> None:
    header, payload = _zstd(_compressible(), "int8")
    with pytest.raises(CodecError, match="went through an entropy stage"):
        get_codec("int8").decode(header, payload)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"raw_payload_bytes": 65535}, "decompresses to 65535 bytes but shape"),
        ({"raw_payload_bytes": 0}, "decompresses to 0 bytes but shape"),
        ({"payload_bytes": 65536}, "65536 zstd bytes for a 65536-byte payload"),
        ({"payload_bytes": 1 << 40}, "zstd bytes for a 65536-byte payload"),
        ({"payload_bytes": 0}, "0 zstd bytes"),
        ({"entropy": tensor_pb2.ENTROPY_NONE}, "raw_payload_bytes but no entropy stage"),
    ],
)
def test_bad_entropy_headers_are_refused_before_any_payload(
    fields: dict[str, int], message: str
) -> None:
    header, _ = _zstd(_compressible())
    for name, value in fields.items():
        setattr(header, name, value)
    with pytest.raises(CodecError, match=message):
        check_header(header)
    with pytest.raises(CodecError, match=message):
        TensorAssembler(header)


def test_max_bytes_bounds_the_decompressed_size() -> None:
    header, payload = _zstd(torch.zeros(1024))  # 4 KiB raw, a few bytes sent
    with pytest.raises(CodecError, match="over the limit of 4095"):
        decode_tensor(header, payload, max_bytes=4095)
    assert torch.equal(decode_tensor(header, payload, max_bytes=4096), torch.zeros(1024))


def test_a_zip_bomb_is_refused_without_allocating() -> None:
    # 1 GiB of zeros is a frame of a few tens of KiB; a header honest about the shape is over
    # max_bytes, and one lying about the shape is caught by the frame's declared size.
    # Made a MiB at a time at level 1, declaring its size up front: the same frame of
    # run-length blocks in a third of a second, where level 19 over one 1 GiB buffer took 16 s.
    compressor = zstandard.ZstdCompressor(level=1).compressobj(size=1 << 30)
    zeros = bytes(1 << 20)
    bomb = b"".join([*(compressor.compress(zeros) for _ in range(1024)), compressor.flush()])
    assert zstandard.frame_content_size(bomb) == 1 << 30
    assert len(bomb) < 1 << 16
    honest, _ = encode_tensor(torch.zeros(16), "lossless")
    honest.ClearField("shape")
    honest.shape.extend([1 << 28])
    honest.entropy = tensor_pb2.ENTROPY_ZSTD
    honest.raw_payload_bytes = 1 << 30
    honest = _with_payload(honest, bomb)
    with pytest.raises(CodecError, match="over the limit"):
        decode_tensor(honest, bomb, max_bytes=1 << 20)
    small, _ = _zstd(_compressible())
    liar = _with_payload(small, bomb)
    with pytest.raises(CodecError, match=f"declares {1 << 30} bytes but the header says"):
        decode_tensor(liar, bomb)


def test_a_frame_that_hides_its_size_or_lies_about_it_is_refused() -> None:
    header, payload = _zstd(_compressible())
    raw = zstandard.ZstdDecompressor().decompress(payload)
    hidden = zstandard.ZstdCompressor(write_content_size=False).compress(raw)
    with pytest.raises(CodecError, match="declares -1 bytes"):
        decode_tensor(_with_payload(header, hidden), hidden)
    # A frame declaring the promised size that then produces more (or less) output.
    for size in (len(raw) + 1000, len(raw) - 1000):
        other = zstandard.ZstdCompressor().compress(bytes(size))
        forged = bytearray(zstandard.ZstdCompressor().compress(bytes(len(raw))))
        header_bytes = zstandard.frame_header_size(forged)
        frame = bytes(forged[:header_bytes]) + other[zstandard.frame_header_size(other) :]
        with pytest.raises(CodecError, match="zstd frame"):
            decode_tensor(_with_payload(header, frame), frame)


def test_truncated_and_padded_frames_are_refused() -> None:
    header, payload = _zstd(_compressible())
    for bad in (payload[:-1], payload[: len(payload) // 2], payload[:5], payload + b"\0"):
        forged = _with_payload(header, bad)
        with pytest.raises(CodecError):
            decode_tensor(forged, bad)


def test_random_bytes_with_a_valid_entropy_header_only_ever_raise_codec_error() -> None:
    rng = random.Random(5)
    header, payload = _zstd(_compressible(), "int4")
    for _ in range(300):
        junk = rng.randbytes(rng.randrange(1, len(payload) + 1))
        if rng.random() < 0.5:  # a real frame header, then junk
            junk = payload[: rng.randrange(4, 20)] + junk
        junk = junk[: header.raw_payload_bytes - 1]
        with pytest.raises(CodecError):
            decode_tensor(_with_payload(header, junk), junk)
