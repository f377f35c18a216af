"""The end of a run: every stage's final state is stored and checked before the run is done,
even when a replica dies while saving, and a finished coordinator prints its summary and
exits 0."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.storage.checkpoints import CheckpointStore

pytestmark = pytest.mark.timeout(300)


def _final_steps(state_dir: Path, stages: int) -> list[int | None]:
    store = CheckpointStore(state_dir / "checkpoints", "testnet")
    latest = [store.latest(stage) for stage in range(stages)]
    return [None if entry is None else entry[0] for entry in latest]


def test_a_hand_started_run_stores_every_final_state_then_summarises_and_exits(  # type: ignore[no-untyped-def]
    procs, tiny
) -> None:
    steps = 6
    coordinator = procs.coordinator(
        *tiny,
        "pipeline.stages=3",
        f"train.steps={steps}",
        "train.eval_every=3",
        "train.eval_samples=8",
        "checkpoint.every_steps=4",  # 4 is no multiple of 6: only the final save stores 6
        stay=False,
    )
    nodes = procs.nodes(3, coordinator)
    coord_popen = procs.children[0][0]
    assert coord_popen.wait(timeout=120) == 0
    for popen in nodes.values():
        assert popen.wait(timeout=60) == 0
    assert _final_steps(procs.tmp / "coordinator-state", 3) == [steps] * 3
    log = (procs.tmp / "coordinator.log").read_text()
    assert f"run 'testnet' done: {steps} of {steps} steps" in log, log
    assert "lost 0" in log and f"every stage's final state at step {steps}" in log
    assert "export it: swarmpipe export --state-dir" in log
    assert "held-out -" not in log  # the final evaluation is in the summary


@pytest.mark.slow
def test_a_replica_killed_while_saving_is_replaced_and_nothing_is_lost(  # type: ignore[no-untyped-def]
    procs, tiny
) -> None:
    steps = 5
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=2", f"train.steps={steps}", "coordinator.min_nodes=4", stay=False
    )
    marker = procs.tmp / "n0.paused"
    # n0 has the lowest id, so it is the replica its stage is asked to save from.
    env = {"SWARMPIPE_PAUSE_AT": f"checkpoint.final:0:{marker}"}
    victim, _ = procs.node("n0", coordinator, env=env)
    for name in ("n1", "n2", "n3"):
        procs.node(name, coordinator)
    paused = poll_until(
        lambda: marker.exists() and json.loads(marker.read_text()), 120, "n0 to pause"
    )
    assert paused["step"] == steps
    os.killpg(victim.pid, signal.SIGKILL)
    coord_popen = procs.children[0][0]
    assert coord_popen.wait(timeout=120) == 0
    assert _final_steps(procs.tmp / "coordinator-state", 2) == [steps] * 2
    log = (procs.tmp / "coordinator.log").read_text()
    assert "lost 0" in log and f"run 'testnet' done: {steps} of {steps} steps" in log, log
    stored_from = [line for line in log.splitlines() if "final state of stage" in line]
    assert len(stored_from) == 2 and not any("from n0" in line for line in stored_from), log
