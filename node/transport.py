"""Tensors on the Stage.Forward stream: encoding, assembling, and counting their bytes.

Encoding and decoding run in a thread (not the event loop, not the compute
worker): codecs are plain torch ops on their own tensors, so they can overlap
with the stage's compute.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from swarmpipe.compression import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_LOWRANK_RANK,
    DEFAULT_TOPK_FRACTION,
    NEAREST,
    EncoderState,
    Rounding,
    TensorAssembler,
    encode_tensor,
    get_codec,
    iter_chunks,
)
from swarmpipe.config import DEFAULT_AUTO_CODECS, DEFAULT_STOCHASTIC_ROUNDING, PipelineConfig
from swarmpipe.errors import PeerError
from swarmpipe.protos import control_pb2, tensor_pb2

MAX_TENSOR_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    header: tensor_pb2.TensorHeader
    chunks: list[bytes]

    @property
    def payload_bytes(self) -> int:
        return int(self.header.payload_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class EncodeOptions:
    """The run's codec parameters, the same for every tensor a node sends."""

    block_size: int = DEFAULT_BLOCK_SIZE
    """Elements per absmax block of int8 and int4."""
    channel_blocks: bool = False
    """Whether int8/int4 blocks run down each channel (the last dimension)."""
    topk_fraction: float = DEFAULT_TOPK_FRACTION
    """Share of entries the topk codec keeps."""
    lowrank_rank: int = DEFAULT_LOWRANK_RANK
    """Factor width of the lowrank codec."""
    auto_activation: tuple[str, ...] = DEFAULT_AUTO_CODECS
    """Codecs auto mode chooses among for activations, least lossy first."""
    auto_gradient: tuple[str, ...] = DEFAULT_AUTO_CODECS
    """Codecs auto mode chooses among for gradients, least lossy first."""
    stochastic_rounding: tuple[str, ...] = DEFAULT_STOCHASTIC_ROUNDING
    """Roles ("activation", "gradient", "reduce") whose int8/int4 encodings round
    stochastically."""
    centered_blocks: tuple[str, ...] = ()
    """Roles whose int8/int4 blocks each send their midpoint (compression/blockwise.py)."""
    zstd: tuple[str, ...] = ()
    """Roles whose payloads also pass through the zstd stage (compression/entropy.py)."""
    activation_code_max: int = 0
    """Largest int8/int4 code of activations; 0 is the codec's own."""

    @classmethod
    def from_pipeline(cls, pipeline: PipelineConfig) -> EncodeOptions:
        return cls(
            block_size=pipeline.int8_block_size,
            channel_blocks=pipeline.int8_channel_blocks,
            topk_fraction=pipeline.topk_fraction,
            lowrank_rank=pipeline.lowrank_rank,
            auto_activation=pipeline.auto_activation_codecs,
            auto_gradient=pipeline.auto_gradient_codecs,
            stochastic_rounding=pipeline.stochastic_rounding,
            centered_blocks=pipeline.int8_centered,
            zstd=pipeline.zstd,
            activation_code_max=pipeline.activation_code_max,
        )

    def entropy(self, role: str) -> str:
        """The entropy stage a tensor of `role` passes through: "zstd" or "none"."""
        return "zstd" if role in self.zstd else "none"

    def code_max(self, role: str) -> int:
        """The largest int8/int4 code of a tensor of `role`; 0 is the codec's own."""
        return self.activation_code_max if role == "activation" else 0

    def rounding(self, codec: int | str, role: str, device: torch.device) -> Rounding:
        """How `codec` rounds a tensor of `role` on `device`: stochastically where the run
        asks for it and the codec quantises, each encoding with a fresh generator of its own
        (so encodings running at once in threads share no state, and the default torch
        generator that dropout draws from is left alone)."""
        if role not in self.stochastic_rounding or not get_codec(codec).rounds:
            return NEAREST
        generator = torch.Generator(device=device)
        generator.seed()
        return Rounding(stochastic=True, generator=generator)

    def encode_now(
        self, tensor: torch.Tensor, codec: int | str, role: str, state: EncoderState | None
    ) -> tuple[tensor_pb2.TensorHeader, bytes]:
        """`tensor`, a tensor of `role`, under `codec` with these options, on this thread:
        how a node encodes what it sends (and the convergence bench what a hop would)."""
        return encode_tensor(
            tensor,
            codec,
            block_size=self.block_size,
            rounding=self.rounding(codec, role, tensor.device),
            channel_blocks=self.channel_blocks,
            centered=role in self.centered_blocks,
            entropy=self.entropy(role),
            code_max=self.code_max(role),
            topk_fraction=self.topk_fraction,
            rank=self.lowrank_rank,
            state=state,
        )


async def encode(
    tensor: torch.Tensor,
    codec: int,
    options: EncodeOptions,
    *,
    role: str,
    state: EncoderState | None = None,
) -> EncodedTensor:
    """`tensor`, a tensor of `role` ("activation", "gradient" or "reduce"), under `codec`, in
    chunks; `state` is the link and role's EncoderState, which only the topk and lowrank
    codecs use (see swarmpipe.compression)."""

    def work() -> EncodedTensor:
        header, payload = options.encode_now(tensor, codec, role, state)
        return EncodedTensor(header, list(iter_chunks(payload)))

    return await asyncio.to_thread(work)


class TensorReader:
    """Collects one tensor from a header and chunk messages; bounded by the header."""

    def __init__(
        self,
        header: tensor_pb2.TensorHeader,
        stats: LinkStats | None = None,
        device: torch.device | None = None,
    ) -> None:
        """`device` is where the tensor is decoded and returned (None: the host); for a GPU
        the payload gathers in pinned host memory and only it is copied there."""
        # TensorAssembler checks the header (sizes, codec, dtype) before any
        # payload is buffered, so a hostile header costs nothing.
        on_gpu = device is not None and device.type == "cuda"
        self._assembler = TensorAssembler(header, max_bytes=MAX_TENSOR_BYTES, pin_memory=on_gpu)
        self._device = device
        self.header = header
        self._stats = stats

    def add(self, data: bytes) -> None:
        self._assembler.add(data)
        if self._stats is not None:
            self._stats.add_received(len(data))

    @property
    def complete(self) -> bool:
        return self._assembler.complete

    async def finish(self) -> torch.Tensor:
        if not self._assembler.complete:
            raise PeerError(
                f"stream ended after {self._assembler.received} of "
                f"{self.header.payload_bytes} tensor bytes"
            )
        return await asyncio.to_thread(self._assembler.finish, device=self._device)


class LinkStats:
    """Bytes and tensors this node sent, per (peer, direction, codec); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str, int], list[int]] = defaultdict(lambda: [0, 0])
        self.received_bytes = 0

    def add_received(self, nbytes: int) -> None:
        with self._lock:
            self.received_bytes += nbytes

    def record(self, peer: str, direction: str, codec: int, nbytes: int) -> None:
        with self._lock:
            entry = self._counts[(peer, direction, codec)]
            entry[0] += nbytes
            entry[1] += 1

    def total_bytes(self) -> int:
        with self._lock:
            return sum(v[0] for v in self._counts.values())

    def snapshot(self) -> list[control_pb2.LinkCounter]:
        with self._lock:
            return [
                control_pb2.LinkCounter(
                    peer=peer,
                    direction=direction,
                    codec=codec,  # type: ignore[arg-type]
                    bytes=v[0],
                    tensors=v[1],
                )
                for (peer, direction, codec), v in sorted(self._counts.items())
            ]
