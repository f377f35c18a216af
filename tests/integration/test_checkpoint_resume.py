"""A stage loses its only replica: a fresh node resumes it from its checkpoint and the run ends.

Also under train.step_overlap: no step opens early while the stage is unserved (a current
step on older parameters would start again on the newest: unit-tested in
tests/coordinator/test_step_overlap.py, since which of the two a kill meets is timing), the
fresh node enters at a drain point, and steps overlap again once it serves."""

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


@pytest.mark.parametrize(
    ("shared_folder", "overlap"),
    [(False, False), (True, False), (False, True)],
    ids=["coordinator", "shared-folder", "step-overlap"],
)
def test_a_stage_without_replicas_resumes_from_its_checkpoint(  # type: ignore[no-untyped-def]
    procs, tiny, tmp_path: Path, shared_folder: bool, overlap: bool
) -> None:
    # The run stalls from the kill until n2 serves, so it cannot end early: 40 steps leave
    # room for a kill near step 10 on a loaded machine without 60 more steps to wait for.
    steps, every = 40, 5
    root = tmp_path / "shared" if shared_folder else tmp_path / "coordinator-state" / "checkpoints"
    settings = [f"checkpoint.dir={root}"] if shared_folder else []
    settings += ["train.step_overlap=true"] if overlap else []
    coordinator = procs.coordinator(
        *tiny,
        *settings,
        "pipeline.stages=2",
        f"train.steps={steps}",
        "coordinator.min_nodes=2",
        f"checkpoint.every_steps={every}",
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
        # Kill between two checkpoints, so the stage loses a few steps.
        poll_until(lambda: status().step % every >= 2, 60, "a step between checkpoints")
        os.killpg(nodes[victim].pid, signal.SIGKILL)
        killed_at = status().step
        saved = sorted(int(p.stem.split("-")[1]) for p in store.glob("step-*.ckpt"))
        assert saved and saved[-1] % every == 0 and saved[-1] <= killed_at + 1
        procs.node("n2", coordinator)
        final = poll_until(lambda: (s := status()).done and s, 360, "the run to finish")
    finally:
        channel.close()
    info = json.loads((tmp_path / "n2.ready.json").read_text())
    assert info["stage"] == 1 and info["serving"], info
    restored = int(info["source"].removeprefix("checkpoint of step "))
    assert restored % every == 0 and saved[-1] <= restored <= killed_at + 1
    assert info["step"] >= killed_at
    log = (tmp_path / "n2.log").read_text()
    assert f"resumed from its checkpoint of step {restored}" in log
    assert "this stage lost the updates of steps" in log
    c = final.counters
    assert c.lost == 0 and c.outstanding == 0 and c.committed >= steps * 16
    n2 = next(n for n in final.nodes if n.node_id == "n2")
    assert n2.last_step == steps - 1
    assert len(final.steps) == steps
    if overlap:
        trains_on = {s.step: s.trains_on for s in final.steps}
        entered = int(info["step"])
        # The fresh node entered at a step that trains on the state it downloaded.
        assert trains_on[entered] == entered, (entered, trains_on)
        # Steps overlapped before the kill and again once the fresh node served.
        assert any(trains_on[s] == s - 1 for s in range(1, killed_at)), trains_on
        assert any(trains_on[s] == s - 1 for s in range(entered + 1, steps)), trains_on
