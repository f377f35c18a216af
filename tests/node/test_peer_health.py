"""Measured hop deadlines and the bench of failing peers (pure bookkeeping, a fake clock)."""

from __future__ import annotations

import random

from swarmpipe.node.peer_health import BENCH_MAX_S, BENCH_START_S, PeerHealth


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, low: float = 0.5, high: float = 60.0) -> PeerHealth:
    return PeerHealth(min_deadline_s=low, max_deadline_s=high, clock=clock, rng=random.Random(1))


def test_first_deadline_is_the_upper_bound_then_follows_measurements() -> None:
    health = make(Clock())
    assert health.deadline(1, "a") == 60.0
    for _ in range(50):
        health.succeeded(1, "a", 2.0)
    settled = health.deadline(1, "a")
    assert 4.0 <= settled < 5.0  # about 2x a steady 2 s round trip: deviation has decayed
    # Jittery round trips widen the deadline.
    for seconds in [1.0, 3.0] * 25:
        health.succeeded(1, "b", seconds)
    assert health.deadline(1, "b") > settled


def test_deadline_is_clamped_and_an_unmeasured_peer_borrows_its_stage() -> None:
    health = make(Clock(), low=0.5, high=10.0)
    for _ in range(20):
        health.succeeded(2, "fast", 0.01)
    assert health.deadline(2, "fast") == 0.5
    assert health.deadline(2, "new") == health.deadline(2, "fast")  # the stage's estimate
    assert health.deadline(3, "elsewhere") == 10.0  # nothing known about stage 3
    for _ in range(20):
        health.succeeded(4, "slow", 100.0)
    assert health.deadline(4, "slow") == 10.0


def test_bench_doubles_per_failure_expires_and_resets_on_success() -> None:
    clock = Clock()
    health = make(clock)
    lengths = [health.failed("a") for _ in range(12)]
    assert health.benched("a") and health.failures("a") == 12
    assert BENCH_START_S * 0.75 <= lengths[0] <= BENCH_START_S * 1.25
    assert lengths[3] > 2 * lengths[1] * 0.75 / 1.25  # grows roughly twofold with jitter
    assert max(lengths) <= BENCH_MAX_S * 1.25
    clock.now += BENCH_MAX_S * 1.25 + 0.1
    assert not health.benched("a")
    health.failed("a")
    health.succeeded(1, "a", 1.0)
    assert not health.benched("a") and health.failures("a") == 0


def test_forget_drops_a_departed_peer() -> None:
    health = make(Clock())
    health.succeeded(1, "a", 0.01)
    health.failed("a")
    health.forget({"a"})
    assert not health.benched("a")
    assert health.deadline(1, "a") == health.deadline(1, "other")  # stage estimate remains
