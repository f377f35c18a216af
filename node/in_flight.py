"""How many microbatches a head keeps in the pipeline: `pipeline.in_flight = "auto"`.

A head's window is full when the bottleneck of the pipeline never waits for work. One
microbatch needs a round trip C through the pipeline (forward on every stage, the links
both ways with their delays, backward, and the lease and commit around it) and the
bottleneck takes T per microbatch (the slowest stage's compute, or the time a link takes
to carry one microbatch's tensor). So a window of C / T keeps it busy, the bandwidth-delay
product of the whole pipeline counted in microbatches; with H heads sharing the bottleneck
each needs C / (H T). One more covers the jitter of a shared machine.

- C is the least round trip among the head's recent microbatches: under load, queues at
  the bottleneck stretch every round trip (a window sized from those would grow itself),
  while the first microbatches of each step cross an empty pipeline and show its unloaded
  round trip.
- T is the largest of: the head's own compute per microbatch, its links' time per tensor
  (the last tensor's wire bytes over the measured bandwidth), and the slowest stage's
  compute per microbatch from the plan's weights (each replica's measured samples per busy
  second, summed per stage). The head sees only its own links; in a pipeline whose
  busiest link is further down, the round trip still grows with it, and the bound
  below keeps a wrong guess cheap.

The window is 2 (the old fixed default) until C and T are known, and at most
MAX_WINDOW: every microbatch in flight holds activations on every stage, and past the
bandwidth-delay product more only queues. With steps open ahead (train.step_overlap = k)
the cap is the microbatches of the k+1 open steps, up to MAX_DEEP_WINDOW (`window_cap`):
at 4 microbatches a step, 16 holds every step past the third out of the pipeline, and on
50 ms links depths 4 to 8 all stopped at 160 to 200 samples/s under it (docs/latency.md).
Pure arithmetic: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

START_WINDOW = 2
MAX_WINDOW = 16
MAX_DEEP_WINDOW = 32
"""The cap under train.step_overlap's deeper settings; the peer limits' default streams
(transport/peer_limits.py: 136) still hold four heads at it."""
MIN_WINDOW = 1
RECENT = 32
"""Round trips kept; the least of them is the unloaded estimate."""

UNMEASURED_WEIGHT = 1.0
"""The plan's weight for a stage none of whose replicas has measured itself yet
(coordinator/membership.py): not a rate, so left out of the bottleneck."""


def window_cap(*, microbatches_per_step: int, overlap_depth: int) -> int:
    """The most microbatches an auto window keeps in flight: MAX_WINDOW, or every
    microbatch of the steps open at once (overlap_depth + 1 of them) up to MAX_DEEP_WINDOW."""
    open_steps = microbatches_per_step * (overlap_depth + 1)
    return max(MAX_WINDOW, min(MAX_DEEP_WINDOW, open_steps))


class InFlightSizer:
    """The window for one head from the round trips it saw and the bottleneck's time."""

    def __init__(self, *, maximum: int = MAX_WINDOW) -> None:
        self.maximum = maximum
        self._round_trips: deque[float] = deque(maxlen=RECENT)
        self.round_trip_s: float | None = None
        self.bottleneck_s: float | None = None
        self.window = START_WINDOW

    def add_round_trip(self, seconds: float) -> None:
        """One microbatch's lease-to-commit seconds at this head."""
        if seconds > 0 and math.isfinite(seconds):
            self._round_trips.append(seconds)

    def update(
        self,
        *,
        samples_per_microbatch: int,
        own_compute_s: float | None,
        link_seconds: Iterable[float],
        stage_weights: Iterable[Sequence[float]],
        heads: int,
    ) -> int:
        """Recompute the window; returns it.

        `link_seconds`: this head's time per tensor on each of its links; `stage_weights`:
        each stage's replica weights from the plan (samples per busy second).
        """
        if not self._round_trips:
            return self.window
        candidates = [s for s in link_seconds if s > 0]
        if own_compute_s:
            candidates.append(own_compute_s)
        rates = [
            sum(weights)
            for weights in stage_weights
            if weights and any(w != UNMEASURED_WEIGHT for w in weights)
        ]
        if rates and min(rates) > 0:
            candidates.append(samples_per_microbatch / min(rates))
        if not candidates:
            return self.window
        self.round_trip_s = min(self._round_trips)
        self.bottleneck_s = max(candidates)
        share = self.round_trip_s / (self.bottleneck_s * max(heads, 1))
        self.window = max(MIN_WINDOW, min(self.maximum, math.ceil(share) + 1))
        return self.window
