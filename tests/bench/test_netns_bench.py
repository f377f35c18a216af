"""`bench netns`'s arithmetic: what the links carried, by the senders' and the kernel's count."""

from __future__ import annotations

import pytest

from swarmpipe.bench.netns import carried, training_seconds


def _report(netns: bool) -> dict[str, object]:
    report: dict[str, object] = {
        # Step 0 opens at 1 s (ends 3 s); the last ends at 11 s: 10 s of training.
        "steps": [{"elapsed_s": 3.0, "seconds": 2.0}, {"elapsed_s": 11.0, "seconds": 2.0}],
        "link_choices": [
            {"src": "n0", "dst": "n1", "direction": "activation", "wire_bytes": 5_000_000},
            {"src": "n1", "dst": "n0", "direction": "gradient", "wire_bytes": 2_500_000},
            {"src": "n1", "dst": "n2", "direction": "reduce", "wire_bytes": 90_000_000},
        ],
    }
    if netns:
        report["netns"] = {"kernel_sent_bytes": {"n0->n1": 5_250_000, "n1->n0": 0}}
    return report


def test_training_time_runs_from_step_0_opening_to_the_last_step_end() -> None:
    assert training_seconds(_report(False)) == pytest.approx(10.0)


def test_carried_mbit_per_direction_leaves_reduces_out() -> None:
    links = carried(_report(False))
    assert links["senders_mbit"] == {
        "n0->n1 activation": pytest.approx(4.0),
        "n1->n0 gradient": pytest.approx(2.0),
    }
    assert links["busiest_senders_mbit"] == pytest.approx(4.0)
    assert "kernel_mbit" not in links


def test_the_kernel_count_is_reported_beside_the_senders() -> None:
    links = carried(_report(True))
    assert links["kernel_mbit"] == {"n0->n1": pytest.approx(4.2), "n1->n0": 0.0}
    assert links["busiest_kernel_mbit"] == pytest.approx(4.2)
