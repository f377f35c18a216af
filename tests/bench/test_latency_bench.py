"""`bench latency`'s arithmetic: samples/s over whole step cycles and the link bound."""

from __future__ import annotations

import pytest

from swarmpipe.bench.latency import _link_bound, cycle_samples_per_second


def test_samples_per_second_counts_the_boundaries_and_skips_step_0() -> None:
    # Steps open at 0, 3, 5, 7 s; each trains 1.5 s. Steps 2 and 3 make whole cycles:
    # 64 samples in the 4 s from step 1's last commit to step 3's.
    report = {
        "steps": [
            {"samples": 32, "seconds": 1.5, "elapsed_s": opened + 1.5}
            for opened in (0.0, 3.0, 5.0, 7.0)
        ]
    }
    assert cycle_samples_per_second(report) == pytest.approx(64 / 4.0)


def test_too_few_steps_is_one_line() -> None:
    with pytest.raises(SystemExit, match="at least 3 steps"):
        cycle_samples_per_second({"steps": [{"samples": 1, "seconds": 1, "elapsed_s": 1}]})


def test_the_link_bound_is_the_limit_over_the_busiest_directions_bytes_per_sample() -> None:
    report = {
        "counters": {"committed": 100},
        "link_choices": [
            {"direction": "activation", "wire_bytes": 3_000_000},
            {"direction": "gradient", "wire_bytes": 2_000_000},
            {"direction": "reduce", "wire_bytes": 90_000_000},  # once a step, not per sample
        ],
    }
    # 10 Mbit/s = 1.25 MB/s over 30 kB per sample.
    assert _link_bound(report, 10.0) == pytest.approx(1.25e6 / 30_000)
