"""Who is in the swarm, which stage each node serves, and the plan built from that.

Healing: when a stage loses its last live replica and no node is on its way to it, `heal`
moves a replica from the stage with the most live replicas (the one with the lowest
measured rate, so the donor stage loses least). The mover leaves the plan at once (its
old stage keeps at least one replica), fetches the new stage's state (from its latest
checkpoint, as no replica is left) and serves it once Ready, like a joiner.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from swarmpipe.protos import control_pb2

# A node that joined but has not announced itself on MQTT yet still holds its
# stage for this long, so two nodes joining together do not take the same one.
JOIN_GRACE_S = 30.0
# A replica's routing weight is republished when its measured rate moves this
# far (relative) from the weight in the last plan; smaller moves are noise.
WEIGHT_DRIFT = 0.25


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


@dataclass(frozen=True, slots=True)
class MoveOrder:
    order: int
    node_id: str
    from_stage: int
    to_stage: int
    reason: str


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

    def _holds_stage(self, m: Member, now: float) -> bool:
        if m.drained:
            return False
        # A node that went offline stops holding its stage at once, so the next
        # joiner replaces it instead of piling onto a stage that still has one.
        return m.online or (not m.announced and now - m.joined_at < JOIN_GRACE_S)

    def assign(self, node_id: str, address: str) -> Member:
        """Place a joining node on the stage with the fewest replicas (lowest index on ties)."""
        now = time.monotonic()
        previous = self.members.get(node_id)
        counts = [0] * self.num_stages
        for m in self.members.values():
            if m.node_id != node_id and self._holds_stage(m, now):
                counts[m.stage] += 1
        stage = min(range(self.num_stages), key=lambda s: (counts[s], s))
        if (
            previous is not None
            and not previous.drained
            and counts[previous.stage] == counts[stage]
        ):
            stage = previous.stage  # a restarted node keeps its stage when that costs nothing
        member = Member(node_id=node_id, address=address, stage=stage, joined_at=now)
        self.members[node_id] = member
        return member

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

    def _coming(self, stage: int, now: float) -> bool:
        """A node is on its way to `stage`: joined or moved there, online (or not announced
        yet, within JOIN_GRACE_S) and fetching its state."""
        return any(
            m.stage == stage and not m.serving and self._holds_stage(m, now)
            for m in self.members.values()
        )

    def heal(self) -> MoveOrder | None:
        """Move a replica to a stage that has none left and nobody coming, from the stage
        with the most live replicas (at least two); None when no such move exists."""
        now = time.monotonic()
        live = self.live()
        by_stage: dict[int, list[Member]] = {s: [] for s in range(self.num_stages)}
        for m in live:
            by_stage[m.stage].append(m)
        empty = [s for s, ms in by_stage.items() if not ms and not self._coming(s, now)]
        donor = max(by_stage, key=lambda s: (len(by_stage[s]), -s))
        if not empty or len(by_stage[donor]) < 2:
            return None

        def rate(m: Member) -> float:
            t = m.telemetry
            return t.compute_samples_per_second if t is not None else 0.0

        mover = min(by_stage[donor], key=lambda m: (rate(m), m.node_id))
        target = empty[0]
        return self.move(
            mover,
            target,
            f"stage {target} lost its last replica; stage {donor} had {len(by_stage[donor])}",
        )

    def move(self, member: Member, stage: int, reason: str) -> MoveOrder:
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
        member.move_order = order.order
        self.moves.append(order)
        return order

    def weights(self, stage: int) -> dict[str, float]:
        """Routing weight of each live replica of `stage`: its measured compute rate.

        The rate is samples per busy second of the node's compute thread, which
        says what it *could* do; the rate it does do follows the traffic it is
        sent, and weighting by that would starve whichever replica got less at
        first. A replica with no measurement yet gets the mean of the others, or
        1.0 when none is measured.
        """
        replicas = sorted((m for m in self.live() if m.stage == stage), key=lambda m: m.node_id)
        measured = {
            m.node_id: m.telemetry.compute_samples_per_second
            for m in replicas
            if m.telemetry is not None and m.telemetry.compute_samples_per_second > 0
        }
        default = sum(measured.values()) / len(measured) if measured else 1.0
        return {m.node_id: measured.get(m.node_id, default) for m in replicas}

    def weights_drifted(self) -> bool:
        """Whether any live replica's weight moved past WEIGHT_DRIFT since the last plan."""
        for stage in range(self.num_stages):
            for node_id, weight in self.weights(stage).items():
                old = self.published_weights.get(node_id)
                if old is None or abs(weight - old) > WEIGHT_DRIFT * old:
                    return True
        return False

    def plan(self) -> control_pb2.Plan:
        self.plan_version += 1
        stages = []
        self.published_weights = {}
        for s in range(self.num_stages):
            weights = self.weights(s)
            self.published_weights.update(weights)
            by_id = {m.node_id: m for m in self.live()}
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
