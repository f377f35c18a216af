"""The coordinator: its gRPC API (join, lease, commit, status, drain) and its MQTT watch.

All state lives on one asyncio loop, so handlers need no locks. Domain errors
become `context.abort(StatusCode..., message)` here, at the boundary only.

Joining a running run: a node that joins after a step was applied is online
but not serving (out of the plan, the reduce and the awaited acks) until it
calls Ready with the state of the step it can start at (`target_step`). Ready
is accepted at once while that step trains, or the node is promoted when that
step opens (it fetched the state of a replica that already applied the step
before); a state the swarm has moved past is STALE, and the node fetches again
while the next step boundary waits for it (`coordinator.join_hold_s`). So no
node enters a reduce at a step whose state it does not hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiomqtt
import grpc

from swarmpipe.config import RunConfig, codec_enum, codec_name
from swarmpipe.control.bus import BrokerAddress, BrokerAuthError, Topics, make_client
from swarmpipe.control.mqtt_acl import RESERVED_USERS
from swarmpipe.coordinator import fleet_model
from swarmpipe.coordinator.admission import Admission
from swarmpipe.coordinator.membership import Member, Membership, MoveOrder, ThroughputView
from swarmpipe.coordinator.placement import PlacementPolicy, StepCosts
from swarmpipe.coordinator.state_db import Extras, MoveRow, StateDB
from swarmpipe.coordinator.step_protocol import Phase, StepProtocol
from swarmpipe.coordinator.suspects import DATA, REDUCE, Suspects
from swarmpipe.coordinator.tokens import TokenError
from swarmpipe.errors import PeerError, SwarmpipeError
from swarmpipe.protos import control_pb2, coordinator_pb2, coordinator_pb2_grpc, state_pb2
from swarmpipe.storage.checkpoints import CheckpointStore, CheckpointWriter, state_messages
from swarmpipe.transport.request_parsing import BAD_REQUESTS
from swarmpipe.transport.tls import RunCA, TLSError

logger = logging.getLogger(__name__)

_PHASES = {
    Phase.WAITING: control_pb2.StepState.PHASE_WAITING,
    Phase.TRAINING: control_pb2.StepState.PHASE_TRAINING,
    Phase.APPLY: control_pb2.StepState.PHASE_APPLY,
    Phase.SAVING: control_pb2.StepState.PHASE_SAVE,
    Phase.DONE: control_pb2.StepState.PHASE_DONE,
}
MAX_LEASE_WAIT_S = 30.0
# A refused upload is logged through the rate-limited log of bad calls.
PUT_CHECKPOINT = "/swarmpipe.v1.Coordinator/PutCheckpoint"
MAX_READY_WAIT_S = 30.0
MAX_NODE_ID_LEN = 128
# At most one plan per this many seconds for routing-weight changes alone
# (membership changes publish at once): every plan reaches every node.
PLAN_REFRESH_S = 5.0
# A large change in a node's rate is looked for at most this often.
RATE_CHECK_S = 2.0
# Status shows the throughput model as of at most this long ago: the best plan it shows
# beside the bound is a search (the testnet polls Status four times a second).
THROUGHPUT_VIEW_S = 2.0
# coordinator.apply_timeout_s = 0: the replicas' reduce (contributions for
# pipeline.reduce_timeout_s, manifests for half that again: node/replica_sync.py) plus this
# for the optimizer step, the digest and StepDone on a loaded machine.
APPLY_SLACK_S = 20.0
# How often the coordinator looks for an APPLY that a node cannot finish.
APPLY_CHECK_S = 1.0
# A step begins again at most this many times (a held APPLY that benched somebody): then it
# is applied unheld, as the screens left it, so no run can be held at one step for ever.
MAX_ATTEMPTS = 3


def apply_timeout(config: RunConfig) -> float:
    """How long a step's APPLY waits for a node's acknowledgement
    (`coordinator.apply_timeout_s`)."""
    reduce_s = 1.5 * config.pipeline.reduce_timeout_s
    return config.coordinator.apply_timeout_s or reduce_s + APPLY_SLACK_S


def placement_policy(config: RunConfig) -> PlacementPolicy:
    """The placement policy the run's `coordinator` section sets."""
    c = config.coordinator
    return PlacementPolicy(
        min_gain=c.move_min_gain,
        horizon_s=c.move_horizon_s,
        cooldown_s=c.move_cooldown_s,
        move_overhead_s=c.move_overhead_s,
    )


class CoordinatorService(coordinator_pb2_grpc.CoordinatorServicer):
    """Membership, placement, the step protocol and the run's counters."""

    def __init__(
        self,
        config: RunConfig,
        broker: BrokerAddress,
        state_dir: str | Path = "swarmpipe-state",
        *,
        resume_at: int = 0,
        admission: Admission | None = None,
        state_db: StateDB | None = None,
        ca: RunCA | None = None,
    ) -> None:
        self.config = config
        self.ca = ca
        """The run CA that signs each joiner's certificate (transport/tls.py); None: no TLS."""
        self.state_dir = Path(state_dir)
        self.admission = admission or Admission(self.state_dir, config.run_id, loopback_only=True)
        """Join tokens, credentials, the organiser's token (coordinator/admission.py)."""
        self.checkpoints = CheckpointStore(
            self.state_dir / "checkpoints", config.run_id, keep=config.checkpoint.keep
        )
        self.broker = broker
        self.topics = Topics(config.run_id)
        self.membership = Membership(
            num_stages=config.pipeline.stages,
            activation_codec=codec_enum(config.pipeline.activation_codec),
            gradient_codec=codec_enum(config.pipeline.gradient_codec),
            policy=placement_policy(config),
        )
        self._rates_checked_at = 0.0
        self._throughput: tuple[float, ThroughputView] | None = None
        self.protocol = StepProtocol(
            total_steps=config.train.steps,
            global_batch=config.train.global_batch,
            microbatch=config.train.microbatch,
            lease_timeout_s=config.coordinator.lease_timeout_s,
            eval_every=config.train.eval_every,
            eval_samples=config.train.eval_samples,
            depth=config.train.overlap_depth,
            # A checkpoint holds the parameters its step trains on only at a drain point,
            # so a run resumed from it takes the same steps as one never stopped.
            drain_every=config.checkpoint.every_steps,
            step=resume_at,  # the first step to open (a resumed run's last complete step)
        )
        self.started_at = time.monotonic()
        self._changed = asyncio.Event()
        self._mqtt: aiomqtt.Client | None = None
        self._mqtt_ready = asyncio.Event()
        self.done = asyncio.Event()
        self._plan_published_at = 0.0
        self.final_states: dict[int, Path] = {}
        """Stage -> its stored final state, once the run saves (Phase.SAVING)."""
        self._savers: dict[int, str] = {}
        """Stage -> the replica asked to store its final state."""
        self.joins = 0
        self.certificates_renewed = 0
        self.departures = 0
        self.move_records: list[coordinator_pb2.MoveRecord] = []
        self.suspects = Suspects(
            bench_s=config.robust.bench_s, verdicts=config.robust.bench_verdicts
        )
        self._benched_in_apply: set[str] = set()
        """Nodes benched during the current held APPLY: their step begins again without
        them (`_end_hold`)."""
        self.begun_again: set[tuple[str, int]] = set()
        """(node, step) of each bench that took its step back."""
        self.db = state_db
        """Where every change that matters is recorded (coordinator/state_db.py); None: not
        kept (unit tests)."""
        self._plan_bytes = b""
        self._new_checkpoints: list[tuple[int, int, str]] = []
        self.expected_back: set[str] = set()
        """Members a restarted coordinator remembers as online that have not shown
        themselves on MQTT yet; see `restore`."""

    # -- persistence ------------------------------------------------------

    def restore(self) -> bool:
        """Take up the run recorded in the state database, if it holds one; returns
        whether it did. Members that were online are taken as still online (their nodes
        keep training while the coordinator is away) but `expected_back`: one that does not
        publish its presence within `coordinator.restart_grace_s` counts as gone."""
        if self.db is None or self.db.phase is None:
            return False
        extras = self.db.load(self.protocol, self.membership)
        self.joins, self.departures = extras.joins, extras.departures
        self._plan_bytes = extras.plan
        self.final_states = {stage: Path(path) for stage, path in extras.final_states.items()}
        self.move_records = [
            coordinator_pb2.MoveRecord(
                node_id=r.order.node_id,
                from_stage=r.order.from_stage,
                to_stage=r.order.to_stage,
                reason=r.order.reason,
                step=r.step,
                elapsed_s=r.elapsed_s,
            )
            for r in extras.moves
        ]
        self.expected_back = {m.node_id for m in self.membership.members.values() if m.online}
        c = self.protocol.counters
        logger.warning(
            "resuming run %r live from its state database: step %d (%s), %d samples "
            "committed, %d out on leases; waiting up to %.0f s for %d node(s) to reconnect",
            self.config.run_id,
            self.protocol.step,
            self.protocol.phase.value,
            c.committed,
            self.protocol.outstanding_samples,
            self.config.coordinator.restart_grace_s,
            len(self.expected_back),
        )
        return True

    async def wait_for_members(self) -> None:
        """After a restart: members that have not shown up within the grace are gone."""
        if not self.expected_back:
            return
        await asyncio.sleep(self.config.coordinator.restart_grace_s)
        for node_id in sorted(self.expected_back):
            member = self.membership.members.get(node_id)
            if member is not None and member.online:
                logger.warning(
                    "node %s did not reconnect within %.0f s of the restart",
                    node_id,
                    self.config.coordinator.restart_grace_s,
                )
                await self._on_presence(
                    node_id, control_pb2.Presence(node_id=node_id, online=False, stage=member.stage)
                )
        self.expected_back.clear()

    def _persist(self) -> None:
        """Record the state in the database (one transaction), before any answer that
        depends on it goes out."""
        if self.db is None:
            return
        extras = Extras(
            joins=self.joins,
            departures=self.departures,
            plan=self._plan_bytes,
            final_states={stage: str(path) for stage, path in self.final_states.items()},
            moves=[
                MoveRow(order, step=record.step, elapsed_s=record.elapsed_s)
                for order, record in zip(self.membership.moves, self.move_records, strict=False)
            ],
            checkpoints=self._new_checkpoints,
        )
        self.db.save(self.protocol, self.membership, extras)

    # -- state changes --------------------------------------------------

    def _notify(self) -> None:
        self._persist()
        self._changed.set()
        self._changed = asyncio.Event()

    async def _publish(self, topic: str, payload: bytes) -> None:
        # What nodes act on must be on disk first: a coordinator that published APPLY and
        # died before recording it would come back in TRAINING and drop the nodes' acks.
        self._persist()
        await self._mqtt_ready.wait()
        assert self._mqtt is not None
        await self._mqtt.publish(topic, payload, qos=1, retain=True)

    async def _publish_plan(self) -> None:
        self._plan_published_at = time.monotonic()
        plan = self.membership.plan()
        plan.revoked.extend(sorted(self.admission.revoked_nodes))
        # Recorded by _publish: the plan's version must grow across restarts (nodes drop
        # older ones).
        self._plan_bytes = plan.SerializeToString()
        await self._publish(self.topics.plan, self._plan_bytes)

    async def _publish_step(self) -> None:
        p = self.protocol
        state = control_pb2.StepState(
            step=p.step,
            phase=_PHASES[p.phase],
            samples=p.current.samples if p.history else 0,
            trains_on=p.trains_on(p.step),
            ahead=p.ahead or 0,
            attempt=p.attempt,
            hold=p.apply_held,
        )
        if p.phase is Phase.SAVING:
            self._choose_savers()
            state.save_from.extend(self._savers[s] for s in sorted(self._savers))
        await self._publish(self.topics.step, state.SerializeToString())
        if p.phase is Phase.DONE:
            self.done.set()

    # -- moving nodes -------------------------------------------------------

    async def _heal(self) -> None:
        """A stage lost its last replica and nobody is on the way: move one there."""
        while (order := self.membership.heal()) is not None:
            await self._moved(order)

    def _may_move(self) -> bool:
        p = self.protocol
        # Not while an APPLY is held: a node moved before it reported its reduce would take
        # its share of the step with it, and the step would begin again for a move.
        return bool(p.history) and p.phase not in (Phase.SAVING, Phase.DONE) and not p.apply_held

    def _step_costs(self) -> StepCosts | None:
        """A step's fixed costs as measured over the last steps (fleet_model.step_costs)."""
        return fleet_model.step_costs(
            self.protocol.history, microbatch=self.config.train.microbatch
        )

    async def rebalance(self, why: str) -> int:
        """One rebalancing round now; how many moves it ordered."""
        if not self._may_move():
            return 0
        orders = self.membership.rebalance(time.monotonic(), self._step_costs())
        if orders:
            logger.info("rebalancing (%s): %d move(s)", why, len(orders))
        for order in orders:
            await self._moved(order)
        if orders:
            await self._after_change()
        return len(orders)

    async def rebalance_loop(self) -> None:
        """Rebalance every `coordinator.rebalance_every_s` (0: never)."""
        every = self.config.coordinator.rebalance_every_s
        if every <= 0:
            return
        while True:
            await asyncio.sleep(every)
            try:
                await self.rebalance("periodic")
            except Exception:  # one bad round must not end rebalancing for the run
                logger.exception("a rebalancing round failed; trying again next round")

    async def _check_rates(self) -> None:
        """A node's rate moved by a quarter or more since the last round: rebalance now,
        not at the next tick (checked at most once per RATE_CHECK_S: each check reads the
        whole fleet's telemetry)."""
        now = time.monotonic()
        if self.config.coordinator.rebalance_every_s <= 0 or not self._may_move():
            return
        if now - self._rates_checked_at < RATE_CHECK_S:
            return
        self._rates_checked_at = now
        if self.membership.rates_changed():
            await self.rebalance("a node's rate changed")

    async def _moved(self, order: MoveOrder) -> None:
        """Log, record and publish a move the membership made. The mover owes nothing to
        its old stage: its leases go back to the queue and no step waits for its ack."""
        p = self.protocol
        p.node_lost(order.node_id)
        logger.warning(
            "moving node %s from stage %d to stage %d: %s",
            order.node_id,
            order.from_stage,
            order.to_stage,
            order.reason,
        )
        self.move_records.append(
            coordinator_pb2.MoveRecord(
                node_id=order.node_id,
                from_stage=order.from_stage,
                to_stage=order.to_stage,
                reason=order.reason,
                step=p.step,
                elapsed_s=time.monotonic() - (p.run_started_at or time.monotonic()),
            )
        )
        await self._publish_plan()

    # -- the end of the run -------------------------------------------------

    async def finished(self, grace_s: float) -> None:
        """Return once the run is done and every node has left, or `grace_s` after done."""
        await self.done.wait()
        deadline = time.monotonic() + grace_s
        while any(m.online for m in self.membership.members.values()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                logger.info("not every node has left %.0f s after the run ended", grace_s)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))

    def _choose_savers(self) -> bool:
        """Ask one live replica of each stage whose final state is not stored yet to store
        it: the one asked before while it still serves, else the lowest node id. Returns
        whether the choice changed."""
        chosen: dict[int, str] = {}
        for stage in range(self.config.pipeline.stages):
            if stage in self.final_states:
                continue
            live = sorted(m.node_id for m in self.membership.replicas(stage))
            if not live:
                logger.error(
                    "stage %d has no live replica to store its final state; waiting for one "
                    "(a node that joins now restores the stage's latest checkpoint)",
                    stage,
                )
                continue
            before = self._savers.get(stage)
            chosen[stage] = before if before in live else live[0]
        changed = chosen != self._savers
        self._savers = chosen
        return changed

    async def _final_state_stored(self, stage: int, node_id: str, path: Path) -> None:
        """A stage's final state passed its checks: the run is done once every stage's is."""
        self.final_states[stage] = path
        self._savers.pop(stage, None)
        logger.info("final state of stage %d stored from %s: %s", stage, node_id, path)
        if len(self.final_states) == self.config.pipeline.stages:
            self.protocol.finish()
            logger.info(
                "every stage's final state is stored at step %d; the run is done",
                self.protocol.step,
            )
            await self._publish_step()
            self._notify()

    async def _after_change(self, before: tuple[Phase, int] | None = None) -> None:
        """Move the step protocol along after membership or commits changed.

        `before` is the (phase, step) from before the change, when the caller
        already changed the protocol (a commit can end a step).
        """
        p = self.protocol
        before = before or (p.phase, p.step)
        held_before, attempt_before = p.apply_held, p.attempt
        enough = len(self.membership.live()) >= self.config.coordinator.min_nodes or p.history
        if p.phase is Phase.WAITING and self.membership.covered() and enough:
            p.start()
        elif p.phase is Phase.TRAINING and not self.membership.covered():
            logger.warning("a stage has no live node; leasing paused until one joins")
            p.pause()
        if self._may_move():
            await self._heal()
            for order in self.membership.second_replicas(time.monotonic()):
                await self._moved(order)
        ahead_before = p.ahead
        if p.apply_held and not p.reduce_owed:
            self._end_hold()
        while p.phase is Phase.APPLY:
            if not p.acks_set:
                # The step just ended: every live node must apply it before the next opens;
                # held, they reduce first and step only once every verdict is in.
                live = {m.node_id for m in self.membership.live()}
                if self._hold_wanted():
                    p.hold_apply(live)
                    break
                p.await_acks(live)
            if not p.try_advance():
                self._wake_when_holds_expire()
                break
            await self._step_opened()
        if p.overlap and not self.membership.covered() and p.redo_as_drain():
            # (After the APPLY above: the step that just became current may be one opened
            # early.)
            logger.warning(
                "step %d: a stage has no live node; the step starts again on the newest "
                "parameters, so the node that takes the stage over can serve it",
                p.step,
            )
        settled = self._settled()
        while p.open_ahead(settled=settled):
            logger.info("step %d opens early, on step %d's parameters", p.ahead, p.step)
        if (p.phase, p.step, p.ahead, p.apply_held, p.attempt) != (
            *before,
            ahead_before,
            held_before,
            attempt_before,
        ):
            logger.info("step %d: %s%s", p.step, p.phase.value, " (held)" if p.apply_held else "")
            await self._publish_step()
        elif p.phase is Phase.SAVING and self._choose_savers():
            await self._publish_step()  # a replica asked to save left: ask another
        self._notify()

    def _hold_wanted(self) -> bool:
        """Whether the step entering APPLY is held: reduced everywhere before anybody steps,
        so that a replica benched by its stage's reduce takes its step back with it.

        Only where a bench can happen (a stage with three or more serving replicas: a bench
        needs a majority of two or more of the others) and only without overlap (steps open
        ahead would have trained on what is taken back) and with a reduce at every step."""
        c, p = self.config, self.protocol
        return (
            c.pipeline.sync == "every_step"
            and not p.overlap
            and c.robust.bench_s > 0
            and p.attempt < MAX_ATTEMPTS
            and any(len(self.membership.replicas(s)) >= 3 for s in range(c.pipeline.stages))
        )

    def _end_hold(self) -> None:
        """Every node of the held APPLY has reduced (or left): begin the step again without
        the nodes benched or lost before their reduce meanwhile (their share of the step
        would be missing), or let everybody step. A step whose stage lost its last replica
        goes on: nobody could train it again there."""
        p = self.protocol
        benched, lost = set(self._benched_in_apply), set(p.lost_in_hold) - self._benched_in_apply
        self._benched_in_apply.clear()
        if (benched or lost) and self.membership.covered():
            self.begun_again |= {(node, p.step) for node in benched}
            # What was reported of the step's reduce so far stays a verdict (a bench, or a
            # step counted toward one), but reports of two attempts never add up to one.
            self.suspects.forget_reports(p.step)
            p.begin_again()
            why = [f"{', '.join(sorted(benched))} benched"] if benched else []
            why += [f"{', '.join(sorted(lost))} gone"] if lost else []
            logger.warning(
                "step %d begins again (attempt %d): %s during its reduce, so a share of the "
                "step would have been lost; nobody had stepped",
                p.step,
                p.attempt + 1,
                " and ".join(why),
            )
            return
        p.release_apply({m.node_id for m in self.membership.live()})

    def _settled(self) -> bool:
        """Whether a step may open early (train.step_overlap): every stage served and no
        node on its way into a stage, so no node needs to enter the plan at a step that
        trains on parameters older than the state it downloads, and no joiner holds the
        boundary."""
        return self.membership.settled(time.monotonic()) and self.protocol.held() is None

    async def _step_opened(self) -> None:
        """A step opened: joiners holding its state serve from now on, in the plan first."""
        # Revocations are read at every step boundary too (not only each second), so a
        # revoked node takes part in no step after the one its token was revoked in.
        await self._apply_revocations()
        p = self.protocol
        if p.trains_on(p.step) != p.step:
            # Opened early (train.step_overlap): it trains on parameters older than the state
            # a joiner holds for it. Ready never names such a step, but a joiner that went
            # offline and came back meanwhile may still wait for it: it fetches again.
            for m in self.membership.members.values():
                if m.ready_step == p.step and not m.serving:
                    m.ready_step = -1
        promoted = self.membership.promote(p.step)
        for m in promoted:
            logger.info(
                "node %s serves stage %d from step %d", m.node_id, m.stage, self.protocol.step
            )
        if promoted:
            await self._publish_plan()

    def _wake_when_holds_expire(self) -> None:
        left = self.protocol.held()
        if left is not None:
            loop = asyncio.get_running_loop()
            loop.call_later(left + 0.01, lambda: asyncio.ensure_future(self._after_change()))

    async def watch_applies(self) -> None:
        """Bound every step's APPLY (`check_apply` every APPLY_CHECK_S)."""
        while True:
            await asyncio.sleep(APPLY_CHECK_S)
            try:
                await self.check_apply()
            except Exception:  # one bad round must not end the watch for the run
                logger.exception("checking the step's APPLY failed; trying again")

    async def check_apply(self) -> None:
        """No step's APPLY waits without end. A node that still owes its acknowledgement
        `apply_timeout` after the APPLY began leaves the step, logged: the step completes
        without it, and a node that still serves is ordered to fetch its stage's state again
        (a move to its own stage; until it is Ready it is out of the plan and of the reduce).
        An APPLY that owes nothing and is held by no joiner is moved along, in case a wake-up
        was lost."""
        p = self.protocol
        if p.phase is not Phase.APPLY:
            return
        timeout = apply_timeout(self.config)
        overdue = p.overdue(timeout)
        if not overdue:
            if not p.awaiting and p.held() is None:
                await self._after_change()
            return
        for node_id in sorted(overdue):
            member = self.membership.members.get(node_id)
            p.node_lost(node_id)
            serving = member is not None and member.serving and not member.drained
            logger.warning(
                "step %d: node %s has not acknowledged it %.0f s into its APPLY; the step "
                "completes without it%s",
                p.step,
                node_id,
                p.applying_for(),
                ", and it fetches its stage's state again" if serving else "",
            )
            if member is not None and serving:
                reason = f"re-sync: it did not apply step {p.step} within {timeout:.0f} s"
                await self._moved(self.membership.move(member, member.stage, reason))
        await self._after_change()
        # The step may have opened with a stage whose only replica now re-syncs: pause it.
        await self._after_change()

    # -- gRPC API -------------------------------------------------------

    async def Join(
        self, request: coordinator_pb2.JoinRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.JoinReply:
        if not request.node_id or len(request.node_id) > MAX_NODE_ID_LEN or "/" in request.node_id:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"node_id must be 1-{MAX_NODE_ID_LEN} characters without '/'",
            )
        if request.node_id in RESERVED_USERS:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"node_id {request.node_id!r} is reserved"
            )
        if not request.address or ":" not in request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address must be host:port")
        refusal = self.suspects.refusal(request.node_id, time.monotonic())
        if refusal is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        if self.protocol.phase is Phase.DONE:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run has finished")
        try:
            token_id = self.admission.admit(request.node_id, context.invocation_metadata())
        except TokenError as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise  # unreachable: abort raises
        tls_cert = b""
        if self.ca is not None:
            if not request.tls_public_key:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "this run uses TLS: the node must send a public key for its certificate",
                )
            try:
                tls_cert = self.ca.issue_node(
                    request.node_id, request.tls_public_key, lifetime=self._node_cert_lifetime
                )
            except TLSError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # The joiner serves only once it holds its stage's current state (Ready).
        previous = self.membership.members.get(request.node_id)
        member = self.membership.assign(request.node_id, request.address)
        member.incarnation = request.incarnation
        self.joins += 1
        self.expected_back.discard(request.node_id)
        if previous is not None:
            await self._retire(previous)
        self._persist()
        logger.info(
            "node %s (%s, version %s, token %s) joined: stage %d, %d replica(s) serving it",
            request.node_id,
            request.address,
            request.version or "?",
            token_id or "-",
            member.stage,
            len(self.membership.replicas(member.stage)),
        )
        return coordinator_pb2.JoinReply(
            run_id=self.config.run_id,
            run_config_json=self.config.to_json(),
            stage=member.stage,
            broker_url=self.broker.url,
            credential=self.admission.credential(request.node_id, member.stage),
            verify_key=self.admission.key.public_bytes,
            broker_username=request.node_id,
            broker_password=self.admission.key.mqtt_password(request.node_id),
            tls_certificate=tls_cert,
            tls_ca_certificate=self.ca.cert_pem if self.ca is not None else b"",
        )

    @property
    def _node_cert_lifetime(self) -> datetime.timedelta:
        return datetime.timedelta(hours=self.config.coordinator.node_cert_hours)

    async def RenewCertificate(
        self,
        request: coordinator_pb2.RenewCertificateRequest,
        context: grpc.aio.ServicerContext,
    ) -> coordinator_pb2.RenewCertificateReply:
        """A new certificate for a node of the run, before its old one expires. Its
        credential (checked like every call's, revoked tokens refused) says who it is."""
        await self._check_caller(request.node_id, context)
        if self.ca is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this run does not use TLS")
            raise AssertionError("unreachable: abort raises")
        if request.node_id not in self.membership.members:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"node {request.node_id!r} is not in the run"
            )
        try:
            cert = self.ca.issue_node(
                request.node_id, request.tls_public_key, lifetime=self._node_cert_lifetime
            )
        except TLSError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise AssertionError("unreachable: abort raises") from exc
        self.certificates_renewed += 1
        logger.info("node %s renewed its TLS certificate", request.node_id)
        return coordinator_pb2.RenewCertificateReply(tls_certificate=cert)

    async def _retire(self, previous: Member) -> None:
        """A node joined again under the id of `previous`, an earlier incarnation whose
        leaving the coordinator may not have heard of yet (a restart quicker than its Last
        Will, or a Will that arrives after the new Join and so is taken for the new one's
        and ignored). Whatever that incarnation owed the step goes with it: its leases
        return to the queue, its hold on the boundary ends and no APPLY waits for its
        acknowledgement, which the new incarnation, syncing, would never send (and whose
        Ready waits for the next step: the two would wait for each other for ever)."""
        p = self.protocol
        owed = previous.node_id in p.awaiting
        requeued = p.node_lost(previous.node_id)
        if not (owed or requeued or previous.serving):
            return  # the usual case: its leaving was handled when its Last Will came
        if previous.online:
            self.departures += 1
        logger.warning(
            "node %s joined again while its previous incarnation was still in step %d (%s); "
            "that one leaves the step: %d samples requeued%s",
            previous.node_id,
            p.step,
            p.phase.value,
            requeued,
            ", its acknowledgement is no longer awaited" if owed else "",
        )
        await self._publish_plan()
        await self._after_change()

    async def _check_caller(self, node_id: str, context: grpc.aio.ServicerContext) -> None:
        """Refuse a call whose request names another node than its credential does
        (AuthInterceptor already checked the credential itself)."""
        caller = self.admission.caller(context.invocation_metadata())
        if caller != node_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the request names node {node_id!r} but the credential is {caller!r}'s",
            )

    async def Lease(
        self, request: coordinator_pb2.LeaseRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.LeaseReply:
        await self._check_caller(request.node_id, context)
        member = self.membership.members.get(request.node_id)
        if member is None or member.stage != 0:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {request.node_id!r} is not a joined stage-0 node; only heads lease samples",
            )
        assert member is not None  # abort() raised otherwise
        deadline = time.monotonic() + min(max(request.wait_seconds, 0.0), MAX_LEASE_WAIT_S)
        Reply = coordinator_pb2.LeaseReply
        while True:
            if self.protocol.phase is Phase.DONE:
                return Reply(status=Reply.STATUS_DONE)
            if member.drained:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node was drained")
            serving = member.online and member.serving
            lease = self.protocol.lease(request.node_id) if serving else None
            if lease is not None:
                self._persist()
                return Reply(
                    status=Reply.STATUS_GRANTED,
                    lease_id=lease.lease_id,
                    step=lease.step,
                    sample_start=lease.sample_start,
                    sample_count=lease.sample_count,
                    replay=lease.replay,
                    eval=lease.eval,
                    trains_on=self.protocol.trains_on(lease.step),
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Reply(status=Reply.STATUS_WAIT, step=self.protocol.step)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))

    async def Commit(
        self, request: coordinator_pb2.CommitRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.CommitReply:
        await self._check_caller(request.node_id, context)
        before = (self.protocol.phase, self.protocol.step)
        reason = self.protocol.commit(
            request.node_id, request.lease_id, request.loss_sum, request.tokens
        )
        if reason is not None:
            logger.warning("commit from %s refused: %s", request.node_id, reason)
            self._persist()  # a duplicate is counted
            return coordinator_pb2.CommitReply(accepted=False, reason=reason)
        await self._after_change(before)
        return coordinator_pb2.CommitReply(accepted=True)

    async def Release(
        self, request: coordinator_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReleaseReply:
        await self._check_caller(request.node_id, context)
        if self.protocol.release(request.node_id, request.lease_id):
            logger.info(
                "lease %d released by %s: %s", request.lease_id, request.node_id, request.reason
            )
            self._notify()
        return coordinator_pb2.ReleaseReply()

    async def StepDone(
        self, request: coordinator_pb2.StepDoneRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.StepDoneReply:
        await self._check_caller(request.node_id, context)
        member = self.membership.members.get(request.node_id)
        before = (self.protocol.phase, self.protocol.step)
        if request.held:
            # A held APPLY's reduce is done on that node: it steps once every verdict is in.
            self.protocol.reduced(request.node_id, request.step)
            await self._after_change(before)
            return coordinator_pb2.StepDoneReply()
        if member is not None and member.serving and request.param_digest:
            member.last_step, member.param_digest = request.step, request.param_digest
        if self.protocol.ack(request.node_id, request.step):
            logger.info("step %d applied on every node", request.step)
            await self._step_opened()
            # The step that opened may be one opened early whose leases are all in: its
            # APPLY starts now (_after_change names its nodes and publishes).
            await self._after_change(before)
            if self.config.pipeline.sync == "every_step":  # DiLoCo's replicas drift apart
                for order in self.membership.diverged(request.step):
                    await self._moved(order)
                    await self._after_change()
        else:
            self._persist()
            if self.protocol.phase is Phase.APPLY and not self.protocol.awaiting:
                self._wake_when_holds_expire()
        return coordinator_pb2.StepDoneReply()

    async def Status(
        self, request: coordinator_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.StatusReply:
        return self.status()

    async def Move(
        self, request: coordinator_pb2.MoveRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.MoveReply:
        member = self.membership.members.get(request.node_id)
        if member is None or member.drained:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no node {request.node_id!r} in run {self.config.run_id!r}",
            )
        assert member is not None  # abort() raised otherwise
        stages = self.config.pipeline.stages
        if request.stage >= stages:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stage {request.stage} does not exist: run {self.config.run_id!r} has "
                f"{stages} stages (0 to {stages - 1})",
            )
        if request.stage == member.stage:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {request.node_id!r} already serves stage {member.stage}",
            )
        if self.protocol.phase in (Phase.SAVING, Phase.DONE):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "the run is ending")
        others = [m for m in self.membership.replicas(member.stage) if m is not member]
        if member.serving and not others:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {request.node_id!r} is the last replica of stage {member.stage}: "
                "moving it would leave that stage empty",
            )
        before = member.stage
        order = self.membership.move(member, request.stage, "moved by the operator")
        await self._moved(order)
        await self._after_change()
        return coordinator_pb2.MoveReply(from_stage=before)

    async def Drain(
        self, request: coordinator_pb2.DrainRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.DrainReply:
        member = self.membership.members.get(request.node_id)
        if member is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no node {request.node_id!r}")
        assert member is not None  # abort() raised otherwise
        member.drained = True
        requeued = self.protocol.node_lost(request.node_id)
        logger.info("node %s drained; %d samples requeued", request.node_id, requeued)
        await self._publish_plan()
        await self._after_change()
        return coordinator_pb2.DrainReply()

    async def ReportPeer(
        self, request: coordinator_pb2.ReportPeerRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReportPeerReply:
        kinds = {
            coordinator_pb2.ReportPeerRequest.KIND_REDUCE: REDUCE,
            coordinator_pb2.ReportPeerRequest.KIND_DATA: DATA,
        }
        await self._check_caller(request.reporter, context)
        reporter = self.membership.members.get(request.reporter)
        suspect = self.membership.members.get(request.suspect)
        if reporter is None or not reporter.serving or reporter.drained:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"reporter {request.reporter!r} is not a serving node of this run",
            )
        if suspect is None or request.suspect == request.reporter:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no other node {request.suspect!r} in this run"
            )
        if request.kind not in kinds:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "kind must be REDUCE or DATA")
        assert reporter is not None and suspect is not None  # abort() raised otherwise
        peers = {m.node_id for m in self.membership.replicas(suspect.stage)} - {suspect.node_id}
        entry = self.suspects.report(
            reporter=request.reporter,
            suspect=request.suspect,
            step=request.step,
            kind=kinds[request.kind],
            reason=request.reason[:300],
            stage=suspect.stage,
            stage_peers=peers,
            now=time.monotonic(),
            sole_server=suspect.serving and not suspect.drained and not peers,
            conclusive=request.conclusive,
        )
        if entry is None:
            if kinds[request.kind] == DATA and suspect.serving and not peers:
                logger.warning(
                    "node %s (stage %d) not benched although %s reported that %s: it is its "
                    "stage's only serving replica",
                    request.suspect,
                    suspect.stage,
                    request.reporter,
                    request.reason[:300],
                )
            return coordinator_pb2.ReportPeerReply(benched=False)
        logger.warning(
            "node %s (stage %d) benched for %.0f s at step %d: %s reported that %s",
            entry.node_id,
            entry.stage,
            self.config.robust.bench_s,
            entry.step,
            ", ".join(entry.reporters),
            entry.reason,
        )
        if self.protocol.apply_held and entry.step == self.protocol.step:
            self._benched_in_apply.add(entry.node_id)  # its step begins again without it
        if self.config.robust.bench_s > 0 and not suspect.drained:
            suspect.drained = True  # out of the plan, as Drain does; the node stops
            self.protocol.node_lost(suspect.node_id)
            await self._publish_plan()
            await self._after_change()
        return coordinator_pb2.ReportPeerReply(benched=True)

    # -- joining a running run -------------------------------------------

    async def _syncing_member(self, node_id: str, context: grpc.aio.ServicerContext) -> Member:
        member = self.membership.members.get(node_id)
        if member is None or member.drained:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"node {node_id!r} has not joined (or was drained); call Join first",
            )
        assert member is not None  # abort() raised otherwise
        return member

    async def SyncInfo(
        self, request: coordinator_pb2.SyncInfoRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.SyncInfoReply:
        await self._check_caller(request.node_id, context)
        member = await self._syncing_member(request.node_id, context)
        p = self.protocol
        return coordinator_pb2.SyncInfoReply(
            step=p.step,
            target=p.target_step,
            applying=p.phase is Phase.APPLY,
            done=p.phase is Phase.DONE,
            replicas=[
                control_pb2.Replica(node_id=m.node_id, address=m.address, weight=1.0)
                for m in self.membership.replicas(member.stage)
                if m.node_id != member.node_id
            ],
        )

    async def Ready(
        self, request: coordinator_pb2.ReadyRequest, context: grpc.aio.ServicerContext
    ) -> coordinator_pb2.ReadyReply:
        await self._check_caller(request.node_id, context)
        member = await self._syncing_member(request.node_id, context)
        Reply = coordinator_pb2.ReadyReply
        deadline = time.monotonic() + min(max(request.wait_seconds, 0.0), MAX_READY_WAIT_S)
        step = int(request.step)
        while True:
            p = self.protocol
            if self.membership.members.get(request.node_id) is not member or member.drained:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION, "this node joined again or was drained"
                )
            applying = p.phase is Phase.APPLY
            if p.phase is Phase.DONE:
                return Reply(status=Reply.STATUS_DONE, step=p.step)
            if member.serving:
                return Reply(status=Reply.STATUS_ACCEPTED, step=p.step, applying=applying)
            if step != p.target_step:
                # The swarm moved past this state (or the node is confused): it fetches
                # again, and the next step boundary waits for it so it can catch up.
                p.hold(member.node_id, self.config.coordinator.join_hold_s)
                member.ready_step = -1
                logger.info(
                    "node %s holds step %d but the swarm needs %d; it fetches again",
                    member.node_id,
                    step,
                    p.target_step,
                )
                return Reply(status=Reply.STATUS_STALE, step=p.step, applying=applying)
            pending = member.ready_step == step
            if member.online and not pending:  # its Last Will is armed: losing it is noticed
                # What it holds is the stage's state after step - 1: its digest is what the
                # stage's replicas reported for that step (Membership.diverged compares them).
                member.last_step, member.param_digest = step - 1, request.param_digest
                if applying or step != p.step:
                    # A step to come (the next while this one is applied; with
                    # train.step_overlap, the first that trains on the newest parameters).
                    # Promoted when `step` opens (_step_opened); the boundary need not wait.
                    member.ready_step = step
                    p.drop_hold(member.node_id)
                    await self._after_change()
                else:
                    member.serving, member.ready_step = True, -1
                    p.drop_hold(member.node_id)
                    logger.info(
                        "node %s serves stage %d from step %d", member.node_id, member.stage, step
                    )
                    await self._publish_plan()
                    await self._after_change()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return Reply(status=Reply.STATUS_WAIT, step=p.step, applying=applying)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))

    # -- the checkpoint store ----------------------------------------------

    async def PutCheckpoint(
        self,
        request_iterator: AsyncIterator[state_pb2.StateMessage],
        context: grpc.aio.ServicerContext,
    ) -> coordinator_pb2.PutCheckpointReply:
        writer: CheckpointWriter | None = None
        try:
            async for message in request_iterator:
                if writer is None:
                    writer = self._checkpoint_writer(message)
                await asyncio.to_thread(writer.add, message)
            if writer is None:
                raise PeerError("the checkpoint stream was empty")
            path = await asyncio.to_thread(writer.commit)
        except PeerError as exc:
            if writer is not None:
                writer.abort()
            BAD_REQUESTS.record(PUT_CHECKPOINT, context.peer(), f"a checkpoint: {exc}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        manifest = writer.stream.manifest
        assert manifest is not None
        logger.info(
            "checkpoint of stage %d at step %d from %s stored (%d bytes)",
            manifest.stage,
            manifest.step,
            manifest.node_id,
            manifest.payload_bytes,
        )
        self._new_checkpoints.append((int(manifest.stage), int(manifest.step), str(path)))
        self._persist()
        p = self.protocol
        if p.phase is Phase.SAVING and manifest.step == p.step:
            await self._final_state_stored(int(manifest.stage), manifest.node_id, path)
        return coordinator_pb2.PutCheckpointReply(stored_as=str(path))

    def _checkpoint_writer(self, first: state_pb2.StateMessage) -> CheckpointWriter:
        if first.WhichOneof("kind") != "manifest":
            raise PeerError("a checkpoint stream starts with its manifest")
        manifest = first.manifest
        member = self.membership.members.get(manifest.node_id)
        if member is None or not member.serving or member.stage != manifest.stage:
            raise PeerError(
                f"{manifest.node_id!r} is not a serving replica of stage {manifest.stage}"
            )
        if manifest.step > self.protocol.step + 1:
            raise PeerError(f"step {manifest.step} is ahead of the run's step {self.protocol.step}")
        return self.checkpoints.receive(manifest.stage)

    async def GetCheckpoint(
        self, request: coordinator_pb2.GetCheckpointRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[state_pb2.StateMessage]:
        await self._check_caller(request.node_id, context)
        member = await self._syncing_member(request.node_id, context)
        if request.stage != member.stage:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"node {request.node_id!r} serves stage {member.stage}, not {request.stage}",
            )
        # The newest the node can start from: a resumed run may hold newer checkpoints of
        # some stages, from after its last complete step.
        target = self.protocol.target_step
        latest = next(
            (c for c in reversed(self.checkpoints.checkpoints(request.stage)) if c[0] <= target),
            None,
        )
        if latest is None:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no checkpoint of stage {request.stage} at step {target} or before",
            )
        assert latest is not None
        try:
            manifest, chunks = await asyncio.to_thread(self.checkpoints.read, latest[1])
        except (OSError, PeerError, ValueError) as exc:
            await context.abort(grpc.StatusCode.DATA_LOSS, f"{latest[1]} is unreadable: {exc}")
            raise  # unreachable
        messages = state_messages(manifest, chunks)
        while (message := await asyncio.to_thread(_next_or_none, messages)) is not None:
            yield message

    def status(self) -> coordinator_pb2.StatusReply:
        p = self.protocol
        c = p.counters
        reply = coordinator_pb2.StatusReply(
            run_id=self.config.run_id,
            step=p.step,
            total_steps=p.total_steps,
            phase=p.phase.value,
            done=p.phase is Phase.DONE,
            counters=coordinator_pb2.SampleCounters(
                leased=c.leased,
                committed=c.committed,
                replayed=c.replayed,
                duplicates=c.duplicates,
                lost=c.lost,
                outstanding=p.outstanding_samples,
            ),
            joins=self.joins,
            departures=self.departures,
            moves=self.move_records,
            state_dir=str(self.state_dir.resolve()),
            reports=self.suspects.accepted,
        )
        now = time.monotonic()
        for b in self.suspects.history:
            reply.benched.append(
                coordinator_pb2.BenchRecord(
                    node_id=b.node_id,
                    stage=b.stage,
                    reason=b.reason,
                    step=b.step,
                    reporters=b.reporters,
                    elapsed_s=b.at - self.started_at,
                    seconds_left=max(b.until - now, 0.0),
                    step_begun_again=(b.node_id, b.step) in self.begun_again,
                )
            )
        if self._throughput is None or now - self._throughput[0] > THROUGHPUT_VIEW_S:
            self._throughput = (now, self.membership.throughput(self._step_costs()))
        view = self._throughput[1]
        reply.placement.CopyFrom(
            coordinator_pb2.PlacementRecord(
                bound=view.bound,
                best_bound=view.best_bound,
                stage_rates=view.stage_rates,
                stream_bound=view.stream_bound,
                best_stream_bound=view.best_stream_bound,
                step_fill_s=view.costs.fill_s if view.costs else 0.0,
                step_barrier_s=view.costs.barrier_s if view.costs else 0.0,
                step_samples=view.costs.samples if view.costs else 0.0,
                unconfirmed=sorted(self.membership.unconfirmed()),
                nodes=[
                    coordinator_pb2.NodeRate(
                        node_id=n.node_id,
                        stage=n.stage,
                        compute=n.compute,
                        effective=n.effective,
                        limited_by=n.limited_by,
                    )
                    for n in view.nodes
                ],
            )
        )
        for stage, path in sorted(self.final_states.items()):
            reply.final_states.append(
                coordinator_pb2.FinalStateRecord(stage=stage, step=p.step, path=str(path))
            )
        run_start = p.run_started_at or 0.0
        for s in p.history:
            if s.eval_finished_at is not None:
                reply.evals.append(
                    coordinator_pb2.EvalRecord(
                        step=s.step,
                        loss=s.eval_loss,
                        tokens=s.eval_tokens,
                        elapsed_s=s.eval_finished_at - run_start,
                        trains_on=p.trains_on(s.step),
                    )
                )
            if s.finished_at is None or s.step >= p.total_steps:
                continue  # still running, or the evaluation-only round after the last step
            reply.steps.append(
                coordinator_pb2.StepRecord(
                    step=s.step,
                    loss=s.loss,
                    samples=s.samples,
                    seconds=s.seconds,
                    samples_per_second=s.samples / s.seconds if s.seconds > 0 else 0.0,
                    elapsed_s=s.finished_at - run_start,
                    trains_on=p.trains_on(s.step),
                )
            )
        for m in sorted(self.membership.members.values(), key=lambda m: m.node_id):
            t = m.telemetry
            reply.nodes.append(
                coordinator_pb2.NodeRecord(
                    node_id=m.node_id,
                    stage=m.stage,
                    address=m.address,
                    online=m.online and not m.drained,
                    samples=t.samples if t else 0,
                    samples_per_second=t.samples_per_second if t else 0.0,
                    last_step=max(m.last_step, 0),
                    param_digest=m.param_digest,
                    compute_seconds_per_microbatch=t.compute_seconds_per_microbatch if t else 0.0,
                    serving=m.serving and m.online and not m.drained,
                    step_times=t.step_times if t else (),
                    in_flight_window=t.in_flight_window if t else 0,
                )
            )
            for link in t.links if t else ():
                reply.links.append(
                    coordinator_pb2.LinkRecord(
                        src_node=m.node_id,
                        dst_node=link.peer,
                        direction=link.direction,
                        codec=codec_name(link.codec),
                        bytes=link.bytes,
                        tensors=link.tensors,
                    )
                )
            for estimate in t.link_estimates if t else ():
                reply.link_choices.append(_link_choice_record(m.node_id, estimate))
        return reply

    # -- revoked tokens ---------------------------------------------------

    async def watch_tokens(self, interval_s: float = 1.0) -> None:
        """Put the nodes of a token the organiser revoked out of the run: out of the plan
        (their leases requeued) and refused on every call from then on."""
        while True:
            await self._apply_revocations(after_change=True)
            await asyncio.sleep(interval_s)

    async def _apply_revocations(self, *, after_change: bool = False) -> None:
        revoked = self.admission.newly_revoked()
        for node_id in revoked:
            member = self.membership.members.get(node_id)
            requeued = self.protocol.node_lost(node_id)
            if member is not None:
                member.drained, member.serving = True, False
            logger.warning(
                "node %s put out of the run: its join token was revoked; %d samples requeued",
                node_id,
                requeued,
            )
        if revoked:
            await self._publish_plan()
            if after_change:
                await self._after_change()

    # -- MQTT -----------------------------------------------------------

    async def watch_mqtt(self) -> None:
        """Follow presence and telemetry; reconnect when the broker connection drops.

        A broker that refuses the coordinator's credentials at start is a one-line error
        (the coordinator exits 1): they will not get better by retrying. Refused later, after
        it was in once, the coordinator keeps trying, since the swarm depends on it."""
        backoff = 0.05
        connected_once = False
        while True:
            try:
                async with make_client(self.broker, f"coordinator-{self.config.run_id}") as client:
                    connected_once = True
                    self._mqtt = client
                    await client.subscribe(self.topics.presence(), qos=1)
                    await client.subscribe(self.topics.telemetry(), qos=0)
                    self._mqtt_ready.set()
                    backoff = 0.05
                    await self._publish_plan()
                    await self._publish_step()
                    async for message in client.messages:
                        await self._on_message(str(message.topic), message.payload)
            except BrokerAuthError as exc:
                if not connected_once:
                    raise SwarmpipeError(
                        f"cannot use the MQTT broker at {self.broker.url}: {exc}"
                    ) from exc
                self._mqtt_ready.clear()
                logger.warning("MQTT broker %s: %s; trying again", self.broker.url, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except aiomqtt.MqttError as exc:
                self._mqtt_ready.clear()
                logger.warning(
                    "MQTT connection to %s lost (%s); reconnecting", self.broker.url, exc
                )
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _on_message(self, topic: str, payload: object) -> None:
        kind = self.topics.kind_of(topic)
        if kind is None or not isinstance(payload, bytes | bytearray):
            return
        what, node_id = kind
        member = self.membership.members.get(node_id)
        try:
            if what == "presence":
                presence = control_pb2.Presence.FromString(bytes(payload))
                await self._on_presence(node_id, presence)
            elif what == "telemetry" and member is not None:
                member.telemetry = control_pb2.Telemetry.FromString(bytes(payload))
                now = time.monotonic()
                if (
                    now - self._plan_published_at > PLAN_REFRESH_S
                    and self.membership.weights_drifted()
                ):
                    await self._publish_plan()
        except Exception as exc:  # a hostile or broken payload must not stop the watch
            logger.warning("ignoring malformed %s message from %s: %s", what, node_id, exc)
            return
        if what == "telemetry" and member is not None:
            await self._check_rates()

    async def _on_presence(self, node_id: str, presence: control_pb2.Presence) -> None:
        member = self.membership.members.get(node_id)
        if member is None:
            return  # a retained presence from an earlier coordinator's run
        if (
            presence.incarnation
            and member.incarnation
            and presence.incarnation != member.incarnation
        ):
            # An earlier process of this node id (its Last Will, or a retained "online"),
            # arriving after the process that joined since: not about that one.
            logger.debug("node %s: presence of an earlier incarnation ignored", node_id)
            return
        if presence.online and presence.stage == member.stage:
            self.expected_back.discard(node_id)
        if presence.online and presence.stage != member.stage:
            return  # a stale retained message from an earlier life of this node
        if presence.online == member.online:
            return
        member.online = presence.online
        member.announced = member.announced or presence.online
        if not presence.online:
            member.serving, member.ready_step = False, -1
        if presence.online:
            logger.info("node %s online (stage %d)", node_id, member.stage)
        else:
            self.departures += 1
            requeued = self.protocol.node_lost(node_id)
            level = logging.INFO if self.protocol.phase is Phase.DONE else logging.WARNING
            logger.log(
                level,
                "node %s offline (stage %d); %d samples requeued",
                node_id,
                member.stage,
                requeued,
            )
        await self._publish_plan()
        await self._after_change()


def _link_choice_record(
    src_node: str, estimate: control_pb2.LinkEstimate
) -> coordinator_pb2.LinkChoiceRecord:
    """A node's telemetry about one of its link directions, with codec names for people."""
    return coordinator_pb2.LinkChoiceRecord(
        src_node=src_node,
        dst_node=estimate.peer,
        direction=estimate.direction,
        bytes_per_second=estimate.bytes_per_second,
        limit_bytes_per_second=estimate.limit_bytes_per_second,
        latency_ms=estimate.latency_ms,
        wire_bytes=estimate.wire_bytes,
        codec=codec_name(estimate.codec),
        changes=[
            coordinator_pb2.CodecChangeRecord(
                timestamp=c.timestamp,
                step=c.step,
                codec=codec_name(c.codec),
                bytes_per_second=c.bytes_per_second,
                budget_seconds=c.budget_seconds,
            )
            for c in estimate.changes
        ],
    )


def _next_or_none(messages: Iterator[state_pb2.StateMessage]) -> state_pb2.StateMessage | None:
    """The next message (read from disk in a worker thread), or None at the end."""
    return next(messages, None)
