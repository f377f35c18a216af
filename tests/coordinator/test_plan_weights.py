"""The plan's replica weights come from each node's measured compute rate."""

from __future__ import annotations

from swarmpipe.coordinator.membership import Membership
from swarmpipe.protos import control_pb2


def _membership() -> Membership:
    m = Membership(num_stages=2, activation_codec=1, gradient_codec=1)
    for node in ("a", "b", "c", "d"):
        member = m.assign(node, f"127.0.0.1:{ord(node)}")
        member.online = member.serving = True
    return m


def _weights(plan: control_pb2.Plan, stage: int) -> dict[str, float]:
    return {r.node_id: r.weight for r in plan.stages[stage].replicas}


def test_unmeasured_replicas_weigh_the_same_then_follow_measured_rates() -> None:
    m = _membership()
    stage0 = sorted(n for n, member in m.members.items() if member.stage == 0)
    assert len(stage0) == 2
    assert set(_weights(m.plan(), 0).values()) == {1.0}
    fast, slow = stage0
    m.members[fast].telemetry = control_pb2.Telemetry(compute_samples_per_second=30.0)
    weights = _weights(m.plan(), 0)
    assert weights[fast] == 30.0 and weights[slow] == 30.0  # the unmeasured one gets the mean
    m.members[slow].telemetry = control_pb2.Telemetry(compute_samples_per_second=10.0)
    assert m.weights_drifted()
    weights = _weights(m.plan(), 0)
    assert weights == {fast: 30.0, slow: 10.0}
    assert not m.weights_drifted()
    m.members[slow].telemetry = control_pb2.Telemetry(compute_samples_per_second=11.0)
    assert not m.weights_drifted()  # a 10% move is noise
