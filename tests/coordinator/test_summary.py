"""The end-of-run summary's arithmetic."""

from __future__ import annotations

import pytest

from swarmpipe.coordinator.summary import busy_seconds


def test_busy_seconds_is_the_sum_of_separate_steps_and_the_union_of_overlapping_ones() -> None:
    assert busy_seconds([(0.0, 1.0), (1.5, 2.0)]) == pytest.approx(1.5)
    # train.step_overlap: step 1 opens at 0.5 while step 0 trains until 1.0.
    assert busy_seconds([(0.0, 1.0), (0.5, 1.6), (1.2, 2.0)]) == pytest.approx(2.0)
    assert busy_seconds([]) == 0.0


def test_the_summary_says_how_many_steps_trained_a_step_behind() -> None:
    from swarmpipe.coordinator.summary import summary_lines
    from swarmpipe.protos import coordinator_pb2

    status = coordinator_pb2.StatusReply(run_id="r", total_steps=3, done=True)
    for step, trains_on in ((0, 0), (1, 0), (2, 1)):
        status.steps.add(step=step, trains_on=trains_on, samples=4, seconds=1.0, elapsed_s=step)
    (line,) = [x for x in summary_lines(status) if "throughput" in x]
    assert line.endswith("; 2 of 3 trained a step behind (step overlap)")
    status.steps[2].trains_on = 0  # train.step_overlap = 2
    (line,) = [x for x in summary_lines(status) if "throughput" in x]
    assert line.endswith("; 2 of 3 trained up to 2 steps behind (step overlap)")
    for s in status.steps:
        s.trains_on = s.step
    (line,) = [x for x in summary_lines(status) if "throughput" in x]
    assert "behind" not in line
