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
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""


class TokenBucket:
    """Paces the bytes one node sends to one peer to `bytes_per_second`, chunk by chunk.

    Callers on one event loop share a bucket: grants are handed out in the order they were
    asked for, so concurrent transfers to one peer share the rate instead of each getting it.
    """

    def __init__(
        self,
        bytes_per_second: float,
        *,
        burst_bytes: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not bytes_per_second > 0:
            raise ValueError(f"a token bucket needs a positive rate, not {bytes_per_second}")
        if burst_bytes < 0:
            raise ValueError(f"burst_bytes must be >= 0, not {burst_bytes}")
        self.bytes_per_second = bytes_per_second
        self._burst_s = burst_bytes / bytes_per_second
        self._clock = clock
        self._free_at = clock()

    def reserve(self, nbytes: int) -> float:
        """Grant `nbytes`; the seconds the caller must wait before it sends them."""
        now = self._clock()
        self._free_at = max(self._free_at, now) + nbytes / self.bytes_per_second
        return max(0.0, self._free_at - self._burst_s - now)

    async def acquire(self, nbytes: int) -> None:
        """Wait (without blocking the event loop) until `nbytes` may be sent."""
        delay = self.reserve(nbytes)
        if delay > 0:
            await asyncio.sleep(delay)
