"""Placement and the serving/syncing split the plan is built from."""

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


def _serving(m: Membership, name: str, stage: int, rate: float = 0.0) -> None:
    member = m.assign(name, f"{name}:1")
    member.stage = stage
    member.online = member.announced = member.serving = True
    if rate:
        member.telemetry = control_pb2.Telemetry(compute_samples_per_second=rate)


def test_a_stage_without_replicas_gets_the_slowest_node_of_the_fullest_stage() -> None:
    m = make(3)
    _serving(m, "a", 0, rate=50.0)
    _serving(m, "b", 0, rate=20.0)
    _serving(m, "c", 1)
    _serving(m, "d", 2)
    assert m.heal() is None  # every stage is covered
    m.members["d"].online = False
    order = m.heal()
    assert order is not None and (order.node_id, order.from_stage, order.to_stage) == ("b", 0, 2)
    assert "stage 2 lost its last replica" in order.reason
    b = m.members["b"]
    assert b.stage == 2 and not b.serving
    plan = m.plan()
    assert [r.node_id for r in plan.stages[0].replicas] == ["a"]  # out of its old stage
    assert [(mv.node_id, mv.stage, mv.order) for mv in plan.moves] == [("b", 2, 1)]
    assert m.heal() is None  # b is on its way: no second move
    b.serving = True  # it fetched the stage's state and is Ready
    assert list(m.plan().moves) == [] and m.covered()


def test_healing_never_empties_a_stage() -> None:
    m = make(3)
    _serving(m, "a", 0)
    _serving(m, "b", 1)
    assert m.heal() is None  # no stage has a second replica to give
    assert [x.stage for x in m.live()] == [0, 1]


def _applied(m: Membership, step: int, **digests: str) -> None:
    for name, digest in digests.items():
        m.members[name].last_step, m.members[name].param_digest = step, digest


def test_a_replica_whose_parameters_differ_from_its_stage_majority_is_re_synced() -> None:
    m = make(2)
    for name, stage in (("a", 0), ("b", 0), ("c", 0), ("d", 1), ("e", 1)):
        _serving(m, name, stage)
    _applied(m, 5, a="x", b="y", c="x", d="z", e="z")
    (order,) = m.diverged(5)
    assert (order.node_id, order.from_stage, order.to_stage) == ("b", 0, 0)
    assert "after step 5 (y) differ from 2 of its stage's 3 replicas' (x)" in order.reason
    b = m.members["b"]
    assert not b.serving and [x.node_id for x in m.replicas(0)] == ["a", "c"]
    # Agreement, an older step, or a replica that has not reported: nothing to do.
    assert m.diverged(5) == []
    _applied(m, 6, a="x", c="x", d="z")
    _applied(m, 5, e="w")
    assert m.diverged(6) == []


def test_of_two_replicas_that_differ_the_one_in_the_swarm_longer_is_kept() -> None:
    m = make(1)
    _serving(m, "late", 0)
    _serving(m, "early", 0)
    m.members["early"].joined_at = m.members["late"].joined_at - 10
    _applied(m, 3, late="x", early="y")
    (order,) = m.diverged(3)
    assert order.node_id == "late" and [x.node_id for x in m.replicas(0)] == ["early"]


def test_a_moved_node_is_not_judged_by_the_digest_of_the_stage_it_left() -> None:
    m = make(2)
    for name, stage in (("a", 0), ("b", 0), ("c", 1)):
        _serving(m, name, stage)
    _applied(m, 4, a="x", b="x", c="z")
    b = m.members["b"]
    m.move(b, 1, "moved by the operator")
    b.serving, b.last_step = True, 4  # it serves stage 1 from step 5 (Ready, no digest)
    assert m.diverged(4) == []
