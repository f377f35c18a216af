"""Codecs that send each element as it is or cast to a 16-bit float: lossless, fp16, bf16."""

from __future__ import annotations

import torch

from swarmpipe.compression.codec import DTYPES, Rounding, TensorCodec, header_dtype, numel
from swarmpipe.protos import tensor_pb2

FP16_MAX = torch.finfo(torch.float16).max  # 65504


class _CastCodec(TensorCodec):
    """Sends every element as `wire_dtype`; decoding casts back to the header dtype."""

    wire_dtype: torch.dtype

    def expected_payload_bytes(self, header: tensor_pb2.TensorHeader) -> int:
        return numel(header.shape) * self.wire_dtype.itemsize

    def _cast(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype)

    def _encode_flat(self, flat: torch.Tensor, block_size: int, rounding: Rounding) -> torch.Tensor:
        # A 0-d or empty tensor views as uint8 as well once flat.
        return self._cast(flat).view(torch.uint8)

    def _decode_flat(self, header: tensor_pb2.TensorHeader, raw: torch.Tensor) -> torch.Tensor:
        # .to returns the view itself when the header dtype is the wire dtype: no copy then.
        return raw.view(self.wire_dtype).to(header_dtype(header))


class LosslessCodec(_CastCodec):
    """Raw little-endian bytes of the tensor's own dtype; bit-exact, integers included."""

    codec_id = tensor_pb2.CODEC_LOSSLESS
    name = "lossless"
    dtypes = frozenset(DTYPES.values())

    def expected_payload_bytes(self, header: tensor_pb2.TensorHeader) -> int:
        return numel(header.shape) * header_dtype(header).itemsize

    def _encode_flat(self, flat: torch.Tensor, block_size: int, rounding: Rounding) -> torch.Tensor:
        return flat.view(torch.uint8)

    def _decode_flat(self, header: tensor_pb2.TensorHeader, raw: torch.Tensor) -> torch.Tensor:
        return raw.view(header_dtype(header))


class Fp16Codec(_CastCodec):
    """Cast to float16, clamped to its finite range: an overflow arrives as ±65504, not ±inf.

    A gradient spike that overflows fp16 would otherwise poison the whole step with inf; the
    clamp keeps its sign and a large magnitude. NaN stays NaN, so real breakage still shows.
    """

    codec_id = tensor_pb2.CODEC_FP16
    name = "fp16"
    wire_dtype = torch.float16

    def _cast(self, flat: torch.Tensor) -> torch.Tensor:
        if flat.dtype == torch.float32:
            # Clamping in fp32 and then casting is faster on CPU than clamping fp16 values.
            return flat.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)
        # bf16 cannot hold 65504 (it rounds to 65536), so clamp after the cast instead: only
        # ±inf can be out of range by then, since the cast rounds anything past 65520 to inf.
        half = flat.to(torch.float16)
        if half is flat:  # already fp16, so this is the caller's memory: clamp into a copy
            return half.clamp(-FP16_MAX, FP16_MAX)
        return half.clamp_(-FP16_MAX, FP16_MAX)


class Bf16Codec(_CastCodec):
    """Cast to bfloat16: fp32's range with 8 bits of mantissa, so nothing overflows."""

    codec_id = tensor_pb2.CODEC_BF16
    name = "bf16"
    wire_dtype = torch.bfloat16
