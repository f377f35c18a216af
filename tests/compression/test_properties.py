"""Property-based round trips of every codec, with and without zstd, over hostile values.

Shapes include 0-d, empty and non-contiguous tensors; values include inf, NaN, zeros,
subnormals, fp32's extremes and outlier channels. Whatever the input, the result has the
input's shape and dtype, and each finite element meets its codec's error bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmpipe.compression import CODECS_BY_NAME, decode_tensor, encode_tensor
from swarmpipe.compression.casts import FP16_MAX

pytestmark = pytest.mark.filterwarnings("error")

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
QMAX = {"int8": 127, "int4": 7}
# Below fp32's smallest normal number its arithmetic keeps only absolute precision, so bounds
# relative to a block's absmax get this absolute slack.
FP32_TINY = 2.0**-126
BF16_MAX = torch.finfo(torch.bfloat16).max
FP32_MAX = torch.finfo(torch.float32).max

_SPECIAL = st.sampled_from(
    [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3e38, 3.3961e38, 3.4e38]
)
_VALUES = st.one_of(
    st.floats(width=32, allow_nan=True, allow_infinity=True),
    st.floats(-10, 10, width=32),
    _SPECIAL,
)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A float tensor of any layout, sometimes with outlier channels in its last dimension."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=40))
    array = draw(hnp.arrays(np.float32, shape, elements=_VALUES))
    x = torch.from_numpy(array.copy())
    if x.dim() and x.shape[-1] and draw(st.booleans()):
        channels = draw(st.lists(st.integers(0, x.shape[-1] - 1), min_size=1, max_size=3))
        with np.errstate(over="ignore"):  # x20 of fp32's extremes is inf: a value like any
            x[..., channels] *= draw(st.sampled_from([20.0, 1e4]))
    x = x.to(draw(st.sampled_from(list(UNIT_ROUNDOFF))))
    if x.dim() >= 2 and draw(st.booleans()):
        x = x.transpose(0, -1)  # non-contiguous
    return x


def _blockwise_check(x: torch.Tensor, y: torch.Tensor, block_size: int, qmax: int) -> None:
    n = x.numel()
    nb = -(-n // block_size)
    padded_x = torch.zeros(nb * block_size)
    padded_x[:n] = x.reshape(-1).float()
    padded_y = torch.zeros(nb * block_size)
    padded_y[:n] = y.reshape(-1).float()
    bx, by = padded_x.view(nb, block_size), padded_y.view(nb, block_size)
    finite = bx.isfinite().all(dim=1)
    # A block holding inf or NaN decodes to all NaN (padding aside); the others keep the bound.
    real = torch.arange(nb * block_size).view(nb, block_size) < n
    assert bool(by[~finite][real[~finite]].isnan().all())
    # Known edge: within an ulp or so of fp32's largest value, qmax times the rounded scale can
    # overflow to inf on decoding. No activation or gradient gets there.
    finite &= bx.abs().amax(dim=1) < FP32_MAX * (1 - 2.0**-20)
    absmax = bx[finite].abs().amax(dim=1, keepdim=True)
    bound = absmax / qmax / 2 * (1 + 1e-4) + absmax * UNIT_ROUNDOFF[x.dtype] + FP32_TINY
    assert bool(((by[finite] - bx[finite]).abs() <= bound).all())


def _cast_check(x: torch.Tensor, y: torch.Tensor, codec: str) -> None:
    xf, yf = x.float().reshape(-1), y.float().reshape(-1)
    assert torch.equal(xf.isnan(), yf.isnan())
    if codec == "fp16":
        ref = xf.clamp(-FP16_MAX, FP16_MAX)  # inf included: clamped, never inf
        rtol, atol = 2.0**-11 + UNIT_ROUNDOFF[x.dtype], 2.0**-24
    else:
        rtol, atol = 2.0**-8, 2.0**-133
        # bf16 keeps inf, and rounds fp32 values past its largest finite one to inf too.
        beyond = xf.abs() > BF16_MAX
        assert torch.equal(yf[beyond].sign(), xf[beyond].sign())
        assert bool(((yf[beyond].abs() == BF16_MAX) | yf[beyond].isinf()).all())
        ref = torch.where(beyond, 0.0, xf)
        yf = torch.where(beyond, 0.0, yf)
    ok = ~xf.isnan()
    assert bool(((yf - ref).abs()[ok] <= rtol * ref.abs()[ok] + atol).all())


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=tensors(),
    block_size=st.sampled_from([1, 3, 64, 256]),
    entropy=st.sampled_from(["none", "zstd"]),
)
def test_every_codec_round_trips_within_its_bound(
    x: torch.Tensor, codec: str, block_size: int, entropy: str
) -> None:
    header, payload = encode_tensor(x, codec, block_size=block_size, entropy=entropy)
    y = decode_tensor(header, payload)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    plain = decode_tensor(*encode_tensor(x, codec, block_size=block_size))
    assert torch.equal(_bits(y), _bits(plain))  # zstd is exact w.r.t. the codec alone
    if codec == "lossless":
        assert torch.equal(_bits(y), _bits(x.contiguous()))
    elif codec in QMAX:
        _blockwise_check(x, y, block_size, QMAX[codec])
    else:
        _cast_check(x, y, codec)
