"""A run whose coordinator and nodes are all SIGKILLed resumes from its last complete step
and ends where an uninterrupted run ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import grpc
import pytest

from swarmpipe.coordinator.run_state import last_complete_step
from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.storage.checkpoints import CheckpointStore

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

STEPS, STAGES = 12, 3
# One head with one microbatch in flight: every stage adds its microbatches' gradients in
# the same order in both runs, so they must agree bit for bit.
SETTINGS = (
    f"pipeline.stages={STAGES}",
    f"train.steps={STEPS}",
    "checkpoint.every_steps=4",
    "pipeline.in_flight=1",
    "coordinator.min_nodes=3",
)


def _status(target: str) -> coordinator_pb2.StatusReply:
    with grpc.insecure_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        reply: coordinator_pb2.StatusReply = stub.Status(
            coordinator_pb2.StatusRequest(), timeout=10
        )
    return reply


def _final_digests(target: str) -> dict[int, set[str]]:
    """Stage -> the parameter digests its nodes reported after the last step."""
    status = poll_until(lambda: (s := _status(target)).done and s, 180, "the run to finish")
    digests: dict[int, set[str]] = {}
    for node in status.nodes:
        if node.last_step == STEPS - 1:
            digests.setdefault(node.stage, set()).add(node.param_digest)
    return digests


def _kill_all(procs) -> None:  # type: ignore[no-untyped-def]
    for popen, _ in procs.children:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=30)


def test_a_killed_run_resumes_from_its_last_complete_step_and_ends_alike(  # type: ignore[no-untyped-def]
    procs, tiny, tmp_path: Path
) -> None:
    coordinator = procs.coordinator(*tiny, *SETTINGS)
    procs.nodes(3, coordinator)
    expected = _final_digests(coordinator)
    assert sorted(expected) == list(range(STAGES)) and all(len(d) == 1 for d in expected.values())
    _kill_all(procs)

    # The same run in a fresh folder, killed once every stage has stored step 8.
    procs.tmp = tmp_path / "second"
    procs.tmp.mkdir()
    state = procs.tmp / "coordinator-state"
    coordinator = procs.coordinator(*tiny, *SETTINGS)
    procs.nodes(3, coordinator)
    store = CheckpointStore(state / "checkpoints", "testnet")
    poll_until(lambda: (last_complete_step(store, STAGES) or 0) >= 8, 120, "step 8 everywhere")
    _kill_all(procs)
    resumed_at = last_complete_step(store, STAGES)
    assert resumed_at is not None and resumed_at < STEPS

    _, info = procs.start(
        "coordinator-resumed",
        *("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state), "--stay"),
        "--resume",
    )
    target = f"127.0.0.1:{info['grpc_port']}"
    procs.nodes(3, target)  # new node processes, same names: they restore the checkpoints
    assert _final_digests(target) == expected
    log = (procs.tmp / "coordinator-resumed.log").read_text()
    assert f"resuming run 'testnet' from step {resumed_at}" in log
    status = _status(target)
    assert status.counters.lost == 0
    assert [s.step for s in status.steps] == list(range(resumed_at, STEPS))
