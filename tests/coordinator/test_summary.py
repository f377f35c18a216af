"""The end-of-run summary's arithmetic."""

from __future__ import annotations

import pytest

from swarmpipe.coordinator.summary import busy_seconds


def test_busy_seconds_is_the_sum_of_separate_steps_and_the_union_of_overlapping_ones() -> None:
    assert busy_seconds([(0.0, 1.0), (1.5, 2.0)]) == pytest.approx(1.5)
    # train.step_overlap: step 1 opens at 0.5 while step 0 trains until 1.0.
    assert busy_seconds([(0.0, 1.0), (0.5, 1.6), (1.2, 2.0)]) == pytest.approx(2.0)
    assert busy_seconds([]) == 0.0
