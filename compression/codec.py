"""The tensor codec interface, and the dtype table shared by every codec.

A codec turns one tensor into payload bytes and a `TensorHeader` that describes them, and back.
Integrity (crc32), size limits and chunking belong to the wire form (`wire.py`), not to codecs.
"""

from __future__ import annotations

import abc
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from swarmpipe.compression.state import EncoderState
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

# Payloads are little-endian, and every codec writes the host's bytes as they are. Every platform
# torch ships for is little-endian; fail loudly rather than send byte-swapped tensors.
if sys.byteorder != "little":
    raise ImportError("swarmpipe.compression assumes a little-endian host")

DEFAULT_BLOCK_SIZE = 256
"""Elements per absmax block of blockwise codecs unless the caller says otherwise."""

DEFAULT_TOPK_FRACTION = 0.01
"""Share of a tensor's entries the top-k codec keeps unless the caller says otherwise."""

DEFAULT_LOWRANK_RANK = 8
"""Columns of each factor the low-rank codec sends unless the caller says otherwise."""

MAX_DIMS = 64
"""Most dimensions a header may give; no model tensor comes near, so more is a bug or hostile."""

MAX_EXTENT = (1 << 63) - 1
"""Largest product of a header's dimensions, each counted as at least 1. A shape with a 0 in
it holds no elements and passes every size limit, yet torch computes its strides from the
other dimensions: [0, 2**62, 4] decoded to a RuntimeError ("Stride calculation overflowed")
where a CodecError belongs, found by the decoder fuzz (bench/fuzz_decoders.py)."""

DTYPES: dict[tensor_pb2.DType.ValueType, torch.dtype] = {
    tensor_pb2.DTYPE_FLOAT32: torch.float32,
    tensor_pb2.DTYPE_FLOAT16: torch.float16,
    tensor_pb2.DTYPE_BFLOAT16: torch.bfloat16,
    tensor_pb2.DTYPE_INT64: torch.int64,
    tensor_pb2.DTYPE_INT32: torch.int32,
}
"""The torch dtype of each wire dtype; DTYPE_UNSPECIFIED has none."""

_DTYPE_ENUMS = {torch_dtype: enum for enum, torch_dtype in DTYPES.items()}


@dataclass(frozen=True, kw_only=True, slots=True)
class Rounding:
    """How a quantising codec rounds to its codes; codecs that do not quantise ignore it."""

    stochastic: bool = False
    """Round down or up at random, with the chance of rounding up the distance to the lower
    code: unbiased (the mean of many encodings is the tensor), at up to one step of error
    instead of half a step. Gradients summed over many steps want it; activations rarely do."""
    generator: torch.Generator | None = None
    """Where the random bits come from, on the tensor's device; None is torch's default
    generator, which then also moves the stream dropout and sampling draw from."""


NEAREST = Rounding()
"""Round to the nearest code, half to even."""

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
"""The dtypes lossy codecs accept; rounding an integer tensor is never what the caller meant."""


def dtype_name(dtype: torch.dtype) -> str:
    """`float32` rather than `torch.float32`, for messages."""
    return str(dtype).removeprefix("torch.")


def dtype_enum(dtype: torch.dtype) -> tensor_pb2.DType.ValueType:
    """The wire dtype of a torch dtype; CodecError for one the wire cannot carry."""
    try:
        return _DTYPE_ENUMS[dtype]
    except KeyError:
        known = ", ".join(dtype_name(d) for d in _DTYPE_ENUMS)
        raise CodecError(
            f"cannot send a {dtype_name(dtype)} tensor; the wire carries {known}"
        ) from None


def header_dtype(header: tensor_pb2.TensorHeader) -> torch.dtype:
    """The torch dtype a header decodes to; CodecError for an unknown wire dtype."""
    try:
        return DTYPES[header.dtype]
    except KeyError:
        raise CodecError(
            f"tensor header has unknown dtype enum value {header.dtype}; "
            "the sender runs a newer or broken swarmpipe"
        ) from None


def numel(shape: Sequence[int]) -> int:
    """Elements in a tensor of this shape (Python ints: no overflow on hostile shapes)."""
    return math.prod(shape)


def describe(header: tensor_pb2.TensorHeader) -> str:
    """A header in user terms for error messages: `shape [8, 64], float32, lossless`.

    At most MAX_DIMS dimensions are shown: a hostile header's million dimensions would
    otherwise make a message of megabytes, in the log and the call's status."""
    dtype = DTYPES.get(header.dtype)
    dtype_text = dtype_name(dtype) if dtype is not None else f"dtype enum {header.dtype}"
    try:
        codec_text = tensor_pb2.Codec.Name(header.codec).removeprefix("CODEC_").lower()
    except ValueError:
        codec_text = f"codec enum {header.codec}"
    if header.block_size:
        codec_text += f" block {header.block_size}"
    if header.channel_blocks:
        codec_text += " down channels"
    if header.centered:
        codec_text += " centered"
    if header.code_max:
        codec_text += f" codes to {header.code_max}"
    if header.kept:
        codec_text += f" keeping {header.kept}"
    if header.rank:
        codec_text += f" rank {header.rank}"
    if header.entropy == tensor_pb2.ENTROPY_ZSTD:
        codec_text += " + zstd"
    elif header.entropy != tensor_pb2.ENTROPY_NONE:
        codec_text += f" + entropy enum {header.entropy}"
    shape = list(header.shape[:MAX_DIMS])
    shape_text = str(shape) if len(header.shape) <= MAX_DIMS else f"{str(shape)[:-1]}, ...]"
    return f"shape {shape_text}, {dtype_text}, {codec_text}"


class TensorCodec(abc.ABC):
    """One way to turn a tensor into payload bytes and back; registered by `codec_id`.

    Subclasses implement the three abstract methods on flat tensors; this base class owns the
    header, the shape and the checks every codec needs, so a new codec is a small file.
    """

    codec_id: ClassVar[tensor_pb2.Codec.ValueType]
    """The wire enum value this codec answers to; the registry is keyed by it."""
    name: ClassVar[str]
    """The config name (`pipeline.activation_codec = "int8"`)."""
    dtypes: ClassVar[frozenset[torch.dtype]] = FLOAT_DTYPES
    """Dtypes the codec can encode, and so the header dtypes it can decode to."""
    blockwise: ClassVar[bool] = False
    """Whether the header's block_size means something to this codec."""
    rounds: ClassVar[bool] = False
    """Whether the codec quantises, and so can round stochastically."""
    stateful: ClassVar[bool] = False
    """Whether the codec encodes through `_encode_stateful` and can use an EncoderState."""
    qmax: ClassVar[int] = 0
    """Largest integer code of a quantising codec (127 for int8, 7 for int4); 0 if none."""
    header_fields: ClassVar[frozenset[str]] = frozenset()
    """Codec-specific TensorHeader fields (`kept`, `rank`) this codec sets; others must be 0."""

    @abc.abstractmethod
    def expected_payload_bytes(self, header: tensor_pb2.TensorHeader) -> int:
        """Payload length a valid header implies; call `check_header` first."""

    def planned_payload_bytes(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        centered: bool = False,
        topk_fraction: float = DEFAULT_TOPK_FRACTION,
        rank: int = DEFAULT_LOWRANK_RANK,
    ) -> int:
        """Payload bytes `encode` sends for a finite tensor of this shape and dtype with these
        parameters, without encoding one: what auto codec choice weighs each candidate by."""
        header = tensor_pb2.TensorHeader(
            dtype=dtype_enum(dtype),
            shape=shape,
            codec=self.codec_id,
            block_size=block_size if self.blockwise else 0,
            centered=centered and self.blockwise,
        )
        self._plan_header(header, topk_fraction=topk_fraction, rank=rank)
        return self.expected_payload_bytes(header)

    def _plan_header(
        self, header: tensor_pb2.TensorHeader, *, topk_fraction: float, rank: int
    ) -> None:
        """Set the `header_fields` that encoding a finite tensor with these parameters sets;
        codecs with such fields override it."""
        return  # most codecs have none

    def _encode_flat(self, flat: torch.Tensor, block_size: int, rounding: Rounding) -> torch.Tensor:
        """The payload of a 1-D tensor as a 1-D uint8 tensor on the input's device; every
        codec that is not `stateful` implements it.

        `flat` may share memory with the caller's tensor and must not be modified.
        """
        raise NotImplementedError(f"the {self.name} codec encodes through _encode_stateful")

    def _encode_with_header(
        self, flat: torch.Tensor, header: tensor_pb2.TensorHeader, rounding: Rounding
    ) -> torch.Tensor:
        """`_encode_flat` for codecs whose layout depends on the header (shape, channel
        blocks), which they may also adjust."""
        return self._encode_flat(flat, header.block_size, rounding)

    def _encode_stateful(
        self,
        flat: torch.Tensor,
        header: tensor_pb2.TensorHeader,
        *,
        topk_fraction: float,
        rank: int,
        state: EncoderState | None,
    ) -> torch.Tensor:
        """Like `_encode_flat` for `stateful` codecs, which also set their `header_fields`
        and read and update `state` (None: encode as if it were fresh, remember nothing)."""
        raise NotImplementedError(f"the {self.name} codec encodes through _encode_flat")

    @abc.abstractmethod
    def _decode_flat(self, header: tensor_pb2.TensorHeader, raw: torch.Tensor) -> torch.Tensor:
        """The 1-D tensor of the header's dtype that `raw` (uint8, right length) encodes.

        The codec owns `raw` and may return a view of it.
        """

    def encode(
        self,
        tensor: torch.Tensor,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        rounding: Rounding = NEAREST,
        channel_blocks: bool = False,
        centered: bool = False,
        code_max: int = 0,
        topk_fraction: float = DEFAULT_TOPK_FRACTION,
        rank: int = DEFAULT_LOWRANK_RANK,
        state: EncoderState | None = None,
    ) -> tuple[tensor_pb2.TensorHeader, bytes]:
        """The header (crc32 left 0: the wire sets it) and payload bytes of `tensor`.

        Works on any device; the arithmetic runs where the tensor is and only the payload is
        copied to host memory. `block_size`, `channel_blocks` (blocks down the rows of each
        channel), `centered` (each block sends its midpoint; see blockwise.py) and `code_max`
        (codes only up to this magnitude: fewer levels, for an entropy stage to pack; 0, or
        at least the codec's own largest code, uses all) are ignored by codecs that are not
        blockwise, `topk_fraction` by all but top-k, `rank` by all but low-rank, and `state`
        by codecs that are not `stateful`; stochastic `rounding` is refused by codecs that do
        not quantise.
        """
        if tensor.dtype not in self.dtypes:
            integer = tensor.dtype in _DTYPE_ENUMS and not tensor.dtype.is_floating_point
            raise CodecError(
                f"the {self.name} codec cannot encode {dtype_name(tensor.dtype)} tensors; "
                f"it takes {_dtype_list(self.dtypes)}"
                + ("; send integer tensors with the lossless codec" if integer else "")
            )
        if self.blockwise and block_size < 1:
            raise CodecError(f"block_size must be >= 1 for the {self.name} codec, not {block_size}")
        if rounding.stochastic and not self.rounds:
            raise CodecError(
                f"the {self.name} codec does not quantise, so it has no stochastic rounding"
            )
        if code_max < 0:
            raise CodecError(f"code_max must be 0 (the codec's own) or >= 1, not {code_max}")
        header = tensor_pb2.TensorHeader(
            dtype=dtype_enum(tensor.dtype),
            shape=tensor.shape,
            codec=self.codec_id,
            block_size=block_size if self.blockwise else 0,
            stochastic_rounding=rounding.stochastic,
            channel_blocks=channel_blocks and self.blockwise,
            centered=centered and self.blockwise,
            code_max=code_max if self.blockwise and code_max < self.qmax else 0,
        )
        # reshape copies only when the tensor is not contiguous; detach lets .numpy() work on
        # tensors that require grad without copying them.
        flat = tensor.detach().reshape(-1)
        if not flat.numel():
            # An empty tensor can have stride 0 (torch.from_numpy of an empty array does),
            # which dtype views refuse.
            flat = flat.new_empty(0)
        if self.stateful:
            raw = self._encode_stateful(
                flat, header, topk_fraction=topk_fraction, rank=rank, state=state
            )
        else:
            raw = self._encode_with_header(flat, header, rounding)
        payload = raw.cpu().numpy().tobytes()
        header.payload_bytes = len(payload)
        return header, payload

    def decode(
        self,
        header: tensor_pb2.TensorHeader,
        payload: bytes | bytearray | memoryview,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """The tensor `payload` encodes, with the header's dtype and shape.

        `payload` is only read and the result never shares its memory. Does not check crc32;
        `wire.decode_tensor` does. `device` is where the arithmetic runs and the result lives
        (default CPU): decoding on the GPU moves the compact payload, not the decoded tensor.
        """
        self.check_header(header)
        if header.entropy != tensor_pb2.ENTROPY_NONE:
            raise CodecError(
                f"tensor payload went through an entropy stage; decode it with "
                f"swarmpipe.compression.decode_tensor ({describe(header)})"
            )
        view = memoryview(payload).cast("B")
        expected = self.expected_payload_bytes(header)
        if view.nbytes != expected:
            raise CodecError(
                f"tensor payload is {view.nbytes} bytes but {describe(header)} takes {expected}"
            )
        raw = torch.empty(view.nbytes, dtype=torch.uint8)
        # Copying through the buffer protocol: torch.frombuffer on read-only bytes warns, and
        # decoded tensors must own writable memory anyway.
        raw.numpy().data[:] = view
        return self.decode_owned(header, raw, device=device)

    def decode_owned(
        self,
        header: tensor_pb2.TensorHeader,
        raw: torch.Tensor,
        *,
        device: torch.device | str | None = None,
    ) -> torch.Tensor:
        """Like `decode`, but takes over `raw` (1-D uint8, exactly the payload; the header
        already checked): the result may share its memory, so the caller must not touch `raw`
        again."""
        if device is not None:
            # Only the compact payload crosses to the device; from pinned memory, the copy is
            # queued on the current stream and later ops on it wait for it.
            raw = raw.to(device, non_blocking=raw.is_pinned())
        return self._decode_flat(header, raw).view(tuple(header.shape))

    def check_header(self, header: tensor_pb2.TensorHeader) -> None:
        """CodecError unless the header is one this codec can decode (limits aside)."""
        if header.codec != self.codec_id:
            raise CodecError(f"header is for another codec, not {self.name} ({describe(header)})")
        dtype = header_dtype(header)
        if dtype not in self.dtypes:
            raise CodecError(
                f"the {self.name} codec cannot decode to {dtype_name(dtype)}; it decodes to "
                f"{_dtype_list(self.dtypes)} ({describe(header)})"
            )
        if len(header.shape) > MAX_DIMS:
            raise CodecError(
                f"tensor header has {len(header.shape)} dimensions, more than {MAX_DIMS}"
            )
        if any(dim < 0 for dim in header.shape):
            raise CodecError(f"tensor header has a negative dimension ({describe(header)})")
        # A shape with elements and this extent is over every size limit, refused there.
        if not numel(header.shape) and math.prod(max(d, 1) for d in header.shape) > MAX_EXTENT:
            raise CodecError(
                "tensor header's shape holds no elements, but its other dimensions multiply "
                f"past 2**63 - 1 ({describe(header)})"
            )
        if self.blockwise and header.block_size < 1:
            raise CodecError(f"tensor header needs block_size >= 1 ({describe(header)})")
        if not self.blockwise and header.channel_blocks:
            raise CodecError(
                f"tensor header has channel blocks but the codec has no blocks ({describe(header)})"
            )
        if not self.blockwise and header.centered:
            raise CodecError(
                "tensor header has centered blocks but the codec has no blocks "
                f"({describe(header)})"
            )
        if header.code_max and not (self.blockwise and header.code_max < self.qmax):
            raise CodecError(
                f"tensor header limits codes to {header.code_max} but the {self.name} codec "
                + (
                    f"takes a limit of 1 to {self.qmax - 1} ({describe(header)})"
                    if self.blockwise
                    else f"has no integer codes ({describe(header)})"
                )
            )
        if not self.blockwise and header.block_size:
            raise CodecError(
                f"tensor header has a block_size but the codec has no blocks ({describe(header)})"
            )
        for name in ("kept", "rank"):
            if getattr(header, name) and name not in self.header_fields:
                raise CodecError(
                    f"tensor header sets {name} but the {self.name} codec has no use for it "
                    f"({describe(header)})"
                )
        if not self.rounds and header.stochastic_rounding:
            raise CodecError(
                "tensor header says stochastic rounding but the codec does not quantise "
                f"({describe(header)})"
            )


def _dtype_list(dtypes: frozenset[torch.dtype]) -> str:
    return ", ".join(sorted(dtype_name(d) for d in dtypes))
