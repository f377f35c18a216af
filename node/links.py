"""This node's links to its peers: the send limit, the delay, the measured bandwidth, the codec.

Every tensor the node sends on the data plane (activations downstream, gradients upstream,
gradient sums to the other replicas) crosses its link inside a `Transfer`, which paces each
message through the peer's token bucket (at no cost when the link has no limit), holds it
for the link's one-way delay (none by default) and times the transfer for the peer's
bandwidth meter. Before encoding a tensor the sender asks
`codec_for`: a fixed codec is used as it is; in auto mode the link direction's
`CodecChooser` picks from the link's measured bandwidth and this stage's measured compute
time per microbatch. Each change of codec is kept (bounded) with when it happened, for
telemetry and the testnet's report.

The limits and delays may change while the run goes on (`set_limit`, `set_latency`, driven
by the control plane's `LinkControl` messages). Nothing tells the meter or the chooser: the
meter sees the new speed in the transfers themselves, and the codec choice follows the
meter, as it would on a real link that slowed down.

Everything here runs on the node's event loop, so nothing needs a lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch

from swarmpipe.compression import EncoderState
from swarmpipe.compression.link_choice import CodecChooser, candidates, wire_bytes
from swarmpipe.config import codec_name
from swarmpipe.node.link_limit import TokenBucket
from swarmpipe.node.link_meter import BandwidthMeter, RecentMedian
from swarmpipe.node.transport import EncodeOptions
from swarmpipe.protos import control_pb2
from swarmpipe.transport.limits import check_latency_ms, check_limit

logger = logging.getLogger(__name__)

MAX_CHANGES = 64
"""Codec changes kept per link direction (the oldest go first), so telemetry stays small
even if a link flaps all day."""


@dataclass(slots=True)
class _Direction:
    """What this node sends one way to one peer: the codec now, its history, its bytes."""

    codec: int = 0
    chooser: CodecChooser | None = None
    encoder: EncoderState | None = None
    """The topk/lowrank codecs' residual and warm start for this direction (made on first use)."""
    wire_bytes: int = 0
    last_bytes: int = 0
    """Wire bytes of the last tensor sent this way."""
    changes: deque[control_pb2.CodecChange] = field(
        default_factory=lambda: deque(maxlen=MAX_CHANGES)
    )


@dataclass(slots=True)
class _Link:
    """The link to one peer: the limit and the meter are shared by every direction on it."""

    bucket: TokenBucket
    """The send limit (rate 0: none)."""
    meter: BandwidthMeter
    latency_s: float = 0.0
    """One-way delay added to every message after the limit releases it (0: none)."""
    directions: dict[str, _Direction] = field(default_factory=dict)


class Transfer:
    """One tensor's trip over one link: paces its messages and times them for the meter.

    With a delay on the link, each message reaches the peer `latency_s` after the limit
    releases it, as on a long line: the first message waits for its release and then the
    delay; every later one was, on the line, already sent while the earlier ones were in
    flight, so it asks the bucket as of `latency_s` ago and waits only for its own bytes.
    So a tensor pays the delay once, not once per chunk, and concurrent transfers to one
    peer overlap their delays: latency adds time, never takes throughput. The meter does
    not count the delay as busy time (on a real network the kernel takes the bytes at line
    rate and the delay happens after), so the codec choice sees the line's speed.
    """

    def __init__(self, link: _Link, direction: _Direction) -> None:
        self._link = link
        self._direction = direction
        self.bytes = 0
        self._handed = 0  # bytes of the message the caller is sending now
        self._lag: float | None = None  # this transfer's delay, fixed at its first message
        self._metered = False  # whether the meter counts this transfer as busy now
        self._closed = False

    async def __aenter__(self) -> Transfer:
        self._link.meter.begin()
        self._metered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # Bytes of a failed transfer did cross the link, so they count all the same.
        self._flush()
        self._closed = True
        # A streaming call reads its messages in a task of gRPC's: when the call fails (the
        # peer died), this exit may come while that task still sleeps out the delay in
        # `pace`, the meter already released. Ending it again crashed the node.
        if self._metered:
            self._metered = False
            self._link.meter.end()
        if self.bytes:
            self._direction.last_bytes = self.bytes

    def _flush(self) -> None:
        if self._handed:
            self._link.meter.add(self._handed)
            self._direction.wire_bytes += self._handed
            self.bytes += self._handed
            self._handed = 0

    async def pace(self, nbytes: int) -> None:
        """Wait until `nbytes` more may go to the peer; the caller then sends them.

        A call also says that the previous message has been handed over, so the meter
        counts its bytes now.
        """
        self._flush()
        link = self._link
        if self._lag is None:
            self._lag = link.latency_s
            await link.bucket.acquire(nbytes)
            self._handed = nbytes
            if self._lag > 0:
                self._flush()  # released: its bytes are on the line, the rest is delay
                if self._metered:
                    self._metered = False
                    link.meter.end()
                try:
                    await asyncio.sleep(self._lag)
                finally:
                    if not self._closed:  # else nobody would end it: the link stays busy
                        link.meter.begin()
                        self._metered = True
            return
        await link.bucket.acquire(nbytes, lag=self._lag)
        self._handed = nbytes

    async def write(self, write: Callable[[Any], Awaitable[None]], message: Any) -> None:
        """Pace one protobuf message (its serialized size), then hand it to `write`."""
        await self.pace(message.ByteSize())
        await write(message)


class Links:
    """Per-peer send limit, bandwidth meter and codec choice for one node."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._links: dict[str, _Link] = {}
        self.limit_bytes_per_second = 0.0
        """The send limit links to new peers start with (0: none)."""
        self.latency_s = 0.0
        """The one-way delay links to new peers start with, in seconds (0: none)."""
        self.options = EncodeOptions()
        """The run's codec parameters, for encoding and for sizing the auto choice."""
        self.compute = RecentMedian()
        """Seconds of forward plus backward per microbatch on this node (median of the last
        few): the time budget a tensor's transfer must fit in for the link not to slow the
        pipeline."""

    def configure(
        self, *, limit_bytes_per_second: float, options: EncodeOptions, latency_s: float = 0.0
    ) -> None:
        """Set the send limit (0: none), the one-way delay and the run's codec parameters,
        before any send."""
        self.set_limit(None, limit_bytes_per_second)
        self.set_latency(None, latency_s)
        self.options = options

    def set_limit(self, peer: str | None, bytes_per_second: float) -> None:
        """Limit what this node sends to `peer` (None: to every peer, and to peers met
        later) to `bytes_per_second` from now on; 0 lifts the limit.

        A ConfigError (and no change) for a limit `check_limit` refuses.
        """
        check_limit(bytes_per_second)
        if peer is None:
            self.limit_bytes_per_second = bytes_per_second
            for link in self._links.values():
                link.bucket.set_rate(bytes_per_second)
        else:
            self._link(peer).bucket.set_rate(bytes_per_second)

    def set_latency(self, peer: str | None, seconds: float) -> None:
        """Delay what this node sends to `peer` (None: to every peer, and to peers met
        later) by `seconds` one way from now on; 0 removes the delay. Transfers already
        under way keep the delay they started with."""
        check_latency_ms(seconds * 1e3)
        if peer is None:
            self.latency_s = seconds
            for link in self._links.values():
                link.latency_s = seconds
        else:
            self._link(peer).latency_s = seconds

    def latency(self, peer: str) -> float:
        """The one-way delay to `peer` now, in seconds (0: none)."""
        link = self._links.get(peer)
        return link.latency_s if link else self.latency_s

    async def propagate(self, peer: str) -> None:
        """Wait out the link's delay for a small message sent outside a transfer (an
        evaluation's result), so that it too arrives as late as the line would bring it."""
        latency = self.latency(peer)
        if latency > 0:
            await asyncio.sleep(latency)

    def limit(self, peer: str) -> float:
        """The send limit to `peer` now (0: none)."""
        link = self._links.get(peer)
        return link.bucket.bytes_per_second if link else self.limit_bytes_per_second

    def encoder_state(self, peer: str, direction: str) -> EncoderState:
        """The stateful codecs' memory for what this node sends `peer` in `direction`.

        Gradients carry what a codec dropped into the next one (error feedback);
        activations keep only the low-rank warm start, since each microbatch's
        activation is a different input and a residual from the last would be noise.
        """
        state = self._direction(peer, direction)
        if state.encoder is None:
            state.encoder = EncoderState(error_feedback=direction != "activation")
        return state.encoder

    def _link(self, peer: str) -> _Link:
        link = self._links.get(peer)
        if link is None:
            bucket = TokenBucket(self.limit_bytes_per_second, clock=self._clock)
            link = _Link(
                bucket=bucket, meter=BandwidthMeter(clock=self._clock), latency_s=self.latency_s
            )
            self._links[peer] = link
        return link

    def _direction(self, peer: str, direction: str) -> _Direction:
        return self._link(peer).directions.setdefault(direction, _Direction())

    def transfer(self, peer: str, direction: str) -> Transfer:
        """An async context for sending one tensor (all its messages) to `peer`."""
        return Transfer(self._link(peer), self._direction(peer, direction))

    def bytes_per_second(self, peer: str) -> float | None:
        """Measured bandwidth to `peer`; None until enough bytes have gone there."""
        link = self._links.get(peer)
        return link.meter.bytes_per_second if link else None

    def seconds_per_tensor(self) -> list[float]:
        """For each link direction that carries microbatches (not reduces): its last
        tensor's wire bytes over the link's measured bandwidth."""
        seconds = []
        for link in self._links.values():
            bandwidth = link.meter.bytes_per_second
            if not bandwidth:
                continue
            for direction, state in link.directions.items():
                if direction != "reduce" and state.last_bytes:
                    seconds.append(state.last_bytes / bandwidth)
        return seconds

    def record_compute(self, seconds: float) -> None:
        """Add one microbatch's forward plus backward seconds on this node."""
        self.compute.add(seconds)

    def codec_for(
        self, peer: str, direction: str, tensor: torch.Tensor, *, step: int, requested: int
    ) -> int:
        """The codec to send `tensor` to `peer` with: `requested`, or in auto mode (0) the
        link direction's choice from its measured bandwidth and this node's compute time."""
        state = self._direction(peer, direction)
        bandwidth = self.bytes_per_second(peer)
        budget = self.compute.value
        if requested:
            codec = requested
        else:
            o = self.options
            if state.chooser is None:
                ladder = o.auto_gradient if direction == "gradient" else o.auto_activation
                state.chooser = CodecChooser(candidates(ladder, tensor.dtype))
            chooser = state.chooser
            sizes = wire_bytes(
                chooser.codec_ids,
                tensor.shape,
                tensor.dtype,
                block_size=o.block_size,
                topk_fraction=o.topk_fraction,
                rank=o.lowrank_rank,
                centered=direction in o.centered_blocks,
            )
            codec = chooser.update(sizes, bytes_per_second=bandwidth, budget_seconds=budget)
        if codec != state.codec:
            if state.codec:
                logger.info(
                    "%s to %s: %s -> %s at step %d (link %.2f Mbit/s, compute %.1f ms per "
                    "microbatch)",
                    direction,
                    peer,
                    codec_name(state.codec),
                    codec_name(codec),
                    step,
                    (bandwidth or 0.0) * 8 / 1e6,
                    (budget or 0.0) * 1e3,
                )
            state.codec = codec
            state.changes.append(
                control_pb2.CodecChange(
                    timestamp=self._wall_clock(),
                    step=step,
                    codec=codec,  # type: ignore[arg-type]
                    bytes_per_second=bandwidth or 0.0,
                    budget_seconds=budget or 0.0,
                )
            )
        return codec

    def snapshot(self) -> list[control_pb2.LinkEstimate]:
        """Every link direction used so far, for telemetry."""
        estimates = []
        for peer, link in sorted(self._links.items()):
            for direction, state in sorted(link.directions.items()):
                estimates.append(
                    control_pb2.LinkEstimate(
                        peer=peer,
                        direction=direction,
                        bytes_per_second=link.meter.bytes_per_second or 0.0,
                        limit_bytes_per_second=link.bucket.bytes_per_second,
                        latency_ms=link.latency_s * 1e3,
                        wire_bytes=state.wire_bytes,
                        codec=state.codec,  # type: ignore[arg-type]
                        changes=list(state.changes),
                    )
                )
        return estimates
