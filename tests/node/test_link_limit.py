"""The send limit: a token bucket that paces chunks like a line, measured on a fake clock."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from swarmpipe.node.link_limit import MBIT, TokenBucket


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _send(bucket: TokenBucket, clock: FakeClock, sizes: list[int]) -> float:
    """Send chunks back to back, waiting as told; the time the last one was released."""
    for size in sizes:
        clock.now += bucket.reserve(size)
    return clock.now


def test_rate_over_a_run_is_the_limit() -> None:
    clock = FakeClock()
    rate = 10 * MBIT
    bucket = TokenBucket(rate, clock=clock)
    rng = random.Random(0)
    sizes = [rng.randint(1, 1 << 20) for _ in range(200)]
    start = clock.now
    end = _send(bucket, clock, sizes)
    assert sum(sizes) / (end - start) == pytest.approx(rate, rel=1e-9)


def test_a_chunk_on_an_idle_link_takes_its_transmission_time() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    clock.now += 50.0  # idle for long: no burst saved up
    assert bucket.reserve(500) == pytest.approx(0.5)


def test_idle_time_is_not_lent_to_later_sends() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    _send(bucket, clock, [1000])
    clock.now += 10.0
    start = clock.now
    end = _send(bucket, clock, [1000] * 5)
    assert end - start == pytest.approx(5.0)


def test_concurrent_senders_share_the_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    # Two transfers interleave their chunks: each waits behind the other's grants.
    waits = [bucket.reserve(250) for _ in range(8)]
    assert waits == pytest.approx([0.25 * (i + 1) for i in range(8)])


def test_a_burst_allowance_lets_that_many_bytes_go_at_once() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, burst_bytes=500, clock=clock)
    assert bucket.reserve(500) == 0.0
    assert bucket.reserve(500) == pytest.approx(0.5)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(0.0)
    with pytest.raises(ValueError, match="burst_bytes"):
        TokenBucket(1.0, burst_bytes=-1)


async def test_acquire_waits_without_blocking_the_loop() -> None:
    bucket = TokenBucket(10_000.0)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    start = time.monotonic()
    await bucket.acquire(1000)  # 0.1 s at 10 kB/s
    elapsed = time.monotonic() - start
    task.cancel()
    assert elapsed >= 0.1 - 1e-3
    assert ticks >= 2  # the loop kept running while the sender waited
