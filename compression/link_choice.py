"""Per-link codec choice: the least lossy codec whose transfer fits in a microbatch's compute.

A pipeline stage runs as fast as its compute allows as long as each link carries one
microbatch's tensor in no more time than a stage spends computing one microbatch; beyond
that the link, not the compute, sets the pace. So the sender of a tensor takes the least
lossy codec whose wire bytes, at the bandwidth it measured on that link, cross within its
compute time per microbatch, and compresses harder only as far as the link needs. A fast
link sends lossless.

This module is the policy alone, with no clock and no I/O, so it is tested exactly: the node
(node/links.py) feeds it measured figures and the shape of the tensor it is about to send.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmpipe.compression.registry import CODECS_BY_NAME, get_codec
from swarmpipe.config import DEFAULT_AUTO_CODECS

LOSSINESS_ORDER: tuple[str, ...] = DEFAULT_AUTO_CODECS
"""The dense codecs from least to most lossy: auto mode's default ladder for both directions
(`pipeline.auto_activation_codecs`, `auto_gradient_codecs`). bf16 sends as many bytes as fp16
with fewer mantissa bits, so it is picked only where fp16 cannot encode the tensor. A run that
meets links too slow even for int4 appends `topk` (gradients: it keeps 1 % of the entries and
feeds the rest back) or `lowrank` to a ladder; how lossy those are depends on the tensor, so
they join only where a run asks for them."""

UPGRADE_HEADROOM = 0.7
"""A less lossy codec replaces the current one only when its transfer fits in this fraction of
the budget, while a codec that no longer fits is replaced at once: measurements wobble, and a
link sitting near the boundary would otherwise flap between two codecs."""

UPGRADE_PATIENCE = 8
"""Consecutive tensors for which a less lossy codec must fit (with headroom) before a
`CodecChooser` moves to it. Compute times on a shared machine swing by several times from one
microbatch to the next; a link that compresses a little more than it needs for a few tensors
costs nothing in throughput, one that flaps back too early costs a slow transfer."""


def candidates(
    names: Sequence[str] = LOSSINESS_ORDER, dtype: torch.dtype = torch.float32
) -> tuple[int, ...]:
    """The Codec values of the ladder `names` (least lossy first) that can encode `dtype`."""
    return tuple(
        CODECS_BY_NAME[name].codec_id
        for name in names
        if name in CODECS_BY_NAME and dtype in CODECS_BY_NAME[name].dtypes
    )


def wire_bytes(
    codec_ids: Sequence[int],
    shape: Sequence[int],
    dtype: torch.dtype,
    *,
    block_size: int,
    topk_fraction: float,
    rank: int,
    centered: bool = False,
) -> list[int]:
    """Payload bytes each codec would send for a tensor of this shape, without encoding it."""
    return [
        get_codec(codec_id).planned_payload_bytes(
            shape,
            dtype,
            block_size=block_size,
            centered=centered,
            topk_fraction=topk_fraction,
            rank=rank,
        )
        for codec_id in codec_ids
    ]


def pick_codec(
    codec_ids: Sequence[int],
    sizes: Sequence[int],
    *,
    bytes_per_second: float,
    budget_seconds: float,
    current: int,
    headroom: float = UPGRADE_HEADROOM,
) -> int:
    """The codec a link should send with now, given where it stands (`current`).

    `codec_ids` run from least to most lossy and `sizes` are their wire bytes for the tensor.
    A codec fits when `size / bytes_per_second <= budget_seconds`. The least lossy fitting
    codec wins, except that moving to a less lossy codec than `current` needs it to fit within
    `headroom * budget_seconds`. When nothing fits, the codec with the fewest bytes wins.
    """
    if len(codec_ids) != len(sizes) or not codec_ids:
        raise ValueError("pick_codec needs one size per codec, and at least one codec")
    if bytes_per_second <= 0 or budget_seconds <= 0:
        raise ValueError("pick_codec needs a positive bandwidth and a positive budget")
    seconds = [size / bytes_per_second for size in sizes]
    smallest = min(range(len(sizes)), key=lambda i: (sizes[i], i))

    def least_lossy_within(limit: float) -> int:
        return next((i for i, s in enumerate(seconds) if s <= limit), smallest)

    fitting = least_lossy_within(budget_seconds)
    if current not in codec_ids:
        return codec_ids[fitting]
    now = codec_ids.index(current)
    if fitting > now or seconds[now] > budget_seconds:
        return codec_ids[fitting]  # the current codec no longer fits: compress harder at once
    # The current codec fits; a less lossy one must fit with room to spare.
    return codec_ids[min(now, least_lossy_within(budget_seconds * headroom))]


class CodecChooser:
    """The codec one direction of one link sends with, moved as the measured figures change.

    Starts lossless (the least lossy candidate) until both the bandwidth and the compute
    budget have been measured: a link nobody has measured yet is not assumed to be slow. Moves
    to a lossier codec as soon as `pick_codec` says so, to a less lossy one only after it has
    said so `patience` times in a row.
    """

    def __init__(
        self,
        codec_ids: Sequence[int],
        *,
        headroom: float = UPGRADE_HEADROOM,
        patience: int = UPGRADE_PATIENCE,
    ) -> None:
        if not codec_ids:
            raise ValueError("a CodecChooser needs at least one codec")
        if patience < 1:
            raise ValueError(f"patience must be >= 1, not {patience}")
        self.codec_ids = tuple(codec_ids)
        self.headroom = headroom
        self.patience = patience
        self.current = self.codec_ids[0]
        self._upgrade_votes = 0

    def update(
        self,
        sizes: Sequence[int],
        *,
        bytes_per_second: float | None,
        budget_seconds: float | None,
    ) -> int:
        """The codec to send the next tensor with (wire `sizes` per codec); updates `current`."""
        if not (bytes_per_second and budget_seconds):
            return self.current
        picked = pick_codec(
            self.codec_ids,
            sizes,
            bytes_per_second=bytes_per_second,
            budget_seconds=budget_seconds,
            current=self.current,
            headroom=self.headroom,
        )
        if self.codec_ids.index(picked) >= self.codec_ids.index(self.current):
            self._upgrade_votes = 0
            self.current = picked
        else:
            self._upgrade_votes += 1
            if self._upgrade_votes >= self.patience:
                self._upgrade_votes = 0
                self.current = picked
        return self.current
