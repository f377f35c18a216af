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
    # Every step is applied: the run saves its final state before it is done.
    assert p.phase is Phase.SAVING and p.step == 2
    assert p.lease("h") is None
    p.finish()
    assert p.phase is Phase.DONE
    assert p.counters.lost == 0 and p.counters.committed == 20


def test_finish_ends_only_a_saving_run() -> None:
    p = make(steps=2)
    p.finish()  # still training: nothing to finish
    assert p.phase is Phase.TRAINING


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


def _run_eval_protocol(p: StepProtocol) -> list[tuple[int, bool, int, int]]:
    """Drive a protocol to DONE; return every lease as (step, eval, start, count)."""
    seen = []
    while p.phase is not Phase.DONE:
        if p.phase is Phase.SAVING:
            p.finish()
            continue
        while (lease := p.lease("h")) is not None:
            seen.append((lease.step, lease.eval, lease.sample_start, lease.sample_count))
            loss = 2.0 * lease.sample_count if lease.eval else 1.0
            assert p.commit("h", lease.lease_id, loss, lease.sample_count) is None
        if p.phase is Phase.APPLY:
            p.await_acks({"h"})
            p.ack("h", p.step)
    return seen


def test_evaluation_rounds_every_few_steps_and_after_the_last() -> None:
    p = StepProtocol(
        total_steps=5, global_batch=8, microbatch=4, lease_timeout_s=30.0,
        eval_every=2, eval_samples=6, clock=Clock(),
    )  # fmt: skip
    p.start()
    seen = _run_eval_protocol(p)
    evals = [(step, start, count) for step, is_eval, start, count in seen if is_eval]
    # Steps 0, 2 and 4 evaluate before training; the round after step 4 (step 5) only evaluates.
    assert evals == [(s, start, count) for s in (0, 2, 4, 5) for start, count in ((0, 4), (4, 2))]
    assert [step for step, is_eval, *_ in seen if not is_eval] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # Evaluation samples are not training samples: the counters see training only.
    assert p.counters.leased == p.counters.committed == 40 and p.counters.lost == 0
    measured = [s for s in p.history if s.eval_finished_at is not None]
    assert [s.step for s in measured] == [0, 2, 4, 5]
    assert all(s.eval_loss == 2.0 and s.eval_tokens == 6 for s in measured)
    assert p.history[-1].samples == 0  # the final round trained on nothing


def test_a_lost_evaluation_lease_is_leased_again_as_evaluation() -> None:
    p = StepProtocol(
        total_steps=1, global_batch=4, microbatch=4, lease_timeout_s=30.0,
        eval_every=1, eval_samples=4, clock=Clock(),
    )  # fmt: skip
    p.start()
    first = p.lease("dead")
    assert first is not None and first.eval
    p.node_lost("dead")
    again = p.lease("alive")
    assert again is not None and again.eval and again.sample_start == first.sample_start
    assert p.counters.replayed == 0 and p.outstanding_samples == 0
    assert p.commit("dead", first.lease_id, 0.0, 1) is not None
    assert p.counters.duplicates == 0


def test_without_evaluation_no_evaluation_leases() -> None:
    p = make(steps=2)
    assert not any(is_eval for _, is_eval, *_ in _run_eval_protocol(p))
    assert all(s.eval_finished_at is None for s in p.history)


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
    assert p.try_advance() and p.phase is Phase.SAVING


def test_the_nodes_owing_an_apply_are_overdue_only_past_the_bound() -> None:
    clock = Clock()
    p = make(steps=3, clock=clock)
    assert p.overdue(10.0) == frozenset()  # training: nothing is owed
    _finish_training(p)
    p.await_acks({"a", "b"})
    clock.now = 10.0
    assert p.overdue(10.0) == frozenset() and p.applying_for() == 10.0
    assert not p.ack("a", 0)
    clock.now = 10.5
    assert p.overdue(10.0) == {"b"}
    p.node_lost("b")
    assert p.overdue(10.0) == frozenset() and p.try_advance() and p.step == 1
    assert p.applying_for() == 0.0


def test_a_held_apply_waits_for_every_reduce_then_goes_on() -> None:
    clock = Clock()
    p = make(steps=3, clock=clock)
    _finish_training(p)
    p.hold_apply({"a", "b", "x"})
    assert p.apply_held and p.reduce_owed == {"a", "b", "x"}
    assert not p.try_advance()  # nobody steps while it is held
    assert not p.reduced("a", 0)
    p.node_lost("x")  # gone before its reduce: not waited for, not awaited for an ack
    assert p.lost_in_hold == {"x"}  # its share may be missing: the service may begin again
    clock.now = 11.0
    assert p.overdue(10.0) == {"b"}  # the reduce is bounded like the acknowledgement
    assert p.reduced("b", 0) and p.awaiting == {"a", "b"}
    p.node_lost("a")  # after its reduce: the others hold its share
    assert p.lost_in_hold == {"x"}
    p.release_apply({"a", "b"})
    assert not p.apply_held and p.awaiting == {"a", "b"}
    assert not p.ack("a", 0) and p.ack("b", 0)
    assert p.phase is Phase.TRAINING and p.step == 1 and p.attempt == 0


def test_a_held_apply_taken_back_leases_the_same_samples_again() -> None:
    p = make(steps=3)
    leases = []
    while (lease := p.lease("h")) is not None:
        leases.append(lease)
        assert p.commit("h", lease.lease_id, 1.0, lease.sample_count) is None
    p.hold_apply({"a", "b", "x"})
    p.node_lost("x")
    assert p.reduced("a", 0) is False and p.reduced("b", 0)
    p.begin_again()
    assert p.phase is Phase.TRAINING and p.step == 0 and p.attempt == 1
    assert not p.apply_held and p.awaiting == frozenset()
    assert p.counters.committed == 0  # the step's samples are not in any step yet
    again = []
    while (lease := p.lease("a")) is not None:
        again.append(lease)
    assert [(x.sample_start, x.sample_count) for x in again] == [
        (x.sample_start, x.sample_count) for x in leases
    ]
    assert all(x.replay for x in again) and p.counters.replayed == 10
    # A commit of the step taken back is refused: its gradient is in no sum now.
    assert p.commit("h", leases[0].lease_id, 0.0, 1) is not None
    for x in again:
        assert p.commit("a", x.lease_id, 0.0, 1) is None
    p.await_acks({"a", "b"})
    assert not p.ack("a", 0) and p.ack("b", 0)
    assert p.step == 1 and p.attempt == 0  # a new step starts at attempt 0
    assert p.counters.committed == 10 and p.counters.lost == 0
