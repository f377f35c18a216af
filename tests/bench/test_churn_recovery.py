"""bench churn's figure: seconds from a kill until a window of steps regains 90% of before."""

from __future__ import annotations

from typing import Any

from swarmpipe.bench.churn import recovery


def _steps(durations: list[float], samples: int = 10) -> list[dict[str, Any]]:
    steps, t = [], 0.0
    for d in durations:
        t += d
        steps.append({"samples": samples, "seen_at_seconds": t})
    return steps


def test_recovery_is_the_end_of_the_first_fast_window_after_the_kill() -> None:
    # 1 s steps, a kill at 6.0 s, three 4 s steps, then 1 s steps again.
    steps = _steps([1.0] * 6 + [4.0] * 3 + [1.0] * 6)
    figures = recovery(steps, kill_at=6.0, window=2, threshold=0.9)
    assert figures["baseline_samples_per_second"] == 10.0
    assert figures["first_step_after_kill_seconds"] == 4.0
    # Windows of 2 steps begun after the kill: 2.5, 2.5, 4, 10 samples/s; the last ends at 20 s.
    assert figures["recovered_after_seconds"] == 14.0
    assert figures["recovered_samples_per_second"] == 10.0


def test_no_recovery_is_reported_as_none() -> None:
    steps = _steps([1.0] * 6 + [4.0] * 6)
    assert recovery(steps, kill_at=6.0, window=2, threshold=0.9)["recovered_after_seconds"] is None
