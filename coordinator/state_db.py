"""The coordinator's state in SQLite, so a coordinator that dies can be started again.

One file, `<state-dir>/coordinator.sqlite`, in WAL mode, holds one run: its id and config,
the step and phase, the current step's leases (pending ranges; open, committed and released
leases with their commits' loss sums and tokens), the sample counters, the members, the move
orders, the last plan, the checkpoint index, the step and evaluation history, and the ports
the coordinator listened on. `CoordinatorService` writes a snapshot of what changed in one
transaction at each event that matters (join, presence, promotion, lease grant, commit,
release, step done, move, drain, checkpoint stored), before it answers the call that caused
it and before it publishes anything over MQTT, so nothing a node was told is forgotten.

Durability: `synchronous=NORMAL` in WAL mode does not fsync each commit. A committed
transaction survives the coordinator's process dying (SIGKILL, a crash), which is what this
file is for; a power cut may lose the last transactions (the database stays consistent).

Loss sums are REAL columns that may be NULL: SQLite stores a NaN (a diverged run's loss) as
NULL, and it is read back as NaN.

Times: the history keeps seconds since the run's first step opened, and the wall-clock time
of that moment, so a restarted coordinator (another monotonic clock) lines them up again.
"""

from __future__ import annotations

import json
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

from swarmpipe.config import RunConfig
from swarmpipe.coordinator.membership import Member, Membership, MoveOrder
from swarmpipe.coordinator.step_protocol import (
    Counters,
    Lease,
    Phase,
    SampleRange,
    StepProtocol,
    StepStats,
)
from swarmpipe.errors import ConfigError

DB_FILE = "coordinator.sqlite"
FORMAT = "swarmpipe.coordinator-state/2"
FORMAT_1 = "swarmpipe.coordinator-state/1"
"""Before train.step_overlap: no step open ahead, every step on the parameters of its own
number. Taken up by adding those facts (`_upgrade_from_1`), so a run the coordinator of an
earlier release left goes on after an upgrade."""

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE protocol (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    step INTEGER NOT NULL, phase TEXT NOT NULL, opened INTEGER NOT NULL,
    next_lease_id INTEGER NOT NULL, eval_pending INTEGER NOT NULL,
    leased INTEGER NOT NULL, committed INTEGER NOT NULL, replayed INTEGER NOT NULL,
    duplicates INTEGER NOT NULL, lost INTEGER NOT NULL,
    awaiting TEXT NOT NULL, joins INTEGER NOT NULL, departures INTEGER NOT NULL,
    plan_version INTEGER NOT NULL, plan BLOB, final_states TEXT NOT NULL,
    ahead INTEGER NOT NULL  -- steps open ahead of the current one (0 or 1 at depth 1)
);
CREATE TABLE pending (
    pos INTEGER PRIMARY KEY, sample_start INTEGER NOT NULL, sample_count INTEGER NOT NULL,
    replay INTEGER NOT NULL, eval INTEGER NOT NULL, step INTEGER NOT NULL
);
CREATE TABLE leases (
    lease_id INTEGER PRIMARY KEY, step INTEGER NOT NULL, node_id TEXT NOT NULL,
    sample_start INTEGER NOT NULL, sample_count INTEGER NOT NULL, replay INTEGER NOT NULL,
    eval INTEGER NOT NULL, state TEXT NOT NULL, loss_sum REAL, tokens INTEGER NOT NULL
);
CREATE TABLE history (
    step INTEGER PRIMARY KEY, started_s REAL NOT NULL, finished_s REAL,
    samples INTEGER NOT NULL, loss_sum REAL, tokens INTEGER NOT NULL,
    eval_loss_sum REAL, eval_tokens INTEGER NOT NULL, eval_leases INTEGER NOT NULL,
    eval_finished_s REAL, trains_on INTEGER NOT NULL, eval_left INTEGER NOT NULL
);
CREATE TABLE members (
    node_id TEXT PRIMARY KEY, address TEXT NOT NULL, stage INTEGER NOT NULL,
    serving INTEGER NOT NULL, online INTEGER NOT NULL, announced INTEGER NOT NULL,
    drained INTEGER NOT NULL, last_step INTEGER NOT NULL, param_digest TEXT NOT NULL,
    ready_step INTEGER NOT NULL, move_order INTEGER NOT NULL
);
CREATE TABLE moves (
    order_no INTEGER PRIMARY KEY, node_id TEXT NOT NULL, from_stage INTEGER NOT NULL,
    to_stage INTEGER NOT NULL, reason TEXT NOT NULL, step INTEGER NOT NULL,
    elapsed_s REAL NOT NULL
);
CREATE TABLE checkpoints (
    stage INTEGER NOT NULL, step INTEGER NOT NULL, path TEXT NOT NULL,
    PRIMARY KEY (stage, step)
);
"""
_TABLES = {"meta", "protocol", "pending", "leases", "history", "members", "moves", "checkpoints"}


def _upgrade_from_1(conn: sqlite3.Connection) -> None:
    """Rewrite a format-1 database as format 2, in one transaction: no step open ahead,
    pending samples belong to the current step, and each step trains on the parameters of
    its own number (history's -1, which StepProtocol.trains_on reads as that)."""
    with conn:
        conn.execute("BEGIN")  # sqlite3 opens none before DDL by itself
        conn.execute("ALTER TABLE protocol ADD COLUMN ahead INTEGER NOT NULL DEFAULT 0")
        conn.execute("ALTER TABLE pending ADD COLUMN step INTEGER NOT NULL DEFAULT 0")
        conn.execute("UPDATE pending SET step = (SELECT step FROM protocol WHERE id = 1)")
        conn.execute("ALTER TABLE history ADD COLUMN trains_on INTEGER NOT NULL DEFAULT -1")
        # The current step's evaluations still owed are protocol.eval_pending, which load
        # takes when this is 0.
        conn.execute("ALTER TABLE history ADD COLUMN eval_left INTEGER NOT NULL DEFAULT 0")
        conn.execute("UPDATE meta SET value = ? WHERE key = 'format'", (FORMAT,))


class StateDBError(ConfigError):
    """The state database cannot be used: corrupt, not ours, or another run's."""


@dataclass(frozen=True, slots=True)
class MoveRow:
    """A move order with when it was made, as the status lists it."""

    order: MoveOrder
    step: int
    elapsed_s: float


@dataclass(slots=True)
class Extras:
    """The service's own state beside the protocol and the membership."""

    joins: int = 0
    departures: int = 0
    plan: bytes = b""
    final_states: dict[int, str] = field(default_factory=dict)
    moves: list[MoveRow] = field(default_factory=list)
    checkpoints: list[tuple[int, int, str]] = field(default_factory=list)


def db_path(state_dir: Path) -> Path:
    return state_dir / DB_FILE


class StateDB:
    """One run's coordinator state in one SQLite file (see the module docstring)."""

    def __init__(self, path: Path, conn: sqlite3.Connection) -> None:
        self.path = path
        self._conn = conn
        self._history_from = 0
        """History rows before this step were written finished and never change again."""
        self._moves_saved = 0
        self.commit_seconds: list[float] = []
        """Wall time of the latest transactions (the cost the module docstring promises to
        keep small), at most 1000 kept."""

    # -- opening ----------------------------------------------------------

    @classmethod
    def create(cls, path: Path, config: RunConfig, *, synchronous: str = "NORMAL") -> StateDB:
        """A new database for `config`'s run; `path` must not exist. `synchronous` is
        SQLite's setting (`swarmpipe bench state-db` compares NORMAL with FULL)."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = _connect(path, synchronous)
            with conn:
                conn.executescript(_SCHEMA)
                conn.executemany(
                    "INSERT INTO meta VALUES (?, ?)",
                    [("format", FORMAT), ("run_id", config.run_id), ("config", config.to_json())],
                )
        except (OSError, sqlite3.Error) as exc:
            raise StateDBError(f"cannot create the state database {path}: {exc}") from exc
        return cls(path, conn)

    @classmethod
    def open(cls, path: Path) -> StateDB:
        """An existing database, checked: a file that is not one of ours, or is damaged, is
        a StateDBError naming it (and is left as it is)."""
        try:
            with path.open("rb") as f:
                header = f.read(16)
        except OSError as exc:
            raise StateDBError(f"cannot read the state database {path}: {exc.strerror}") from exc
        if header != b"SQLite format 3\x00":
            raise StateDBError(
                f"{path} is not an SQLite database (corrupt?); move it away to start afresh"
            )
        try:
            conn = _connect(path)
            check = conn.execute("PRAGMA quick_check").fetchone()
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            meta = dict(conn.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
        except sqlite3.DatabaseError as exc:
            raise StateDBError(
                f"the state database {path} is corrupt ({exc}); move it away to start afresh"
            ) from exc
        if check is None or check[0] != "ok":
            conn.close()
            raise StateDBError(
                f"the state database {path} is corrupt ({check[0] if check else 'no answer'}); "
                "move it away to start afresh"
            )
        if _TABLES <= tables and meta.get("format") == FORMAT_1:
            try:
                _upgrade_from_1(conn)
            except sqlite3.Error as exc:
                conn.close()
                raise StateDBError(f"cannot upgrade the state database {path}: {exc}") from exc
            meta["format"] = FORMAT
        if not _TABLES <= tables or meta.get("format") != FORMAT:
            conn.close()
            raise StateDBError(f"{path} is not a swarmpipe coordinator state ({FORMAT})")
        return cls(path, conn)

    def close(self) -> None:
        self._conn.close()

    # -- the run ------------------------------------------------------------

    def _meta(self, key: str) -> str | None:
        row = self._conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    @property
    def run_id(self) -> str:
        return self._meta("run_id") or ""

    @property
    def config_json(self) -> str:
        return self._meta("config") or ""

    def config(self) -> RunConfig:
        try:
            return RunConfig.from_json(self.config_json)
        except ConfigError as exc:
            raise StateDBError(f"{self.path} holds a run config that is not valid: {exc}") from exc

    @property
    def phase(self) -> Phase | None:
        """The recorded phase; None before the protocol was first written."""
        row = self._conn.execute("SELECT phase FROM protocol").fetchone()
        return None if row is None else Phase(row[0])

    @property
    def step(self) -> int:
        row = self._conn.execute("SELECT step FROM protocol").fetchone()
        return 0 if row is None else int(row[0])

    def ports(self) -> tuple[int, int]:
        """The gRPC and embedded-broker ports of the last life (0: none recorded)."""
        return int(self._meta("grpc_port") or 0), int(self._meta("broker_port") or 0)

    def set_ports(self, grpc_port: int, broker_port: int) -> None:
        with self._conn:
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("grpc_port", str(grpc_port)), ("broker_port", str(broker_port))],
            )

    @property
    def started(self) -> bool:
        """Whether the recorded run ever opened a step (else it holds nothing to lose)."""
        return self._conn.execute("SELECT 1 FROM history LIMIT 1").fetchone() is not None

    def reset(self, config: RunConfig) -> None:
        """Forget the live state and record `config`: `--resume` restarts the same run from
        its checkpoints (their index is kept), or a run that never started is replaced."""
        same_run = config.run_id == self.run_id
        with self._conn:
            for table in sorted(_TABLES - {"meta"} - ({"checkpoints"} if same_run else set())):
                self._conn.execute(f"DELETE FROM {table}")
            self._conn.executemany(
                "INSERT OR REPLACE INTO meta VALUES (?, ?)",
                [("config", config.to_json()), ("run_id", config.run_id)],
            )
            self._conn.execute(
                "DELETE FROM meta WHERE key IN ('wall_start', 'grpc_port', 'broker_port')"
            )

    # -- writing ------------------------------------------------------------

    def save(self, protocol: StepProtocol, membership: Membership, extras: Extras) -> None:
        """Record what may have changed since the last save, in one transaction."""
        t0 = time.perf_counter()
        p, c, conn = protocol, protocol.counters, self._conn
        wall_start = _wall(p.run_started_at)
        with conn:
            if wall_start is not None and self._meta("wall_start") is None:
                conn.execute("INSERT INTO meta VALUES ('wall_start', ?)", (repr(wall_start),))
            conn.execute(
                "INSERT OR REPLACE INTO protocol VALUES "
                "(1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    p.step,
                    p.phase.value,
                    int(p.opened),
                    p.next_lease_id,
                    p.eval_pending,
                    c.leased,
                    c.committed,
                    c.replayed,
                    c.duplicates,
                    c.lost,
                    json.dumps(sorted(p.awaiting)),
                    extras.joins,
                    extras.departures,
                    membership.plan_version,
                    extras.plan,
                    json.dumps({str(k): v for k, v in extras.final_states.items()}),
                    p.steps_ahead,
                ),
            )
            conn.execute("DELETE FROM pending")
            conn.executemany(
                "INSERT INTO pending VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (i, r.start, r.count, int(r.replay), int(r.eval), r.step)
                    for i, r in enumerate(p.pending_ranges())
                ],
            )
            # The leases of the step before too (its last commit may have ended it), and of
            # the steps open ahead (train.step_overlap).
            for step in range(max(p.step - 1, 0), p.step + p.steps_ahead + 1):
                conn.executemany(
                    "INSERT OR REPLACE INTO leases VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [
                        (
                            x.lease_id,
                            x.step,
                            x.node_id,
                            x.sample_start,
                            x.sample_count,
                            int(x.replay),
                            int(x.eval),
                            state,
                            x.loss_sum,
                            x.tokens,
                        )
                        for state, x in p.leases_of(step)
                    ],
                )
            self._save_history(p)
            conn.execute("DELETE FROM members")
            conn.executemany(
                "INSERT INTO members VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        m.node_id,
                        m.address,
                        m.stage,
                        int(m.serving),
                        int(m.online),
                        int(m.announced),
                        int(m.drained),
                        m.last_step,
                        m.param_digest,
                        m.ready_step,
                        m.move_order,
                    )
                    for m in membership.members.values()
                ],
            )
            new_moves = extras.moves[self._moves_saved :]
            conn.executemany(
                "INSERT OR REPLACE INTO moves VALUES (?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        r.order.order,
                        r.order.node_id,
                        r.order.from_stage,
                        r.order.to_stage,
                        r.order.reason,
                        r.step,
                        r.elapsed_s,
                    )
                    for r in new_moves
                ],
            )
            conn.executemany(
                "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?)", extras.checkpoints
            )
        self._moves_saved = len(extras.moves)
        extras.checkpoints.clear()
        self.commit_seconds.append(time.perf_counter() - t0)
        del self.commit_seconds[:-1000]

    def _save_history(self, p: StepProtocol) -> None:
        start = p.run_started_at
        if start is None:
            return

        def rel(t: float | None) -> float | None:
            return None if t is None else t - start

        rows = [s for s in p.history if s.step >= self._history_from]
        self._conn.executemany(
            "INSERT OR REPLACE INTO history VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (
                    s.step,
                    s.started_at - start,
                    rel(s.finished_at),
                    s.samples,
                    s.loss_sum,
                    s.tokens,
                    s.eval_loss_sum,
                    s.eval_tokens,
                    s.eval_leases,
                    rel(s.eval_finished_at),
                    s.trains_on,
                    s.eval_left,
                )
                for s in rows
            ],
        )
        if p.history:
            # A step begun again as a drain point (StepProtocol.redo_as_drain) closed the
            # step that was open ahead: its row goes.
            self._conn.execute("DELETE FROM history WHERE step > ?", (p.history[-1].step,))
            # Every step before the current one is finished: its row will not change again.
            self._history_from = min(p.step, p.history[-1].step)

    # -- reading ------------------------------------------------------------

    def load(self, protocol: StepProtocol, membership: Membership) -> Extras:
        """Put the recorded state into a fresh protocol and membership; returns the rest.

        Members come back as they were (online ones still count as online: they are
        expected to reconnect, see CoordinatorService.expect_back)."""
        conn = self._conn
        row = conn.execute("SELECT * FROM protocol").fetchone()
        extras = Extras()
        if row is None:
            return extras
        (
            _,
            step,
            phase,
            opened,
            next_lease_id,
            eval_pending,
            leased,
            committed,
            replayed,
            duplicates,
            lost,
            awaiting,
            joins,
            departures,
            plan_version,
            plan,
            final_states,
            ahead,
        ) = row
        now_mono, now_wall = time.monotonic(), time.time()
        wall_start = self._meta("wall_start")
        if wall_start is not None:
            protocol.run_started_at = now_mono - (now_wall - float(wall_start))
        start = protocol.run_started_at or now_mono

        def mono(t: float | None) -> float | None:
            return None if t is None else start + t

        protocol.counters = Counters(leased, committed, replayed, duplicates, lost)
        protocol.history = [
            StepStats(
                step=r[0],
                started_at=start + r[1],
                finished_at=mono(r[2]),
                samples=r[3],
                loss_sum=_float(r[4]),
                tokens=r[5],
                eval_loss_sum=_float(r[6]),
                eval_tokens=r[7],
                eval_leases=r[8],
                eval_finished_at=mono(r[9]),
                trains_on=r[10],
                eval_left=r[11],
            )
            for r in conn.execute("SELECT * FROM history ORDER BY step")
        ]
        if protocol.history:
            self._history_from = protocol.history[-1].step
        leases = [
            (
                r[7],
                Lease(
                    lease_id=r[0],
                    step=r[1],
                    node_id=r[2],
                    sample_start=r[3],
                    sample_count=r[4],
                    replay=bool(r[5]),
                    eval=bool(r[6]),
                    granted_at=now_mono,
                    loss_sum=_float(r[8]),
                    tokens=r[9],
                ),
            )
            for r in conn.execute("SELECT * FROM leases ORDER BY lease_id")
        ]
        protocol.restore(
            step=step,
            phase=Phase(phase),
            opened=bool(opened),
            next_lease_id=next_lease_id,
            eval_pending=eval_pending,
            awaiting=set(json.loads(awaiting)),
            pending=[
                SampleRange(r[0], r[1], replay=bool(r[2]), eval=bool(r[3]), step=r[4])
                for r in conn.execute(
                    "SELECT sample_start, sample_count, replay, eval, step FROM pending "
                    "ORDER BY pos"
                )
            ],
            leases=leases,
            ahead=int(ahead),
        )
        membership.plan_version = plan_version
        for r in conn.execute("SELECT * FROM members ORDER BY node_id"):
            membership.members[r[0]] = Member(
                node_id=r[0],
                address=r[1],
                stage=r[2],
                joined_at=now_mono,
                serving=bool(r[3]),
                online=bool(r[4]),
                announced=bool(r[5]),
                drained=bool(r[6]),
                last_step=r[7],
                param_digest=r[8],
                ready_step=r[9],
                move_order=r[10],
            )
        for r in conn.execute("SELECT * FROM moves ORDER BY order_no"):
            order = MoveOrder(order=r[0], node_id=r[1], from_stage=r[2], to_stage=r[3], reason=r[4])
            membership.moves.append(order)
            extras.moves.append(MoveRow(order, step=r[5], elapsed_s=r[6]))
        self._moves_saved = len(extras.moves)
        extras.joins, extras.departures = joins, departures
        extras.plan = bytes(plan or b"")
        extras.final_states = {int(k): v for k, v in json.loads(final_states).items()}
        return extras

    def checkpoint_index(self) -> list[tuple[int, int, str]]:
        """(stage, step, path) of every checkpoint stored, oldest first."""
        return [
            (r[0], r[1], r[2])
            for r in self._conn.execute("SELECT * FROM checkpoints ORDER BY step, stage")
        ]


def _connect(path: Path, synchronous: str = "NORMAL") -> sqlite3.Connection:
    # isolation_level stays the default: `with conn:` is one transaction.
    conn = sqlite3.connect(path, timeout=5.0)
    conn.execute("PRAGMA journal_mode=WAL")
    if synchronous not in ("NORMAL", "FULL"):
        raise ValueError(f"synchronous={synchronous!r}: NORMAL or FULL")
    conn.execute(f"PRAGMA synchronous={synchronous}")
    return conn


def _float(value: float | None) -> float:
    """A REAL column read back: NULL was a NaN."""
    return math.nan if value is None else float(value)


def _wall(mono: float | None) -> float | None:
    """A monotonic time as wall-clock seconds (time.time()), or None."""
    return None if mono is None else time.time() - (time.monotonic() - mono)
