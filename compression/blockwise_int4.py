"""Blockwise absmax int4: about half a byte per element, error bounded per block.

Each block of `block_size` elements sends one fp32 scale `s = absmax / 7` and its elements as
codes in [-7, 7], so an element is off by at most `s / 2` (less than `s` with stochastic
rounding); see `blockwise.py` for the scheme and its failure mode. Sixteen times coarser than
int8: meant for links too slow for int8, and better with small blocks (64) that track outliers.

Payload: `n_blocks` little-endian fp32 scales, then `ceil(numel / 2)` bytes of 4-bit two's
complement codes, element 2i in the low nibble of byte i and element 2i + 1 in the high
nibble; an odd count leaves the last high nibble 0. A nibble of -8 never comes from the
encoder but decodes to -8 s, like any other code.
"""

from __future__ import annotations

import torch

from swarmpipe.compression.blockwise import BlockwiseCodec
from swarmpipe.protos import tensor_pb2


class BlockwiseInt4Codec(BlockwiseCodec):
    """Per-block absmax fp32 scale plus int4 codes, two per byte."""

    codec_id = tensor_pb2.CODEC_BLOCKWISE_INT4
    name = "int4"
    qmax = 7
    codes_per_byte = 2

    def _store(self, y: torch.Tensor, codes: torch.Tensor, start: int) -> None:
        # A non-finite block has NaN codes; converting NaN to an integer is undefined (x86 and
        # CUDA give different answers), so it becomes code 0, which the block's inf or NaN
        # scale decodes to NaN. int8 instead relies on NaN converting to a byte of 0.
        q = y.nan_to_num_(nan=0.0).to(torch.int8).view(torch.uint8)
        m = q.numel()
        pairs = m // 2
        first = start // 2
        if pairs:
            both = q[: 2 * pairs].view(pairs, 2)
            low = codes[first : first + pairs]
            torch.bitwise_and(both[:, 0], 0xF, out=low)
            low.bitwise_or_(both[:, 1] << 4)  # uint8 shifts drop the sign bits off the top
        if m % 2:
            codes[first + pairs : first + pairs + 1] = q[m - 1 :] & 0xF

    def _load(self, codes: torch.Tensor, n: int) -> torch.Tensor:
        packed = codes.view(torch.int8)
        out = torch.empty(packed.numel(), 2, dtype=torch.int8, device=codes.device)
        # int8 right shifts are arithmetic, so they sign-extend each nibble.
        low = out[:, 0]
        torch.bitwise_left_shift(packed, 4, out=low)
        low.bitwise_right_shift_(4)
        torch.bitwise_right_shift(packed, 4, out=out[:, 1])
        return out.view(-1)[:n]
