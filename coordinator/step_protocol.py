"""Data leases and the step protocol: which samples go where, and when a step ends.

Step s trains on the global sample indices [s*G, (s+1)*G) (G = global batch),
cut into microbatch-sized leases. Heads lease, push the microbatch through the
pipeline and commit. When every lease of the step is committed the step enters
APPLY: every node steps its optimizer and acknowledges, and only then does step
s+1 open, so no microbatch ever meets half-updated parameters.

Held APPLY (`hold_apply`, where the service wants one): the nodes reduce and report it
before anybody steps; then the APPLY goes on (`release_apply`) or, when the reduce benched a
replica, the step is taken back and opened again (`begin_again`): its leases retired and
its samples leased again as replays, on the same parameters, since nobody stepped.

Evaluation (train.eval_every > 0): a step whose index is a multiple of eval_every also
carries evaluation leases, ranges of held-out samples that heads run forward only; the step
cannot end before they are committed, so they measure the parameters the step trains from.
After the last step one more evaluation-only round measures the final parameters. Then the
run SAVES: every stage's final state must be stored before it is DONE (the coordinator
calls `finish` once it holds a checked set; see coordinator/service.py), so no node leaves
with the last steps' training. Evaluation samples are not training samples: they are left
out of the counters.

Overlap (train.step_overlap, a depth k >= 1; `true` is 1): step s+j may open while the
steps before it still train or are being applied, once step s+j-k-1 is applied everywhere,
so at most k+1 steps are open: the current step s (the oldest not applied everywhere) and
up to k *ahead* of it. Each step records the parameters it trains on (`trains_on`, counted
in optimizer steps applied): the newest applied everywhere when it opens, so a step opened
ahead of the current step s trains on the parameters after step s-1 (trains_on = s): its
every microbatch sees one version and its gradient is applied up to k steps late, to the
newest parameters. A step that opens as the current one (no step open before it) trains on
the newest parameters (trains_on = its own number), as without overlap: a *drain point*.
Drain points are step 0, every `drain_every`-th step (checkpoints), the first step opened
after a restart, and every step opened while the service says the swarm is not settled (a
node joining, moving or re-syncing): a node can only enter the plan at a step that trains
on the parameters it downloaded. Leases go in step order, the current step's first; APPLY
is for the current step only, so steps are applied in order.

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
    trains_on: int = -1
    """The parameters the step trains on, in optimizer steps applied: `step`, or the
    current step's number when it opened ahead of it (train.step_overlap)."""
    eval_left: int = 0
    """Evaluation leases of the step not committed yet."""

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
    step: int = 0


@dataclass(slots=True)
class StepProtocol:
    """Bookkeeping of leases, commits and step acknowledgements."""

    total_steps: int
    global_batch: int
    microbatch: int
    lease_timeout_s: float
    eval_every: int = 0
    eval_samples: int = 0
    depth: int = 0
    """train.step_overlap as a depth: how many steps may open ahead of the current one (see
    the module docstring); 0: none, every step is a drain point."""
    drain_every: int = 0
    """Every this many steps is a drain point (checkpoint.every_steps); 0: none."""
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
    _acks_set: bool = True
    """False from the moment a step enters APPLY until `await_acks` names its nodes."""
    _ahead: int = 0
    """How many steps are open ahead of the current one: step + 1 ... step + _ahead."""
    _drain_next: bool = False
    """No step opens ahead until one opens as a drain point (set after a restart)."""
    _held: bool = False
    _held_nodes: set[str] = field(default_factory=set)
    """The nodes of a held APPLY (less those lost since): all must step once it goes on."""
    _awaiting_reduce: set[str] = field(default_factory=set)
    """Nodes of a held APPLY that have not reported their reduce yet."""
    _lost_in_hold: set[str] = field(default_factory=set)
    """Nodes of a held APPLY lost before they reported their reduce: their share of the
    step may be missing from the others' sums."""
    attempt: int = 0
    """How often the current step began again after a held APPLY was taken back."""
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
        """Open `step` as the current step: a drain point, on the newest parameters."""
        if step != self.step:
            self.attempt = 0
        self.step = step
        self._opened = True
        self._drain_next = False
        self.history.append(self._ranges_of(step, trains_on=step))

    def _ranges_of(self, step: int, *, trains_on: int) -> StepStats:
        """Queue `step`'s leases (after any queued) and return its fresh stats."""
        now = self.clock()
        if self.run_started_at is None:
            self.run_started_at = now
        stats = StepStats(step=step, started_at=now, trains_on=trains_on)
        # A step opened again (redo_as_drain closed it): its samples leased before count
        # as replayed when leased again.
        leased_before = {(x.sample_start, x.eval) for x in self._retired.values() if x.step == step}
        if self.evaluates(step):
            # Evaluation first: it is short, and its result is what a watcher waits for.
            for offset in range(0, self.eval_samples, self.microbatch):
                count = min(self.microbatch, self.eval_samples - offset)
                replay = (offset, True) in leased_before
                self._pending.append(SampleRange(offset, count, replay, eval=True, step=step))
                stats.eval_leases += 1
            stats.eval_left = stats.eval_leases
        if step < self.total_steps:
            base = step * self.global_batch
            for offset in range(0, self.global_batch, self.microbatch):
                count = min(self.microbatch, self.global_batch - offset)
                replay = (base + offset, False) in leased_before
                self._pending.append(SampleRange(base + offset, count, replay, step=step))
        return stats

    @property
    def overlap(self) -> bool:
        """Whether steps may open ahead (train.step_overlap)."""
        return self.depth > 0

    def open_ahead(self, *, settled: bool) -> bool:
        """Open the step after the newest open one now, on the parameters the current step's
        predecessor left, if overlap allows it: fewer than `depth` steps are open ahead, the
        swarm is `settled` (the service's word: every stage served, no node on its way in),
        and the step is a training step and not a drain point. Returns whether it opened;
        call again to open the next. Sound at any moment of the current step s: step s-1
        is applied everywhere, since s opened only then, and the step opened is at most
        s+depth."""
        if not (self.overlap and settled and self._opened) or self._drain_next:
            return False
        if self._ahead >= self.depth or self.phase not in (Phase.TRAINING, Phase.APPLY):
            return False
        nxt = self.step + self._ahead + 1
        if nxt >= self.total_steps or (self.drain_every and nxt % self.drain_every == 0):
            return False
        self.history.append(self._ranges_of(nxt, trains_on=self.step))
        self._ahead += 1
        return True

    @property
    def ahead(self) -> int | None:
        """The newest step open ahead of the current one (overlap), or None."""
        return self.step + self._ahead if self._ahead else None

    @property
    def steps_ahead(self) -> int:
        """How many steps are open ahead of the current one (0 to `depth`)."""
        return self._ahead

    def trains_on(self, step: int) -> int:
        """The parameters an open (or past) `step` trains on, in optimizer steps applied."""
        stats = self.stats_of(step)
        return step if stats is None or stats.trains_on < 0 else stats.trains_on

    def stats_of(self, step: int) -> StepStats | None:
        for stats in reversed(self.history):
            if stats.step == step:
                return stats
        return None

    def redo_as_drain(self) -> bool:
        """Start the current step again on the newest parameters (and close every step open
        ahead), when it trains on older ones or steps are open ahead: a stage that lost its
        last replica can only be served again by a node that downloads the newest state and
        enters at a drain point. Every lease of those steps, committed ones too, is retired (a
        late commit is refused) and their samples leased again, as replays, when their step
        opens again; the nodes' sums of the old version are never applied (APPLY names the
        version). Only while the current step trains (its APPLY cannot be taken back).
        Returns whether it did anything."""
        if self.phase not in (Phase.TRAINING, Phase.WAITING) or not self._opened:
            return False
        if self.trains_on(self.step) == self.step and not self._ahead:
            return False
        self._take_back(set(range(self.step, self.step + self._ahead + 1)))
        self._ahead = 0
        self._open_step(self.step)
        return True

    def _take_back(self, steps: set[int]) -> None:
        """Retire every lease of `steps`, committed ones too (a late commit is refused), and
        forget their ranges and stats: their samples are leased again, as replays, when the
        steps open again."""
        for book in (self._outstanding, self._committed):
            for lease in [x for x in book.values() if x.step in steps]:
                del book[lease.lease_id]
                self._retired[lease.lease_id] = lease
                if book is self._committed and not lease.eval:
                    self.counters.committed -= lease.sample_count
        self._pending = deque(r for r in self._pending if r.step not in steps)
        self.history = [s for s in self.history if s.step not in steps]

    # -- a held APPLY: every verdict before any optimizer step ---------------

    def hold_apply(self, node_ids: set[str]) -> None:
        """Enter the current step's APPLY held: these nodes reduce and report it (`reduced`),
        and nobody steps its optimizer until `release_apply` (or the step is taken back with
        `begin_again`). Without overlap only: no step is open ahead to train meanwhile."""
        assert self.phase is Phase.APPLY and not self._ahead
        self._awaiting_reduce = set(node_ids)
        self._held_nodes = set(node_ids)
        self._lost_in_hold.clear()
        self._held = True
        self._apply_since = self.clock()
        self._acks_set = True

    @property
    def apply_held(self) -> bool:
        """The current APPLY is held: the nodes reduce but do not step yet."""
        return self._held and self.phase is Phase.APPLY

    @property
    def lost_in_hold(self) -> frozenset[str]:
        """Nodes of the held APPLY lost before they reported their reduce."""
        return frozenset(self._lost_in_hold)

    @property
    def reduce_owed(self) -> frozenset[str]:
        """The nodes of a held APPLY that have not reported their reduce yet."""
        return frozenset(self._awaiting_reduce)

    def reduced(self, node_id: str, step: int) -> bool:
        """A node of a held APPLY has reduced `step`. True when nobody owes it any more."""
        if not self.apply_held or step != self.step:
            return False
        self._awaiting_reduce.discard(node_id)
        return not self._awaiting_reduce

    def release_apply(self, node_ids: set[str]) -> None:
        """Let the held APPLY go on: these nodes step their optimizers and acknowledge."""
        self._held = False
        self._awaiting_reduce.clear()
        self._held_nodes.clear()
        self.await_acks(node_ids)

    def begin_again(self) -> None:
        """Take the held APPLY's step back and open it again on the same parameters (nobody
        stepped): the same samples, leased again as replays, go to the nodes still in the
        plan. `attempt` counts how often the step began again."""
        assert self.apply_held
        self._held = False
        self._awaiting_reduce.clear()
        self._held_nodes.clear()
        self._apply_since = None
        self._take_back({self.step})
        self.attempt += 1
        self._open_step(self.step)
        self.phase = Phase.TRAINING

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
        """The current step's stats (steps open ahead are the last in the history)."""
        return self.history[-1 - self._ahead]

    # -- leases ---------------------------------------------------------

    def lease(self, node_id: str) -> Lease | None:
        """Grant the next range of the current step, or None if there is none now."""
        self.expire()
        # While the current step is applied, the step ahead (if open) is still leased.
        if self.phase not in (Phase.TRAINING, Phase.APPLY) or not self._pending:
            return None
        rng = self._pending.popleft()
        lease = Lease(
            lease_id=self._next_lease_id,
            node_id=node_id,
            step=rng.step,
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
        found = self.stats_of(lease.step)
        assert found is not None  # outstanding leases belong to an open step
        stats = found
        if lease.eval:
            stats.eval_loss_sum += loss_sum
            stats.eval_tokens += tokens
            stats.eval_left -= 1
            if not stats.eval_left:
                stats.eval_finished_at = self.clock()
        else:
            self.counters.committed += lease.sample_count
            if stats.first_commit_at is None:
                stats.first_commit_at = self.clock()
            stats.samples += lease.sample_count
            stats.loss_sum += loss_sum
            stats.tokens += tokens
        if self._all_committed(lease.step):
            stats.finished_at = self.clock()
            if lease.step == self.step:
                self._current_done()
        return None

    def _all_committed(self, step: int) -> bool:
        return not any(r.step == step for r in self._pending) and not any(
            x.step == step for x in self._outstanding.values()
        )

    def _current_done(self) -> None:
        """Every lease of the current step is committed."""
        # The round after the last step only evaluates: nothing to apply.
        if self.eval_only:
            self._save()
        else:
            self.phase = Phase.APPLY
            # With overlap a step can enter APPLY as it becomes the current one, inside
            # try_advance: nothing advances it until `await_acks` named its nodes.
            self._acks_set = False

    def _requeue(self, lease: Lease) -> None:
        del self._outstanding[lease.lease_id]
        self._retired[lease.lease_id] = lease
        again = SampleRange(
            lease.sample_start, lease.sample_count, replay=True, eval=lease.eval, step=lease.step
        )
        # Replays go to the front of their step's ranges so a step's stragglers finish
        # first; a step ahead's stay behind the ranges of the steps before it (the queue is
        # in step order).
        at = sum(1 for r in self._pending if r.step < lease.step)
        self._pending.insert(at, again)

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
        if self.apply_held and node_id in self._awaiting_reduce:
            self._lost_in_hold.add(node_id)
        self._awaiting_reduce.discard(node_id)
        self._held_nodes.discard(node_id)
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
        self._acks_set = True

    @property
    def acks_set(self) -> bool:
        """False while the current step is in APPLY and `await_acks` has not named its nodes."""
        return self._acks_set

    def overdue(self, timeout_s: float) -> frozenset[str]:
        """The nodes still owing the current step's acknowledgement `timeout_s` after its
        APPLY began: the coordinator takes them out of the step, so no node that cannot
        finish an APPLY holds the swarm up without end."""
        owing = frozenset(self._awaiting_reduce if self.apply_held else self._awaiting_ack)
        if self.phase is not Phase.APPLY or not owing:
            return frozenset()
        if self._apply_since is None:
            self._apply_since = self.clock()
        if self.clock() - self._apply_since <= timeout_s:
            return frozenset()
        return owing

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
        """The step whose state a node must hold to start serving: the current step, or the
        next one while the current one is being applied; with overlap, the first step that
        does not train on older parameters than that state: the current one when it is a
        drain point still training (the steps open ahead of it train on its parameters
        too), else the first step not open yet (a node on its way in keeps the swarm
        unsettled, so that step opens as a drain point)."""
        if self.phase is not Phase.APPLY and self.trains_on(self.step) == self.step:
            return self.step
        return self.step + self._ahead + 1

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
        and no joining node holds the boundary. A step open ahead becomes the current one
        (in APPLY at once when its leases are all committed already)."""
        if self.phase is not Phase.APPLY or self._awaiting_ack or self.apply_held:
            return False
        if self.overlap and not self._acks_set:
            return False
        if self.held() is not None and self.step + 1 < self.total_steps:
            return False
        done = self.current
        self.counters.lost += self.global_batch - done.samples
        self._apply_since = None
        if self._ahead:
            self.step += 1
            self._ahead -= 1
            self.phase = Phase.TRAINING
            if self._all_committed(self.step):
                self._current_done()
        elif self.step + 1 >= self.total_steps and not self.evaluates(self.total_steps):
            self._save()
        else:
            self._open_step(self.step + 1)
            self.phase = Phase.TRAINING
        return True

    @property
    def awaiting(self) -> frozenset[str]:
        """The nodes the current APPLY waits for: their acknowledgement, or in a held one their
        reduce (a coordinator that restarts takes these up as owing acknowledgements: it lets
        the held APPLY go on)."""
        return frozenset(self._awaiting_ack | self._held_nodes)

    # -- what a restarted coordinator needs (coordinator/state_db.py) --------

    @property
    def next_lease_id(self) -> int:
        return self._next_lease_id

    @property
    def opened(self) -> bool:
        return self._opened

    @property
    def eval_pending(self) -> int:
        return self.current.eval_left if self.history else 0

    def pending_ranges(self) -> list[SampleRange]:
        """The open steps' samples not leased yet, in the order they will be."""
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
        ahead: int = 0,
    ) -> None:
        """Take up the state a coordinator that died had recorded (the history first). Leases
        that were open stay open for a full lease timeout from now: the heads that hold them
        still work on them and commit once they reach this coordinator. Steps open ahead
        (`ahead` of them) stay open; the next step to open is a drain point."""
        self.step, self.phase, self._opened = step, phase, opened
        self._next_lease_id, self._ahead = next_lease_id, ahead
        self._drain_next = True
        self._acks_set = True
        if self.history and not self.current.eval_left:
            self.current.eval_left = eval_pending
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
