"""The step protocol's bookkeeping: every leased sample ends committed or leased again."""

from __future__ import annotations

from swarmpipe.coordinator.step_protocol import Phase, StepProtocol


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    steps: int = 2, batch: int = 10, micro: int = 4, clock: Clock | None = None
) -> StepProtocol:
    p = StepProtocol(
        total_steps=steps,
        global_batch=batch,
        microbatch=micro,
        lease_timeout_s=30.0,
        clock=clock or Clock(),
    )
    p.start()
    return p


def test_leases_cover_the_step_exactly_once() -> None:
    p = make()
    leases = []
    while (lease := p.lease("h")) is not None:
        leases.append(lease)
    assert [(x.sample_start, x.sample_count) for x in leases] == [(0, 4), (4, 4), (8, 2)]
    for x in leases:
        assert p.commit("h", x.lease_id, 1.0, x.sample_count) is None
    assert p.phase is Phase.APPLY
    assert p.counters.leased == p.counters.committed == 10


def test_step_advances_only_after_every_node_acks() -> None:
    p = make()
    while (lease := p.lease("h")) is not None:
        p.commit("h", lease.lease_id, 0.0, 1)
    p.await_acks({"a", "b"})
    assert not p.ack("a", 0)
    assert p.lease("h") is None  # nothing leases during APPLY
    assert p.ack("b", 0)
    assert p.phase is Phase.TRAINING and p.step == 1
    assert p.lease("h").sample_start == 10  # type: ignore[union-attr]


def test_lost_node_leases_are_replayed_and_late_commit_is_a_duplicate() -> None:
    p = make()
    first = p.lease("dead")
    assert first is not None
    assert p.node_lost("dead") == 4
    again = p.lease("alive")
    assert again is not None and again.replay and again.sample_start == first.sample_start
    assert p.counters.replayed == 4
    assert p.commit("dead", first.lease_id, 0.0, 1) is not None
    assert p.counters.duplicates == 4


def test_expired_lease_is_leased_again() -> None:
    clock = Clock()
    p = make(clock=clock)
    lease = p.lease("slow")
    assert lease is not None
    clock.now = 31.0
    again = p.lease("other")
    assert again is not None and again.sample_start == lease.sample_start and again.replay


def test_run_finishes_with_nothing_lost() -> None:
    p = make(steps=2)
    for step in range(2):
        while (lease := p.lease("h")) is not None:
            p.commit("h", lease.lease_id, 0.0, 1)
        p.await_acks({"h"})
        p.ack("h", step)
    assert p.phase is Phase.DONE
    assert p.counters.lost == 0 and p.counters.committed == 20


def test_commit_of_unknown_or_foreign_lease_is_refused() -> None:
    p = make()
    lease = p.lease("a")
    assert lease is not None
    assert "unknown" in (p.commit("a", 999, 0.0, 1) or "")
    assert "belongs to a" in (p.commit("b", lease.lease_id, 0.0, 1) or "")


def test_pause_stops_leasing_until_resumed() -> None:
    p = make()
    p.pause()
    assert p.lease("h") is None
    p.start()
    assert p.lease("h") is not None


def _finish_training(p: StepProtocol) -> None:
    while (lease := p.lease("h")) is not None:
        assert p.commit("h", lease.lease_id, 1.0, lease.sample_count) is None
    assert p.phase is Phase.APPLY


def test_target_step_is_the_next_one_while_applying() -> None:
    p = make(steps=3)
    assert p.target_step == 0
    _finish_training(p)
    assert p.target_step == 1


def test_a_joiner_hold_keeps_the_next_step_closed_until_dropped() -> None:
    clock = Clock()
    p = make(steps=3, clock=clock)
    _finish_training(p)
    p.await_acks({"a"})
    p.hold("joiner", 30.0)
    assert not p.ack("a", 0)
    assert p.phase is Phase.APPLY and p.held() == 30.0
    p.drop_hold("joiner")
    assert p.try_advance() and p.step == 1 and p.phase is Phase.TRAINING


def test_a_hold_expires_and_dies_with_its_node() -> None:
    clock = Clock()
    p = make(steps=3, clock=clock)
    _finish_training(p)
    p.hold("slow", 30.0)
    p.hold("gone", 60.0)
    p.node_lost("gone")
    assert not p.try_advance()
    clock.now = 30.5
    assert p.held() is None
    assert p.try_advance() and p.step == 1


def test_no_hold_delays_the_end_of_the_run() -> None:
    p = make(steps=1)
    _finish_training(p)
    p.hold("joiner", 30.0)
    assert p.try_advance() and p.phase is Phase.DONE
