"""Bandwidth a link actually gives, measured from the transfers that cross it.

The meter divides bytes by the time the link was busy sending them: from the moment a
transfer starts until the last overlapping one ends, so two transfers sharing a link are not
each credited with the whole rate, and the idle time between transfers (while the stage
computes) is not charged to the link. Bytes count when each message has been handed over, so
a link that never goes idle is measured as well as one that does. A transfer of a few KiB
measures round-trip latency rather than bandwidth, so busy time and bytes are pooled until at
least `min_sample_bytes` have gone through before they make one sample, or the link has been
busy for `max_sample_seconds` (so on a slow link a slowdown shows within a fraction of a
second, not after 64 KiB have crawled through). Samples are smoothed with an EWMA; when the
link changes speed for real (its send limit is changed during a run, a route changes),
`RESTART_AFTER` samples in a row more than `RESTART_FACTOR` times off the estimate, the same
way, restart it from the newest, rather than letting the old speed fade out over many
samples while the codec choice sends tensors the link can no longer carry in time.

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

MAX_SAMPLE_SECONDS = 0.25
"""Busy seconds after which the pooled bytes make a sample even if they are fewer than
`MIN_SAMPLE_BYTES`: long enough that one round trip does not dominate, short enough that a
link slowed to a few Mbit/s is seen to be slow within a step or two."""

SMOOTHING = 0.4
"""Weight of the newest sample in the estimates' EWMA."""

RESTART_FACTOR = 2.0
RESTART_AFTER = 2
"""The estimate restarts from the newest sample after this many samples in a row each more
than RESTART_FACTOR times above it, or each as far below. One such sample is taken as noise
(a preempted sender on a shared machine) and only smoothed in; two are a new link speed."""


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
        max_sample_seconds: float = MAX_SAMPLE_SECONDS,
        weight: float = SMOOTHING,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.min_sample_bytes = min_sample_bytes
        self.max_sample_seconds = max_sample_seconds
        self._estimate = Ewma(weight)
        self._departures = 0  # consecutive samples off the estimate, + above, - below
        self._clock = clock
        self._active = 0
        self._since = 0.0  # start of the busy time not yet added to _seconds
        self._bytes = 0  # pooled toward the next sample
        self._seconds = 0.0
        self.total_bytes = 0
        self.samples = 0
        self.restarts = 0
        """How often the estimate was restarted because the link changed speed."""

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
        # the busy time here once enough bytes are pooled or enough time has passed.
        if (
            self._bytes >= self.min_sample_bytes
            or self._seconds + self._clock() - self._since >= self.max_sample_seconds
        ):
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
        if self._seconds > 0 and (
            self._bytes >= self.min_sample_bytes
            or (self._bytes > 0 and self._seconds >= self.max_sample_seconds)
        ):
            self._add_sample(self._bytes / self._seconds)
            self._bytes, self._seconds = 0, 0.0

    def _add_sample(self, sample: float) -> None:
        self.samples += 1
        estimate = self._estimate.value
        if estimate is None:
            self._estimate.add(sample)
            return
        if sample > RESTART_FACTOR * estimate:
            self._departures = max(self._departures, 0) + 1
        elif sample * RESTART_FACTOR < estimate:
            self._departures = min(self._departures, 0) - 1
        else:
            self._departures = 0
        if abs(self._departures) >= RESTART_AFTER:
            self._estimate.value = sample
            self._departures = 0
            self.restarts += 1
        else:
            self._estimate.add(sample)
