"""report.json's time breakdown from a Status, built by hand."""

from __future__ import annotations

import pytest

from swarmpipe.protos import control_pb2, coordinator_pb2
from swarmpipe.testnet.time_breakdown import link_utilisation, time_breakdown


def _status() -> coordinator_pb2.StatusReply:
    status = coordinator_pb2.StatusReply()
    # Steps open at 0, 2.5, 5.0 and 7.0 s; each trains 2 s, then a 0.5 s or 0 s boundary.
    for step, (started, train) in enumerate([(0.0, 2.0), (2.5, 2.0), (5.0, 2.0), (7.0, 1.0)]):
        status.steps.append(
            coordinator_pb2.StepRecord(
                step=step, samples=32, seconds=train, elapsed_s=started + train
            )
        )
    node = status.nodes.add(node_id="n0", stage=0)
    for step in range(3):
        node.step_times.append(
            control_pb2.StepTimes(
                step=step, train_s=2.0, compute_s=0.5, drain_s=0.3, reduce_s=0.1, apply_s=0.1,
                step_done_s=0.1, next_s=0.2, microbatches=4, complete=step < 2,
            )
        )  # fmt: skip
    return status


def test_steps_cycles_and_boundaries() -> None:
    breakdown = time_breakdown(_status())
    steps = breakdown["coordinator"]["steps"]
    assert [s.get("boundary_s") for s in steps] == pytest.approx([0.5, 0.5, 0.0, None])
    assert [s.get("cycle_s") for s in steps] == pytest.approx([2.5, 2.5, 2.0, None])
    coordinator = breakdown["coordinator"]
    # Step 0 (warm-up) and the last (no next step opened) are left out of the totals.
    assert coordinator["steps_counted"] == 2
    assert coordinator["cycle_s"] == pytest.approx(4.5)
    assert coordinator["boundary_share"] == pytest.approx(0.5 / 4.5)


def test_a_nodes_shares_add_up_and_incomplete_steps_are_not_counted() -> None:
    node = time_breakdown(_status())["nodes"]["n0"]
    assert node["steps_counted"] == 1  # step 1: step 0 is warm-up, step 2 is incomplete
    assert len(node["steps"]) == 3
    assert node["totals"]["waiting_s"] == pytest.approx(1.5)
    assert sum(node["shares"].values()) == pytest.approx(1.0)
    assert node["shares"]["compute"] == pytest.approx(0.5 / 2.5)
    assert node["boundary_share"] == pytest.approx(0.5 / 2.5)
    assert time_breakdown(_status(), skip_first=False)["nodes"]["n0"]["steps_counted"] == 2


def test_link_utilisation_is_bytes_over_what_the_limit_could_carry() -> None:
    report = {
        "link_choices": [
            {"src": "n0", "dst": "n1", "direction": "activation", "limit_mbit": 8.0,
             "wire_bytes": 5_000_000},
            {"src": "n1", "dst": "n0", "direction": "gradient", "limit_mbit": 0.0,
             "wire_bytes": 5_000_000},
        ]
    }  # fmt: skip
    # 50 kB per sample at 10 samples/s over a 1 MB/s limit: busy half the time.
    busy = link_utilisation(report, samples_per_second=10.0, committed=100)
    assert busy == {
        "n0->n1 activation": {"wire_bytes_per_sample": 50_000.0, "busy_share": pytest.approx(0.5)}
    }
