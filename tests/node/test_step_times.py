"""A node's time per step, phase by phase, on a fake clock."""

from __future__ import annotations

import pytest

from swarmpipe.node.step_times import KEEP_STEPS, StepTimes


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_a_step_cycle_splits_into_compute_waiting_and_the_boundary() -> None:
    clock = Clock()
    times = StepTimes(clock=clock)
    times.forward_started(3)  # t = 0
    clock.now += 0.5
    times.computed(3, 0.2)  # t = 0.5
    clock.now += 1.0
    times.computed(3, 0.3)  # t = 1.5: its last compute of the step
    clock.now += 0.4
    times.apply_arrived(3)  # t = 1.9
    clock.now += 0.1
    times.reduced(3)
    clock.now += 0.05
    times.applied(3)
    clock.now += 0.02
    times.acked(3)
    [open_record] = times.snapshot()
    assert not open_record.complete and open_record.next_s == 0.0
    clock.now += 0.33
    times.forward_started(4)
    record, _ = [r for r in times.snapshot() if r.step == 3] + [None]
    assert record is not None and record.complete
    assert record.microbatches == 2
    assert record.train_s == pytest.approx(1.9)
    assert record.compute_s == pytest.approx(0.5)
    assert record.drain_s == pytest.approx(0.4)
    assert (record.reduce_s, record.apply_s, record.step_done_s, record.next_s) == pytest.approx(
        (0.1, 0.05, 0.02, 0.33)
    )
    # Train window plus boundary is the whole cycle from one first forward to the next.
    cycle = record.train_s + record.reduce_s + record.apply_s + record.step_done_s + record.next_s
    assert cycle == pytest.approx(2.4)


def test_steps_before_apply_are_left_out_and_old_ones_forgotten() -> None:
    clock = Clock()
    times = StepTimes(clock=clock)
    times.apply_arrived(0)  # a node that never computed step 0 (it joined later): nothing
    for step in range(KEEP_STEPS + 5):
        times.forward_started(step)
        clock.now += 1.0
        times.apply_arrived(step)
        times.apply_arrived(step)  # MQTT redelivers: the first arrival counts
        times.acked(step)
    times.forward_started(KEEP_STEPS + 5)
    records = times.snapshot()
    assert [r.step for r in records] == list(range(6, KEEP_STEPS + 5))
    assert all(r.train_s == pytest.approx(1.0) for r in records)


def test_a_step_that_began_before_the_last_was_acknowledged_has_no_next_wait() -> None:
    # train.step_overlap: step 4's first forward comes while step 3 is still applied.
    clock = Clock()
    times = StepTimes(clock=clock)
    times.forward_started(3)
    clock.now += 1.0
    times.forward_started(4)
    times.apply_arrived(3)
    clock.now += 0.1
    times.acked(3)
    [record] = [r for r in times.snapshot() if r.step == 3]
    assert record.complete and record.next_s == 0.0
