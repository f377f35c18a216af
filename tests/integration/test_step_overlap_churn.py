"""train.step_overlap through churn: a stage loses its only replica while steps overlap; no
step opens early while it is unserved (and a current step on older parameters would start
again on the newest: unit-tested in tests/coordinator/test_step_overlap.py, since which of
the two a kill meets is timing), a fresh node resumes the stage from its checkpoint and
enters at a drain point, and overlap resumes once it serves."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc
import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480)]


def test_a_stage_without_replicas_comes_back_at_a_drain_point(  # type: ignore[no-untyped-def]
    procs, tiny, tmp_path: Path
) -> None:
    steps, every = 40, 5
    root = tmp_path / "coordinator-state" / "checkpoints"
    coordinator = procs.coordinator(
        *tiny,
        "pipeline.stages=2",
        f"train.steps={steps}",
        "coordinator.min_nodes=2",
        f"checkpoint.every_steps={every}",
        "train.step_overlap=true",
    )
    channel = grpc.insecure_channel(coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def status() -> coordinator_pb2.StatusReply:
        return stub.Status(coordinator_pb2.StatusRequest(), timeout=10)

    try:
        nodes = procs.nodes(2, coordinator)
        stage_of = {n.node_id: n.stage for n in status().nodes}
        victim = next(name for name, stage in stage_of.items() if stage == 1)
        store = root / "testnet" / "stage-1"
        poll_until(lambda: list(store.glob("step-*.ckpt")), 180, "a checkpoint of stage 1")
        # Kill between two checkpoints, where steps open early.
        poll_until(lambda: status().step % every >= 2, 60, "a step between checkpoints")
        os.killpg(nodes[victim].pid, signal.SIGKILL)
        killed_at = status().step
        procs.node("n2", coordinator)
        final = poll_until(lambda: (s := status()).done and s, 360, "the run to finish")
    finally:
        channel.close()
    info = json.loads((tmp_path / "n2.ready.json").read_text())
    assert info["stage"] == 1 and info["serving"], info
    entered = int(info["step"])
    assert entered >= killed_at
    trains_on = {s.step: s.trains_on for s in final.steps}
    assert len(trains_on) == steps
    # The fresh node entered at a step that trains on the state it downloaded.
    assert trains_on[entered] == entered, (entered, trains_on)
    # Steps overlapped before the kill and again once the fresh node served.
    assert any(trains_on[s] == s - 1 for s in range(1, killed_at)), trains_on
    assert any(trains_on[s] == s - 1 for s in range(entered + 1, steps)), trains_on
    c = final.counters
    assert c.lost == 0 and c.outstanding == 0 and c.committed >= steps * 16
    n2 = next(n for n in final.nodes if n.node_id == "n2")
    assert n2.last_step == steps - 1
