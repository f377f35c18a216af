"""Data leases and the step protocol: which samples go where, and when a step ends.

Step s trains on the global sample indices [s*G, (s+1)*G) (G = global batch),
cut into microbatch-sized leases. Heads lease, push the microbatch through the
pipeline and commit. When every lease of the step is committed the step enters
APPLY: every node steps its optimizer and acknowledges, and only then does step
s+1 open, so no microbatch ever meets half-updated parameters.

Evaluation (train.eval_every > 0): a step whose index is a multiple of eval_every also
carries evaluation leases, ranges of held-out samples that heads run forward only; the step
cannot end before they are committed, so they measure the parameters the step trains from.
After the last step one more evaluation-only round measures the final parameters. Then the
run SAVES: every stage's final state must be stored before it is DONE (the coordinator
calls `finish` once it holds a checked set; see coordinator/service.py), so no node leaves
with the last steps' training. Evaluation samples are not training samples: they are left
out of the counters.

Guarantee: every leased sample is committed or leased again. A lease returns
to the queue (and is counted as replayed) when its head releases it, when the
head goes offline, or when it outlives the lease timeout. This class is pure
bookkeeping with no I/O so it can be tested and simulated on its own.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field


class Phase(enum.Enum):
    WAITING = "waiting"  # not every stage has a live node
    TRAINING = "training"
    APPLY = "apply"
    SAVING = "saving"  # the last step is applied: every stage's final state is being stored
    DONE = "done"


@dataclass(slots=True)
class Lease:
    lease_id: int
    node_id: str
    step: int
    sample_start: int
    sample_count: int
    replay: bool
    granted_at: float
    eval: bool = False
    loss_sum: float = 0.0
    """Once committed: the loss sum and tokens the commit reported."""
    tokens: int = 0


@dataclass(slots=True)
class Counters:
    """Sample counters of the whole run."""

    leased: int = 0
    committed: int = 0
    replayed: int = 0
    duplicates: int = 0
    lost: int = 0


@dataclass(slots=True)
class StepStats:
    step: int
    started_at: float
    samples: int = 0
    loss_sum: float = 0.0
    tokens: int = 0
    finished_at: float | None = None
    first_commit_at: float | None = None
    """When its first training microbatch was committed: the pipeline had filled."""
    eval_loss_sum: float = 0.0
    eval_tokens: int = 0
    eval_leases: int = 0
    """Evaluation leases this step carries; 0 when it does not evaluate."""
    eval_finished_at: float | None = None

    @property
    def loss(self) -> float:
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def eval_loss(self) -> float:
        return self.eval_loss_sum / self.eval_tokens if self.eval_tokens else float("nan")

    @property
    def seconds(self) -> float:
        return (self.finished_at or time.monotonic()) - self.started_at


@dataclass(slots=True)
class SampleRange:
    """Samples of the current step waiting for a lease."""

    start: int
    count: int
    replay: bool = False
    eval: bool = False


@dataclass(slots=True)
class StepProtocol:
    """Bookkeeping of leases, commits and step acknowledgements."""

    total_steps: int
    global_batch: int
    microbatch: int
    lease_timeout_s: float
    eval_every: int = 0
    eval_samples: int = 0
    clock: Callable[[], float] = time.monotonic
    phase: Phase = Phase.WAITING
    step: int = 0
    counters: Counters = field(default_factory=Counters)
    history: list[StepStats] = field(default_factory=list)
    _pending: deque[SampleRange] = field(default_factory=deque)
    _outstanding: dict[int, Lease] = field(default_factory=dict)
    _retired: dict[int, Lease] = field(default_factory=dict)
    _committed: dict[int, Lease] = field(default_factory=dict)
    _next_lease_id: int = 1
    _awaiting_ack: set[str] = field(default_factory=set)
    _apply_since: float | None = None
    """When the current step's APPLY began awaiting acknowledgements (or, after a
    restart, when this coordinator took it up)."""
    _holds: dict[str, float] = field(default_factory=dict)
    _opened: bool = False
    _eval_pending: int = 0
    run_started_at: float | None = None

    # -- step lifecycle -------------------------------------------------

    def start(self) -> None:
        """Open step 0 (or resume the current step) once every stage has a node."""
        if self.phase is not Phase.WAITING:
            return
        if not self._opened:
            self._open_step(self.step)
        self.phase = Phase.TRAINING

    def pause(self) -> None:
        """A stage has no live node: stop leasing until it has one again."""
        if self.phase is Phase.TRAINING:
            self.phase = Phase.WAITING

    def _open_step(self, step: int) -> None:
        self.step = step
        self._opened = True
        now = self.clock()
        if self.run_started_at is None:
            self.run_started_at = now
        stats = StepStats(step=step, started_at=now)
        if self.evaluates(step):
            # Evaluation first: it is short, and its result is what a watcher waits for.
            for offset in range(0, self.eval_samples, self.microbatch):
                count = min(self.microbatch, self.eval_samples - offset)
                self._pending.append(SampleRange(offset, count, eval=True))
                stats.eval_leases += 1
            self._eval_pending = stats.eval_leases
        if not self.eval_only:
            base = step * self.global_batch
            for offset in range(0, self.global_batch, self.microbatch):
                count = min(self.microbatch, self.global_batch - offset)
                self._pending.append(SampleRange(base + offset, count))
        self.history.append(stats)

    def evaluates(self, step: int) -> bool:
        """Whether `step` carries evaluation leases (the round after the last step does)."""
        return (
            self.eval_every > 0
            and self.eval_samples > 0
            and (step % self.eval_every == 0 or step >= self.total_steps)
        )

    @property
    def eval_only(self) -> bool:
        """The current round is the final evaluation after the last training step."""
        return self.step >= self.total_steps

    @property
    def current(self) -> StepStats:
        return self.history[-1]

    # -- leases ---------------------------------------------------------

    def lease(self, node_id: str) -> Lease | None:
        """Grant the next range of the current step, or None if there is none now."""
        self.expire()
        if self.phase is not Phase.TRAINING or not self._pending:
            return None
        rng = self._pending.popleft()
        lease = Lease(
            lease_id=self._next_lease_id,
            node_id=node_id,
            step=self.step,
            sample_start=rng.start,
            sample_count=rng.count,
            replay=rng.replay,
            granted_at=self.clock(),
            eval=rng.eval,
        )
        self._next_lease_id += 1
        self._outstanding[lease.lease_id] = lease
        if not rng.eval:
            self.counters.leased += lease.sample_count
            if rng.replay:
                self.counters.replayed += lease.sample_count
        return lease

    def commit(self, node_id: str, lease_id: int, loss_sum: float, tokens: int) -> str | None:
        """Record a finished microbatch. Returns None if accepted, else why not."""
        lease = self._outstanding.get(lease_id)
        if lease is None:
            done = self._committed.get(lease_id)
            if done is not None and done.node_id == node_id:
                # A commit sent again because the coordinator restarted before it could
                # answer: it was recorded once, and that is all it counts.
                return None
            if lease_id in self._retired:
                # The samples were leased again after this lease expired or was
                # released; its gradient is already in the accumulators.
                if not self._retired[lease_id].eval:
                    self.counters.duplicates += self._retired[lease_id].sample_count
                return f"lease {lease_id} was already re-leased; counted as a duplicate"
            return f"lease {lease_id} is unknown"
        if lease.node_id != node_id:
            return f"lease {lease_id} belongs to {lease.node_id}, not {node_id}"
        del self._outstanding[lease_id]
        lease.loss_sum, lease.tokens = loss_sum, tokens
        self._committed[lease_id] = lease
        stats = self.current
        if lease.eval:
            stats.eval_loss_sum += loss_sum
            stats.eval_tokens += tokens
            self._eval_pending -= 1
            if not self._eval_pending:
                stats.eval_finished_at = self.clock()
        else:
            self.counters.committed += lease.sample_count
            if stats.first_commit_at is None:
                stats.first_commit_at = self.clock()
            stats.samples += lease.sample_count
            stats.loss_sum += loss_sum
            stats.tokens += tokens
        if not self._pending and not self._outstanding:
            stats.finished_at = self.clock()
            # The round after the last step only evaluates: nothing to apply.
            if self.eval_only:
                self._save()
            else:
                self.phase = Phase.APPLY
        return None

    def _requeue(self, lease: Lease) -> None:
        del self._outstanding[lease.lease_id]
        self._retired[lease.lease_id] = lease
        # Replays go to the front so a step's stragglers finish first.
        self._pending.appendleft(
            SampleRange(lease.sample_start, lease.sample_count, replay=True, eval=lease.eval)
        )

    def release(self, node_id: str, lease_id: int) -> bool:
        """The head gives a lease back (it could not finish it)."""
        lease = self._outstanding.get(lease_id)
        if lease is None or lease.node_id != node_id:
            return False
        self._requeue(lease)
        return True

    def node_lost(self, node_id: str) -> int:
        """Requeue every lease a vanished node held; returns the samples requeued."""
        lost = [lease for lease in self._outstanding.values() if lease.node_id == node_id]
        for lease in lost:
            self._requeue(lease)
        self._awaiting_ack.discard(node_id)
        self._holds.pop(node_id, None)
        return sum(lease.sample_count for lease in lost)

    def expire(self) -> int:
        now = self.clock()
        stale = [
            lease
            for lease in self._outstanding.values()
            if now - lease.granted_at > self.lease_timeout_s
        ]
        for lease in stale:
            self._requeue(lease)
        return len(stale)

    @property
    def outstanding_samples(self) -> int:
        """Training samples leased and neither committed nor released yet."""
        return sum(lease.sample_count for lease in self._outstanding.values() if not lease.eval)

    # -- optimizer step acknowledgements ---------------------------------

    def await_acks(self, node_ids: set[str]) -> None:
        """Enter APPLY bookkeeping: these nodes must apply the step before the next opens."""
        self._awaiting_ack = set(node_ids)
        self._apply_since = self.clock()

    def overdue(self, timeout_s: float) -> frozenset[str]:
        """The nodes still owing the current step's acknowledgement `timeout_s` after its
        APPLY began: the coordinator takes them out of the step, so no node that cannot
        finish an APPLY holds the swarm up without end."""
        if self.phase is not Phase.APPLY or not self._awaiting_ack:
            return frozenset()
        if self._apply_since is None:
            self._apply_since = self.clock()
        if self.clock() - self._apply_since <= timeout_s:
            return frozenset()
        return frozenset(self._awaiting_ack)

    def applying_for(self) -> float:
        """Seconds the current APPLY has been awaiting acknowledgements (0 outside one)."""
        if self.phase is not Phase.APPLY or self._apply_since is None:
            return 0.0
        return self.clock() - self._apply_since

    def ack(self, node_id: str, step: int) -> bool:
        """A node applied `step`. Returns True when the step is complete everywhere."""
        if self.phase is not Phase.APPLY or step != self.step:
            return False
        self._awaiting_ack.discard(node_id)
        return self.try_advance()

    @property
    def target_step(self) -> int:
        """The step whose state a node must hold to start serving now: the current step,
        or the next one while the current one is being applied."""
        return self.step + 1 if self.phase is Phase.APPLY else self.step

    def hold(self, node_id: str, seconds: float) -> None:
        """Keep the next step from opening for up to `seconds` while `node_id` fetches its
        state: a joiner whose download the last step outran gets the boundary to itself."""
        if seconds > 0:
            self._holds[node_id] = self.clock() + seconds

    def drop_hold(self, node_id: str) -> None:
        self._holds.pop(node_id, None)

    def held(self) -> float | None:
        """Seconds until the last hold expires, or None when nothing holds the boundary."""
        now = self.clock()
        for node, until in list(self._holds.items()):
            if until <= now:
                del self._holds[node]
        return max(self._holds.values()) - now if self._holds else None

    def try_advance(self) -> bool:
        """Open the next step (or finish) once no node still owes an acknowledgement
        and no joining node holds the boundary."""
        if self.phase is not Phase.APPLY or self._awaiting_ack:
            return False
        if self.held() is not None and self.step + 1 < self.total_steps:
            return False
        done = self.current
        self.counters.lost += self.global_batch - done.samples
        self._apply_since = None
        if self.step + 1 >= self.total_steps and not self.evaluates(self.total_steps):
            self._save()
        else:
            self._open_step(self.step + 1)
            self.phase = Phase.TRAINING
        return True

    @property
    def awaiting(self) -> frozenset[str]:
        return frozenset(self._awaiting_ack)

    # -- what a restarted coordinator needs (coordinator/state_db.py) --------

    @property
    def next_lease_id(self) -> int:
        return self._next_lease_id

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def eval_pending(self) -> int:
        return self._eval_pending

    def pending_ranges(self) -> list[SampleRange]:
        """The current step's samples not leased yet, in the order they will be."""
        return list(self._pending)

    def leases_of(self, step: int) -> list[tuple[str, Lease]]:
        """Every lease of `step` with its state: "open", "committed" or "released"."""
        found = [("open", x) for x in self._outstanding.values() if x.step == step]
        found += [("committed", x) for x in self._committed.values() if x.step == step]
        found += [("released", x) for x in self._retired.values() if x.step == step]
        return found

    def restore(
        self,
        *,
        step: int,
        phase: Phase,
        opened: bool,
        next_lease_id: int,
        eval_pending: int,
        awaiting: set[str],
        pending: list[SampleRange],
        leases: list[tuple[str, Lease]],
    ) -> None:
        """Take up the state a coordinator that died had recorded. Leases that were open
        stay open for a full lease timeout from now: the heads that hold them still work on
        them and commit once they reach this coordinator."""
        self.step, self.phase, self._opened = step, phase, opened
        self._next_lease_id, self._eval_pending = next_lease_id, eval_pending
        self._awaiting_ack = set(awaiting)
        self._pending = deque(pending)
        now = self.clock()
        # The bound on an APPLY taken up after a restart counts from now: the nodes were
        # without their coordinator meanwhile.
        self._apply_since = now if phase is Phase.APPLY else None
        books = {"open": self._outstanding, "committed": self._committed, "released": self._retired}
        for state, lease in leases:
            if state == "open":
                lease.granted_at = now
            books[state][lease.lease_id] = lease

    # -- the end of the run -----------------------------------------------

    def _save(self) -> None:
        """Every step is applied (and the final evaluation committed): store the final state.
        `step` becomes `total_steps`, the step the final state would take part in next, which
        is the step its checkpoints carry."""
        self.step = self.total_steps
        self.phase = Phase.SAVING

    def finish(self) -> None:
        """Every stage's final state is stored: the run is done."""
        if self.phase is Phase.SAVING:
            self.phase = Phase.DONE
