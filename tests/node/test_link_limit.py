"""The send limit: a token bucket that paces chunks like a line, measured on a fake clock."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.node.link_limit import TokenBucket
from swarmpipe.transport.limits import MAX_LIMIT, MBIT, MIN_LIMIT, check_limit


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
    for rate in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rate >= 0"):
            TokenBucket(rate)
    with pytest.raises(ValueError, match="rate >= 0"):
        TokenBucket(1.0).set_rate(-5.0)
    with pytest.raises(ValueError, match="burst_bytes"):
        TokenBucket(1.0, burst_bytes=-1)


def test_rate_zero_is_no_limit() -> None:
    clock = FakeClock()
    bucket = TokenBucket(0.0, clock=clock)
    assert [bucket.reserve(1 << 20) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_new_rate_paces_the_next_chunks() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    assert _send(bucket, clock, [1000] * 3) - 1000.0 == pytest.approx(3.0)
    bucket.set_rate(100.0)  # the link slows tenfold
    start = clock.now
    assert _send(bucket, clock, [100] * 4) - start == pytest.approx(4.0)
    bucket.set_rate(10_000.0)  # and speeds up a hundredfold
    start = clock.now
    assert _send(bucket, clock, [10_000] * 2) - start == pytest.approx(2.0)


def test_bytes_owed_at_a_change_drain_at_the_new_rate() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    for _ in range(4):
        bucket.reserve(1000)  # four transfers queue up 4 s of bytes at once
    bucket.set_rate(4000.0)  # those 4000 bytes now drain in 1 s
    assert bucket.reserve(4000) == pytest.approx(2.0)
    bucket.set_rate(0.0)  # no limit: nothing is owed any more
    assert bucket.reserve(1 << 20) == 0.0
    clock.now += 0.1
    bucket.set_rate(1000.0)  # limited again: starts from an empty queue
    assert bucket.reserve(500) == pytest.approx(0.5)


def test_an_idle_link_saves_nothing_across_a_change() -> None:
    clock = FakeClock()
    bucket = TokenBucket(1000.0, clock=clock)
    _send(bucket, clock, [1000])
    clock.now += 60.0
    bucket.set_rate(500.0)
    assert bucket.reserve(500) == pytest.approx(1.0)


@pytest.mark.parametrize("limit", [0.0, MIN_LIMIT, 2 * MBIT, MAX_LIMIT])
def test_check_limit_accepts_none_and_sane_rates(limit: float) -> None:
    assert check_limit(limit) == limit


@pytest.mark.parametrize("limit", [-1.0, MIN_LIMIT / 2, MAX_LIMIT * 2, float("nan"), float("inf")])
def test_check_limit_refuses_the_rest_saying_what_would_do(limit: float) -> None:
    with pytest.raises(ConfigError, match=r"give 0 \(no limit\) or 0.001 to 1e\+07 Mbit/s"):
        check_limit(limit)
    with pytest.raises(ConfigError, match=r"^--link-mbit -8e-06 is out of range"):
        check_limit(-1.0, what="--link-mbit -8e-06")


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
