"""The wire form: crc, chunking, and a receiver that turns every malformed input into CodecError."""

from __future__ import annotations

import random
import zlib
from typing import Any

import pytest
import torch

from swarmpipe.compression import (
    CHUNK_BYTES,
    CODECS,
    TensorAssembler,
    check_header,
    decode_tensor,
    encode_tensor,
    iter_chunks,
)
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")


def _header(**fields: Any) -> tensor_pb2.TensorHeader:
    """A valid [8, 64] float32 lossless header with `fields` replaced."""
    header, _ = encode_tensor(torch.zeros(8, 64), "lossless")
    for name, value in fields.items():
        if name == "shape":
            del header.shape[:]
            header.shape.extend(value)
        else:
            setattr(header, name, value)
    return header


def _assemble(header: tensor_pb2.TensorHeader, payload: bytes, chunk: int) -> torch.Tensor:
    assembler = TensorAssembler(header)
    for piece in iter_chunks(payload, chunk):
        assembler.add(piece)
    return assembler.finish()


def test_encode_fills_every_header_field() -> None:
    header, payload = encode_tensor(torch.ones(3, 5, dtype=torch.bfloat16), "int8", block_size=4)
    assert header.dtype == tensor_pb2.DTYPE_BFLOAT16
    assert list(header.shape) == [3, 5]
    assert header.codec == tensor_pb2.CODEC_BLOCKWISE_INT8
    assert header.payload_bytes == len(payload) == 4 * 4 + 15
    assert header.block_size == 4
    assert header.crc32 == zlib.crc32(payload)
    # A header survives its own serialisation, as it does on the wire.
    parsed = tensor_pb2.TensorHeader.FromString(header.SerializeToString())
    assert torch.equal(decode_tensor(parsed, payload), decode_tensor(header, payload))


def test_codec_can_be_named_by_enum_value() -> None:
    x = torch.randn(10)
    for value, codec in CODECS.items():
        assert encode_tensor(x, value) == encode_tensor(x, codec.name)
    assert encode_tensor(x, "lossless")[0].block_size == 0  # block_size only for blockwise


def test_iter_chunks_sizes() -> None:
    assert list(iter_chunks(b"")) == []
    small = b"abc"
    assert next(iter_chunks(small)) is small  # fits one chunk: no copy
    assert list(iter_chunks(b"abcdefg", 3)) == [b"abc", b"def", b"g"]
    assert list(iter_chunks(b"abcdef", 3)) == [b"abc", b"def"]
    with pytest.raises(CodecError, match="chunk_bytes must be >= 1"):
        list(iter_chunks(b"abc", 0))


def test_large_tensor_chunks_stay_under_the_limit_and_reassemble_exactly() -> None:
    x = torch.randn(8, 512, 1024, generator=torch.Generator().manual_seed(0))
    header, payload = encode_tensor(x, "lossless")
    chunks = list(iter_chunks(payload))
    assert len(chunks) == 16
    assert all(len(c) <= CHUNK_BYTES for c in chunks)
    # Each chunk also fits a serialised TensorChunk under gRPC's 4 MiB default.
    assert len(tensor_pb2.TensorChunk(data=chunks[0]).SerializeToString()) < 4 << 20
    assembler = TensorAssembler(header)
    for chunk in chunks:
        assert not assembler.complete
        assembler.add(chunk)
    assert assembler.complete and assembler.received == len(payload)
    assert torch.equal(assembler.finish(), x)


@pytest.mark.parametrize("codec", ["lossless", "fp16", "bf16", "int8"])
def test_uneven_chunks_reassemble_like_one(codec: str) -> None:
    x = torch.randn(37, 29).t()
    header, payload = encode_tensor(x, codec, block_size=50)
    assert torch.equal(_assemble(header, payload, 333), decode_tensor(header, payload))
    assert torch.equal(_assemble(header, payload, 1), decode_tensor(header, payload))


def test_empty_tensor_needs_no_chunks() -> None:
    header, _ = encode_tensor(torch.empty(0, 3), "int8")
    assembler = TensorAssembler(header)
    assert assembler.complete
    assert assembler.finish().shape == (0, 3)


def test_wrong_payload_size_names_the_problem() -> None:
    header, payload = encode_tensor(torch.zeros(8, 64), "lossless")
    message = (
        r"tensor payload is 100 bytes but header says 2048 \(shape \[8, 64\], float32, lossless\)"
    )
    with pytest.raises(CodecError, match=message):
        decode_tensor(header, payload[:100])
    with pytest.raises(CodecError, match="is 2049 bytes but header says 2048"):
        decode_tensor(header, payload + b"\0")


def test_truncated_stream_fails_at_finish() -> None:
    header, payload = encode_tensor(torch.zeros(8, 64), "lossless")
    assembler = TensorAssembler(header)
    assembler.add(payload[:1000])
    with pytest.raises(CodecError, match="ended after 1000 bytes but header says 2048"):
        assembler.finish()


def test_overlong_stream_fails_at_the_chunk_that_overruns() -> None:
    header, payload = encode_tensor(torch.zeros(8, 64), "int8")
    assembler = TensorAssembler(header)
    assembler.add(payload)
    with pytest.raises(CodecError, match="runs to at least 521 bytes but header says 520"):
        assembler.add(b"x")
    assert assembler.received == 520  # the bad chunk was not taken
    assert torch.equal(assembler.finish(), torch.zeros(8, 64))


def test_crc_mismatch() -> None:
    header, payload = encode_tensor(torch.ones(8, 64), "fp16")
    corrupted = bytearray(payload)
    corrupted[77] ^= 0x10
    with pytest.raises(CodecError, match=r"crc32 .* corrupted in transit"):
        decode_tensor(header, corrupted)


def test_assembler_is_single_use() -> None:
    header, payload = encode_tensor(torch.ones(3), "lossless")
    assembler = TensorAssembler(header)
    assembler.add(payload)
    assembler.finish()
    with pytest.raises(CodecError, match="already decoded"):
        assembler.finish()
    with pytest.raises(CodecError, match="after the tensor was decoded"):
        assembler.add(b"")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"codec": 99}, "unknown codec enum value 99"),
        ({"codec": tensor_pb2.CODEC_UNSPECIFIED}, "unknown codec enum value 0"),
        ({"dtype": 77}, "unknown dtype enum value 77"),
        ({"dtype": tensor_pb2.DTYPE_UNSPECIFIED}, "unknown dtype enum value 0"),
        ({"codec": tensor_pb2.CODEC_FP16, "dtype": tensor_pb2.DTYPE_INT64}, "cannot decode to"),
        ({"shape": [8, -64]}, "negative dimension"),
        ({"shape": [1 << 40, 1 << 40]}, "over the limit"),
        ({"shape": [1 << 62] * 8, "payload_bytes": 0}, "over the limit"),
        ({"shape": [1] * 65}, "65 dimensions"),
        ({"payload_bytes": 2047}, "payload is 2047 bytes but shape .* takes 2048"),
        ({"payload_bytes": 1 << 63}, "but shape .* takes 2048"),
        ({"block_size": 256}, "has a block_size but the codec has no blocks"),
        (
            {"codec": tensor_pb2.CODEC_BLOCKWISE_INT8, "block_size": 0, "payload_bytes": 516},
            "needs block_size >= 1",
        ),
    ],
)
def test_bad_headers_are_refused_before_any_payload(fields: dict[str, Any], message: str) -> None:
    header = _header(**fields)
    with pytest.raises(CodecError, match=message):
        check_header(header)
    with pytest.raises(CodecError, match=message):
        TensorAssembler(header)


def test_max_bytes_bounds_payload_and_decoded_size() -> None:
    header, payload = encode_tensor(torch.zeros(1024), "int8")  # 1040 B sent, 4 KiB decoded
    with pytest.raises(CodecError, match="4096 bytes decoded, over the limit of 4095"):
        TensorAssembler(header, max_bytes=4095)
    assert decode_tensor(header, payload, max_bytes=4096).shape == (1024,)
    header, payload = encode_tensor(torch.zeros(1024), "lossless")
    with pytest.raises(CodecError, match="over the limit of 1000"):
        decode_tensor(header, payload, max_bytes=1000)


def _random_header(rng: random.Random) -> tensor_pb2.TensorHeader:
    shape = [
        rng.choice([0, 1, 2, 3, 7, 64, 300, -1, 1 << 31, 1 << 62]) for _ in range(rng.randrange(5))
    ]
    return tensor_pb2.TensorHeader(
        dtype=tensor_pb2.DType.ValueType(rng.randrange(-1, 8)),
        codec=tensor_pb2.Codec.ValueType(rng.randrange(-1, len(CODECS) + 2)),
        shape=shape,
        payload_bytes=rng.choice([0, 1, 5, 16, 1040, rng.randrange(1 << 64)]),
        block_size=rng.choice([0, 1, 4, 256, rng.randrange(1 << 32)]),
        crc32=rng.randrange(1 << 32),
        kept=rng.choice([0, 0, 1, 3, 1 << 40, rng.randrange(1 << 64)]),
        rank=rng.choice([0, 0, 1, 2, 8, rng.randrange(1 << 32)]),
    )


def _random_valid(rng: random.Random) -> tuple[tensor_pb2.TensorHeader, bytes]:
    codec = rng.choice(list(CODECS.values()))
    dtype = rng.choice(sorted(codec.dtypes, key=str))
    shape = [rng.randrange(6) for _ in range(rng.randrange(4))]
    x = (torch.randn(shape) * 100).to(dtype)
    return encode_tensor(
        x,
        codec.codec_id,
        block_size=rng.choice([1, 3, 256]),
        topk_fraction=rng.choice([0.01, 0.3, 1.0]),
        rank=rng.choice([1, 2]),
    )


def test_fuzzed_input_only_ever_raises_codec_error() -> None:
    rng = random.Random(1234)
    for _ in range(600):
        kind = rng.randrange(4)
        if kind == 0:  # a random header and random bytes
            header = _random_header(rng)
            payload = rng.randbytes(rng.choice([0, 1, 7, 100, 1040]))
        else:  # a real tensor, then damaged
            header, payload = _random_valid(rng)
            if kind == 1:
                cut = rng.randrange(len(payload) + 1)
                payload = payload[:cut] + rng.randbytes(rng.randrange(3))
            elif kind == 2:
                payload = rng.randbytes(len(payload))
            else:
                field = rng.choice(
                    ["dtype", "codec", "payload_bytes", "block_size", "shape", "kept", "rank"]
                )
                mutant = _random_header(rng)
                if field == "shape":
                    header.ClearField("shape")
                    header.shape.extend(mutant.shape)
                else:
                    setattr(header, field, getattr(mutant, field))
        # Whatever else happens, the crc cannot match, so no case may decode.
        header.crc32 = zlib.crc32(payload) ^ (1 + rng.randrange((1 << 32) - 1))
        with pytest.raises(CodecError):
            if rng.random() < 0.5:
                decode_tensor(header, payload, max_bytes=1 << 20)
            else:
                assembler = TensorAssembler(header, max_bytes=1 << 20)
                for chunk in iter_chunks(payload, rng.choice([1, 5, 64])):
                    assembler.add(chunk)
                assembler.finish()


def test_random_payload_with_a_valid_header_decodes_to_the_promised_tensor() -> None:
    # Every bit pattern is some value (NaN and inf included) in every codec but top-k, so
    # random bytes with a right header and crc must decode, never crash, and give the
    # promised shape. Top-k's positions must check out, so there they may be a CodecError.
    rng = random.Random(99)
    refused = 0
    for _ in range(300):
        header, payload = _random_valid(rng)
        payload = rng.randbytes(len(payload))
        header.crc32 = zlib.crc32(payload)
        if header.codec == tensor_pb2.CODEC_TOPK and header.kept:
            with pytest.raises(CodecError, match="top-k payload"):
                decode_tensor(header, payload)
            refused += 1
            continue
        y = decode_tensor(header, payload)
        assert list(y.shape) == list(header.shape)
    assert refused


@pytest.mark.parametrize("codec", sorted(c.name for c in CODECS.values()))
@pytest.mark.parametrize("shape", [[0, 1 << 62, 4], [1 << 40, 1 << 40, 0], [0, (1 << 63) - 1, 2]])
def test_an_empty_shape_whose_dimensions_overflow_is_a_codec_error(
    codec: str, shape: list[int]
) -> None:
    # Found by the decoder fuzz: such a shape has no elements, so it passed every size limit,
    # and torch raised RuntimeError ("Stride calculation overflowed") at the final view.
    header, payload = encode_tensor(torch.zeros(0, 4), codec)
    del header.shape[:]
    header.shape.extend(shape)
    if codec == "lowrank":
        header.rank = 0
    with pytest.raises(CodecError, match="multiply past"):
        decode_tensor(header, payload)


def test_a_header_with_a_million_dimensions_makes_a_short_message() -> None:
    header = _header(
        shape=[1] * 1_000_000, codec=tensor_pb2.CODEC_FP16, dtype=tensor_pb2.DTYPE_INT64
    )
    with pytest.raises(CodecError) as error:
        check_header(header)
    assert len(str(error.value)) < 1000
