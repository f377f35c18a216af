"""What a sender has learned about each next-hop peer: round-trip times and failures.

Two decisions come from it. The *deadline* of a hop is measured, not a
constant: an EWMA of the round-trip time of whole microbatch calls (the
downstream part of the pipeline included) plus a multiple of its mean
deviation, the estimator TCP uses for its retransmission timeout. Tuned for
a call that may queue behind others, it is clamped between
`pipeline.hop_timeout_min_s` and `pipeline.hop_timeout_s`. A peer with no
measurement yet borrows its stage's estimate, and before any call of the
stage has finished the upper bound applies: the first calls pay for warm-up
(allocator growth, lazy initialisation), and a deadline that cut them short
would resend healthy work.

A peer that fails is *benched*: not picked until its bench time passes,
which doubles with each consecutive failure (with jitter so that senders do
not all return at once) and resets on a success. A benched peer is still
picked when it is the only replica left, since waiting on it beats giving up.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

# EWMA gains of the round-trip mean and mean deviation (RFC 6298's 1/8 and 1/4).
RTT_GAIN = 0.125
DEVIATION_GAIN = 0.25
# Deadline = MEAN_MARGIN * mean + DEVIATIONS * deviation. A deadline that fires
# on a healthy but queued call resends work (and that microbatch may then add
# to two replicas' gradients), so the margin is generous.
MEAN_MARGIN = 2.0
DEVIATIONS = 4.0
BENCH_START_S = 0.5
BENCH_MAX_S = 30.0


@dataclass(slots=True)
class RoundTrip:
    """Smoothed round-trip time and its mean deviation, in seconds."""

    mean: float
    deviation: float

    @classmethod
    def first(cls, seconds: float) -> RoundTrip:
        return cls(mean=seconds, deviation=seconds / 2)

    def add(self, seconds: float) -> None:
        self.deviation += DEVIATION_GAIN * (abs(seconds - self.mean) - self.deviation)
        self.mean += RTT_GAIN * (seconds - self.mean)

    def deadline(self) -> float:
        return MEAN_MARGIN * self.mean + DEVIATIONS * self.deviation


@dataclass(slots=True)
class _Bench:
    failures: int = 0
    until: float = 0.0


class PeerHealth:
    """Per-peer round-trip estimates, per-stage fallbacks, and the bench."""

    def __init__(
        self,
        *,
        min_deadline_s: float,
        max_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.min_deadline_s = min_deadline_s
        self.max_deadline_s = max_deadline_s
        self._clock = clock
        self._rng = rng or random.Random()
        self._peer_rtt: dict[str, RoundTrip] = {}
        self._stage_rtt: dict[int, RoundTrip] = {}
        self._bench: dict[str, _Bench] = {}

    def deadline(self, stage: int, peer: str) -> float:
        """Seconds to allow one call to `peer`, a replica of `stage`."""
        rtt = self._peer_rtt.get(peer) or self._stage_rtt.get(stage)
        if rtt is None:
            return self.max_deadline_s
        return min(self.max_deadline_s, max(self.min_deadline_s, rtt.deadline()))

    def succeeded(self, stage: int, peer: str, seconds: float) -> None:
        """A call finished: learn its round-trip time and take the peer off the bench."""
        self._peer_rtt[peer] = _learn(self._peer_rtt.get(peer), seconds)
        self._stage_rtt[stage] = _learn(self._stage_rtt.get(stage), seconds)
        self._bench.pop(peer, None)

    def failed(self, peer: str) -> float:
        """A call to `peer` failed or ran out of time: bench it; returns the bench seconds."""
        bench = self._bench.setdefault(peer, _Bench())
        bench.failures += 1
        seconds = min(BENCH_MAX_S, BENCH_START_S * (1 << min(bench.failures - 1, 16)))
        seconds *= 0.75 + 0.5 * self._rng.random()
        bench.until = self._clock() + seconds
        return seconds

    def benched(self, peer: str) -> bool:
        bench = self._bench.get(peer)
        return bench is not None and self._clock() < bench.until

    def failures(self, peer: str) -> int:
        bench = self._bench.get(peer)
        return bench.failures if bench else 0

    def forget(self, peers: set[str]) -> None:
        """Drop what is known about peers that left the plan (a rejoin starts afresh)."""
        for peer in peers:
            self._peer_rtt.pop(peer, None)
            self._bench.pop(peer, None)


def _learn(rtt: RoundTrip | None, seconds: float) -> RoundTrip:
    if rtt is None:
        return RoundTrip.first(seconds)
    rtt.add(seconds)
    return rtt
