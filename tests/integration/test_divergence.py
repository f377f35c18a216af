"""Replicas that differ after a step, which the reduce cannot see, are noticed and healed.

The replicas of a stage take bit-identical steps and report a digest of their parameters
with every acknowledgement. A node armed with the `apply.drift` fault point nudges its
parameters once after applying a step, as a bad memory bit would; the coordinator must see
the stage's digests differ, keep the replica that has been in the swarm longer (two
replicas: no majority) and make the other fetch the stage's state again, after which both
agree to the end of the run and nothing is lost.
"""

from __future__ import annotations

import pytest

from tests.conftest import run_to_end_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_replica_that_drifted_is_re_synced_and_the_replicas_agree_again(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=1", "train.steps=30", "coordinator.min_nodes=2"
    )
    procs.node("n0", coordinator)
    procs.wait_serving("n0")
    marker = procs.tmp / "n1.drifted"
    procs.node("n1", coordinator, env={"SWARMPIPE_PAUSE_AT": f"apply.drift:5:{marker}"})
    final = run_to_end_at(coordinator)
    assert marker.exists(), "n1 never reached the fault point"
    (move,) = [m for m in final.moves if m.node_id == "n1"]
    assert (move.from_stage, move.to_stage) == (0, 0)
    assert move.reason.startswith("re-sync: its parameters after step "), move.reason
    assert final.counters.lost == 0 and final.counters.outstanding == 0
    digests = {n.node_id: n.param_digest for n in final.nodes}
    assert digests["n0"] == digests["n1"] != "", digests
    log = (procs.tmp / "n1.log").read_text()
    assert "nudging the parameters for a test" in log
