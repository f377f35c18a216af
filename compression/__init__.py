"""Tensor codecs and the wire form of a tensor, for activations and gradients between stages.

A sender calls `encode_tensor(tensor, "int8")` for a `TensorHeader` and payload and streams
the payload with `iter_chunks`; the receiver feeds the chunks to a `TensorAssembler` built
from the header, which rejects a malformed or oversized tensor with CodecError before it
costs memory. Codecs (lossless, fp16, bf16, blockwise int8 and int4, top-k, low-rank)
implement `TensorCodec` and are registered by their tensor_pb2.Codec value; the registry is
checked at import. `encode_tensor(..., rounding=Rounding(stochastic=True))` rounds int8/int4
without bias, and `entropy="zstd"` passes any codec's payload through a lossless zstd stage.

Stateful encoding (top-k and low-rank). The sender owns one `EncoderState` per next-stage
link and tensor role, and passes it with every tensor it sends there:

    states = {}  # (peer link, role) -> EncoderState, made on first use
    state = states.setdefault(
        (link, role), EncoderState(error_feedback=role in ("gradient", "reduce"))
    )
    header, payload = encode_tensor(
        tensor, "topk", topk_fraction=0.01, rank=8, state=state  # or "lowrank"
    )

- `error_feedback=True` (gradients, replica reduce): what a tensor's encoding dropped is added
  to the next tensor encoded with that state, so the receiver's sum over steps tracks the
  sender's. For "reduce" (weight gradients summed across steps) that is exact bookkeeping; for
  a pipeline's activation gradients it is the usual approximation (the residual passes
  through the next microbatch's backward, not its own). `False` (activations) keeps only the
  low-rank warm start.
- The state is keyed by the tensor's shape, dtype and device and resets itself when they
  change (`state.resets` counts it); it holds one fp32 residual and one [m, rank] factor at
  most. `state.reset()` forgets everything, e.g. after a send that failed in the "reduce" role.
- It is thread-safe (encodings sharing it run one at a time), lives only on the sender, and
  the receiver decodes with no state at all: a reroute to another replica corrupts nothing,
  the residual simply rides along with the next tensor sent on that link.
- `state=None` encodes as if the state were fresh and remembers nothing; lossless, fp16,
  bf16, int8 and int4 ignore the state.
"""

from swarmpipe.compression.blockwise_int4 import BlockwiseInt4Codec
from swarmpipe.compression.blockwise_int8 import BlockwiseInt8Codec
from swarmpipe.compression.casts import Bf16Codec, Fp16Codec, LosslessCodec
from swarmpipe.compression.codec import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOWRANK_RANK,
    DEFAULT_TOPK_FRACTION,
    NEAREST,
    Rounding,
    TensorCodec,
)
from swarmpipe.compression.entropy import ENTROPY_BY_NAME
from swarmpipe.compression.lowrank import LowRankCodec
from swarmpipe.compression.registry import CODECS, CODECS_BY_NAME, get_codec
from swarmpipe.compression.state import EncoderState
from swarmpipe.compression.topk import TopKCodec
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
    "DEFAULT_LOWRANK_RANK",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_TOPK_FRACTION",
    "ENTROPY_BY_NAME",
    "NEAREST",
    "Bf16Codec",
    "BlockwiseInt4Codec",
    "BlockwiseInt8Codec",
    "EncoderState",
    "Fp16Codec",
    "LosslessCodec",
    "LowRankCodec",
    "Rounding",
    "TensorAssembler",
    "TensorCodec",
    "TopKCodec",
    "check_header",
    "decode_tensor",
    "encode_tensor",
    "get_codec",
    "iter_chunks",
]
