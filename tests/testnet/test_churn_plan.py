"""The testnet's churn scenario: schedule parsing and seeded random kills (no processes)."""

from __future__ import annotations

import re

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.testnet.churn import ChurnEvent, ChurnPlan, ChurnRecord, parse_schedule


def test_schedule_parses_times_and_steps_in_order() -> None:
    events = parse_schedule("kill n1@8s, start n1@15.5s,kill n4@step12 , start fresh-1@step14")
    assert events == [
        ChurnEvent("kill", "n1", seconds=8.0),
        ChurnEvent("start", "n1", seconds=15.5),
        ChurnEvent("kill", "n4", after_steps=12),
        ChurnEvent("start", "fresh-1", after_steps=14),
    ]
    assert parse_schedule("") == []


@pytest.mark.parametrize("bad", ["stop n1@3s", "kill n1", "kill n1@3", "kill @3s", "kill n/1@3s"])
def test_a_bad_schedule_item_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ConfigError, match="must look like 'kill NODE@8s'"):
        parse_schedule(f"kill n0@1s, {bad}")


def test_events_come_due_by_time_or_by_steps_once() -> None:
    plan = ChurnPlan(parse_schedule("kill n1@8s, start n1@step3, kill n2@step1"))
    assert plan.due(1.0, 0) == []
    assert [e.node for e in plan.due(2.0, 1)] == ["n2"]
    assert [(e.action, e.node) for e in plan.due(9.0, 3)] == [("kill", "n1"), ("start", "n1")]
    assert plan.due(100.0, 100) == [] and not plan.active


def _random_run(seed: int) -> list[tuple[float, str | None]]:
    plan = ChurnPlan([], random_rate_per_min=60.0, seed=seed, downtime_s=2.0)
    picks = []
    for tick in range(200):
        now = tick * 0.25
        victim = plan.random_victim(now, ["a", "b", "c", "d"])
        if victim is not None:
            picks.append((now, victim))
        plan.due(now, 0)  # restarts are handed out like scheduled events
    return picks


def test_random_kills_follow_the_seed_and_schedule_restarts() -> None:
    first = _random_run(3)
    assert first == _random_run(3) and first != _random_run(4)
    assert 20 <= len(first) <= 90  # about one a second over 50 s
    plan = ChurnPlan([], random_rate_per_min=60.0, seed=3, downtime_s=2.0)
    victim = None
    now = 0.0
    while victim is None:
        now += 0.25
        victim = plan.random_victim(now, ["a", "b"])
    assert plan.due(now + 1.9, 0) == []
    assert plan.due(now + 2.0, 0) == [ChurnEvent("start", victim, seconds=now + 2.0)]
    assert ChurnPlan([], random_rate_per_min=600.0, seed=1).random_victim(60.0, []) == ""


def test_link_items_parse_with_mbit_or_off_for_a_node_or_all() -> None:
    events = parse_schedule("link n1=2@step8, link all=0.5@20s, link n1=off@step20, link n2=0@3s")
    assert events == [
        ChurnEvent("link", "n1", after_steps=8, mbit=2.0),
        ChurnEvent("link", "all", seconds=20.0, mbit=0.5),
        ChurnEvent("link", "n1", after_steps=20, mbit=None),
        ChurnEvent("link", "n2", seconds=3.0, mbit=0.0),
    ]
    assert [e.label for e in events] == [
        "link n1=2@step8",
        "link all=0.5@20s",
        "link n1=off@step20",
        "link n2=0@3s",
    ]
    plan = ChurnPlan(events)
    assert [e.label for e in plan.due(0.0, 8)] == ["link n1=2@step8"]


@pytest.mark.parametrize("bad", ["link n1@step8", "link n1=fast@3s", "link n1=2", "link =2@3s"])
def test_a_bad_link_item_is_named(bad: str) -> None:
    with pytest.raises(ConfigError, match=f"--churn item '{bad}' must look like .* 'link NODE=2@"):
        parse_schedule(f"link n0=1@1s, {bad}")


@pytest.mark.parametrize("mbit", ["0.0000001", "99999999"])
def test_a_link_limit_out_of_range_is_named(mbit: str) -> None:
    item = f"link n1={mbit}@step2"
    with pytest.raises(ConfigError, match=f"--churn item '{item}': .* is out of range"):
        parse_schedule(item)


def test_link_events_are_recorded_with_their_mbit() -> None:
    record = ChurnRecord("link", "all", "step8", 3.5, 8, -1, "limited to 2 Mbit/s", mbit=2.0)
    assert record.as_dict()["mbit"] == 2.0
    assert ChurnRecord("kill", "n1", "3s", 3.0, 1, 0, "killed").as_dict()["mbit"] is None


def test_profile_items_set_the_keys_they_name_and_keep_their_commas() -> None:
    events = parse_schedule("kill n0@1s, profile n1=mbit:5,slow:2@20s, profile n2=slow:3@step4")
    assert events == [
        ChurnEvent("kill", "n0", seconds=1.0),
        ChurnEvent("profile", "n1", seconds=20.0, mbit=5.0, slow=2.0),
        ChurnEvent("profile", "n2", after_steps=4, slow=3.0),
    ]
    assert [e.label for e in events[1:]] == [
        "profile n1=mbit:5,slow:2@20s",
        "profile n2=slow:3@step4",
    ]


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("profile n1=fast:2@3s", "'fast:2' is not mbit:NUMBER or slow:NUMBER"),
        ("profile n1=slow:0.5@3s", "slow:0.5 is out of range: give 1 to 1000"),
        ("profile n1=mbit:-1@3s", "mbit:-1 is out of range"),
        ("profile n1=slow:x@3s", "'slow:x' is not mbit:NUMBER"),
        ("profile n1=slow:2", "must look like"),
    ],
)
def test_a_bad_profile_item_is_named(bad: str, words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_schedule(bad)
