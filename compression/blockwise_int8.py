"""Blockwise absmax int8: about 1 byte per element with error bounded per block.

Each block of `block_size` elements sends one fp32 scale `s = absmax / 127` and its elements
as codes in [-127, 127], so an element is off by at most `s / 2` (less than `s` with stochastic
rounding); see `blockwise.py` for the scheme and its failure mode.

Payload: `n_blocks` little-endian fp32 scales, then `numel` int8 codes (no padding).
"""

from __future__ import annotations

import torch

from swarmpipe.compression.blockwise import BlockwiseCodec
from swarmpipe.protos import tensor_pb2


class BlockwiseInt8Codec(BlockwiseCodec):
    """Per-block absmax fp32 scale plus int8 codes."""

    codec_id = tensor_pb2.CODEC_BLOCKWISE_INT8
    name = "int8"
    qmax = 127
    codes_per_byte = 1

    def _store(self, y: torch.Tensor, codes: torch.Tensor, start: int) -> None:
        codes[start : start + y.numel()].view(torch.int8).copy_(y)

    def _load(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        return codes.view(torch.int8)
