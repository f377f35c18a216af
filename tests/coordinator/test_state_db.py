"""The coordinator's state database: what a restarted coordinator takes up, and what it
refuses."""

from __future__ import annotations

import math
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from swarmpipe.config import RunConfig, load_config
from swarmpipe.coordinator.membership import Membership
from swarmpipe.coordinator.state_db import Extras, MoveRow, StateDB, StateDBError
from swarmpipe.coordinator.step_protocol import Phase, StepProtocol
from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc


def _protocol() -> StepProtocol:
    return StepProtocol(
        total_steps=5,
        global_batch=10,
        microbatch=4,
        lease_timeout_s=30.0,
        eval_every=2,
        eval_samples=4,
    )


def _membership() -> Membership:
    return Membership(num_stages=2, activation_codec=1, gradient_codec=1)


def _config(**sets: object) -> RunConfig:
    return load_config(None, [f"{k}={v}" for k, v in sets.items()])


def _mid_run() -> tuple[StepProtocol, Membership, Extras]:
    """Step 1 training: one lease committed, one open, one released; two members."""
    p, m = _protocol(), _membership()
    for name, stage in (("a", 0), ("b", 1)):
        member = m.assign(name, f"{name}:1")
        assert member.stage == stage
        member.online = member.announced = member.serving = True
    p.start()
    while (lease := p.lease("a")) is not None:
        assert p.commit("a", lease.lease_id, 2.0, lease.sample_count * 3) is None
    p.await_acks({"a", "b"})
    p.ack("a", 0)
    assert p.ack("b", 0) and p.step == 1
    done, open_, released = p.lease("a"), p.lease("a"), p.lease("a")
    assert done and open_ and released
    assert p.commit("a", done.lease_id, 1.5, 12) is None
    assert p.release("a", released.lease_id)
    order = m.move(m.members["b"], 0, "moved by the operator")
    m.members["b"].last_step, m.members["b"].param_digest = 0, "abc"
    extras = Extras(
        joins=2,
        departures=1,
        plan=m.plan().SerializeToString(),
        final_states={},
        moves=[MoveRow(order, step=1, elapsed_s=3.5)],
        checkpoints=[(0, 1, "/x/stage0/step1")],
    )
    return p, m, extras


def test_a_saved_run_comes_back_as_it_was(tmp_path: Path) -> None:
    p, m, extras = _mid_run()
    db = StateDB.create(tmp_path / "c.sqlite", _config())
    db.save(p, m, extras)
    db.close()

    again = StateDB.open(tmp_path / "c.sqlite")
    assert again.run_id == "testnet" and again.config() == _config()
    assert again.phase is Phase.TRAINING and again.step == 1
    q, n = _protocol(), _membership()
    back = again.load(q, n)
    assert (q.step, q.phase, q.next_lease_id, q.awaiting) == (1, p.phase, p.next_lease_id, set())
    assert q.counters == p.counters
    assert [(r.start, r.count, r.replay) for r in q.pending_ranges()] == [
        (r.start, r.count, r.replay) for r in p.pending_ranges()
    ]
    states = sorted((s, x.lease_id, x.loss_sum, x.tokens) for s, x in q.leases_of(1))
    assert states == sorted((s, x.lease_id, x.loss_sum, x.tokens) for s, x in p.leases_of(1))
    assert [(s.step, s.samples, s.loss_sum, s.tokens) for s in q.history] == [
        (s.step, s.samples, s.loss_sum, s.tokens) for s in p.history
    ]
    assert {k: (v.stage, v.serving, v.online, v.move_order, v.param_digest) for k, v in
            n.members.items()} == {k: (v.stage, v.serving, v.online, v.move_order,
                                       v.param_digest) for k, v in m.members.items()}  # fmt: skip
    assert n.plan_version == m.plan_version and n.moves == m.moves
    assert (back.joins, back.departures, back.plan) == (2, 1, extras.plan)
    assert back.moves == [MoveRow(m.moves[0], step=1, elapsed_s=3.5)]
    assert again.checkpoint_index() == [(0, 1, "/x/stage0/step1")]


def test_leases_out_at_the_restart_stay_open_and_commits_of_them_count_once(
    tmp_path: Path,
) -> None:
    p, m, extras = _mid_run()
    db = StateDB.create(tmp_path / "c.sqlite", _config())
    db.save(p, m, extras)
    q = _protocol()
    db.load(q, _membership())
    (open_,) = [x for s, x in q.leases_of(1) if s == "open"]
    (released,) = [x for s, x in q.leases_of(1) if s == "released"]
    (done,) = [x for s, x in q.leases_of(1) if s == "committed"]
    committed = q.counters.committed
    assert q.commit("a", open_.lease_id, 1.0, 4) is None
    assert q.counters.committed == committed + open_.sample_count
    # A commit the dead coordinator recorded but never answered is sent again: no change.
    assert q.commit("a", done.lease_id, 1.5, 12) is None
    assert q.counters.committed == committed + open_.sample_count
    assert "duplicate" in (q.commit("a", released.lease_id, 1.0, 4) or "")
    # The released range is leased again (replayed), and new lease ids do not collide.
    again = q.lease("a")
    assert again is not None and again.replay and again.lease_id == p.next_lease_id


def test_a_nan_loss_is_kept_as_nan(tmp_path: Path) -> None:
    """A diverged run commits NaN losses; SQLite would store them as NULL."""
    p, m, extras = _mid_run()
    (open_,) = [x for s, x in p.leases_of(1) if s == "open"]
    assert p.commit("a", open_.lease_id, math.nan, 4) is None
    db = StateDB.create(tmp_path / "c.sqlite", _config())
    db.save(p, m, extras)
    q = _protocol()
    db.load(q, _membership())
    (back,) = [x for s, x in q.leases_of(1) if x.lease_id == open_.lease_id]
    assert math.isnan(back.loss_sum) and math.isnan(q.history[-1].loss_sum)


def test_a_save_is_one_transaction(tmp_path: Path) -> None:
    """A save that fails half-way leaves the previous save whole."""
    p, m, extras = _mid_run()
    db = StateDB.create(tmp_path / "c.sqlite", _config())
    db.save(p, m, extras)
    lease = p.lease("a")
    assert lease is not None
    m.members["a"].address = "broken"
    m.members["a"].param_digest = None  # type: ignore[assignment]  # violates NOT NULL
    with pytest.raises(sqlite3.IntegrityError):
        db.save(p, m, Extras())
    q, n = _protocol(), _membership()
    db.load(q, n)
    assert n.members["a"].address == "a:1"
    assert lease.lease_id not in {x.lease_id for _, x in q.leases_of(1)}
    assert q.next_lease_id == lease.lease_id


def test_a_file_that_is_not_a_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"not a database at all" * 100)
    with pytest.raises(StateDBError, match="not an SQLite database"):
        StateDB.open(path)
    assert path.read_bytes() == b"not a database at all" * 100


def test_a_damaged_database_is_refused(tmp_path: Path) -> None:
    p, m, extras = _mid_run()
    path = tmp_path / "c.sqlite"
    db = StateDB.create(path, _config())
    db.save(p, m, extras)
    db.close()
    data = bytearray(path.read_bytes())
    # Keep the header, scribble over the pages after the first.
    data[4096:] = b"\xff" * (len(data) - 4096)
    path.write_bytes(bytes(data))
    with pytest.raises(StateDBError, match="corrupt"):
        StateDB.open(path)


def test_a_state_dir_that_cannot_hold_the_database_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDBError, match="cannot create the state database"):
        StateDB.create(tmp_path / "file" / "c.sqlite", _config())


def test_another_kind_of_sqlite_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE t (x)")
    with pytest.raises(StateDBError, match="not a swarmpipe coordinator state"):
        StateDB.open(path)


def _coordinator(state_dir: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", "coordinator", "--state-dir", str(state_dir)]
    cmd += ["--listen", "127.0.0.1:0"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)


def _one_line_exit_2(done: subprocess.CompletedProcess[str], expected: str) -> None:
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("swarmpipe")]
    assert len(errors) == 1 and expected in errors[0], done.stderr
    assert "Traceback" not in done.stderr


def _store(path: Path, config: RunConfig, *, phase: Phase | None = None) -> None:
    p, m, extras = _mid_run()
    if phase is not None:
        p.phase = phase
    db = StateDB.create(path, config)
    db.save(p, m, extras)
    db.close()


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stored", "sets", "expected"),
    [
        ({"run_id": "other"}, [], "holds the state of run 'other';"),
        ({}, ["train.steps=7"], "holds the state of run 'testnet' with another config"),
    ],
)
def test_a_state_dir_of_another_run_is_refused_and_left_alone(
    tmp_path: Path, stored: dict[str, object], sets: list[str], expected: str
) -> None:
    _store(tmp_path / "coordinator.sqlite", _config(**stored))
    before = _snapshot(tmp_path)
    _one_line_exit_2(_coordinator(tmp_path, *sets), expected)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_finished_run_is_refused(tmp_path: Path) -> None:
    _store(tmp_path / "coordinator.sqlite", _config(), phase=Phase.DONE)
    before = _snapshot(tmp_path)
    _one_line_exit_2(_coordinator(tmp_path), "is finished (step 1): pass --resume")
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["garbage", "pages"])
def test_a_corrupt_state_database_is_one_line_and_exit_2(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "coordinator.sqlite"
    if damage == "garbage":
        path.write_bytes(b"\x00garbage" * 1000)
    else:
        _store(path, _config())
        data = bytearray(path.read_bytes())
        data[4096:] = b"\xff" * (len(data) - 4096)
        path.write_bytes(bytes(data))
    before = _snapshot(tmp_path)
    done = _coordinator(tmp_path)
    _one_line_exit_2(done, "move it away to start afresh")
    assert _snapshot(tmp_path) == before


def test_only_a_run_that_never_started_may_be_replaced(tmp_path: Path) -> None:
    path = tmp_path / "c.sqlite"
    db = StateDB.create(path, _config(run_id="other"))
    db.save(_protocol(), _membership(), Extras())  # a coordinator stopped while waiting
    assert not db.started
    db.reset(_config())
    assert (db.run_id, db.config(), db.phase) == ("testnet", _config(), None)
    p, m, extras = _mid_run()
    db.save(p, m, extras)
    assert db.started


@pytest.mark.slow
def test_a_coordinator_stopped_before_its_run_started_can_start_another(procs) -> None:  # type: ignore[no-untyped-def]
    state = procs.tmp / "coordinator-state"
    procs.coordinator("train.steps=5")

    def recorded() -> Phase | None:
        db = StateDB.open(state / "coordinator.sqlite")
        try:
            return db.phase
        finally:
            db.close()

    # Once it has published its first plan (a SIGTERM in the embedded broker's first
    # milliseconds is another matter).
    assert poll_until(recorded, 30, "the first state") is Phase.WAITING
    procs.children[-1][0].send_signal(signal.SIGTERM)
    assert procs.children[-1][0].wait(timeout=30) == 0
    db = StateDB.open(state / "coordinator.sqlite")
    assert db.phase is Phase.WAITING and not db.started
    db.close()
    # Another config: the first run lost nothing, so its state is replaced.
    _, info = procs.start(
        "coordinator-again",
        *("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state)),
        *("--set", "train.steps=7"),
    )
    with grpc.insecure_channel(f"127.0.0.1:{info['grpc_port']}") as channel:
        status = coordinator_pb2_grpc.CoordinatorStub(channel).Status(
            coordinator_pb2.StatusRequest(), timeout=10
        )
    assert status.total_steps == 7


def test_a_database_of_the_format_before_step_overlap_is_taken_up(tmp_path: Path) -> None:
    # A coordinator of the release before train.step_overlap wrote format 1, without the
    # columns for a step open ahead; an upgrade mid-run goes on from it, as synchronous steps.
    p, m, extras = _mid_run()
    path = tmp_path / "c.sqlite"
    db = StateDB.create(path, _config())
    db.save(p, m, extras)
    db.close()
    conn = sqlite3.connect(path)
    with conn:
        for table, column in [("protocol", "ahead"), ("pending", "step"),
                              ("history", "trains_on"), ("history", "eval_left")]:  # fmt: skip
            conn.execute(f"ALTER TABLE {table} DROP COLUMN {column}")
        conn.execute("UPDATE meta SET value = 'swarmpipe.coordinator-state/1' WHERE key = 'format'")
    conn.close()

    again = StateDB.open(path)
    q, n = _protocol(), _membership()
    again.load(q, n)
    assert (q.step, q.phase, q.next_lease_id) == (1, p.phase, p.next_lease_id)
    assert [(r.start, r.count, r.replay, r.step) for r in q.pending_ranges()] == [
        (r.start, r.count, r.replay, r.step) for r in p.pending_ranges()
    ]
    assert [q.trains_on(s.step) for s in q.history] == [s.step for s in p.history]
    assert q.eval_pending == p.eval_pending
    again.save(q, n, extras)  # and it is written as format 2 from then on
    again.close()
    assert StateDB.open(path).step == 1
