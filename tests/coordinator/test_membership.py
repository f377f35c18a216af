"""Placement, the serving/syncing split the plan is built from, and replica weights from
each node's measured compute rate."""

from __future__ import annotations

from swarmpipe.coordinator.membership import Membership
from swarmpipe.protos import control_pb2


def make(stages: int = 2) -> Membership:
    return Membership(num_stages=stages, activation_codec=1, gradient_codec=1)


def test_a_joined_node_holds_its_stage_before_it_announces_itself() -> None:
    m = make()
    assert m.assign("a", "h:1").stage == 0
    assert m.assign("b", "h:2").stage == 1
    assert m.assign("c", "h:3").stage == 0


def test_a_node_that_went_offline_frees_its_stage_for_the_next_joiner() -> None:
    m = make()
    for name in ("a", "b"):
        member = m.assign(name, f"{name}:1")
        member.online = member.announced = member.serving = True
    m.members["b"].online = False
    assert m.assign("c", "c:1").stage == 1


def test_only_serving_nodes_are_live_in_the_plan_and_cover_stages() -> None:
    m = make()
    a, b = m.assign("a", "a:1"), m.assign("b", "b:1")
    a.online = b.online = True
    a.serving = True
    assert [x.node_id for x in m.live()] == ["a"]
    assert not m.covered()
    assert [len(s.replicas) for s in m.plan().stages] == [1, 0]
    b.ready_step = 4
    assert m.promote(3) == [] and m.promote(4) == [b]
    assert b.serving and b.ready_step == -1 and m.covered()


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
