"""The top-k codec: exact kept entries, compact positions, checked payloads, error feedback."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from swarmpipe.compression import (
    EncoderState,
    TensorAssembler,
    check_header,
    decode_tensor,
    encode_tensor,
    get_codec,
    topk,
)
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")

FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kept_exactly(x: torch.Tensor, y: torch.Tensor, k: int) -> None:
    """y holds the k largest |x| bit-exactly and zeros elsewhere (ties may go either way)."""
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    magnitude = xf.float().abs().nan_to_num(nan=math.inf, posinf=math.inf)
    if k == 0:
        assert not bool(yf.any())
        return
    threshold = magnitude.topk(k).values[-1]
    above = magnitude > threshold
    below = magnitude < threshold
    bits = torch.int32 if x.dtype == torch.float32 else torch.int16
    assert torch.equal(yf[above].view(bits), xf[above].contiguous().view(bits))
    assert bool((yf[below] == 0).all())
    tied = ~(above | below)
    assert bool(((yf[tied] == 0) | (yf[tied].view(bits) == xf[tied].view(bits))).all())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(
    ("shape", "fraction"),
    [((), 0.01), ((0, 5), 0.5), ((7,), 0.3), ((40, 70), 0.01), ((3, 300_000), 0.001)],
)
def test_topk_keeps_the_largest_entries_exactly(
    shape: tuple[int, ...], fraction: float, dtype: torch.dtype
) -> None:
    x = (torch.randn(shape, generator=_gen(1)) * 10).to(dtype)
    header, payload = encode_tensor(x, "topk", topk_fraction=fraction)
    n = x.numel()
    k = topk.kept_entries(n, fraction)
    assert header.kept == k
    assert header.payload_bytes == 4 * -(-n // topk.SPAN) + k * (dtype.itemsize + 2)
    y = decode_tensor(header, payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    _kept_exactly(x, y, k)


def test_topk_of_a_non_contiguous_tensor() -> None:
    x = torch.randn(300, 500, generator=_gen(2)).t()[:, ::3]
    y = decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.05))
    _kept_exactly(x, y, topk.kept_entries(x.numel(), 0.05))


def test_topk_sampled_threshold_matches_a_full_topk() -> None:
    # Large enough that _largest samples a threshold; outlier channels on a stride must not
    # fool the sample.
    x = torch.randn(1024, 1024, generator=_gen(3))
    x[:, ::97] *= 20
    for fraction in (0.001, 0.01, 0.1):
        k = topk.kept_entries(x.numel(), fraction)
        got = topk._largest(x.reshape(-1), k)
        want = x.reshape(-1).abs().topk(k).indices.sort().values
        assert torch.equal(got, want)  # no ties among random floats


def test_topk_sends_inf_and_nan_first() -> None:
    x = torch.zeros(1000)
    x[10] = float("nan")
    x[500] = -float("inf")
    x[999] = 3.0
    y = decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.002))  # k = 2
    assert math.isnan(y[10].item()) and y[500].item() == -float("inf")
    assert y[999].item() == 0.0
    # inf outranks the largest finite value (nan_to_num would have made them equal).
    for dtype in FLOATS:
        big = torch.finfo(dtype).max
        x = torch.tensor([big, float("inf"), -big, big], dtype=dtype)
        y = decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.25))
        assert y.tolist() == [0.0, float("inf"), 0.0, 0.0]


def test_topk_payload_layout() -> None:
    x = torch.zeros(70_000)
    x[3] = 1.0
    x[65_536 + 2] = -2.0  # the second span
    header, payload = encode_tensor(x, "topk", topk_fraction=2 / 70_000)
    assert header.kept == 2
    counts = torch.frombuffer(bytearray(payload[:8]), dtype=torch.int32).tolist()
    values = torch.frombuffer(bytearray(payload[8:16]), dtype=torch.float32).tolist()
    assert counts == [1, 1] and values == [1.0, -2.0]
    assert payload[16:] == bytes([3, 0, 2, 0])  # uint16 offsets within each span


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5, math.nan])
def test_topk_refuses_a_bad_fraction(fraction: float) -> None:
    with pytest.raises(CodecError, match="topk_fraction must be in"):
        encode_tensor(torch.ones(10), "topk", topk_fraction=fraction)


def _forged(header: tensor_pb2.TensorHeader, payload: bytes) -> tensor_pb2.TensorHeader:
    forged = tensor_pb2.TensorHeader()
    forged.CopyFrom(header)
    forged.crc32 = zlib.crc32(payload)
    return forged


def test_topk_refuses_payloads_whose_positions_do_not_check_out() -> None:
    x = torch.arange(1.0, 101.0)
    header, payload = encode_tensor(x, "topk", topk_fraction=0.03)  # keeps 98, 99, 100
    assert header.kept == 3
    body = bytearray(payload)
    bad_count = body.copy()
    bad_count[0] = 2
    out_of_order = body.copy()
    out_of_order[4 + 12 : 4 + 12 + 2] = bytes([99, 0])  # first offset after the second
    out_of_range = body.copy()
    out_of_range[-2:] = bytes([100, 0])  # position 100 of a 100-element tensor
    negative = body.copy()
    negative[0:4] = (-1).to_bytes(4, "little", signed=True)
    for bad, message in [
        (bad_count, "do not add up"),
        (negative, "do not add up"),
        (out_of_order, "out of range or out of order"),
        (out_of_range, "out of range or out of order"),
    ]:
        with pytest.raises(CodecError, match=message):
            decode_tensor(_forged(header, bytes(bad)), bytes(bad))


def test_topk_headers_with_hostile_k_are_refused_before_any_payload() -> None:
    header, _ = encode_tensor(torch.ones(100), "topk")
    header.kept = 101
    with pytest.raises(CodecError, match="keeps 101 entries of 100"):
        TensorAssembler(header)
    header.kept = 1 << 62
    with pytest.raises(CodecError, match="keeps"):
        check_header(header)
    lossless, _ = encode_tensor(torch.ones(100), "lossless")
    lossless.kept = 3
    with pytest.raises(CodecError, match="sets kept but the lossless codec has no use for it"):
        check_header(lossless)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_error_feedback_sum_tracks_the_inputs(dtype: torch.dtype) -> None:
    # The receiver's running sum differs from the sender's by exactly the residual, which
    # stays bounded: every entry gets through eventually.
    state = EncoderState(error_feedback=True)
    g = _gen(4)
    sent = torch.zeros(5000, dtype=torch.float64)
    received = torch.zeros(5000, dtype=torch.float64)
    plain = torch.zeros(5000, dtype=torch.float64)
    steps = 300
    for _ in range(steps):
        x = (torch.randn(5000, generator=g) + 0.1).to(dtype)
        y = decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.02, state=state))
        sent += x.double()
        received += y.double()
        plain += decode_tensor(*encode_tensor(x, "topk", topk_fraction=0.02)).double()
    assert state.residual is not None
    gap = sent - received
    # Only the residual is owed (up to the rounding of sums), and it is far below the sum.
    assert torch.allclose(gap, state.residual.double(), atol=1e-2 * (1 + sent.abs().max()))
    assert gap.norm() < 0.1 * sent.norm()
    assert (sent - plain).norm() > 5 * gap.norm()  # without feedback most mass is lost


def test_without_error_feedback_the_state_changes_nothing() -> None:
    state = EncoderState(error_feedback=False)
    x = torch.randn(2000, generator=_gen(5))
    for _ in range(3):
        assert encode_tensor(x, "topk", state=state) == encode_tensor(x, "topk")
    assert state.residual is None


def test_non_finite_tensors_clear_the_residual() -> None:
    state = EncoderState(error_feedback=True)
    encode_tensor(torch.randn(1000, generator=_gen(6)), "topk", state=state)
    assert state.residual is not None
    bad = torch.randn(1000, generator=_gen(7))
    bad[::10] = float("nan")  # more NaN than k: some stay behind
    encode_tensor(bad, "topk", state=state)
    assert state.residual is None
    y = decode_tensor(*encode_tensor(torch.ones(1000), "topk", state=state))
    assert bool(y.isfinite().all())


def test_topk_codec_decode_is_stateless() -> None:
    codec = get_codec("topk")
    header, payload = codec.encode(torch.randn(300, generator=_gen(8)), topk_fraction=0.1)
    assert header.crc32 == 0 and header.kept == 30
    assert torch.equal(codec.decode(header, payload), codec.decode(header, payload))
