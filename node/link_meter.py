"""Bandwidth a link actually gives, measured from the transfers that cross it.

The meter divides bytes by the time the link was busy sending them: from the moment a
transfer starts until the last overlapping one ends, so two transfers sharing a link are not
each credited with the whole rate, and the idle time between transfers (while the stage
computes) is not charged to the link. Bytes count when each message has been handed over, so
a link that never goes idle is measured as well as one that does. A transfer of a few KiB
measures round-trip latency rather than bandwidth, so busy time and bytes are pooled until at
least `min_sample_bytes` have gone through before they make one sample; samples are smoothed
with an EWMA, so the estimate follows a link that slows down or speeds up within a few
samples.

Known limit: the time is taken where gRPC accepts the bytes, which on a real network is
after HTTP/2 flow control lets them out; kernel buffers of a few hundred KiB can still make a
lone small transfer look faster than the link. The testnet's send limit paces before gRPC, so
there the measurement is exact.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

MIN_SAMPLE_BYTES = 64 * 1024
"""Bytes pooled into one bandwidth sample: far more than a round trip's worth on links slow
enough to matter (64 KiB take 5 ms at 100 Mbit/s)."""

SMOOTHING = 0.4
"""Weight of the newest sample in the estimates' EWMA."""


class Ewma:
    """An exponentially weighted moving average; None until the first sample."""

    def __init__(self, weight: float = SMOOTHING) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"an EWMA weight is in (0, 1], not {weight}")
        self.weight = weight
        self.value: float | None = None

    def add(self, sample: float) -> float:
        if self.value is None:
            self.value = sample
        else:
            self.value += self.weight * (sample - self.value)
        return self.value


class RecentMedian:
    """The median of the last `window` samples; None until the first.

    For compute times on a shared machine: one microbatch preempted for a moment takes several
    times as long as the next, and a median shrugs that off where an average follows it.
    """

    def __init__(self, window: int = 16) -> None:
        if window < 1:
            raise ValueError(f"a median window holds at least one sample, not {window}")
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, sample: float) -> None:
        self._samples.append(sample)

    @property
    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


class BandwidthMeter:
    """Bytes per second one node gets sending to one peer, from its real transfers.

    Call `begin()` when a transfer starts, `add(nbytes)` as each of its messages has gone and
    `end()` when it is over; transfers may overlap. Not thread-safe: the node calls it from
    its event loop only.
    """

    def __init__(
        self,
        *,
        min_sample_bytes: int = MIN_SAMPLE_BYTES,
        weight: float = SMOOTHING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_sample_bytes = min_sample_bytes
        self._estimate = Ewma(weight)
        self._clock = clock
        self._active = 0
        self._since = 0.0  # start of the busy time not yet added to _seconds
        self._bytes = 0  # pooled toward the next sample
        self._seconds = 0.0
        self.total_bytes = 0
        self.samples = 0

    @property
    def bytes_per_second(self) -> float | None:
        """The smoothed estimate; None until `min_sample_bytes` have been sent."""
        return self._estimate.value

    def begin(self) -> None:
        if self._active == 0:
            self._since = self._clock()
        self._active += 1

    def add(self, nbytes: int) -> None:
        if self._active <= 0:
            raise RuntimeError("BandwidthMeter.add() outside a transfer: call begin() first")
        self._bytes += nbytes
        self.total_bytes += nbytes
        # A link that never goes idle (many transfers in flight) still yields samples: cut
        # the busy time here once enough bytes are pooled.
        if self._bytes >= self.min_sample_bytes:
            self._cut()

    def end(self) -> None:
        if self._active <= 0:
            raise RuntimeError("BandwidthMeter.end() without a matching begin()")
        self._active -= 1
        if self._active == 0:
            self._cut()  # the link goes idle: its busy time stops here

    def _cut(self) -> None:
        now = self._clock()
        self._seconds += now - self._since
        self._since = now
        if self._bytes >= self.min_sample_bytes and self._seconds > 0:
            self._estimate.add(self._bytes / self._seconds)
            self.samples += 1
            self._bytes, self._seconds = 0, 0.0
