"""Who is in the swarm, which stage each node serves, and the plan built from that.

Placement runs the policy of coordinator/placement.py on the live fleet, as
coordinator/fleet_model.py reads it from the nodes' telemetry:

- `assign`: a joiner goes where it raises the sorted stage rates most, a stage with one
  replica first while that costs the bound little (`placement.place_joiner`).
- `heal`: when a stage loses its last live replica and no node is on its way to it, the
  node that costs the rest least moves there, never a stage's last replica
  (`placement.refill`).
- `second_replicas`: at every change, a stage left with one replica while another has
  three or more gets a second (`placement.second_replicas`), cool-down or not.
- `rebalance`: the periodic round (and one on a large rate change): second replicas, then
  throughput moves that pay for their state download, with hysteresis
  (`placement.rebalance`). It waits while any node is still fetching a stage's state, so
  one batch of moves settles before the next is planned, and plans no throughput move
  while a mover's figures on its new stage are estimates (`unconfirmed`).

A mover leaves its old stage's plan at once (that stage keeps a live replica), fetches the
new stage's state (from a live replica, else its latest checkpoint) and serves it once
Ready, like a joiner. Every move is recorded with its reason.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from swarmpipe.coordinator import fleet_model, placement
from swarmpipe.protos import control_pb2

logger = logging.getLogger(__name__)

# A node that joined but has not announced itself on MQTT yet still holds its
# stage for this long, so two nodes joining together do not take the same one.
JOIN_GRACE_S = 30.0
# A replica's routing weight is republished when its measured rate moves this
# far (relative) from the weight in the last plan; smaller moves are noise.
WEIGHT_DRIFT = 0.25
# A stage whose replicas give less than this share of what they compute is held back by
# its links: a move to it is reported as a "bandwidth" move.
LINK_BOUND = 0.9
# A node that moved counts as measured on its new stage once it has reported this many
# whole steps there: the first may be partial (it starts serving mid-step), and its link
# meters and byte counters need a step of the new traffic.
CONFIRM_STEPS = 2
# ... or once the swarm is this many steps past its move whatever it reported: a mover that
# gets no traffic (or whose telemetry is lost) must not hold rebalancing up for the run.
CONFIRM_WITHIN_STEPS = 6
# Status shows the best plan's bound beside the current one for fleets up to this size; a
# plan of thousands of nodes takes seconds, too long for every Status call.
BEST_PLAN_FLEET = 256


@dataclass(slots=True)
class Member:
    node_id: str
    address: str
    stage: int
    joined_at: float
    online: bool = False
    announced: bool = False
    """It has been online once: from then on only `online` says whether it holds its stage."""
    drained: bool = False
    telemetry: control_pb2.Telemetry | None = None
    last_step: int = -1
    param_digest: str = ""
    serving: bool = False
    """In the plan: it holds its stage's state for the current step. A node that
    joins a running run is online but not serving while it downloads that state."""
    ready_step: int = -1
    """A syncing node holding the state of the step about to open; it serves from then."""
    move_order: int = 0
    """The latest move the coordinator ordered for this node (0: none); listed in the plan
    until the node serves its new stage."""
    moved_at: float = -1.0
    """When it joined or was last moved (monotonic seconds): the policy's cool-down."""
    incarnation: int = 0
    """The node process that joined last under this id (JoinRequest.incarnation; 0:
    unknown, as after a coordinator restart): presence from another process is stale."""
    moved_from: control_pb2.Telemetry | None = None
    """Its telemetry when it was last moved: its figures on the new stage count only what
    it did since (its counters are the process's totals), and are estimates until it has
    been measured there (`Membership.unconfirmed`). None: never moved."""
    moved_at_step: int = -1
    """The swarm's latest reported step when it was last moved."""


@dataclass(frozen=True, slots=True)
class MoveOrder:
    order: int
    node_id: str
    from_stage: int
    to_stage: int
    reason: str


@dataclass(frozen=True, slots=True)
class NodeRateView:
    node_id: str
    stage: int
    compute: float
    effective: float
    limited_by: str


@dataclass(frozen=True, slots=True)
class ThroughputView:
    """`Membership.throughput`: what the model makes of the serving nodes, in samples/s."""

    bound: float
    """Whole steps' samples/s where the nodes are: `stream_bound` with the step's costs."""
    best_bound: float
    stage_rates: list[float]
    nodes: list[NodeRateView]
    stream_bound: float = 0.0
    """The slowest stage's rate: what the pipeline streams between a step's fill and drain."""
    best_stream_bound: float = 0.0
    costs: placement.StepCosts | None = None


@dataclass(slots=True)
class Membership:
    """The coordinator's view of the nodes, and the plan it publishes."""

    num_stages: int
    activation_codec: int
    gradient_codec: int
    members: dict[str, Member] = field(default_factory=dict)
    plan_version: int = 0
    published_weights: dict[str, float] = field(default_factory=dict)
    moves: list[MoveOrder] = field(default_factory=list)
    policy: placement.PlacementPolicy = field(default_factory=placement.PlacementPolicy)
    rated: dict[str, float] = field(default_factory=dict)
    """Each live node's effective rate at the last rebalance, to notice a large change."""

    def _holds_stage(self, m: Member, now: float) -> bool:
        if m.drained:
            return False
        # A node that went offline stops holding its stage at once, so the next
        # joiner replaces it instead of piling onto a stage that still has one.
        return m.online or (not m.announced and now - m.joined_at < JOIN_GRACE_S)

    def assign(self, node_id: str, address: str) -> Member:
        """Place a joining node where it raises the throughput bound most
        (`placement.place_joiner`; with nothing measured yet, that is the stage with the
        fewest replicas, lowest index on ties)."""
        now = time.monotonic()
        previous = self.members.get(node_id)
        holders = [
            m for m in self.members.values() if m.node_id != node_id and self._holds_stage(m, now)
        ]
        fleet = [_observed(m) for m in holders]
        specs = fleet_model.stage_specs(fleet, self.num_stages)
        caps = fleet_model.node_caps([*fleet, fleet_model.Observed(node_id, -1, None)], specs)
        joiner = caps.pop(node_id)
        assignment = {m.node_id: m.stage for m in holders}
        rates = placement.stage_rates(assignment, caps, specs)
        stage = placement.place_joiner(
            joiner,
            specs,
            self.policy,
            rates=rates,
            replicas=placement.replica_counts(assignment, self.num_stages),
        )
        if previous is not None and not previous.drained and previous.stage != stage:
            # A restarted node keeps its stage when that costs nothing.
            def with_joiner(s: int) -> list[float]:
                trial = list(rates)
                trial[s] += placement.effective_rate(joiner, specs, s)
                return sorted(trial)

            if with_joiner(previous.stage) >= with_joiner(stage):
                stage = previous.stage
        member = Member(node_id=node_id, address=address, stage=stage, joined_at=now, moved_at=now)
        self.members[node_id] = member
        return member

    def fleet(
        self, members: list[Member]
    ) -> tuple[tuple[placement.StageSpec, ...], dict[str, placement.NodeCaps]]:
        """The policy's view of these members: the stages' specs and each node's caps."""
        observed = [_observed(m) for m in members]
        specs = fleet_model.stage_specs(observed, self.num_stages)
        return specs, fleet_model.node_caps(observed, specs)

    def live(self) -> list[Member]:
        """Serving nodes: online, not drained, and holding their stage's current state."""
        return [m for m in self.members.values() if m.online and m.serving and not m.drained]

    def replicas(self, stage: int) -> list[Member]:
        """The live replicas of one stage, by node id."""
        return sorted((m for m in self.live() if m.stage == stage), key=lambda m: m.node_id)

    def promote(self, step: int) -> list[Member]:
        """Step `step` opens: nodes that hold its state (ready_step) start serving."""
        promoted = []
        for m in self.members.values():
            if m.ready_step == step and m.online and not m.drained and not m.serving:
                m.serving, m.ready_step = True, -1
                promoted.append(m)
        return promoted

    def covered(self) -> bool:
        """Every stage has at least one live replica."""
        return {m.stage for m in self.live()} == set(range(self.num_stages))

    def settled(self, now: float) -> bool:
        """Every stage has a live replica and no node is on its way into a stage (joined,
        moved or re-syncing, fetching its state): train.step_overlap opens steps early only
        then (coordinator/step_protocol.py)."""
        return self.covered() and not self._coming(None, now)

    def _coming(self, stage: int | None, now: float) -> bool:
        """A node is on its way to `stage` (None: to any stage): joined or moved there,
        online (or not announced yet, within JOIN_GRACE_S) and fetching its state."""
        return any(
            (stage is None or m.stage == stage) and not m.serving and self._holds_stage(m, now)
            for m in self.members.values()
        )

    def heal(self) -> MoveOrder | None:
        """Move a replica to a stage that has none left and nobody coming: the node whose
        leaving costs the rest least, from a stage that keeps a live replica
        (`placement.refill`); None when no such move exists. Call again for another
        empty stage."""
        now = time.monotonic()
        live = self.live()
        held = {m.stage for m in live}
        empty = [s for s in range(self.num_stages) if s not in held and not self._coming(s, now)]
        if not empty:
            return None
        specs, caps = self.fleet(live)
        moves = placement.refill(
            {m.node_id: m.stage for m in live}, caps, specs, self.policy, targets=empty[:1]
        )
        if not moves:
            return None
        mv = moves[0]
        donors = sum(1 for m in live if m.stage == mv.from_stage)
        return self.move(
            self.members[mv.node_id],
            mv.to_stage,
            f"empty stage: stage {mv.to_stage} lost its last replica; stage {mv.from_stage} "
            f"had {donors}",
            now=now,
        )

    def diverged(self, step: int) -> list[MoveOrder]:
        """Re-sync the replicas whose parameters after `step` differ from their stage's.

        Replicas of a stage take bit-identical steps (node/replica_sync.py), so two digests
        for one step mean a fault the reduce could not see (replicas cut off from each other
        in both directions, a bad memory bit). The digest most of the stage's replicas
        reported wins, a tie going to the one whose holder has been in the swarm longest;
        every other replica is ordered to fetch the stage's state again (a move to its own
        stage), from the replicas that stay, so at least one always does."""
        orders = []
        for stage in range(self.num_stages):
            reported = [m for m in self.replicas(stage) if m.last_step == step and m.param_digest]
            groups: dict[str, list[Member]] = {}
            for m in reported:
                groups.setdefault(m.param_digest, []).append(m)
            if len(groups) < 2:
                continue
            keep = max(groups, key=lambda d: (len(groups[d]), -min(m.joined_at for m in groups[d])))
            for digest, members in sorted(groups.items()):
                if digest == keep:
                    continue
                for m in members:
                    reason = (
                        f"re-sync: its parameters after step {step} ({digest}) differ from "
                        f"{len(groups[keep])} of its stage's {len(reported)} replicas' ({keep})"
                    )
                    orders.append(self.move(m, m.stage, reason))
        return orders

    def effective_rates(self) -> dict[str, float]:
        """Each live node's effective rate on its stage, as the policy sees it now."""
        live = self.live()
        specs, caps = self.fleet(live)
        return {m.node_id: placement.effective_rate(caps[m.node_id], specs, m.stage) for m in live}

    def throughput(self, costs: placement.StepCosts | None = None) -> ThroughputView:
        """The throughput model of the serving nodes: the bound of where they are, the best
        plan's bound for the same nodes (both whole steps' rates, with a step's fixed
        `costs` counted), each stage's rate and each node's."""
        live = self.live()
        specs, caps = self.fleet(live)
        assignment = {m.node_id: m.stage for m in live}
        rates = placement.stage_rates(assignment, caps, specs)
        # The best plan is a search: past BEST_PLAN_FLEET nodes Status shows 0 for it.
        small = 0 < len(live) <= BEST_PLAN_FLEET
        best = placement.plan(caps.values(), specs, self.policy) if small else {}
        nodes = []
        for m in sorted(live, key=lambda m: m.node_id):
            node = caps[m.node_id]
            measured = node.compute_rates[m.stage]
            compute = measured if measured > 0 else node.speed / specs[m.stage].cost
            nodes.append(
                NodeRateView(
                    node_id=m.node_id,
                    stage=m.stage,
                    compute=compute,
                    effective=placement.effective_rate(node, specs, m.stage),
                    limited_by=fleet_model.limited_by(node, specs[m.stage], compute),
                )
            )
        best_stream = placement.throughput_bound(best, caps, specs) if small else 0.0
        return ThroughputView(
            bound=placement.step_rate(min(rates), costs) if live else 0.0,
            best_bound=placement.step_rate(best_stream, costs),
            stage_rates=rates,
            nodes=nodes,
            stream_bound=min(rates) if live else 0.0,
            best_stream_bound=best_stream,
            costs=costs,
        )

    def rates_changed(self) -> bool:
        """Whether a live node's effective rate moved by the policy's `rate_change` since the
        last rebalance (nodes new since then are the join's business, not a change)."""
        for node_id, rate in self.effective_rates().items():
            old = self.rated.get(node_id)
            if old is not None and placement.rate_changed(old, rate, self.policy):
                return True
        return False

    def second_replicas(self, now: float) -> list[MoveOrder]:
        """A second replica for a stage left with one while another has three or more
        (`placement.second_replicas`), the moment the serving nodes show it, not at the
        next rebalancing round: the run may be over by then. None while a node is still
        fetching a stage's state, as for `rebalance`."""
        live = self.live()
        assignment = {m.node_id: m.stage for m in live}
        counts = placement.replica_counts(assignment, self.num_stages)
        if 1 not in counts or max(counts) < 3:
            return []  # the common case, checked first: this runs at every change
        if self._coming(None, now):
            return []
        specs, caps = self.fleet(live)
        moves = placement.second_replicas(
            assignment,
            caps,
            specs,
            self.policy,
            now=now,
            last_moved={m.node_id: m.moved_at for m in live},
        )
        bound = placement.throughput_bound(assignment, caps, specs)
        return self._order(moves, caps, specs, bound, bound, now=now)

    def unconfirmed(self) -> set[str]:
        """Live nodes that moved and have not been measured on their new stage yet: their
        rates there are speed x cost and their links as measured where they were, so a
        plan's bound that counts them changes once they are (bench rebalance: four batches
        of moves in 95 s, each starting from a different bound, one node moved three
        times). Measured: CONFIRM_STEPS whole steps reported on the new stage, or the
        swarm CONFIRM_WITHIN_STEPS steps past the move."""
        swarm_step = self._latest_step()
        waiting = set()
        for m in self.live():
            if m.moved_from is None:
                continue
            t = m.telemetry
            since = max((st.step for st in m.moved_from.step_times), default=-1)
            whole = (
                sum(1 for st in t.step_times if st.complete and st.step > since)
                if t is not None and t.stage == m.stage
                else 0
            )
            if whole >= CONFIRM_STEPS or swarm_step - m.moved_at_step >= CONFIRM_WITHIN_STEPS:
                continue
            waiting.add(m.node_id)
        return waiting

    def _latest_step(self) -> int:
        """The latest step any node has reported the times of (-1: none)."""
        reported = (m.telemetry.step_times for m in self.members.values() if m.telemetry)
        return max((st.step for times in reported for st in times), default=-1)

    def rebalance(self, now: float, costs: placement.StepCosts | None = None) -> list[MoveOrder]:
        """One rebalancing round (`placement.rebalance`): the moves it ordered, each with
        its reason ("empty stage", "second replica", "bandwidth" or "compute"). None while
        a node is still fetching a stage's state: the last batch must settle first; no
        throughput move while a mover is `unconfirmed`. Gains are judged on whole steps'
        rates, with a step's fixed `costs` counted (the bound Status shows)."""
        if self._coming(None, now):
            return []
        live = self.live()
        specs, caps = self.fleet(live)
        self.rated = {
            m.node_id: placement.effective_rate(caps[m.node_id], specs, m.stage) for m in live
        }
        assignment = {m.node_id: m.stage for m in live}
        moves = placement.rebalance(
            assignment,
            caps,
            specs,
            self.policy,
            now=now,
            last_moved={m.node_id: m.moved_at for m in live},
            unconfirmed=self.unconfirmed(),
            step_costs=costs,
        )
        if not moves:
            return []
        before = placement.step_rate(placement.throughput_bound(assignment, caps, specs), costs)
        # A mover stops serving its old stage at once, and a node moving in serves only
        # once it holds the state: a batch that takes every serving replica off a stage
        # would leave it unserved meanwhile. Such moves are left out, and the rest made only
        # if they still lift the bound by the policy's min_gain.
        serving = placement.replica_counts(assignment, self.num_stages)
        leaving = placement.replica_counts(
            {mv.node_id: mv.from_stage for mv in moves}, self.num_stages
        )
        kept = [mv for mv in moves if leaving[mv.from_stage] < serving[mv.from_stage]]
        after_assignment = dict(assignment)
        for mv in kept:
            after_assignment[mv.node_id] = mv.to_stage
        after = placement.step_rate(
            placement.throughput_bound(after_assignment, caps, specs), costs
        )
        if len(kept) < len(moves):
            throughput = [mv for mv in kept if mv.reason == "throughput"]
            if throughput and after < (1 + self.policy.min_gain) * before:
                kept = [mv for mv in kept if mv.reason != "throughput"]
            logger.info(
                "%d of %d planned moves left out: they would leave a stage unserved while "
                "the nodes moving in fetch its state",
                len(moves) - len(kept),
                len(moves),
            )
        return self._order(kept, caps, specs, before, after, now=now)

    def _order(
        self,
        moves: list[placement.Move],
        caps: dict[str, placement.NodeCaps],
        specs: tuple[placement.StageSpec, ...],
        before: float,
        after: float,
        *,
        now: float,
    ) -> list[MoveOrder]:
        """Order the policy's moves, each with the reason people read."""
        return [
            self.move(
                self.members[mv.node_id],
                mv.to_stage,
                self._reason(mv, caps, specs, before, after),
                now=now,
            )
            for mv in moves
        ]

    def _held_by(
        self,
        mv: placement.Move,
        caps: dict[str, placement.NodeCaps],
        specs: tuple[placement.StageSpec, ...],
    ) -> str:
        """Why a throughput move helps: "bandwidth" when the mover's links hold it back
        where it is, or the stage it goes to gives much less than its replicas compute
        (links hold that stage back); else "compute"."""

        def compute(node: placement.NodeCaps, stage: int) -> float:
            measured = node.compute_rates[stage] if stage < len(node.compute_rates) else 0.0
            return measured if measured > 0 else node.speed / specs[stage].cost

        mover = caps[mv.node_id]
        if fleet_model.limited_by(mover, specs[mv.from_stage], compute(mover, mv.from_stage)) == (
            "bandwidth"
        ):
            return "bandwidth"
        there = [caps[m.node_id] for m in self.replicas(mv.to_stage)]
        effective = sum(placement.effective_rate(n, specs, mv.to_stage) for n in there)
        computed = sum(compute(n, mv.to_stage) for n in there)
        return "bandwidth" if effective < LINK_BOUND * computed else "compute"

    def _reason(
        self,
        mv: placement.Move,
        caps: dict[str, placement.NodeCaps],
        specs: tuple[placement.StageSpec, ...],
        before: float,
        after: float,
    ) -> str:
        node = caps[mv.node_id]
        if mv.reason == "second-replica":
            return (
                f"second replica: stage {mv.to_stage} had one, so its node's death would "
                "lose the steps since its last checkpoint"
            )
        if mv.reason == "empty-stage":
            return f"empty stage: stage {mv.to_stage} had no replica"
        here = placement.effective_rate(node, specs, mv.from_stage)
        there = placement.effective_rate(node, specs, mv.to_stage)
        kind = self._held_by(mv, caps, specs)
        return (
            f"{kind}: {mv.node_id} gives {here:.3g} samples/s on stage {mv.from_stage} and "
            f"{there:.3g} on stage {mv.to_stage}; bound {before:.3g} -> {after:.3g} samples/s"
        )

    def move(
        self, member: Member, stage: int, reason: str, *, now: float | None = None
    ) -> MoveOrder:
        """Order `member` to serve `stage`: it leaves its stage's plan now and serves the new
        one once it holds that stage's state (Ready)."""
        order = MoveOrder(
            order=len(self.moves) + 1,
            node_id=member.node_id,
            from_stage=member.stage,
            to_stage=stage,
            reason=reason,
        )
        member.stage, member.serving, member.ready_step = stage, False, -1
        member.param_digest = ""  # of the state it leaves; Ready reports the one it fetched
        member.move_order = order.order
        member.moved_from = member.telemetry or control_pb2.Telemetry()
        member.moved_at_step = self._latest_step()
        member.moved_at = time.monotonic() if now is None else now
        self.moves.append(order)
        return order

    def weights(self, stage: int) -> dict[str, float]:
        """Routing weight of each live replica of `stage`: its effective rate in the
        throughput model (fleet_model.py), the lesser of its compute rate and what its
        links carry.

        The compute rate is samples per busy second of the node's compute thread, which
        says what it *could* do; the rate it does do follows the traffic it is sent, and
        weighting by that would starve whichever replica got less at first. Its links cap
        it: a replica whose uplink fell would otherwise be sent its compute rate's share and
        hold every step up until its microbatches crawl through. A replica with no
        measurement yet counts as the fleet's mean node (1.0 when none is measured).
        """
        return self._all_weights()[stage]

    def _all_weights(self) -> list[dict[str, float]]:
        """`weights` of every stage, from one reading of the fleet."""
        by_stage: list[dict[str, float]] = [{} for _ in range(self.num_stages)]
        for node_id, rate in sorted(self.effective_rates().items()):
            by_stage[self.members[node_id].stage][node_id] = rate
        return by_stage

    def weights_drifted(self) -> bool:
        """Whether any live replica's weight moved past WEIGHT_DRIFT since the last plan."""
        for weights in self._all_weights():
            for node_id, weight in weights.items():
                old = self.published_weights.get(node_id)
                if old is None or abs(weight - old) > WEIGHT_DRIFT * old:
                    return True
        return False

    def plan(self) -> control_pb2.Plan:
        self.plan_version += 1
        stages = []
        self.published_weights = {}
        by_id = {m.node_id: m for m in self.live()}
        for s, weights in enumerate(self._all_weights()):
            self.published_weights.update(weights)
            replicas = [
                control_pb2.Replica(node_id=node_id, address=by_id[node_id].address, weight=weight)
                for node_id, weight in weights.items()
            ]
            stages.append(control_pb2.StagePlan(stage=s, replicas=replicas))
        return control_pb2.Plan(
            version=self.plan_version,
            num_stages=self.num_stages,
            stages=stages,
            activation_codec=self.activation_codec,  # type: ignore[arg-type]
            gradient_codec=self.gradient_codec,  # type: ignore[arg-type]
            drained=sorted(m.node_id for m in self.members.values() if m.drained),
            moves=[
                control_pb2.Move(
                    node_id=m.node_id,
                    stage=m.stage,
                    order=m.move_order,
                    reason=self.moves[m.move_order - 1].reason,
                )
                for m in sorted(self.members.values(), key=lambda m: m.node_id)
                if m.move_order and not m.serving and not m.drained
            ],
        )


def _observed(m: Member) -> fleet_model.Observed:
    t = m.telemetry
    if t is not None and m.moved_from is not None and t.stage == m.stage:
        t = fleet_model.since(t, m.moved_from)
    return fleet_model.Observed(m.node_id, m.stage, t)
