"""Every codec, keyed by its wire enum and by its config name; checked at import.

A `Codec` value added to tensor.proto without a codec here (or two codecs claiming one value)
fails the import of `swarmpipe.compression`, so it cannot reach a node that would then reject
its peers' tensors at run time.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from swarmpipe.compression.blockwise_int4 import BlockwiseInt4Codec
from swarmpipe.compression.blockwise_int8 import BlockwiseInt8Codec
from swarmpipe.compression.casts import Bf16Codec, Fp16Codec, LosslessCodec
from swarmpipe.compression.codec import TensorCodec
from swarmpipe.compression.lowrank import LowRankCodec
from swarmpipe.compression.topk import TopKCodec
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

_ALL: tuple[TensorCodec, ...] = (
    LosslessCodec(),
    Fp16Codec(),
    Bf16Codec(),
    BlockwiseInt8Codec(),
    BlockwiseInt4Codec(),
    TopKCodec(),
    LowRankCodec(),
)


def _check(codecs: tuple[TensorCodec, ...]) -> None:
    """Raise unless every Codec enum value but CODEC_UNSPECIFIED has exactly one codec."""
    wanted = {
        value: name
        for name, value in tensor_pb2.Codec.items()
        if value != tensor_pb2.CODEC_UNSPECIFIED
    }
    ids = [codec.codec_id for codec in codecs]
    names = [codec.name for codec in codecs]
    problems = [f"two codecs for {wanted.get(i, i)}" for i in set(ids) if ids.count(i) > 1]
    problems += [f"two codecs named {n!r}" for n in set(names) if names.count(n) > 1]
    problems += [f"no codec for {name}" for value, name in wanted.items() if value not in ids]
    problems += [f"codec {c.name!r} has no enum value" for c in codecs if c.codec_id not in wanted]
    if problems:
        raise ImportError(f"swarmpipe.compression codec registry: {'; '.join(sorted(problems))}")


_check(_ALL)

CODECS: Mapping[int, TensorCodec] = MappingProxyType({codec.codec_id: codec for codec in _ALL})
"""Each tensor_pb2.Codec value (but CODEC_UNSPECIFIED) to its codec."""

CODECS_BY_NAME: Mapping[str, TensorCodec] = MappingProxyType({codec.name: codec for codec in _ALL})
"""Each codec by its config name: lossless, fp16, bf16, int8, int4, topk, lowrank."""


def get_codec(codec: int | str) -> TensorCodec:
    """The codec for a tensor_pb2.Codec value or a config name; CodecError if there is none."""
    if isinstance(codec, str):
        try:
            return CODECS_BY_NAME[codec]
        except KeyError:
            raise CodecError(
                f"unknown codec {codec!r}; choose one of {', '.join(CODECS_BY_NAME)}"
            ) from None
    try:
        return CODECS[codec]
    except KeyError:
        known = ", ".join(f"{value} ({c.name})" for value, c in CODECS.items())
        raise CodecError(
            f"unknown codec enum value {codec}; this swarmpipe knows {known}. "
            "A peer sending another value runs a newer or incompatible version"
        ) from None
