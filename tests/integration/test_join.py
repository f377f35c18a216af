"""Nodes join a running run: they download their stage's state and stay equal to its replicas."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


class Watch:
    """The coordinator's Status, for polling."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.stub = coordinator_pb2_grpc.CoordinatorStub(self.channel)

    def status(self) -> coordinator_pb2.StatusReply:
        return self.stub.Status(coordinator_pb2.StatusRequest(), timeout=10)

    def serving(self, node_id: str) -> bool:
        return any(n.node_id == node_id and n.serving for n in self.status().nodes)


def _equal_step(watch: Watch, after: int) -> coordinator_pb2.StatusReply | None:
    """A status in which every node reports the same applied step, past `after`."""
    status = watch.status()
    steps = {n.last_step for n in status.nodes}
    if len(status.nodes) == 4 and len(steps) == 1 and steps.pop() > after:
        return status
    return None


def test_nodes_joining_a_running_run_copy_their_stage_and_stay_equal(
    procs, tiny, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Long enough never to finish here: the test compares the replicas mid-run. 100 ms
    # each way: the run has to go on while nodes start and join, not burn both cores.
    coordinator = procs.coordinator(
        *tiny,
        "pipeline.stages=2",
        "train.steps=100000",
        "coordinator.min_nodes=2",
        "checkpoint.every_steps=0",
        "pipeline.link_latency_ms=100",
    )
    watch = Watch(coordinator)
    try:
        procs.nodes(2, coordinator)  # one per stage
        poll_until(lambda: len(watch.status().steps) >= 3, 180, "the run to get going")
        joined = {}
        for name in ("n2", "n3"):
            procs.node(name, coordinator)
            joined[name] = procs.wait_serving(name)
            assert watch.serving(name)
        last_join = max(info["step"] for info in joined.values())
        status = poll_until(
            lambda: _equal_step(watch, last_join + 3), 120, "every node to apply the same step"
        )
    finally:
        watch.channel.close()
    for info in joined.values():
        assert info["serving"] and info["source"].startswith("replica "), info
        assert info["step"] > 0 and info["download_bytes"] > 0, info
    # Placement filled the emptiest stage: each joiner made a stage 2-replica.
    assert sorted(n.stage for n in status.nodes if n.node_id in joined) == [0, 1]
    assert all(n.serving for n in status.nodes)
    for stage in (0, 1):
        digests = {n.node_id: n.param_digest for n in status.nodes if n.stage == stage}
        assert len(digests) == 2 and len(set(digests.values())) == 1, (stage, digests)
    c = status.counters
    assert c.lost == 0 and c.duplicates == 0
    assert any(link.direction == "state" for link in status.links)
    assert any(link.direction == "reduce" and link.src_node in joined for link in status.links)
