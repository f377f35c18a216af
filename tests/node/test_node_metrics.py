"""A node's metrics, read back with Prometheus' own text parser: names, labels, values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from swarmpipe.node.compute import ComputeWorker
from swarmpipe.node.context import NodeStatus
from swarmpipe.node.links import Links
from swarmpipe.node.metrics import node_families
from swarmpipe.node.router import Router
from swarmpipe.node.transport import LinkStats
from swarmpipe.process.metrics import registry_of
from swarmpipe.protos import control_pb2, tensor_pb2


@pytest.fixture
def compute() -> Iterator[ComputeWorker]:
    worker = ComputeWorker()
    yield worker
    worker.close()


def _plan() -> control_pb2.Plan:
    def replicas(*names: str) -> list[control_pb2.Replica]:
        return [control_pb2.Replica(node_id=n, address=f"{n}:1", weight=1.0) for n in names]

    return control_pb2.Plan(
        version=1,
        num_stages=2,
        stages=[
            control_pb2.StagePlan(stage=0, replicas=replicas("n0")),
            control_pb2.StagePlan(stage=1, replicas=replicas("n1", "n2")),
        ],
    )


def _scrape(**parts: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Family name (as the parser gives it) -> [(labels, value)] of every sample."""
    text = generate_latest(registry_of(lambda: node_families(**parts))).decode()
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
    }


def test_node_metrics_show_what_the_parts_counted(compute: ComputeWorker) -> None:
    status, stats = NodeStatus(), LinkStats()
    router = Router("n0", stats, Links(), seed=1)
    router.set_plan(_plan())
    router.health.failed("n2")
    router.reroutes = 3
    status.start_serving()
    status.count_samples(12)
    stats.record("n1", "activation", tensor_pb2.CODEC_BLOCKWISE_INT8, 1000)
    stats.record("n1", "activation", tensor_pb2.CODEC_BLOCKWISE_INT8, 500)
    stats.record("n2", "activation", tensor_pb2.CODEC_LOSSLESS, 4000)
    stats.add_received(777)
    with status.track_microbatch():
        got = _scrape(
            node_id="n0",
            stage=0,
            step=5,
            samples_per_second=2.5,
            status=status,
            compute=compute,
            stats=stats,
            router=router,
        )
    me = {"node": "n0", "stage": "0"}
    assert got["swarmpipe_node_samples"] == [(me, 12.0)]  # the parser drops `_total`
    assert got["swarmpipe_node_step"] == [(me, 5.0)]
    assert got["swarmpipe_node_samples_per_second"] == [(me, 2.5)]
    assert got["swarmpipe_node_serving"] == [(me, 1.0)]
    assert got["swarmpipe_node_microbatches_in_flight"] == [(me, 1.0)]
    assert got["swarmpipe_node_compute_queue_depth"] == [(me, 0.0)]
    assert got["swarmpipe_node_received_bytes"] == [(me, 777.0)]
    assert got["swarmpipe_node_reroutes"] == [(me, 3.0)]
    assert got["swarmpipe_node_benched_peers"] == [(me, 1.0)]
    assert sorted(got["swarmpipe_node_peer_benched"], key=lambda s: s[0]["peer"]) == [
        ({**me, "peer": "n1"}, 0.0),
        ({**me, "peer": "n2"}, 1.0),
    ]
    link = {**me, "direction": "activation"}
    assert sorted(got["swarmpipe_node_sent_bytes"], key=lambda s: s[0]["peer"]) == [
        ({**link, "peer": "n1", "codec": "int8"}, 1500.0),
        ({**link, "peer": "n2", "codec": "lossless"}, 4000.0),
    ]
    assert sorted(got["swarmpipe_node_sent_tensors"], key=lambda s: s[0]["peer"]) == [
        ({**link, "peer": "n1", "codec": "int8"}, 2.0),
        ({**link, "peer": "n2", "codec": "lossless"}, 1.0),
    ]


def test_before_join_the_stage_label_is_empty_and_nothing_is_benched(
    compute: ComputeWorker,
) -> None:
    stats = LinkStats()
    got = _scrape(
        node_id="n7",
        stage=-1,
        step=0,
        samples_per_second=0.0,
        status=NodeStatus(),
        compute=compute,
        stats=stats,
        router=Router("n7", stats, Links()),
    )
    assert got["swarmpipe_node_serving"] == [({"node": "n7", "stage": ""}, 0.0)]
    assert got["swarmpipe_node_sent_bytes"] == []
    assert got["swarmpipe_node_peer_benched"] == []
