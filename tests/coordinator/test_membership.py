"""Placement and the serving/syncing split the plan is built from."""

from __future__ import annotations

from swarmpipe.coordinator.membership import Membership


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
