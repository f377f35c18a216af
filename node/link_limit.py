"""A send limit on one link: a token bucket that paces each chunk like a line of that speed.

The testnet runs every node on one machine, where loopback carries gigabytes a second; to
see what slow links do to a run, each node limits what it sends to each peer. Each node
limits only its own sends, so the two directions of a link are limited independently, as on
a full-duplex line. Kernel-level shaping (tc) would limit every byte below gRPC too; this is
enough to make the codec choice meet slow links in a test.

The bucket is kept as a virtual clock (the GCRA form of a token bucket): `free_at` is when
the bytes granted so far have drained at `bytes_per_second`, and a chunk is released once its
own bytes would have drained too. So a chunk on an idle link takes its transmission time, as
on a real line, rather than leaving at once on tokens saved up while the link was idle: a
saved-up burst would make the bandwidth meter see speed that the link does not have. The
burst allowance is therefore zero beyond the chunk being sent (chunks are at most 1 MiB).

The rate can change while a run goes on (`set_rate`, from the control plane's `LinkControl`):
bytes already granted keep their place in the queue and drain at the new rate from then on.
Known limit: a sender already asleep on a grant wakes when the old rate said, so a change
reaches a link within one chunk's time at the old rate (4 s for 1 MiB at 2 Mbit/s).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable


class TokenBucket:
    """Paces the bytes one node sends to one peer to `bytes_per_second`, chunk by chunk.

    Callers on one event loop share a bucket: grants are handed out in the order they were
    asked for, so concurrent transfers to one peer share the rate instead of each getting it.
    A rate of 0 lets every chunk go at once (no limit).
    """

    def __init__(
        self,
        bytes_per_second: float,
        *,
        burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if burst_bytes < 0:
            raise ValueError(f"burst_bytes must be >= 0, not {burst_bytes}")
        self._burst_bytes = burst_bytes
        self._clock = clock
        self._free_at = clock()
        self.bytes_per_second = 0.0
        self.set_rate(bytes_per_second)

    def set_rate(self, bytes_per_second: float) -> None:
        """Pace from now on at `bytes_per_second` (0: no limit).

        The bytes granted but not yet drained stay owed and drain at the new rate, so a
        faster rate shortens the queue at once and a slower one does not forgive it; leaving
        or entering "no limit" starts from an empty queue (nothing is owed to an unlimited
        line, and an unlimited line saved up no credit).
        """
        if not (math.isfinite(bytes_per_second) and bytes_per_second >= 0):
            raise ValueError(f"a token bucket needs a rate >= 0, not {bytes_per_second}")
        now = self._clock()
        old = self.bytes_per_second
        if old > 0 and bytes_per_second > 0:
            owed = max(0.0, self._free_at - now) * old
            self._free_at = now + owed / bytes_per_second
        else:
            self._free_at = now
        self.bytes_per_second = bytes_per_second
        self._burst_s = self._burst_bytes / bytes_per_second if bytes_per_second > 0 else 0.0

    def reserve(self, nbytes: int, *, lag: float = 0.0) -> float:
        """Grant `nbytes`; the seconds the caller must wait before it sends them.

        `lag` > 0 is for a sender whose messages reach the peer that long after the line
        released them (links.py's delay): it asks for a message the line already had ready
        `lag` seconds ago, so the grant starts from then and the wait ends `lag` after it.
        """
        if self.bytes_per_second == 0:
            return 0.0
        now = self._clock()
        self._free_at = max(self._free_at, now - lag) + nbytes / self.bytes_per_second
        return max(0.0, self._free_at + lag - self._burst_s - now)

    async def acquire(self, nbytes: int, *, lag: float = 0.0) -> None:
        """Wait (without blocking the event loop) until `nbytes` may be sent."""
        delay = self.reserve(nbytes, lag=lag)
        if delay > 0:
            await asyncio.sleep(delay)
