"""Round trips and error bounds of every codec, and the registry's import-time check."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from swarmpipe import config
from swarmpipe.compression import (
    CODECS,
    CODECS_BY_NAME,
    BlockwiseInt8Codec,
    LosslessCodec,
    TensorCodec,
    blockwise,
    decode_tensor,
    encode_tensor,
    get_codec,
    registry,
)
from swarmpipe.compression.codec import describe
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")  # e.g. torch.frombuffer on read-only bytes

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
# Unit roundoff of each dtype: the most a single rounding to it moves a value, relatively.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# Each case builds a float32 tensor; the test casts it to the dtype under test.
SHAPES: dict[str, Callable[[], torch.Tensor]] = {
    "0-d": lambda: torch.tensor(-1.75),
    "empty": lambda: torch.empty(0),
    "empty-2d": lambda: torch.empty(4, 0, 3),
    "3x5": lambda: torch.randn(3, 5, generator=_gen(1)),
    "transposed": lambda: torch.randn(40, 70, generator=_gen(2)).t(),  # non-contiguous
    "strided": lambda: torch.randn(9, 300, generator=_gen(3))[::2, 5:],
    "1000 (4 blocks, short tail)": lambda: 10 * torch.randn(1000, generator=_gen(4)),
    "2x512 (whole blocks)": lambda: torch.randn(2, 512, generator=_gen(5)) * 1e-3,
    "mixed magnitudes": lambda: (
        torch.randn(3, 256, generator=_gen(6)) * torch.tensor([1e-4, 1.0, 300.0])[:, None]
    ),
}


def _roundtrip(x: torch.Tensor, codec: str, block_size: int = 256) -> torch.Tensor:
    header, payload = encode_tensor(x, codec, block_size=block_size)
    assert len(payload) == header.payload_bytes
    assert header.payload_bytes == get_codec(codec).expected_payload_bytes(header)
    y = decode_tensor(header, payload)
    assert y.dtype == x.dtype
    assert y.shape == x.shape
    assert y.is_contiguous()
    return y


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", SHAPES)
def test_lossless_is_bit_identical(case: str, dtype: torch.dtype) -> None:
    x = SHAPES[case]().to(dtype)
    y = _roundtrip(x, "lossless")
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(y.reshape(-1).view(bits), x.reshape(-1).contiguous().view(bits))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_lossless_integers_are_exact(dtype: torch.dtype) -> None:
    info = torch.iinfo(dtype)
    x = torch.tensor([[info.min, -1, 0], [1, 7, info.max]], dtype=dtype).t()
    assert torch.equal(_roundtrip(x, "lossless"), x)


def test_lossless_keeps_nan_and_inf_bits() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    y = _roundtrip(x, "lossless")
    assert torch.equal(y.view(torch.int32), x.view(torch.int32))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", SHAPES)
@pytest.mark.parametrize(("codec", "rtol"), [("fp16", 1e-3), ("bf16", 1e-2)])
def test_half_casts_are_within_relative_error(
    case: str, dtype: torch.dtype, codec: str, rtol: float
) -> None:
    x = SHAPES[case]().to(dtype)
    y = _roundtrip(x, codec)
    # atol covers values in fp16's subnormal range, where only absolute spacing is promised.
    err = (y.float() - x.float()).abs()
    assert bool((err <= rtol * x.float().abs() + 2.0**-24).all())


QMAX = {"int8": 127, "int4": 7}


def _blockwise_bound(x: torch.Tensor, block_size: int, qmax: int) -> torch.Tensor:
    """Per-element bound on |decoded - x| that follows from the codec's arithmetic.

    Rounding to the nearest code is off by at most half a step, s/2 with s = absmax/qmax.
    The fp32 arithmetic (the reciprocal, the product, the scale and the decoding multiply)
    adds at most ~500 ulp of s, which (1 + 1e-4) covers; decoding to fp16/bf16 rounds once
    more, by at most the dtype's unit roundoff times |value| <= absmax.
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    nb = -(-n // block_size)
    padded = torch.zeros(nb * block_size)
    padded[:n] = flat.abs()
    absmax = padded.view(nb, block_size).amax(dim=1)
    per_block = absmax / qmax / 2 * (1 + 1e-4) + absmax * UNIT_ROUNDOFF[x.dtype]
    return per_block.repeat_interleave(block_size)[:n].view(x.shape)


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("block_size", [256, 64, 7, 1, 100_000])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", SHAPES)
def test_blockwise_error_is_within_half_a_step_per_block(
    case: str, dtype: torch.dtype, block_size: int, codec: str
) -> None:
    x = SHAPES[case]().to(dtype)
    header, _ = encode_tensor(x, codec, block_size=block_size)
    assert header.block_size == block_size
    assert not header.stochastic_rounding
    y = _roundtrip(x, codec, block_size)
    err = (y.float() - x.float()).abs()
    assert bool((err <= _blockwise_bound(x, block_size, QMAX[codec])).all())


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("n", "block_size"), [(1000, 7), (4096, 256), (777, 256), (50, 1)])
def test_blockwise_pieces_give_the_same_bytes_as_one_pass(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, n: int, block_size: int, codec: str
) -> None:
    # CPU quantisation works through cache-sized pieces; small pieces must change nothing.
    x = (torch.randn(n, generator=_gen(9)) * 30).to(dtype)
    header, payload = encode_tensor(x, codec, block_size=block_size)
    y = decode_tensor(header, payload)
    monkeypatch.setattr(blockwise, "_CPU_PIECE_ELEMENTS", 3 * block_size + 1)
    assert encode_tensor(x, codec, block_size=block_size) == (header, payload)
    assert torch.equal(decode_tensor(header, payload), y)


def test_int8_payload_is_scales_then_codes() -> None:
    x = torch.tensor([0.0, 0.0, 254.0, -127.0, 1.0])  # blocks of 2: [0, 0], [254, -127], [1]
    header, payload = encode_tensor(x, "int8", block_size=2)
    scales = torch.frombuffer(bytearray(payload[:12]), dtype=torch.float32)
    codes = torch.frombuffer(bytearray(payload[12:]), dtype=torch.int8)
    assert torch.equal(scales, torch.tensor([0.0, 2.0, 1.0 / 127]))
    assert codes.tolist() == [0, 0, 127, -64, 127]  # -63.5 rounds half to even
    assert header.payload_bytes == 3 * 4 + 5
    assert decode_tensor(header, payload).tolist()[:4] == [0.0, 0.0, 254.0, -128.0]


def test_int8_non_finite_block_decodes_to_nan_and_spares_the_others() -> None:
    x = torch.ones(4 * 8)
    x[1] = float("nan")
    x[9] = float("inf")
    x[17] = -float("inf")
    y = _roundtrip(x, "int8", block_size=8)
    assert bool(y[:24].isnan().all())
    assert torch.equal(y[24:], x[24:])


def test_fp16_clamps_to_the_finite_range() -> None:
    x = torch.tensor([1e6, -1e6, float("inf"), -float("inf"), 65519.0, 65520.0, float("nan")])
    clamped = [65504.0, -65504.0, 65504.0, -65504.0, 65504.0, 65504.0]
    for dtype in (torch.float32, torch.bfloat16):
        header, payload = encode_tensor(x.to(dtype), "fp16")
        sent = torch.frombuffer(bytearray(payload), dtype=torch.float16).float()
        assert sent[:6].tolist() == clamped
        assert math.isnan(sent[6].item())
        y = decode_tensor(header, payload)
        # bf16 has no 65504: decoding back to bf16 rounds it to 65536, still finite.
        assert torch.equal(y[:6], torch.tensor(clamped).to(dtype))
        assert math.isnan(y[6].item())
    half = torch.tensor([float("inf"), 1.0], dtype=torch.float16)
    assert _roundtrip(half, "fp16").tolist() == [65504.0, 1.0]
    assert half[0].item() == float("inf")  # the caller's tensor is left alone


@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_encoding_leaves_the_input_alone(codec: str, dtype: torch.dtype) -> None:
    x = torch.randn(3, 300, generator=_gen(7)).to(dtype).requires_grad_()
    before = x.detach().clone()
    encode_tensor(x, codec)
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
def test_decoded_tensor_owns_writable_memory(codec: str) -> None:
    header, payload = encode_tensor(torch.arange(6.0).view(2, 3), codec)
    y = decode_tensor(header, memoryview(payload))
    first = y.clone()
    y.add_(1)  # would warn, raise or corrupt `payload` if the result viewed the bytes
    assert torch.equal(decode_tensor(header, payload), first)


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_lossy_codecs_refuse_integer_tensors(codec: str, dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match=f"cannot encode {str(dtype)[6:]}"):
        encode_tensor(torch.arange(5, dtype=dtype), codec)


@pytest.mark.parametrize("dtype", [torch.float64, torch.uint8, torch.bool], ids=str)
def test_dtypes_the_wire_cannot_carry_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(CodecError):
        encode_tensor(torch.zeros(3, dtype=dtype), "lossless")


@pytest.mark.parametrize("codec", sorted(QMAX))
def test_blockwise_codecs_refuse_a_block_size_below_one(codec: str) -> None:
    with pytest.raises(CodecError, match="block_size must be >= 1"):
        encode_tensor(torch.ones(3), codec, block_size=0)


def test_codec_decode_checks_the_payload_length() -> None:
    codec = get_codec("int8")
    header, payload = codec.encode(torch.ones(10), block_size=4)
    assert header.crc32 == 0  # integrity is the wire's job
    assert torch.equal(codec.decode(header, payload), torch.ones(10))
    with pytest.raises(CodecError, match="tensor payload is 21 bytes but shape"):
        codec.decode(header, payload[:-1])


def test_every_codec_enum_value_has_exactly_one_codec() -> None:
    values = {v for v in tensor_pb2.Codec.values() if v != tensor_pb2.CODEC_UNSPECIFIED}
    assert set(CODECS) == values
    for value, codec in CODECS.items():
        assert isinstance(codec, TensorCodec)
        assert codec.codec_id == value
        assert get_codec(value) is codec
        assert get_codec(codec.name) is codec


def test_codec_names_match_the_config() -> None:
    # In the same order: commands list CODEC_NAMES (without importing torch) where they
    # mean every registered codec, e.g. the default of `swarmpipe bench codecs --codecs`.
    assert config.CODEC_NAMES == tuple(CODECS_BY_NAME)
    for name in config.CODEC_NAMES:
        assert get_codec(name).codec_id == config.codec_enum(name)


def test_registry_check_rejects_gaps_and_duplicates() -> None:
    complete = tuple(CODECS.values())
    registry._check(complete)
    last = tensor_pb2.Codec.Name(complete[-1].codec_id)
    with pytest.raises(ImportError, match=f"no codec for {last}"):
        registry._check(complete[:-1])
    with pytest.raises(ImportError, match="two codecs for CODEC_LOSSLESS"):
        registry._check((*complete, LosslessCodec()))

    class Orphan(BlockwiseInt8Codec):
        codec_id = tensor_pb2.CODEC_UNSPECIFIED
        name = "orphan"

    with pytest.raises(ImportError, match="'orphan' has no enum value"):
        registry._check((*complete, Orphan()))


@pytest.mark.parametrize("bad", [0, 99, -1, "int2", "CODEC_FP16", ""])
def test_unknown_codecs_are_codec_errors(bad: int | str) -> None:
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec(bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(5, 1000), (600, 300)])
def test_cuda_matches_cpu(codec: str, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    x = (torch.randn(shape, generator=_gen(8)) * 50).to(dtype)
    # (600, 300) uses channel blocks, centred ones, and low-rank factors rather than dense.
    options: dict[str, Any] = {"channel_blocks": True, "rank": 2, "centered": shape[0] == 600}
    cpu_header, cpu_payload = encode_tensor(x, codec, **options)
    gpu_header, gpu_payload = encode_tensor(x.cuda().t().contiguous().t(), codec, **options)
    fields = (
        "dtype",
        "shape",
        "codec",
        "payload_bytes",
        "block_size",
        "channel_blocks",
        "centered",
    )
    for field in (*fields, "kept", "rank"):
        assert getattr(gpu_header, field) == getattr(cpu_header, field)
    y_gpu = decode_tensor(gpu_header, gpu_payload, device="cuda")
    assert y_gpu.is_cuda
    y_cpu = decode_tensor(cpu_header, cpu_payload)
    # Bit-identical payloads are not promised (GPU rounding may differ by an ulp in the
    # scale), but both sides must meet the same bound.
    if codec == "lowrank":  # the same start, so the same factors up to rounding
        gap = (y_gpu.cpu().float() - y_cpu.float()).norm() / y_cpu.float().norm()
        assert float(gap) < 1e-2
        return
    if codec == "topk":
        # fp16 and bf16 hold many equal magnitudes, and which of a tie at the threshold is
        # kept is not promised: the same number of values, of the same magnitudes, are.
        kept_gpu = y_gpu.cpu().float().abs().flatten().sort().values
        assert torch.equal(kept_gpu, y_cpu.float().abs().flatten().sort().values)
        return
    assert torch.allclose(y_gpu.cpu().float(), y_cpu.float(), rtol=1e-2, atol=1e-2 * 50 / 127)


def test_channel_blocks_payload_is_scales_per_row_block_and_channel() -> None:
    # [4, 2] in blocks of 2 rows: scales [[max |col 0| rows 0-1, col 1], [rows 2-3 ...]].
    x = torch.tensor([[1.0, -100.0], [-2.0, 50.0], [4.0, 0.0], [0.5, 0.0]])
    header, payload = encode_tensor(x, "int8", block_size=2, channel_blocks=True)
    assert header.channel_blocks
    scales = torch.frombuffer(bytearray(payload[:16]), dtype=torch.float32)
    assert torch.equal(scales, torch.tensor([2.0, 100.0, 4.0, 0.0]) / 127)
    codes = torch.frombuffer(bytearray(payload[16:]), dtype=torch.int8)
    assert codes.tolist() == [64, -127, -127, 64, 127, 0, 16, 0]  # element order: no transpose
    assert header.payload_bytes == 4 * 4 + 8


@pytest.mark.parametrize("codec", sorted(QMAX))
def test_channel_blocks_keep_outlier_channels_from_coarsening_the_rest(codec: str) -> None:
    g = _gen(10)
    x = torch.randn(4, 256, 512, generator=g)
    outliers = x.clone()
    outliers[..., ::100] *= 20
    normal = torch.ones(512, dtype=torch.bool)
    normal[::100] = False

    def error(t: torch.Tensor, channel_blocks: bool) -> float:
        y = decode_tensor(*encode_tensor(t, codec, channel_blocks=channel_blocks))
        return float((y - t)[..., normal].norm() / t[..., normal].norm())

    # Down channels, the normal channels do not notice the outliers; flat blocks do.
    assert error(outliers, True) == pytest.approx(error(x, True), rel=1e-6)
    assert error(outliers, False) > 2 * error(outliers, True)
    flat_bytes = len(encode_tensor(x, codec)[1])
    assert len(encode_tensor(x, codec, channel_blocks=True)[1]) == flat_bytes


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize(
    ("shape", "block_size", "used"),
    [
        ((3, 5), 16, False),
        ((0,), 1, False),
        ((3, 0), 1, False),
        ((0, 4), 4, False),
        ((), 4, False),
        ((1000,), 7, False),
        ((16, 5), 16, True),
        ((300, 7), 16, True),
        ((2, 150, 3), 64, True),
    ],
)
def test_channel_blocks_are_used_where_they_pay(
    shape: tuple[int, ...], block_size: int, used: bool, codec: str
) -> None:
    x = torch.randn(shape, generator=_gen(11)) * 10
    header, payload = encode_tensor(x, codec, block_size=block_size, channel_blocks=True)
    assert header.channel_blocks == used
    assert header.payload_bytes == get_codec(codec).expected_payload_bytes(header)
    y = decode_tensor(header, payload)
    assert y.shape == x.shape
    # Every element within half a step of its own block (fp32 slack as above).
    flat = x.reshape(-1)
    channels = shape[-1] if used else 1
    index = torch.arange(flat.numel())
    ids = index // channels // block_size * channels + index % channels
    if flat.numel():
        absmax = torch.zeros(int(ids.max()) + 1).scatter_reduce_(0, ids, flat.abs(), "amax")
        bound = absmax[ids] / QMAX[codec] / 2 * (1 + 1e-4)
        assert bool(((y.reshape(-1) - flat).abs() <= bound).all())


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("shape", "block_size"), [((600, 7), 16), ((333, 9), 5), ((64, 1), 8)])
def test_channel_block_pieces_give_the_same_bytes_as_one_pass(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    shape: tuple[int, int],
    block_size: int,
    codec: str,
) -> None:
    x = (torch.randn(shape, generator=_gen(12)) * 30).to(dtype)
    header, payload = encode_tensor(x, codec, block_size=block_size, channel_blocks=True)
    assert header.channel_blocks
    y = decode_tensor(header, payload)
    monkeypatch.setattr(blockwise, "_CPU_PIECE_ELEMENTS", 3 * block_size * shape[1] + 1)
    assert encode_tensor(x, codec, block_size=block_size, channel_blocks=True) == (header, payload)
    assert torch.equal(decode_tensor(header, payload), y)


def test_channel_blocks_of_an_empty_tensor_decode_to_it() -> None:
    # The sender never sets the flag for an empty tensor, but a header that does must decode.
    for shape in ([0], [3, 0], [0, 3]):
        header, payload = encode_tensor(torch.empty(shape), "int4", block_size=1)
        header.channel_blocks = True
        assert decode_tensor(header, payload).shape == tuple(shape)


def test_channel_blocks_on_a_codec_without_blocks_are_refused() -> None:
    header, payload = encode_tensor(torch.ones(4, 4), "lossless", channel_blocks=True)
    assert not header.channel_blocks  # ignored by codecs without blocks
    header.channel_blocks = True
    with pytest.raises(CodecError, match="channel blocks but the codec has no blocks"):
        decode_tensor(header, payload)


def test_centered_payload_is_scales_then_midpoints_then_codes() -> None:
    x = torch.tensor([10.0, 12.0, 14.0, -1.0, 1.0, 0.0])
    header, payload = encode_tensor(x, "int8", block_size=3, centered=True)
    assert header.centered and header.payload_bytes == 4 * 2 + 4 * 2 + 6
    scales = torch.frombuffer(bytearray(payload[:8]), dtype=torch.float32)
    assert torch.equal(scales, torch.tensor([2.0, 1.0]) / 127)  # half of each block's range
    mids = torch.frombuffer(bytearray(payload[8:16]), dtype=torch.float32)
    assert mids.tolist() == [12.0, 0.0]
    codes = torch.frombuffer(bytearray(payload[16:]), dtype=torch.int8)
    assert codes.tolist() == [-127, 0, 127, -127, 127, 0]
    assert torch.equal(decode_tensor(header, payload), x)
    assert "centered" in describe(header)


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("channel_blocks", [False, True])
def test_centered_blocks_spend_their_codes_on_the_spread_not_the_offset(
    codec: str, channel_blocks: bool
) -> None:
    # Channels like a bottleneck's outputs: a spread of 1 around means up to 30. Flat blocks
    # run along the tensor, so there each block needs one offset of its own: channels first.
    offsets = torch.tensor([30.0, -8.0, 30.0, 3.0])
    x = torch.randn(512, 4, generator=_gen(13)) + offsets
    if not channel_blocks:
        x = x.t().contiguous()

    def error(centered: bool) -> float:
        y = decode_tensor(
            *encode_tensor(x, codec, channel_blocks=channel_blocks, centered=centered)
        )
        spread = x - (x.mean(0) if channel_blocks else x.mean(1, keepdim=True))
        return float((y - x).norm() / spread.norm())

    assert error(True) < error(False) / 3
    # A block centred on zero keeps its error; every block costs one fp32 more.
    zero_mean = torch.randn(512, 4, generator=_gen(15))
    plain, centred = encode_tensor(zero_mean, codec), encode_tensor(zero_mean, codec, centered=True)
    scales = blockwise.n_scales([512, 4], 256, False)
    assert len(centred[1]) == len(plain[1]) + 4 * scales
    gap = (decode_tensor(*centred) - zero_mean).norm() / (decode_tensor(*plain) - zero_mean).norm()
    assert float(gap) < 1.1


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_centered_pieces_give_the_same_bytes_as_one_pass(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, codec: str
) -> None:
    x = (torch.randn(600, 7, generator=_gen(14)) * 30 + 100).to(dtype)
    for channel_blocks in (False, True):
        options: dict[str, Any] = {"block_size": 16, "channel_blocks": channel_blocks}
        header, payload = encode_tensor(x, codec, centered=True, **options)
        y = decode_tensor(header, payload)
        with monkeypatch.context() as patch:
            patch.setattr(blockwise, "_CPU_PIECE_ELEMENTS", 3 * 16 * 7 + 1)
            assert encode_tensor(x, codec, centered=True, **options) == (header, payload)
            assert torch.equal(decode_tensor(header, payload), y)


def test_a_decoder_that_ignores_centering_refuses_the_payload() -> None:
    # An older receiver has no `centered` field: the midpoints make the payload the wrong size.
    header, payload = encode_tensor(torch.randn(300) + 5, "int4", centered=True)
    header.centered = False
    with pytest.raises(CodecError, match=r"payload is \d+ bytes but"):
        get_codec("int4").decode(header, payload)


def test_centered_blocks_on_a_codec_without_blocks_are_refused() -> None:
    header, payload = encode_tensor(torch.ones(4, 4), "fp16", centered=True)
    assert not header.centered  # ignored by codecs without blocks
    header.centered = True
    with pytest.raises(CodecError, match="centered blocks but the codec has no blocks"):
        get_codec("fp16").decode(header, payload)


def test_centered_blocks_of_extreme_values_stay_finite_or_nan_as_documented() -> None:
    # max - min of finite fp32 can overflow; the midpoint and half-range are halved first.
    x = torch.tensor([3e38, -3e38, 1.0, 5.0, 5.0, 5.0, float("inf"), 0.0, 1.0])
    y = decode_tensor(*encode_tensor(x, "int8", block_size=3, centered=True))
    assert torch.allclose(y[:2], x[:2], rtol=1e-2) and bool(y[:6].isfinite().all())
    assert torch.equal(y[3:6], x[3:6])  # a constant block comes back exactly
    assert bool(y[6:].isnan().all())  # a block with inf decodes to NaN, as without centring


def test_tiny_blocks_keep_their_precision() -> None:
    # Below absmax ~4e-37 int8's factor 127 / absmax overflows fp32; such blocks are lifted.
    x = torch.tensor([1.0484e-37, -2e-38, 5e-31, 1.0, 0.0, 3e-39])
    for codec in QMAX:
        y = decode_tensor(*encode_tensor(x, codec, block_size=1))
        assert torch.allclose(y, x, rtol=1e-6, atol=2.0**-126)
        assert y[0].item() != 0.0


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_code_max_narrows_the_codes_in_the_same_container(codec: str) -> None:
    x = torch.randn(512, 8, generator=_gen(21)) * 3 + 1
    full = encode_tensor(x, codec, channel_blocks=True, centered=True)
    header, payload = encode_tensor(x, codec, channel_blocks=True, centered=True, code_max=3)
    assert header.code_max == 3 and header.payload_bytes == full[0].payload_bytes
    assert "codes to 3" in describe(header)
    y = decode_tensor(header, payload)
    # Seven levels per block: every decoded value of a channel block is one of them.
    assert all(len(y[:256, c].unique()) <= 7 for c in range(8))
    error = float((y - x).abs().max())
    assert error > float((decode_tensor(*full) - x).abs().max())  # coarser, as asked
    # A receiver that does not know the field decodes the same tensor: only levels differ.
    header.code_max = 0
    assert torch.equal(decode_tensor(header, payload), y)


def test_code_max_pays_through_zstd() -> None:
    x = torch.randn(1024, 8, generator=_gen(22))
    options: dict[str, Any] = {"channel_blocks": True, "entropy": "zstd"}
    int8 = encode_tensor(x, "int8", **options)[0].payload_bytes
    narrowed = encode_tensor(x, "int8", code_max=11, **options)[0].payload_bytes
    assert narrowed < 0.65 * int8  # 23 levels instead of 255: about 4.6 bits a code, not 8


def test_code_max_at_or_above_the_codecs_own_is_the_full_range() -> None:
    x = torch.randn(300, generator=_gen(23))
    for codec, code_max in (("int8", 127), ("int8", 500), ("int4", 7), ("int4", 15)):
        assert encode_tensor(x, codec, code_max=code_max) == encode_tensor(x, codec)
    # Codecs without integer codes ignore it, as they ignore block sizes.
    assert encode_tensor(x, "fp16", code_max=3) == encode_tensor(x, "fp16")


def test_bad_code_max_is_refused() -> None:
    with pytest.raises(CodecError, match="code_max must be 0"):
        encode_tensor(torch.ones(4), "int8", code_max=-1)
    header, payload = encode_tensor(torch.ones(4, 4), "int4", code_max=3)
    header.code_max = 7
    with pytest.raises(CodecError, match="takes a limit of 1 to 6"):
        decode_tensor(header, payload)
    header, payload = encode_tensor(torch.ones(4, 4), "fp16")
    header.code_max = 3
    with pytest.raises(CodecError, match="fp16 codec has no integer codes"):
        decode_tensor(header, payload)


def test_lowrank_of_subnormal_values_stays_finite() -> None:
    # The power iteration divides by the absmax; 1e-45 made that overflow and the factors NaN.
    x = torch.full((2, 4), 1.4013e-45)
    y = decode_tensor(*encode_tensor(x, "lowrank", rank=1))
    assert bool(y.isfinite().all())
    assert float((y.double() - x.double()).norm()) <= float(x.double().norm()) * 1.001
