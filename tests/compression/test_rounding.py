"""Stochastic rounding of the blockwise codecs: unbiased, within one step, flagged on the wire."""

from __future__ import annotations

import pytest
import torch

from swarmpipe.compression import Rounding, decode_tensor, encode_tensor
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

pytestmark = pytest.mark.filterwarnings("error")

QMAX = {"int8": 127, "int4": 7}
BLOCK = 64


def _steps(x: torch.Tensor) -> torch.Tensor:
    """Each element's quantisation step s = block absmax / qmax, for qmax = 1."""
    return x.view(-1, BLOCK).abs().amax(dim=1).repeat_interleave(BLOCK)


def _tensor() -> torch.Tensor:
    # Values between codes on purpose: round-to-nearest then has a bias of up to half a step,
    # which the unbiasedness test must tell apart from stochastic rounding's none.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8 * BLOCK, generator=g) * torch.logspace(-3, 3, 8).repeat_interleave(BLOCK)
    return x


@pytest.mark.parametrize("codec", sorted(QMAX))
def test_stochastic_rounding_is_unbiased_and_within_one_step(codec: str) -> None:
    x = _tensor()
    step = _steps(x) / QMAX[codec]
    rounding = Rounding(stochastic=True, generator=torch.Generator().manual_seed(0))
    k = 2000
    total = torch.zeros_like(x, dtype=torch.float64)
    for _ in range(k):
        header, payload = encode_tensor(x, codec, block_size=BLOCK, rounding=rounding)
        assert header.stochastic_rounding
        y = decode_tensor(header, payload)
        assert bool(((y - x).abs() <= step * (1 + 1e-4)).all())  # never more than one step
        total += y.double()
    mean = (total / k).float()
    # Each encoding is off by a variable of variance <= step^2 / 4, so the mean of k of them
    # has standard deviation <= step / (2 sqrt k); 6 of those over 512 elements never fails
    # by chance (and the generator is seeded).
    assert bool(((mean - x).abs() <= 6 * step / (2 * k**0.5)).all())
    nearest = decode_tensor(*encode_tensor(x, codec, block_size=BLOCK))
    assert (nearest - x).abs().max() > 10 * (mean - x).abs().max()  # the test can tell


@pytest.mark.parametrize("codec", sorted(QMAX))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_stochastic_rounding_of_half_inputs_stays_in_range(codec: str, dtype: torch.dtype) -> None:
    # Block maxima sit exactly on the top code, where y + u would round past qmax unclamped.
    x = torch.tensor([1.0, -1.0, 0.5, 0.0] * 64).to(dtype)
    rounding = Rounding(stochastic=True, generator=torch.Generator().manual_seed(1))
    header, payload = encode_tensor(x, codec, block_size=4, rounding=rounding)
    y = decode_tensor(header, payload)
    assert y.dtype == dtype
    assert torch.equal(y[0::4], x[0::4]) and torch.equal(y[1::4], x[1::4])
    assert bool((y.abs() <= 1).all())


def test_same_generator_state_gives_the_same_bytes() -> None:
    x = _tensor()

    def once() -> tuple[tensor_pb2.TensorHeader, bytes]:
        g = torch.Generator().manual_seed(42)
        return encode_tensor(x, "int4", rounding=Rounding(stochastic=True, generator=g))

    assert once() == once()


@pytest.mark.parametrize("codec", ["lossless", "fp16", "bf16"])
def test_codecs_that_do_not_quantise_refuse_stochastic_rounding(codec: str) -> None:
    with pytest.raises(CodecError, match="no stochastic rounding"):
        encode_tensor(torch.ones(3), codec, rounding=Rounding(stochastic=True))
    header, payload = encode_tensor(torch.ones(3), codec)
    header.stochastic_rounding = True
    with pytest.raises(CodecError, match="says stochastic rounding but the codec does not"):
        decode_tensor(header, payload)
