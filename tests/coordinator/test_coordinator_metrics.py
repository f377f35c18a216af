"""The coordinator's metrics, read back with Prometheus' own text parser."""

from __future__ import annotations

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.coordinator.metrics import coordinator_families
from swarmpipe.process.metrics import registry_of
from swarmpipe.protos import coordinator_pb2 as pb


def _status() -> pb.StatusReply:
    return pb.StatusReply(
        run_id="r1",
        step=2,
        total_steps=10,
        phase="training",
        counters=pb.SampleCounters(
            leased=40, committed=32, replayed=8, duplicates=4, lost=0, outstanding=8
        ),
        steps=[
            pb.StepRecord(step=0, loss=5.5, samples=16, seconds=2.0, samples_per_second=8.0),
            pb.StepRecord(step=1, loss=4.25, samples=16, seconds=1.0, samples_per_second=16.0),
        ],
        evals=[pb.EvalRecord(step=0, loss=5.75, tokens=64)],
        nodes=[
            pb.NodeRecord(node_id="n0", stage=0, online=True, serving=True, samples=32),
            pb.NodeRecord(node_id="n1", stage=1, online=True, serving=False, samples=0),
            pb.NodeRecord(node_id="n2", stage=1, online=False, samples=16),
        ],
        links=[
            pb.LinkRecord(
                src_node="n0", dst_node="n1", direction="activation", codec="int8", bytes=999
            )
        ],
    )


def _scrape(status: pb.StatusReply) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = registry_of(lambda: coordinator_families(status, stages=3))
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(generate_latest(registry).decode())
    }


def test_coordinator_metrics_show_the_status_counters_step_phase_and_loss() -> None:
    got = _scrape(_status())
    # The parser names a counter's family without `_total`; its sample keeps it.
    assert got["swarmpipe_coordinator_leased_samples"] == [({}, 40.0)]
    assert got["swarmpipe_coordinator_committed_samples"] == [({}, 32.0)]
    assert got["swarmpipe_coordinator_replayed_samples"] == [({}, 8.0)]
    assert got["swarmpipe_coordinator_duplicate_samples"] == [({}, 4.0)]
    assert got["swarmpipe_coordinator_lost_samples"] == [({}, 0.0)]
    assert got["swarmpipe_coordinator_outstanding_samples"] == [({}, 8.0)]
    assert got["swarmpipe_coordinator_steps_finished"] == [({}, 2.0)]
    assert got["swarmpipe_coordinator_step"] == [({}, 2.0)]
    assert got["swarmpipe_coordinator_total_steps"] == [({}, 10.0)]
    assert got["swarmpipe_coordinator_loss"] == [({}, 4.25)]
    assert got["swarmpipe_coordinator_samples_per_second"] == [({}, 16.0)]
    assert got["swarmpipe_coordinator_eval_loss"] == [({}, 5.75)]
    assert got["swarmpipe_coordinator_run_info"] == [({"run": "r1"}, 1.0)]
    assert dict((s["phase"], v) for s, v in got["swarmpipe_coordinator_phase"]) == {
        "waiting": 0.0,
        "training": 1.0,
        "apply": 0.0,
        "saving": 0.0,
        "done": 0.0,
    }
    assert dict((s["stage"], v) for s, v in got["swarmpipe_coordinator_nodes_online"]) == {
        "0": 1.0,
        "1": 1.0,
        "2": 0.0,
    }
    assert dict((s["stage"], v) for s, v in got["swarmpipe_coordinator_nodes_serving"]) == {
        "0": 1.0,
        "1": 0.0,
        "2": 0.0,
    }
    assert sorted(got["swarmpipe_coordinator_node_samples"], key=lambda s: s[0]["node"]) == [
        ({"node": "n0", "stage": "0"}, 32.0),
        ({"node": "n1", "stage": "1"}, 0.0),
        ({"node": "n2", "stage": "1"}, 16.0),
    ]
    assert got["swarmpipe_coordinator_link_sent_bytes"] == [
        ({"node": "n0", "peer": "n1", "direction": "activation", "codec": "int8"}, 999.0)
    ]


def test_before_the_first_step_there_is_no_loss_yet() -> None:
    got = _scrape(pb.StatusReply(run_id="r1", phase="waiting", total_steps=10))
    assert "swarmpipe_coordinator_loss" not in got
    assert "swarmpipe_coordinator_eval_loss" not in got
    assert got["swarmpipe_coordinator_steps_finished"] == [({}, 0.0)]
