"""Tensor codecs and the wire form of a tensor, for activations and gradients between stages.

A sender calls `encode_tensor(tensor, "int8")` for a `TensorHeader` and payload and streams
the payload with `iter_chunks`; the receiver feeds the chunks to a `TensorAssembler` built
from the header, which rejects a malformed or oversized tensor with CodecError before it
costs memory. Codecs (lossless, fp16, bf16, blockwise int8 and int4) implement `TensorCodec`
and are registered by their tensor_pb2.Codec value; the registry is checked at import.
`encode_tensor(..., rounding=Rounding(stochastic=True))` rounds int8/int4 without bias, and
`entropy="zstd"` passes any codec's payload through a lossless zstd stage.
"""

from swarmpipe.compression.blockwise_int4 import BlockwiseInt4Codec
from swarmpipe.compression.blockwise_int8 import BlockwiseInt8Codec
from swarmpipe.compression.casts import Bf16Codec, Fp16Codec, LosslessCodec
from swarmpipe.compression.codec import DEFAULT_BLOCK_SIZE, NEAREST, Rounding, TensorCodec
from swarmpipe.compression.entropy import ENTROPY_BY_NAME
from swarmpipe.compression.registry import CODECS, CODECS_BY_NAME, get_codec
from swarmpipe.compression.wire import (
    CHUNK_BYTES,
    DEFAULT_MAX_BYTES,
    TensorAssembler,
    check_header,
    decode_tensor,
    encode_tensor,
    iter_chunks,
)

__all__ = [
    "CHUNK_BYTES",
    "CODECS",
    "CODECS_BY_NAME",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MAX_BYTES",
    "ENTROPY_BY_NAME",
    "NEAREST",
    "Bf16Codec",
    "BlockwiseInt4Codec",
    "BlockwiseInt8Codec",
    "Fp16Codec",
    "LosslessCodec",
    "Rounding",
    "TensorAssembler",
    "TensorCodec",
    "check_header",
    "decode_tensor",
    "encode_tensor",
    "get_codec",
    "iter_chunks",
]
