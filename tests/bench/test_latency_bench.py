"""`bench latency`'s arithmetic: samples/s over whole step cycles and the link bound."""

from __future__ import annotations

import pytest

from swarmpipe.bench.latency import (
    _link_bound,
    cycle_samples_per_second,
    depth_kind,
    depth_settings,
    eager_trains_on,
    parse_depths,
)


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


def test_depths_name_their_runs_and_bad_ones_are_one_line() -> None:
    assert parse_depths("0,1,3") == [0, 1, 3]
    # Depths 0 and 1 keep the run names earlier figures used.
    assert [depth_kind(d) for d in (0, 1, 3)] == ["auto", "auto_overlap", "auto_depth_3"]
    assert depth_settings(0) == ["pipeline.in_flight=auto"]
    assert depth_settings(3) == ["pipeline.in_flight=auto", "train.step_overlap=3"]
    for bad in ("0,x", "1,1", "9", ""):
        with pytest.raises(SystemExit, match="--depths"):
            parse_depths(bad)


def test_the_staleness_part_replays_the_coordinators_opening_rule() -> None:
    # Depth k: steps 1..k open with step 0; then each trains k steps behind, until a
    # checkpoint step (10) drains and the steps after it train on its parameters.
    assert eager_trains_on(12, 0, 10) == list(range(12))
    assert eager_trains_on(12, 1, 10) == [0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 10]
    assert eager_trains_on(12, 3, 10) == [0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 10, 10]
    assert eager_trains_on(6, 3, 0) == [0, 0, 0, 0, 1, 2]
