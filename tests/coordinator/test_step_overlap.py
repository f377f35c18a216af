"""train.step_overlap in the step protocol: which step opens early, what each trains on."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from swarmpipe.config import load_config
from swarmpipe.coordinator.membership import Membership
from swarmpipe.coordinator.state_db import Extras, StateDB
from swarmpipe.coordinator.step_protocol import Lease, Phase, StepProtocol
from swarmpipe.protos import control_pb2, coordinator_pb2
from tests.coordinator.test_apply_bound import NODES, Swarm


def make(steps: int = 6, drain_every: int = 0, eval_every: int = 0, depth: int = 1) -> StepProtocol:
    p = StepProtocol(
        total_steps=steps,
        global_batch=8,
        microbatch=4,
        lease_timeout_s=30.0,
        eval_every=eval_every,
        eval_samples=4 if eval_every else 0,
        depth=depth,
        drain_every=drain_every,
        clock=lambda: 0.0,
    )
    p.start()
    return p


def _saved_and_loaded(
    p: StepProtocol, tmp_path: Path, settings: list[str], again: StepProtocol
) -> StepProtocol:
    """`p` saved to a state database and loaded into `again`, a fresh coordinator's protocol
    that has not started (a restart)."""
    db = StateDB.create(tmp_path / "c.sqlite", load_config(None, settings))
    db.save(p, Membership(num_stages=2, activation_codec=1, gradient_codec=1), Extras())
    db.close()
    again.phase, again._opened = Phase.WAITING, False
    again.history.clear()
    StateDB.open(tmp_path / "c.sqlite").load(again, Membership(2, 1, 1))
    return again


def lease_all(p: StepProtocol) -> list[Lease]:
    leases = []
    while (lease := p.lease("h")) is not None:
        leases.append(lease)
    return leases


def commit(p: StepProtocol, leases: list[Lease]) -> None:
    for x in leases:
        assert p.commit("h", x.lease_id, 1.0, 4) is None


def apply_everywhere(p: StepProtocol) -> None:
    """The service's part at APPLY: name the nodes, let them acknowledge."""
    assert p.phase is Phase.APPLY
    p.await_acks({"a"})
    assert p.ack("a", p.step)


def test_the_next_step_opens_with_the_current_one_and_trains_one_version_behind() -> None:
    p = make()
    assert p.trains_on(0) == 0  # step 0 is a drain point
    assert p.open_ahead(settled=True) and p.ahead == 1
    assert p.trains_on(1) == 0
    leases = lease_all(p)
    # The current step's leases first, then the step ahead's.
    assert [(x.step, x.sample_start) for x in leases] == [(0, 0), (0, 4), (1, 8), (1, 12)]
    commit(p, leases[:2])
    assert (p.phase, p.step) == (Phase.APPLY, 0)
    apply_everywhere(p)
    # Step 1 (opened ahead) is the current step now; step 2 may open, on step 1's version.
    assert (p.phase, p.step, p.ahead) == (Phase.TRAINING, 1, None)
    assert p.open_ahead(settled=True) and p.trains_on(2) == 1
    commit(p, leases[2:])
    assert p.phase is Phase.APPLY and p.step == 1
    # While step 1 is applied, step 2 still leases.
    assert [x.step for x in lease_all(p)] == [2, 2]


def test_a_step_ahead_that_finished_first_is_applied_as_soon_as_it_is_current() -> None:
    p = make()
    p.open_ahead(settled=True)
    leases = lease_all(p)
    commit(p, leases[2:])  # step 1's samples come back before step 0's
    assert p.phase is Phase.TRAINING and p.step == 0
    commit(p, leases[:2])
    p.await_acks({"a"})
    assert p.ack("a", 0)
    # Step 1 is all committed: it is in APPLY, and does not move on before its nodes are named.
    assert (p.phase, p.step) == (Phase.APPLY, 1)
    assert not p.acks_set and not p.try_advance()
    apply_everywhere(p)
    assert p.step == 2 and p.trains_on(2) == 2  # nothing was ahead: a drain point


def test_drain_points_checkpoints_unsettled_swarm_the_last_step_and_a_restart() -> None:
    p = make(steps=4, drain_every=2)
    assert not p.open_ahead(settled=False)  # a node on its way in: no step opens early
    assert p.open_ahead(settled=True)
    commit(p, lease_all(p))
    apply_everywhere(p)
    # Step 2 is a checkpoint step: it opens only as the current step, on the newest version.
    assert not p.open_ahead(settled=True)
    apply_everywhere(p)
    assert (p.step, p.trains_on(2)) == (2, 2)
    assert p.open_ahead(settled=True) and p.ahead == 3
    commit(p, lease_all(p))
    apply_everywhere(p)
    assert p.step == 3 and not p.open_ahead(settled=True)  # no step 4 to open
    # After a restart nothing opens early until a step opened as a drain point.
    q = make(steps=4)
    q.restore(
        step=1,
        phase=Phase.TRAINING,
        opened=True,
        next_lease_id=1,
        eval_pending=0,
        awaiting=set(),
        pending=[],
        leases=[],
    )
    assert not q.open_ahead(settled=True)


def test_a_joiner_is_sent_to_the_first_step_that_trains_on_what_it_downloads() -> None:
    p = make()
    assert p.target_step == 0
    p.open_ahead(settled=True)
    leases = lease_all(p)
    commit(p, leases[:2])
    apply_everywhere(p)  # step 1 is current and trains on version 0
    assert p.target_step == 2
    p.open_ahead(settled=True)
    assert p.target_step == 3  # step 2 is open ahead too, on version 1
    commit(p, leases[2:])
    assert p.phase is Phase.APPLY and p.target_step == 3


def test_redo_as_drain_starts_the_current_step_again_on_the_newest_parameters() -> None:
    p = make()
    p.open_ahead(settled=True)
    leases = lease_all(p)
    commit(p, leases[:2])
    apply_everywhere(p)
    p.open_ahead(settled=True)
    step1 = leases[2]
    commit(p, [step1])
    committed = p.counters.committed
    assert p.redo_as_drain()
    assert (p.step, p.trains_on(1), p.ahead) == (1, 1, None)
    assert p.counters.committed == committed - 4
    # The late commit of a lease of the old version is refused; its samples lease again.
    assert p.commit("h", leases[3].lease_id, 1.0, 4) is not None
    again = lease_all(p)
    assert [(x.step, x.sample_start, x.replay) for x in again] == [(1, 8, True), (1, 12, True)]
    assert not p.redo_as_drain()  # already on the newest parameters


def test_evaluation_of_a_step_opened_ahead_measures_the_version_it_trains_on() -> None:
    p = make(eval_every=1)
    p.open_ahead(settled=True)
    leases = lease_all(p)
    evals = [x for x in leases if x.eval]
    assert [x.step for x in evals] == [0, 1]
    assert p.trains_on(1) == 0
    commit(p, leases)
    assert p.stats_of(1) is not None and p.stats_of(1).eval_finished_at is not None  # type: ignore[union-attr]


def test_without_overlap_no_step_opens_early() -> None:
    p = StepProtocol(total_steps=3, global_batch=8, microbatch=4, lease_timeout_s=30.0)
    p.start()
    assert not p.open_ahead(settled=True)
    assert p.trains_on(0) == 0 and p.ahead is None


async def test_a_joiner_enters_only_at_a_step_on_the_newest_parameters(tmp_path: Path) -> None:
    # The coordinator in-process (test_apply_bound's harness), train.step_overlap on.
    swarm = Swarm(tmp_path, "train.step_overlap=true")
    service = swarm.service
    p = service.protocol
    await swarm.start()
    assert (p.step, p.ahead, p.trains_on(1)) == (0, 1, 0)  # settled: step 1 opened early
    state = control_pb2.StepState.FromString(
        next(x for t, x in reversed(swarm.broker.published) if t == service.topics.step)
    )
    assert (state.step, state.ahead, state.trains_on) == (0, 1, 0)
    head = next(n for n in NODES if service.membership.members[n].stage == 0)
    leases = []
    while True:
        reply = await service.Lease(
            coordinator_pb2.LeaseRequest(node_id=head, wait_seconds=0), swarm.ctx(head)
        )
        if reply.status != reply.STATUS_GRANTED:
            break
        leases.append(reply)
    assert {(x.step, x.trains_on) for x in leases} == {(0, 0), (1, 0)}

    # A fifth node joins: until it serves, no step opens early.
    await swarm.join("n4")
    await swarm.presence("n4", True)
    for x in leases:
        commit = coordinator_pb2.CommitRequest(
            node_id=head, lease_id=x.lease_id, loss_sum=1.0, tokens=4
        )
        assert (await service.Commit(commit, swarm.ctx(head))).accepted
    assert (p.phase, p.step) == (Phase.APPLY, 0)
    info = await service.SyncInfo(coordinator_pb2.SyncInfoRequest(node_id="n4"), swarm.ctx("n4"))
    # Step 1 trains on version 0 and step 2 does not exist yet: n4 fetches the state of 2.
    assert info.target == 2
    reply = await swarm.ready("n4", 2)
    assert reply.status == reply.STATUS_WAIT
    for node in NODES:
        await swarm.step_done(node, 0)
    # Step 1 was all committed: it is applied at once, and nothing opened ahead of it.
    assert (p.phase, p.step, p.ahead) == (Phase.APPLY, 1, None)
    for node in NODES:
        await swarm.step_done(node, 1)
    # Step 2 opened as a drain point, with n4 in the plan; with it serving, step 3 opens early.
    assert (p.step, p.trains_on(2)) == (2, 2)
    assert service.membership.members["n4"].serving
    assert (p.ahead, p.trains_on(3)) == (3, 2)


def test_a_restarted_coordinator_keeps_the_step_open_ahead(tmp_path: Path) -> None:
    p = make(eval_every=1)
    p.open_ahead(settled=True)
    leases = lease_all(p)
    commit(p, [x for x in leases if x.step == 0])  # step 0 in APPLY, step 1's leases out
    p.await_acks({"a"})
    first_of_step1 = next(x for x in leases if x.step == 1 and not x.eval)
    assert p.release("h", first_of_step1.lease_id)
    again = _saved_and_loaded(p, tmp_path, [], make(eval_every=1))
    assert (again.phase, again.step, again.ahead) == (Phase.APPLY, 0, 1)
    assert [again.trains_on(s) for s in (0, 1)] == [0, 0]
    assert [(r.step, r.start) for r in again.pending_ranges()] == [(1, 8)]
    # The heads' open leases of step 1 still commit; step 1 ends once they and the replay do.
    assert again.ack("a", 0) and (again.phase, again.step) == (Phase.TRAINING, 1)
    commit(again, [x for x in leases if x.step == 1 and x is not first_of_step1])
    commit(again, lease_all(again))
    assert again.phase is Phase.APPLY and again.current.eval_finished_at is not None
    # The first step opened after the restart is a drain point.
    assert not again.open_ahead(settled=True)


async def test_a_stage_left_without_replicas_restarts_an_overlapped_step(tmp_path: Path) -> None:
    swarm = Swarm(tmp_path, "train.step_overlap=true")
    service = swarm.service
    p = service.protocol
    await swarm.start()
    head = next(n for n in NODES if service.membership.members[n].stage == 0)

    async def lease() -> coordinator_pb2.LeaseReply:
        request = coordinator_pb2.LeaseRequest(node_id=head, wait_seconds=0)
        reply: coordinator_pb2.LeaseReply = await service.Lease(request, swarm.ctx(head))
        return reply

    leases = [await lease() for _ in range(8)]
    for x in leases:
        if x.step == 0:
            commit = coordinator_pb2.CommitRequest(
                node_id=head, lease_id=x.lease_id, loss_sum=1.0, tokens=4
            )
            assert (await service.Commit(commit, swarm.ctx(head))).accepted
    for node in NODES:
        await swarm.step_done(node, 0)
    # Step 1 (opened early, on version 0) is current and step 2 is ahead.
    assert (p.phase, p.step, p.trains_on(1), p.ahead) == (Phase.TRAINING, 1, 0, 2)
    for node in NODES:
        if service.membership.members[node].stage == 1:
            await swarm.presence(node, False)
    # Stage 1's newcomer will hold version 1 only: step 1 starts again on it.
    assert (p.step, p.trains_on(1), p.ahead) == (1, 1, None)
    late = next(x for x in leases if x.step == 1)
    commit = coordinator_pb2.CommitRequest(
        node_id=head, lease_id=late.lease_id, loss_sum=1.0, tokens=4
    )
    assert not (await service.Commit(commit, swarm.ctx(head))).accepted
    assert p.target_step == 1


async def test_a_joiner_that_was_away_is_not_promoted_into_a_step_opened_early(
    tmp_path: Path,
) -> None:
    swarm = Swarm(tmp_path, "train.step_overlap=true")
    service = swarm.service
    p = service.protocol
    await swarm.start()
    await swarm.join("n4")
    await swarm.presence("n4", True)
    await swarm.train_step()  # step 0 and the step ahead's leases all committed
    assert (p.phase, p.step, p.target_step) == (Phase.APPLY, 0, 2)
    assert (await swarm.ready("n4", 2)).status == coordinator_pb2.ReadyReply.STATUS_WAIT
    await swarm.presence("n4", False)  # away: the swarm is settled without it
    for node in NODES:
        await swarm.step_done(node, 0)
    assert (p.step, p.ahead, p.trains_on(2)) == (1, 2, 1)
    await swarm.presence("n4", True)
    head = next(n for n in NODES if service.membership.members[n].stage == 0)
    while p.phase is not Phase.APPLY:
        x = await service.Lease(
            coordinator_pb2.LeaseRequest(node_id=head, wait_seconds=0), swarm.ctx(head)
        )
        assert x.status == x.STATUS_GRANTED
        commit = coordinator_pb2.CommitRequest(
            node_id=head, lease_id=x.lease_id, loss_sum=1.0, tokens=4
        )
        assert (await service.Commit(commit, swarm.ctx(head))).accepted
    for node in NODES:
        await swarm.step_done(node, 1)
    # Step 2 trains on version 1; n4 holds version 2: it is not let in (its wait ended when
    # it went offline, and the step opened early meanwhile), and fetches again.
    member = service.membership.members["n4"]
    assert p.step == 2 and not member.serving and member.ready_step == -1
    assert (await swarm.ready("n4", 2)).status == coordinator_pb2.ReadyReply.STATUS_STALE


# -- deeper overlap (train.step_overlap = k > 1) ---------------------------------


def open_all(p: StepProtocol) -> int:
    opened = 0
    while p.open_ahead(settled=True):
        opened += 1
    return opened


@pytest.mark.parametrize("depth", [2, 3])
def test_at_depth_k_k_steps_open_ahead_on_the_newest_applied_parameters(depth: int) -> None:
    p = make(steps=12, depth=depth)
    assert open_all(p) == depth and p.steps_ahead == depth and p.ahead == depth
    assert [p.trains_on(s) for s in range(depth + 1)] == [0] * (depth + 1)
    leases = lease_all(p)
    # Step order: the current step's leases first, then each step ahead's in turn.
    assert [x.step for x in leases] == sorted(x.step for x in leases)
    # The steps ahead come back first: nothing is applied out of order.
    commit(p, [x for x in leases if x.step > 0])
    assert (p.phase, p.step) == (Phase.TRAINING, 0)
    commit(p, [x for x in leases if x.step == 0])
    applied = []
    while p.step < 12 and p.phase is Phase.APPLY:
        applied.append(p.step)
        apply_everywhere(p)
        # Each apply lets exactly one more step open, on the parameters applied everywhere.
        opened = open_all(p)
        assert p.steps_ahead <= depth
        if opened:
            assert p.trains_on(p.ahead or -1) == p.step
        commit(p, lease_all(p))
        if p.phase is Phase.SAVING:
            break
    assert applied == list(range(12))
    # In the steady state every step trains on the parameters `depth` steps old.
    assert [p.trains_on(s) for s in range(12)] == [max(0, s - depth) for s in range(12)]
    assert p.counters.committed == 12 * 8 and p.counters.replayed == 0


@pytest.mark.parametrize("seed", range(5))
def test_at_depth_3_random_commit_orders_keep_the_rule(seed: int) -> None:
    # Whatever order commits come back in: at most depth + 1 steps open, each trains on
    # parameters at most `depth` steps old and opened once the step `depth + 1` before it was
    # applied everywhere, and steps are applied one at a time, in order.
    rng = random.Random(seed)
    depth, steps = 3, 10
    p = make(steps=steps, depth=depth)
    applied: list[int] = []
    opened_at: dict[int, int] = {0: 0}  # step -> steps applied everywhere when it opened
    out: list[Lease] = []
    while p.phase not in (Phase.SAVING, Phase.DONE):
        while p.open_ahead(settled=rng.random() < 0.8):
            opened_at[p.ahead or -1] = len(applied)
        assert p.steps_ahead <= depth
        out += lease_all(p)
        if p.phase is Phase.APPLY and (not out or rng.random() < 0.5):
            applied.append(p.step)
            apply_everywhere(p)
            opened_at.setdefault(p.step, len(applied))
            continue
        if out:
            x = out.pop(rng.randrange(len(out)))
            assert p.commit("h", x.lease_id, 1.0, 4) is None
    assert applied == list(range(steps))
    for s in range(steps):
        assert s - depth <= p.trains_on(s) <= s
        assert p.trains_on(s) == opened_at[s]  # the newest parameters applied everywhere
        assert opened_at[s] >= s - depth  # step s - depth - 1 was applied
    assert p.counters.committed == steps * 8


def test_at_depth_3_a_checkpoint_step_and_the_last_step_bound_the_steps_ahead() -> None:
    p = make(steps=6, drain_every=4, depth=3)
    assert open_all(p) == 3  # steps 1, 2, 3
    commit(p, lease_all(p))
    for _ in range(3):
        apply_everywhere(p)
        assert open_all(p) == 0  # step 4 is a checkpoint step: it opens only as the current
    apply_everywhere(p)
    assert (p.step, p.trains_on(4), p.steps_ahead) == (4, 4, 0)
    assert open_all(p) == 1  # only step 5 is left


def test_at_depth_3_redo_as_drain_closes_every_step_ahead_and_replays_them() -> None:
    p = make(steps=8, depth=3)
    open_all(p)
    leases = lease_all(p)
    commit(p, [x for x in leases if x.step == 0])
    apply_everywhere(p)  # step 1 current (on version 0); steps 2, 3 ahead; 4 opens on 1
    assert open_all(p) == 1 and (p.step, p.ahead, p.trains_on(4)) == (1, 4, 1)
    commit(p, [x for x in leases if x.step == 2][:1])  # one of step 2's is committed
    out = [x for x in leases if x.step in (1, 3)]  # step 1's and 3's still out; 4's queued
    assert p.redo_as_drain()
    assert (p.step, p.trains_on(1), p.ahead, p.steps_ahead) == (1, 1, None, 0)
    assert p.counters.committed == 8  # step 0's only
    for x in out:  # late commits of the old versions are refused
        assert p.commit("h", x.lease_id, 1.0, 4) is not None
    assert {r.step for r in p.pending_ranges()} == {1}
    # The steps closed open again, on version 1; what was leased before is a replay.
    assert open_all(p) == 3 and [p.trains_on(s) for s in (2, 3, 4)] == [1, 1, 1]
    again = lease_all(p)
    assert [(x.step, x.replay) for x in again] == [
        (1, True),
        (1, True),
        (2, True),
        (2, True),
        (3, True),
        (3, True),
        (4, False),
        (4, False),
    ]
    commit(p, again)
    # Every sample counts once: what was leased again is all replay.
    assert p.counters.leased - p.counters.replayed == p.counters.committed == 5 * 8


def test_at_depth_2_a_joiner_targets_the_first_step_on_what_it_downloads() -> None:
    p = make(depth=2)
    open_all(p)  # step 0 (a drain point) and steps 1, 2 on its parameters
    assert p.target_step == 0
    commit(p, [x for x in lease_all(p) if x.step == 0])
    assert p.phase is Phase.APPLY and p.target_step == 3
    apply_everywhere(p)
    assert (p.step, p.steps_ahead, p.target_step) == (1, 1, 3)
    open_all(p)
    assert (p.ahead, p.target_step) == (3, 4)


def test_at_depth_3_a_restarted_coordinator_keeps_every_step_open_ahead(tmp_path: Path) -> None:
    p = make(depth=3)
    open_all(p)
    leases = lease_all(p)
    commit(p, [x for x in leases if x.step in (0, 2)])
    p.await_acks({"a"})
    again = _saved_and_loaded(p, tmp_path, ["train.step_overlap=3"], make(depth=3))
    assert (again.phase, again.step, again.ahead, again.steps_ahead) == (Phase.APPLY, 0, 3, 3)
    assert [again.trains_on(s) for s in range(4)] == [0, 0, 0, 0]
    assert not again.open_ahead(settled=True)  # the next step to open is a drain point
    # Steps 1 and 3's leases are still out and commit; step 2 is applied as soon as current.
    commit(again, [x for x in leases if x.step in (1, 3)])
    applied = []
    while again.phase is Phase.APPLY:
        applied.append(again.step)
        apply_everywhere(again)
    assert applied == [0, 1, 2, 3] and (again.step, again.trains_on(4)) == (4, 4)


def test_at_depth_2_a_released_lease_goes_back_in_front_of_its_own_step() -> None:
    p = make(depth=2)
    open_all(p)
    leases = lease_all(p)
    first = {s: next(x for x in leases if x.step == s) for s in (0, 1, 2)}
    for s in (0, 2, 1):
        assert p.release("h", first[s].lease_id)
    # The queue stays in step order: each replay goes behind the steps before its own.
    assert [(r.step, r.replay) for r in p.pending_ranges()] == [(0, True), (1, True), (2, True)]


async def test_the_coordinator_opens_every_step_its_depth_allows(tmp_path: Path) -> None:
    # In-process coordinator at depth 3: the steps ahead open at once, leases say each
    # one's version, and StepState names the newest open step.
    swarm = Swarm(tmp_path, "train.step_overlap=3")
    service = swarm.service
    p = service.protocol
    await swarm.start()
    assert (p.step, p.ahead, p.steps_ahead) == (0, 3, 3)
    state = control_pb2.StepState.FromString(
        next(x for t, x in reversed(swarm.broker.published) if t == service.topics.step)
    )
    assert (state.step, state.ahead, state.trains_on) == (0, 3, 0)
    head = next(n for n in NODES if service.membership.members[n].stage == 0)
    steps = set()
    while True:
        reply = await service.Lease(
            coordinator_pb2.LeaseRequest(node_id=head, wait_seconds=0), swarm.ctx(head)
        )
        if reply.status != reply.STATUS_GRANTED:
            break
        steps.add((reply.step, reply.trains_on))
    assert steps == {(0, 0), (1, 0), (2, 0), (3, 0)}
