"""Property-based round trips of every codec, with and without zstd, over hostile values.

Shapes include 0-d, empty and non-contiguous tensors; values include inf, NaN, zeros,
subnormals, fp32's extremes and outlier channels. Whatever the input, the result has the
input's shape and dtype, and each finite element meets its codec's error bound: top-k keeps
the largest magnitudes bit-exactly and zeros the rest, low-rank never strays further from the
tensor than the tensor is from zero (a projection) and is exact when it sends the tensor dense.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmpipe.compression import CODECS_BY_NAME, decode_tensor, encode_tensor, topk
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


def block_ids(shape: torch.Size, block_size: int, channel_blocks: bool) -> torch.Tensor:
    """The block of each element of a tensor of `shape` (flat order), in either layout."""
    index = torch.arange(shape.numel())
    if channel_blocks and len(shape):
        channels = shape[-1]
        return index // channels // block_size * channels + index % channels
    return index // block_size


def _blockwise_check(
    x: torch.Tensor,
    y: torch.Tensor,
    block_size: int,
    qmax: int,
    channel_blocks: bool,
    *,
    centered: bool = False,
) -> None:
    if not x.numel():
        return
    ids = block_ids(x.shape, block_size, channel_blocks)
    xf, yf = x.reshape(-1).float(), y.reshape(-1).float()
    blocks = int(ids.max()) + 1
    # A block holding inf or NaN decodes to all NaN; the others keep the bound.
    broken = torch.zeros(blocks).index_add_(0, ids, (~xf.isfinite()).float()) > 0
    assert bool(yf[broken[ids]].isnan().all())
    absmax = torch.zeros(blocks).scatter_reduce_(0, ids, xf.abs(), "amax")
    # Known edge: within an ulp or so of fp32's largest value, qmax times the rounded scale can
    # overflow to inf on decoding. No activation or gradient gets there.
    checked = ~broken[ids] & (absmax[ids] < FP32_MAX * (1 - 2.0**-20))
    a = absmax[ids][checked]
    if centered:
        # Half a step of half the block's range, plus fp32 roundings of x - mid and
        # code * scale + mid, each within an ulp of the block's absmax.
        high = torch.full((blocks,), -math.inf).scatter_reduce_(0, ids, xf, "amax")
        low = torch.full((blocks,), math.inf).scatter_reduce_(0, ids, xf, "amin")
        half = (high[ids][checked] / 2 - low[ids][checked] / 2).double()
        bound = half / qmax / 2 * (1 + 1e-4) + a * (UNIT_ROUNDOFF[x.dtype] + 2.0**-21)
        bound = bound + FP32_TINY
        gap = (yf[checked].double() - xf[checked].double()).abs()
        assert bool((gap <= bound).all())
        return
    bound = a / qmax / 2 * (1 + 1e-4) + a * UNIT_ROUNDOFF[x.dtype] + FP32_TINY
    assert bool(((yf[checked] - xf[checked]).abs() <= bound).all())


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


def _topk_check(x: torch.Tensor, y: torch.Tensor, fraction: float) -> None:
    xf, yf = x.reshape(-1), y.reshape(-1)
    k = topk.kept_entries(xf.numel(), fraction)
    assert int(((yf != 0) | yf.isnan()).sum()) <= k
    if not k:
        return
    magnitude = xf.float().abs().nan_to_num(nan=math.inf, posinf=math.inf)
    threshold = magnitude.topk(k).values[-1]
    above, below = magnitude > threshold, magnitude < threshold
    assert torch.equal(_bits(yf[above]), _bits(xf[above]))
    assert bool((yf[below] == 0).all())


def _lowrank_check(x: torch.Tensor, y: torch.Tensor, rank: int) -> None:
    if rank == 0:
        assert torch.equal(_bits(y), _bits(x.contiguous()))
        return
    assert bool(x.isfinite().all())  # anything else is sent dense
    xd, yd = x.double().reshape(-1), y.double().reshape(-1)
    # P P^T M is an orthogonal projection of M: never further from M than M is from 0, up to
    # fp32 arithmetic and one rounding to the tensor's dtype per element (and clamping to its
    # largest value, which only moves an element towards M).
    slack = 1e-4 + 2 * UNIT_ROUNDOFF[x.dtype]
    assert float((yd - xd).norm()) <= float(xd.norm()) * (1 + slack) + FP32_TINY


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("codec", sorted(CODECS_BY_NAME))
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    x=tensors(),
    entropy=st.sampled_from(["none", "zstd"]),
    options=st.fixed_dictionaries(
        {
            "block_size": st.sampled_from([1, 3, 64, 256]),
            "channel_blocks": st.booleans(),
            "centered": st.booleans(),
            "code_max": st.sampled_from([0, 1, 3, 15]),
            "topk_fraction": st.sampled_from([1e-3, 0.05, 0.5, 1.0]),
            "rank": st.sampled_from([1, 2, 8]),
        }
    ),
)
def test_every_codec_round_trips_within_its_bound(
    x: torch.Tensor, codec: str, entropy: str, options: dict[str, Any]
) -> None:
    header, payload = encode_tensor(x, codec, entropy=entropy, **options)
    y = decode_tensor(header, payload)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    plain = decode_tensor(*encode_tensor(x, codec, **options))
    assert torch.equal(_bits(y), _bits(plain))  # zstd is exact w.r.t. the codec alone
    if codec == "lossless":
        assert torch.equal(_bits(y), _bits(x.contiguous()))
    elif codec in QMAX:
        _blockwise_check(
            x,
            y,
            options["block_size"],
            header.code_max or QMAX[codec],
            header.channel_blocks,
            centered=header.centered,
        )
    elif codec == "topk":
        _topk_check(x, y, options["topk_fraction"])
    elif codec == "lowrank":
        _lowrank_check(x, y, header.rank)
    else:
        _cast_check(x, y, codec)
