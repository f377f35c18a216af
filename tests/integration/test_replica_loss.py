"""A replica SIGKILLed mid-run: traffic goes around it, its leases are replayed, nothing is lost."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_killing_one_replica_of_each_stage_loses_nothing(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    coordinator = procs.coordinator(
        *tiny,
        "pipeline.stages=3",
        "train.steps=40",
        "pipeline.reduce_timeout_s=10",
        "coordinator.min_nodes=6",
    )
    nodes = procs.nodes(6, coordinator)
    channel = grpc.insecure_channel(coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def status() -> coordinator_pb2.StatusReply:
        return stub.Status(coordinator_pb2.StatusRequest(), timeout=5)

    try:
        poll_until(lambda: len(status().steps) >= 3, 120, "the run to get going")
        stages = {n.node_id: n.stage for n in status().nodes}
        victims = []
        for stage in range(3):  # one replica of every stage, a moment apart
            victim = sorted(n for n, s in stages.items() if s == stage)[0]
            os.killpg(nodes[victim].pid, signal.SIGKILL)
            victims.append(victim)
            before = len(status().steps)
            poll_until(lambda b=before: len(status().steps) > b, 120, "training to continue")
            time.sleep(0.2)
        final = poll_until(lambda: (s := status()).done and s, 240, "the run to finish")
        assert final.counters.lost == 0 and final.counters.outstanding == 0
        assert final.counters.committed >= 40 * 16
        online = [n for n in final.nodes if n.node_id not in victims]
        for stage in range(3):
            digests = {n.param_digest for n in online if n.stage == stage}
            assert len(digests) == 1, (stage, digests)
    finally:
        channel.close()
