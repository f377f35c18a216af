"""The bandwidth meter: bytes over busy time, pooled past latency, smoothed, on a fake clock."""

from __future__ import annotations

import pytest

from swarmpipe.node.link_meter import BandwidthMeter, Ewma, RecentMedian

KIB = 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _transfer(meter: BandwidthMeter, clock: FakeClock, nbytes: int, rate: float) -> None:
    meter.begin()
    clock.now += nbytes / rate
    meter.add(nbytes)
    meter.end()


def test_idle_time_between_transfers_is_not_charged_to_the_link() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    for _ in range(5):
        _transfer(meter, clock, 256 * KIB, rate=1e6)
        clock.now += 3.0  # the stage computes; the link is idle
    assert meter.bytes_per_second == pytest.approx(1e6)


def test_small_transfers_are_pooled_until_they_make_a_sample() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    for _ in range(15):
        _transfer(meter, clock, 4 * KIB, rate=1e6)
    assert meter.bytes_per_second is None  # 60 KiB so far: no sample yet
    _transfer(meter, clock, 4 * KIB, rate=1e6)
    assert meter.bytes_per_second == pytest.approx(1e6) and meter.samples == 1


def test_overlapping_transfers_share_the_link() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    # Two transfers of 100 KiB at once on a 1 MB/s link, their 10 KiB messages interleaved.
    meter.begin()
    meter.begin()
    for _ in range(20):
        clock.now += 10 * KIB / 1e6
        meter.add(10 * KIB)
    meter.end()
    meter.end()
    assert meter.samples == 2 and meter.bytes_per_second == pytest.approx(1e6)


def test_a_link_that_never_goes_idle_still_yields_samples() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    meter.begin()  # one transfer stays open throughout
    for _ in range(4):
        meter.begin()
        clock.now += 128 * KIB / 2e6
        meter.add(128 * KIB)
        meter.end()
    assert meter.samples == 4 and meter.bytes_per_second == pytest.approx(2e6)


def test_the_estimate_follows_a_link_that_slows_down() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    for _ in range(5):
        _transfer(meter, clock, 128 * KIB, rate=10e6)
    for _ in range(5):
        _transfer(meter, clock, 128 * KIB, rate=1e6)
    slowing = meter.bytes_per_second
    assert slowing is not None and slowing < 2e6  # most of the tenfold drop within 5 samples
    for _ in range(7):
        _transfer(meter, clock, 128 * KIB, rate=1e6)
    estimate = meter.bytes_per_second
    assert estimate is not None and estimate == pytest.approx(1e6, rel=0.1)


def test_a_speed_change_restarts_the_estimate_after_two_samples() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    for _ in range(10):
        _transfer(meter, clock, 128 * KIB, rate=1e5)
    _transfer(meter, clock, 128 * KIB, rate=1e7)  # the limit is lifted
    first = meter.bytes_per_second
    assert first is not None and 1e5 < first < 1e7 and meter.restarts == 0
    _transfer(meter, clock, 128 * KIB, rate=1e7)
    assert meter.bytes_per_second == pytest.approx(1e7) and meter.restarts == 1
    for _ in range(2):  # and limited again
        _transfer(meter, clock, 128 * KIB, rate=2e5)
    assert meter.bytes_per_second == pytest.approx(2e5) and meter.restarts == 2


def test_one_odd_sample_is_smoothed_in_not_restarted_from() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, clock=clock)
    for _ in range(5):
        _transfer(meter, clock, 128 * KIB, rate=1e6)
    _transfer(meter, clock, 128 * KIB, rate=1e4)  # the sender was preempted once
    _transfer(meter, clock, 128 * KIB, rate=1e6)
    # Far off in opposite directions is no new speed either.
    _transfer(meter, clock, 128 * KIB, rate=1e8)
    _transfer(meter, clock, 128 * KIB, rate=1e4)
    assert meter.restarts == 0 and meter.samples == 9


def test_a_slowed_link_is_sampled_after_a_quarter_second_of_busy_time() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, max_sample_seconds=0.25, clock=clock)
    for _ in range(3):
        _transfer(meter, clock, 128 * KIB, rate=1e6)
    # Limited to 10 kB/s: 1 KiB messages take 0.1 s each, and 64 KiB would take 6.6 s.
    meter.begin()
    seconds = 0.0
    while meter.restarts == 0:
        clock.now += KIB / 1e4
        seconds += KIB / 1e4
        meter.add(KIB)
    meter.end()
    assert seconds == pytest.approx(6 * KIB / 1e4)  # two samples of three messages each
    assert meter.bytes_per_second == pytest.approx(1e4)


def test_a_short_busy_spell_still_waits_for_enough_bytes() -> None:
    clock = FakeClock()
    meter = BandwidthMeter(min_sample_bytes=64 * KIB, max_sample_seconds=0.25, clock=clock)
    for _ in range(10):  # 4 KiB round trips of 10 ms each: latency, not bandwidth
        _transfer(meter, clock, 4 * KIB, rate=4 * KIB / 0.01)
        clock.now += 1.0
    assert meter.samples == 0


def test_end_without_begin_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="without a matching begin"):
        BandwidthMeter().end()
    with pytest.raises(RuntimeError, match="outside a transfer"):
        BandwidthMeter().add(1)


def test_ewma() -> None:
    average = Ewma(0.5)
    assert average.value is None
    assert average.add(4.0) == 4.0
    assert average.add(2.0) == 3.0
    with pytest.raises(ValueError):
        Ewma(0.0)


def test_recent_median_ignores_one_slow_microbatch() -> None:
    median = RecentMedian(window=4)
    assert median.value is None
    for seconds in (0.01, 0.01, 0.5, 0.012):
        median.add(seconds)
    assert median.value == pytest.approx(0.011)
    for seconds in (0.2, 0.2, 0.2):  # the window moves on: a lasting slow-down shows
        median.add(seconds)
    assert median.value == pytest.approx(0.2)
