"""The head's auto window: the pipeline's bandwidth-delay product in microbatches, bounded."""

from __future__ import annotations

from swarmpipe.node.in_flight import (
    MAX_DEEP_WINDOW,
    MAX_WINDOW,
    START_WINDOW,
    InFlightSizer,
    window_cap,
)


def _update(sizer: InFlightSizer, **kw: object) -> int:
    args: dict[str, object] = {
        "samples_per_microbatch": 8,
        "own_compute_s": 0.03,
        "link_seconds": [],
        "stage_weights": [],
        "heads": 1,
    }
    args.update(kw)
    return sizer.update(**args)  # type: ignore[arg-type]


def test_the_window_starts_at_two_until_a_round_trip_is_seen() -> None:
    sizer = InFlightSizer()
    assert sizer.window == START_WINDOW == 2
    assert _update(sizer, link_seconds=[0.2]) == 2


def test_a_slow_link_far_away_needs_its_bandwidth_delay_product() -> None:
    # 10 Mbit/s: 0.21 s per 262 kB activation; a round trip of 1.0 s crosses four such
    # transfers plus compute, so five microbatches keep the link busy, plus one for jitter.
    sizer = InFlightSizer()
    sizer.add_round_trip(1.0)
    assert _update(sizer, link_seconds=[0.21, 0.05]) == 5 + 1
    # Queues stretch later round trips; the least one stays the estimate.
    for _ in range(10):
        sizer.add_round_trip(3.0)
    assert _update(sizer, link_seconds=[0.21]) == 6
    assert sizer.round_trip_s == 1.0 and sizer.bottleneck_s == 0.21


def test_the_slowest_stage_from_the_plan_is_the_bottleneck_when_slower() -> None:
    sizer = InFlightSizer()
    sizer.add_round_trip(0.5)
    # Stage 1 has two replicas of 40 samples/s: 80 samples/s, 0.1 s per 8-sample microbatch.
    weights = [[400.0], [40.0, 40.0], [300.0]]
    assert _update(sizer, stage_weights=weights) == 5 + 1
    # Two heads share the bottleneck: each needs half the window.
    assert _update(sizer, stage_weights=weights, heads=2) == 3 + 1


def test_unmeasured_plan_weights_are_not_rates() -> None:
    sizer = InFlightSizer()
    sizer.add_round_trip(0.3)
    # Weight 1.0 is the coordinator's placeholder: 8 s per microbatch would shrink the window.
    assert _update(sizer, stage_weights=[[1.0], [1.0, 1.0]]) == 10 + 1


def test_the_window_is_bounded() -> None:
    sizer = InFlightSizer()
    sizer.add_round_trip(100.0)
    assert _update(sizer, own_compute_s=0.001) == MAX_WINDOW
    small = InFlightSizer()
    small.add_round_trip(0.01)
    assert _update(small, own_compute_s=1.0) == 2  # one in flight plus one: never below 1
    assert _update(InFlightSizer(maximum=4), own_compute_s=0.001) == START_WINDOW


def test_deeper_overlap_raises_the_cap_to_the_open_steps_microbatches() -> None:
    # 4 microbatches a step: up to depth 3 the 16 of four open steps fit under MAX_WINDOW;
    # deeper, every open step's microbatches may be in flight, up to MAX_DEEP_WINDOW.
    assert [window_cap(microbatches_per_step=4, overlap_depth=k) for k in (0, 1, 3)] == [16] * 3
    assert window_cap(microbatches_per_step=4, overlap_depth=4) == 20
    assert window_cap(microbatches_per_step=4, overlap_depth=8) == MAX_DEEP_WINDOW == 32
    sizer = InFlightSizer(maximum=window_cap(microbatches_per_step=4, overlap_depth=8))
    sizer.add_round_trip(100.0)
    assert _update(sizer, own_compute_s=0.001) == 32
