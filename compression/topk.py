"""Top-k sparsification: send only the k largest-magnitude entries, exactly, and where they are.

Meant for gradients with error feedback (`state.py`): what is not sent this time is added to
the next tensor, so over many steps every entry gets through. `k = ceil(fraction * numel)`
(at least 1 for a non-empty tensor); kept entries arrive bit-exact, every other one as 0.
inf and NaN count as the largest magnitudes, so they are always sent as they are.

Positions are sent as 16-bit offsets within spans of 65536 elements plus one uint32 count per
span, about 2 bytes per kept entry: half of int32 indices, and unlike 8-bit deltas it does not
depend on how evenly the kept entries are spread (a span of zeros costs 4 bytes, a dense span
nothing extra). At the default 1% that is 6 bytes per kept fp32 entry, 67x fewer than dense.

Payload: `ceil(numel / 65536)` little-endian uint32 counts of kept entries per span, then the
`kept` values in the tensor's own dtype, then `kept` little-endian uint16 offsets within their
span, in increasing position order (the decoder refuses anything else).
"""

from __future__ import annotations

import math

import torch

from swarmpipe.compression.codec import TensorCodec, describe, header_dtype, numel
from swarmpipe.compression.state import EncoderState
from swarmpipe.errors import CodecError
from swarmpipe.protos import tensor_pb2

SPAN = 1 << 16
"""Elements per span: a position is the span's start plus a 16-bit offset."""

# Selecting k of n with torch.topk costs ~0.6 s for 4 Mi elements on one CPU core. Instead a
# threshold from a random sample keeps a few more than k candidates in one pass, and topk runs
# on those; if the sample was unlucky and fewer than k pass, the whole tensor goes to topk.
_SAMPLE = 1 << 16
_SAMPLE_MARGIN = 1.5  # candidates per kept entry aimed for; misses cost one full topk
_SAMPLE_SEED = 0x5EED


def kept_entries(n: int, fraction: float) -> int:
    """How many of `n` entries top-k keeps at `fraction`: at least one of a non-empty tensor."""
    return min(n, max(1, math.ceil(fraction * n))) if n else 0


class TopKCodec(TensorCodec):
    """The k largest-magnitude entries in the tensor's dtype, with span-relative positions."""

    codec_id = tensor_pb2.CODEC_TOPK
    name = "topk"
    stateful = True
    header_fields = frozenset({"kept"})

    def expected_payload_bytes(self, header: tensor_pb2.TensorHeader) -> int:
        n = numel(header.shape)
        itemsize = header_dtype(header).itemsize
        return 4 * _spans(n) + header.kept * (itemsize + 2)

    def _plan_header(
        self, header: tensor_pb2.TensorHeader, *, topk_fraction: float, rank: int
    ) -> None:
        header.kept = kept_entries(numel(header.shape), topk_fraction)

    def check_header(self, header: tensor_pb2.TensorHeader) -> None:
        super().check_header(header)
        if header.kept > numel(header.shape):
            raise CodecError(
                f"tensor header keeps {header.kept} entries of {numel(header.shape)} "
                f"({describe(header)})"
            )

    def _encode_stateful(
        self,
        flat: torch.Tensor,
        header: tensor_pb2.TensorHeader,
        *,
        topk_fraction: float,
        rank: int,
        state: EncoderState | None,
    ) -> torch.Tensor:
        if not 0.0 < topk_fraction <= 1.0:
            raise CodecError(f"topk_fraction must be in (0, 1], not {topk_fraction}")
        n = flat.numel()
        self._plan_header(header, topk_fraction=topk_fraction, rank=rank)
        k = header.kept
        dtype = flat.dtype
        size = self.expected_payload_bytes(header)
        out = torch.empty(size, dtype=torch.uint8, device=flat.device)
        if n == 0:
            return out
        spans = _spans(n)
        counts = out[: 4 * spans].view(torch.int32)
        values = out[4 * spans : 4 * spans + k * dtype.itemsize].view(dtype)
        offsets = out[4 * spans + k * dtype.itemsize :].view(k, 2)
        if state is None:
            positions = _largest(flat, k)
            values.copy_(flat[positions])
        else:
            with state.hold(tuple(header.shape), dtype, flat.device):
                # fp32 working copy: the residual is fp32, and it must not touch the input.
                x = state.with_residual(flat.to(torch.float32, copy=True))
                positions = _largest(x, k)
                kept = x[positions]
                values.copy_(kept)  # rounds to a 16-bit dtype; the rounding feeds back too
                x[positions] = kept.sub_(values.float())
                state.keep_residual(x)
        counts.copy_(torch.bincount(positions >> 16, minlength=spans))
        offsets[:, 0].copy_(positions & 0xFF)
        offsets[:, 1].copy_((positions >> 8) & 0xFF)
        return out

    def _decode_flat(self, header: tensor_pb2.TensorHeader, raw: torch.Tensor) -> torch.Tensor:
        n = numel(header.shape)
        dtype = header_dtype(header)
        k = header.kept
        out = torch.zeros(n, dtype=dtype, device=raw.device)
        if k == 0:
            return out
        spans = _spans(n)
        counts = raw[: 4 * spans].view(torch.int32).long()
        values = raw[4 * spans : 4 * spans + k * dtype.itemsize].view(dtype)
        offsets = raw[4 * spans + k * dtype.itemsize :].view(k, 2).long()
        # Payload bytes are the sender's word, so the positions are checked before use: counts
        # that add up to k (bounding repeat_interleave), positions inside the tensor and
        # strictly increasing, so no entry is written twice.
        if bool((counts < 0).any()) or int(counts.sum()) != k:
            raise CodecError(
                f"top-k payload's span counts do not add up to the {k} kept entries "
                f"({describe(header)})"
            )
        span_starts = torch.repeat_interleave(
            torch.arange(spans, device=raw.device) * SPAN, counts, output_size=k
        )
        positions = span_starts + offsets[:, 0] + (offsets[:, 1] << 8)
        if int(positions[-1]) >= n or bool((positions[1:] <= positions[:-1]).any()):
            raise CodecError(
                f"top-k payload's positions are out of range or out of order ({describe(header)})"
            )
        out[positions] = values
        return out


def _spans(n: int) -> int:
    return -(-n // SPAN)


def _largest(x: torch.Tensor, k: int) -> torch.Tensor:
    """Positions (int64, increasing) of the `k` largest |x|, NaN and inf counting as largest."""
    n = x.numel()
    magnitude = x.abs().nan_to_num_(nan=math.inf, posinf=math.inf)
    positions: torch.Tensor | None = None
    aim = math.ceil(k * _SAMPLE_MARGIN * _SAMPLE / n) + 8  # sample entries above the threshold
    if n > 4 * _SAMPLE and aim < _SAMPLE // 2:
        generator = torch.Generator(device=x.device).manual_seed(_SAMPLE_SEED)
        sample = magnitude[torch.randint(n, (_SAMPLE,), generator=generator, device=x.device)]
        threshold = sample.topk(aim, sorted=False).values.min()
        candidates = (magnitude >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            chosen = magnitude[candidates].topk(k, sorted=False).indices
            positions = candidates[chosen]
    if positions is None:
        positions = magnitude.topk(k, sorted=False).indices
    return positions.sort().values
