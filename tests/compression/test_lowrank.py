"""The low-rank codec: exact at low rank, converging warm starts, dense where factors don't pay."""

from __future__ import annotations

import zlib

import pytest
import torch

from swarmpipe.compression import (
    EncoderState,
    TensorAssembler,
    check_header,
    decode_tensor,
    encode_tensor,
    lowrank,
)
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _of_rank(rank: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """A tensor whose [n, m] view has exactly this rank."""
    n, m = lowrank.matrix_dims(list(shape))
    g = _gen(seed)
    return (torch.randn(n, rank, generator=g) @ torch.randn(rank, m, generator=g)).view(shape)


def _relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y.double() - x.double()).norm() / x.double().norm())


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize(("true_rank", "rank"), [(1, 1), (3, 4), (8, 8)])
def test_a_tensor_of_rank_at_most_r_comes_back_exact(
    true_rank: int, rank: int, dtype: torch.dtype
) -> None:
    x = _of_rank(true_rank, 4, 32, 96).to(dtype)
    header, payload = encode_tensor(x, "lowrank", rank=rank)
    assert header.rank == rank
    assert header.payload_bytes == 4 + 4 * rank * (128 + 96)
    y = decode_tensor(header, payload)
    assert y.shape == x.shape and y.dtype == x.dtype
    # fp32 factors: exact up to fp32 rounding, then one rounding to the tensor's dtype.
    assert _relative_error(x, y) < 1e-4 + 2 * UNIT_ROUNDOFF[dtype]


def test_rank_r_keeps_the_top_singular_directions() -> None:
    # A dominant rank-4 part plus noise: the codec must find the rank-4 part, close to the
    # best rank-4 approximation (the truncated SVD).
    x = _of_rank(4, 256, 200, seed=1) * 10 + torch.randn(256, 200, generator=_gen(2))
    y = decode_tensor(*encode_tensor(x, "lowrank", rank=4))
    u, s, vh = torch.linalg.svd(x, full_matrices=False)
    best = (u[:, :4] * s[:4]) @ vh[:4]
    assert _relative_error(x, y) < 1.05 * _relative_error(x, best)


def test_warm_start_converges_over_calls() -> None:
    # A full-rank matrix with a slowly decaying spectrum: one cold encoding is well off the
    # best rank-4 approximation, and repeated warm encodings close the gap.
    g = _gen(3)
    u, _ = torch.linalg.qr(torch.randn(300, 300, generator=g))
    v, _ = torch.linalg.qr(torch.randn(200, 200, generator=g))
    spectrum = 0.8 ** torch.arange(200.0)
    x = (u[:, :200] * spectrum) @ v.T
    best = (u[:, :4] * spectrum[:4]) @ v[:, :4].T
    floor = _relative_error(x, best)
    state = EncoderState(error_feedback=False)  # warm start only, as for activations
    errors = []
    for _ in range(12):
        errors.append(
            _relative_error(x, decode_tensor(*encode_tensor(x, "lowrank", rank=4, state=state)))
        )
    cold = _relative_error(x, decode_tensor(*encode_tensor(x, "lowrank", rank=4)))
    assert errors[0] == pytest.approx(cold)  # a fresh state starts like no state
    assert errors[-1] < 1.01 * floor < cold
    assert errors[-1] <= errors[1] <= errors[0]


def test_error_feedback_sum_tracks_the_inputs() -> None:
    # Noise at rank 2 of 48 loses most of each tensor, yet with error feedback the gap between
    # the sums is exactly the residual and stops growing, while without it the gap keeps
    # growing with the number of steps.
    state = EncoderState(error_feedback=True)
    g = _gen(4)
    sent = torch.zeros(64, 48, dtype=torch.float64)
    received = torch.zeros_like(sent)
    plain = torch.zeros_like(sent)
    gaps = []
    for _ in range(100):
        x = torch.randn(64, 48, generator=g) + 0.05
        received += decode_tensor(*encode_tensor(x, "lowrank", rank=2, state=state)).double()
        plain += decode_tensor(*encode_tensor(x, "lowrank", rank=2)).double()
        sent += x.double()
        gaps.append(float((sent - received).norm()))
    assert state.residual is not None
    gap = sent - received
    assert torch.allclose(gap.view(-1), state.residual.double(), atol=1e-3 * sent.abs().max())
    assert gaps[-1] < 1.25 * gaps[39]
    assert (sent - plain).norm() > 2.5 * gaps[-1]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5, 0), (1000,), (3, 4), (2, 3, 4), (64, 8)])
def test_shapes_where_factors_do_not_pay_are_sent_dense_and_exact(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    x = torch.randn(shape, generator=_gen(5)).to(dtype)
    header, payload = encode_tensor(x, "lowrank", rank=8)
    assert header.rank == 0
    assert header.payload_bytes == x.numel() * dtype.itemsize
    y = decode_tensor(header, payload)
    assert y.shape == x.shape and torch.equal(y, x)


def test_non_finite_tensors_go_dense_and_clear_the_residual() -> None:
    state = EncoderState(error_feedback=True)
    encode_tensor(torch.randn(64, 64, generator=_gen(6)), "lowrank", rank=2, state=state)
    assert state.residual is not None
    x = torch.randn(64, 64, generator=_gen(7))
    x[3, 5] = float("nan")
    x[9, 1] = float("inf")
    header, payload = encode_tensor(x, "lowrank", rank=2, state=state)
    assert header.rank == 0
    y = decode_tensor(header, payload)
    assert y[3, 5].isnan() and y[9, 1].item() == float("inf")
    assert state.residual is None


def test_zero_and_huge_tensors() -> None:
    zeros = decode_tensor(*encode_tensor(torch.zeros(64, 64), "lowrank", rank=2))
    assert torch.equal(zeros, torch.zeros(64, 64))
    # Near fp32's largest value the product must not overflow to inf (it is clamped).
    huge = _of_rank(1, 64, 64, seed=8)
    huge = huge / huge.abs().max() * 3.4e38
    y = decode_tensor(*encode_tensor(huge, "lowrank", rank=1))
    assert bool(y.isfinite().all())
    assert _relative_error(huge, y) < 1e-4
    fp16 = (huge / 3.4e38 * 65504).half()
    assert bool(decode_tensor(*encode_tensor(fp16, "lowrank", rank=1)).isfinite().all())


def test_lowrank_refuses_a_rank_below_one() -> None:
    with pytest.raises(CodecError, match="rank must be >= 1"):
        encode_tensor(torch.ones(64, 64), "lowrank", rank=0)


def test_lowrank_headers_with_hostile_ranks_are_refused_before_any_payload() -> None:
    header, _ = encode_tensor(torch.ones(64, 32), "lowrank", rank=2)
    assert header.rank == 2
    for rank in (33, 1 << 31):
        header.rank = rank
        with pytest.raises(CodecError, match=f"rank {rank} for a \\[64, 32\\] matrix"):
            TensorAssembler(header)
    header.rank = 2
    header.payload_bytes = 4 + 4 * 2 * 96 - 1
    with pytest.raises(CodecError, match="takes 772"):
        check_header(header)
    lossless, _ = encode_tensor(torch.ones(100), "lossless")
    lossless.rank = 3
    with pytest.raises(CodecError, match="sets rank but the lossless codec"):
        check_header(lossless)


def test_random_factor_bytes_decode_to_the_promised_shape() -> None:
    header, payload = encode_tensor(torch.randn(64, 32, generator=_gen(9)), "lowrank", rank=2)
    junk = torch.randint(0, 256, (len(payload),), dtype=torch.uint8, generator=_gen(10))
    data = junk.numpy().tobytes()
    forged = tensor_pb2.TensorHeader()
    forged.CopyFrom(header)
    forged.crc32 = zlib.crc32(data)
    assert decode_tensor(forged, data).shape == (64, 32)
