"""Which stage each node serves: the swarm's throughput model, joiners' placement, rebalancing.

Pure: no I/O, no clock (callers pass `now`), no torch, no grpc, so the coordinator and
`swarmpipe simulate` run exactly this code.

**The model.** A pipeline trains no faster than its slowest stage (the bottleneck). A
stage's rate is the sum of its replicas' effective rates. A replica's effective rate is the
least of its compute rate on that stage and what its links carry at the codecs in use:
inbound bandwidth over the bytes it receives per sample (activations from the stage before,
gradients from the stage after), outbound bandwidth over the bytes it sends. Links are
taken as full duplex; the state download of a move is its own term (below).

**Placement.** A joiner goes where it raises the sorted vector of stage rates most
(leximin): onto the bottleneck when it helps there, which raises the bound; ties and
helpless cases fall to the next-slowest stage (and see prices and safety below). Placing a
whole fleet (`plan`) is a max-min assignment of unrelated machines (links make a node's
rates differ from stage to stage), NP-hard in general. We place nodes fastest first onto
the bottleneck, then improve locally: move a node from a stage with slack to the bottleneck
while both stages end above the old bottleneck. Each step raises the sorted vector of stage
rates, so the search ends. In a large fleet a node is a small part of a stage and moves
balance the stages to about one node's rate (O(n) per move, no O(n^2) step); what moves to
the bottleneck cannot fix is *which* nodes share a stage (a node with slow links carries
twice as much on the first or last stage, which move half the bytes of a middle one). So
there a node, in `plan` and when it joins, goes only among the stages where it is worth
nearly the most at the prices of the linear relaxation (`relaxed_upper_bound`), while that
costs the bound at most 3 %: at 10,000 nodes the plan is then within 0.2 % of the
relaxation's bound, against 6 % without prices. Small fleets (up to `max_swap_fleet`) are
where one node is a large part of a stage and the search is cheap: there steps may also
exchange nodes (one for one; two for one or two up to 16 nodes), may lift any stage (a
chain of them reaches what no single step on the bottleneck does), and the search restarts
from seeded shuffles and kicks of the best plan, keeping the best. Against an exhaustive
search on fleets of up to 8 nodes and 4 stages the worst plan found was 1.6 % short.

**Safety against throughput.** A stage served by one node loses the steps since its last
checkpoint when that node dies, and is then behind its neighbours. So a stage with one
replica is *at risk*: once the fleet has two nodes per stage, placement gives every stage a
second replica before it seeks throughput, as long as that costs the throughput bound at
most `safety_tolerance` (10 %) against ignoring the rule; past that, throughput wins.
Throughput moves never take a stage below two replicas once the fleet can give every
stage two, and never take a stage's last replica.

**Rebalancing** (`rebalance`), in this order: (1) a stage with no replica gets the node
that costs the rest least, at once, whatever the cool-down or gain; (2) at-risk stages get
a second replica under the rule above, at once too (a node out of its cool-down first,
where one can go: these moves cannot oscillate); (3) throughput: the local
improvement above, from the current assignment, where each move must pay for itself and the
whole batch must raise the bound by `min_gain` (10 %) or it is dropped. A move pays when,
over `horizon_s`, the samples it gains after the mover is in place exceed those lost while
it downloads the state (`move_overhead_s` + state bytes / its inbound bandwidth): the mover
is gone from its stage, and one replica of the stage it goes to is charged as serving
nothing while it streams the state. A batch leaves every stage one of the replicas it had
(a mover stops serving at once, a node moving in only once it holds the state, so a chain
of moves must not take a stage's last present replica while others are on their way).
Hysteresis is the gain threshold plus a per-node cool-down after a join or move (for
throughput moves): ±3 % noise on every rate can fake at most a 1.03/0.97 - 1 = 6.2 % gain,
under 10 %. No throughput move is planned while a node
that moved is still an estimate on its new stage (`unconfirmed`: the caller says which), and
with a step's fixed costs given (`StepCosts`) gains are judged on whole steps' rates.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

Reason = Literal["empty-stage", "second-replica", "throughput"]
REASONS: tuple[Reason, ...] = ("empty-stage", "second-replica", "throughput")

# A step must lift the bottleneck by this much (relative) to count, so float rounding in
# running totals cannot make the local search go round in circles.
_EPS = 1e-9
# Fleets up to this size also try exchanges of two nodes for one or two: O(n^4) per step,
# and the small fleets are where one node is a large part of a stage.
_GROUP_EXCHANGE_FLEET = 16
# Extra greedy orders `plan` tries on a fleet of n nodes: about this many over n^2.
_RESTART_BUDGET = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class StageSpec:
    """What serving one stage asks of a node, per sample and once on joining."""

    cost: float = 1.0
    """Compute per sample relative to a unit stage: a node of speed v does v / cost samples/s."""
    bytes_in_per_sample: float = 0.0
    """Bytes a replica receives per sample at the codecs in use: activations from the stage
    before plus gradients from the stage after (from the senders' counters)."""
    bytes_out_per_sample: float = 0.0
    """Bytes a replica sends per sample: activations onward plus gradients back."""
    state_bytes: float = 0.0
    """The stage's state (parameters and optimizer): what a node joining it downloads."""

    def __post_init__(self) -> None:
        if not self.cost > 0:
            raise ValueError(f"stage cost must be > 0, got {self.cost}")
        if min(self.bytes_in_per_sample, self.bytes_out_per_sample, self.state_bytes) < 0:
            raise ValueError("stage bytes must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeCaps:
    """One node's measured capabilities."""

    node_id: str
    speed: float
    """Samples/s on a stage of cost 1 (a measured rate on stage s times that stage's cost)."""
    bandwidth_in: float
    """Inbound bytes/s (the link meters)."""
    bandwidth_out: float
    """Outbound bytes/s."""
    compute_rates: tuple[float, ...] = ()
    """Measured samples/s per stage where known (0 = not measured: speed / cost is used)."""

    def __post_init__(self) -> None:
        if min(self.speed, self.bandwidth_in, self.bandwidth_out) < 0:
            raise ValueError(f"node {self.node_id}: speed and bandwidths must be >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepCosts:
    """What a synchronous step costs besides streaming its samples through the bottleneck,
    as measured (coordinator/fleet_model.py, `step_costs`).

    A step of `samples` whose first microbatch (`first_samples`) comes back `fill_s` after
    the step opens, and whose later samples follow at the pipeline's rate T, takes
    fill_s + (samples - first_samples) / T + barrier_s: the pipeline starts empty and ends
    drained (a microbatch's trip there and back), then waits at the barrier. So the rate a
    step gives is samples over that, less than T by the fixed part."""

    samples: float
    """Training samples a step (the global batch)."""
    first_samples: float
    """Samples the first commit of a step brings (a microbatch)."""
    fill_s: float
    """Seconds from a step's opening to its first commit: the pipeline filling."""
    barrier_s: float
    """Seconds from a step's last commit until the next opens: APPLY, the replicas' reduce,
    the optimizer step, StepDone, the opening."""

    def __post_init__(self) -> None:
        if not self.samples > 0 or not 0 <= self.first_samples <= self.samples:
            raise ValueError("a step needs samples > 0 and 0 <= first_samples <= samples")
        if min(self.fill_s, self.barrier_s) < 0:
            raise ValueError("fill_s and barrier_s must be >= 0")

    def rate(self, stream: float) -> float:
        """Samples/s of whole steps when the pipeline streams `stream` samples/s."""
        if stream <= 0:
            return 0.0
        seconds = self.fill_s + self.barrier_s + (self.samples - self.first_samples) / stream
        return self.samples / seconds if seconds > 0 else stream


def step_rate(stream: float, costs: StepCosts | None) -> float:
    """The throughput bound with a step's fixed costs counted (`stream` without them)."""
    return stream if costs is None else costs.rate(stream)


@dataclass(frozen=True, kw_only=True, slots=True)
class Move:
    """One node to move, and why."""

    node_id: str
    from_stage: int
    to_stage: int
    reason: Reason
    download_s: float
    """Seconds the node is expected to take to download its new stage's state."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PlacementPolicy:
    """How placement weighs throughput, safety and the cost of moving."""

    min_gain: float = 0.10
    """A batch of throughput moves must raise the bound by this fraction, or none is made.
    Above the 6.2 % that ±3 % measurement noise on every rate can fake."""
    horizon_s: float = 3600.0
    """How far ahead a move's gain is counted against its cost: about how long a volunteer
    node stays (10 % leave per hour means a mean stay of 10 h; one hour is cautious)."""
    cooldown_s: float = 900.0
    """A node that joined or moved this recently is not moved for throughput (a second
    replica takes one only when no node out of its cool-down can go)."""
    safety_tolerance: float = 0.10
    """Second replicas come first while they cost the bound at most this fraction."""
    move_overhead_s: float = 30.0
    """Seconds a move costs besides the download: restart, build, connect, enter the plan
    (the `join` benchmark's phases other than the download)."""
    rate_change: float = 0.25
    """A node's rate moving this far (relative) calls for a rebalance before the next tick."""
    max_swap_fleet: int = 64
    """Fleets up to this size get exchanges, any-stage steps and restarts (`plan`): O(n^2)
    and more per step, and worth it only where one node is a large part of a stage."""

    def __post_init__(self) -> None:
        if self.min_gain < 0 or not 0 <= self.safety_tolerance < 1:
            raise ValueError("min_gain must be >= 0 and safety_tolerance in [0, 1)")
        if min(self.horizon_s, self.cooldown_s, self.move_overhead_s) < 0:
            raise ValueError("horizon_s, cooldown_s and move_overhead_s must be >= 0")


def stages_from_cuts(
    costs: Sequence[float],
    activation_bytes: Sequence[float],
    gradient_bytes: Sequence[float],
    state_bytes: Sequence[float],
) -> tuple[StageSpec, ...]:
    """Stage specs from per-cut traffic: cut i lies between stage i and i + 1, and carries
    `activation_bytes[i]` per sample forward and `gradient_bytes[i]` back."""
    n = len(costs)
    if not len(activation_bytes) == len(gradient_bytes) == n - 1 or len(state_bytes) != n:
        raise ValueError(
            "need one cost and state size per stage, and one of each byte count per cut"
        )
    specs = []
    for s in range(n):
        inbound = (activation_bytes[s - 1] if s > 0 else 0.0) + (
            gradient_bytes[s] if s < n - 1 else 0.0
        )
        outbound = (activation_bytes[s] if s < n - 1 else 0.0) + (
            gradient_bytes[s - 1] if s > 0 else 0.0
        )
        specs.append(
            StageSpec(
                cost=costs[s],
                bytes_in_per_sample=inbound,
                bytes_out_per_sample=outbound,
                state_bytes=state_bytes[s],
            )
        )
    return tuple(specs)


def effective_rate(node: NodeCaps, stages: Sequence[StageSpec], stage: int) -> float:
    """Samples/s `node` can serve on `stage`: compute, capped by what its links carry."""
    spec = stages[stage]
    measured = node.compute_rates[stage] if stage < len(node.compute_rates) else 0.0
    rate = measured if measured > 0 else node.speed / spec.cost
    if spec.bytes_in_per_sample > 0:
        rate = min(rate, node.bandwidth_in / spec.bytes_in_per_sample)
    if spec.bytes_out_per_sample > 0:
        rate = min(rate, node.bandwidth_out / spec.bytes_out_per_sample)
    return rate


def rate_table(
    nodes: Iterable[NodeCaps], stages: Sequence[StageSpec]
) -> dict[str, tuple[float, ...]]:
    """Each node's effective rate on every stage."""
    return {
        n.node_id: tuple(effective_rate(n, stages, s) for s in range(len(stages))) for n in nodes
    }


def stage_rates(
    assignment: Mapping[str, int], nodes: Mapping[str, NodeCaps], stages: Sequence[StageSpec]
) -> list[float]:
    """Each stage's rate: the sum of its replicas' effective rates (0 for an empty stage)."""
    totals = [0.0] * len(stages)
    for node_id, stage in assignment.items():
        totals[stage] += effective_rate(nodes[node_id], stages, stage)
    return totals


def throughput_bound(
    assignment: Mapping[str, int], nodes: Mapping[str, NodeCaps], stages: Sequence[StageSpec]
) -> float:
    """Samples/s the pipeline can train at most: its slowest stage's rate."""
    return min(stage_rates(assignment, nodes, stages))


def download_seconds(node: NodeCaps, stage: StageSpec, policy: PlacementPolicy) -> float:
    """Seconds from a move's start until `node` serves `stage`."""
    if stage.state_bytes == 0:
        return policy.move_overhead_s
    if node.bandwidth_in <= 0:
        return math.inf
    return policy.move_overhead_s + stage.state_bytes / node.bandwidth_in


def rate_changed(old: float, new: float, policy: PlacementPolicy) -> bool:
    """Whether a rate moved far enough to rebalance before the next periodic round."""
    return abs(new - old) > policy.rate_change * max(old, 1e-12)


def relaxed_upper_bound(
    rows: Sequence[Sequence[float]],
    weights: Sequence[float] | None = None,
    *,
    iterations: int = 60,
) -> tuple[float, list[float]]:
    """An upper bound on the throughput bound of any plan of these nodes (each row: a node's
    effective rate per stage), and the stage weights that give it.

    For weights y >= 0 summing to 1, a plan of bound T has T = sum_s y_s T <= sum_s y_s
    (its rate on s) <= sum_n max_s y_s r(n, s): every y gives an upper bound, and the least
    of them is the optimum of the linear relaxation (a node may split its time between
    stages). We descend toward it from `weights` by exponentiated gradient steps on a
    smoothed max (a node's load spread over the stages where its weighted rate is within a
    few percent of its best: the plain subgradient puts a tied node wholly on one stage and
    oscillates), and return the exact sum at the best weights met. The weights are prices
    too: a node is worth most where y_s r(n, s) is highest."""
    n_stages = len(rows[0]) if rows else 0
    if not rows or n_stages == 0:
        return 0.0, []
    y = list(weights) if weights else [1.0 / n_stages] * n_stages
    best_value, best_y = math.inf, y
    for _ in range(iterations + 1):
        loads = [0.0] * n_stages
        value = 0.0
        for row in rows:
            worth = [w * r for w, r in zip(y, row, strict=True)]
            top = max(worth)
            value += top
            if top <= 0:
                continue
            shares = [math.exp(_SMOOTHING * (w / top - 1.0)) for w in worth]
            total = sum(shares)
            for s in range(n_stages):
                loads[s] += shares[s] / total * row[s]
        if value < best_value:
            best_value, best_y = value, y
        # Weight flows from stages the nodes crowd onto to stages they leave starved.
        mean = sum(loads) / n_stages or 1.0
        y = [w * math.exp(-0.2 * (g / mean - 1.0)) for w, g in zip(y, loads, strict=True)]
        total = sum(y)
        y = [w / total for w in y]
    return best_value, list(best_y)


# How sharply relaxed_upper_bound's smoothed max picks a node's best stage: a stage 1 %
# below the best gets e^-1 of its share.
_SMOOTHING = 100.0


class _Layout:
    """An assignment being planned, with each stage's members and total rate."""

    def __init__(
        self, rates: Mapping[str, tuple[float, ...]], assignment: Mapping[str, int], n: int
    ) -> None:
        self.rates = rates
        self.stage_of: dict[str, int] = {}
        # dicts as ordered sets: a set of str iterates in a per-process hash order, and a
        # plan must not depend on PYTHONHASHSEED.
        self.members: list[dict[str, None]] = [{} for _ in range(n)]
        self.totals = [0.0] * n
        for node_id, stage in assignment.items():
            if not 0 <= stage < n:
                raise ValueError(f"node {node_id} is on stage {stage}, not one of 0..{n - 1}")
            self.add(node_id, stage)

    def add(self, node_id: str, stage: int) -> None:
        self.stage_of[node_id] = stage
        self.members[stage][node_id] = None
        self.totals[stage] += self.rates[node_id][stage]

    def remove(self, node_id: str) -> int:
        stage = self.stage_of.pop(node_id)
        del self.members[stage][node_id]
        self.totals[stage] -= self.rates[node_id][stage]
        if not self.members[stage]:
            self.totals[stage] = 0.0  # no rounding residue on an empty stage
        return stage

    def move(self, node_id: str, stage: int) -> None:
        self.remove(node_id)
        self.add(node_id, stage)

    def bound(self) -> float:
        return min(self.totals)

    def bottleneck(self) -> int:
        return min(range(len(self.totals)), key=lambda s: (self.totals[s], s))

    def counts(self) -> list[int]:
        return [len(m) for m in self.members]

    def bound_with(self, changes: Mapping[int, float]) -> float:
        """The bound if each stage's total changed by the given amounts."""
        return min(t + changes.get(s, 0.0) for s, t in enumerate(self.totals))


class _DepartureLayout(_Layout):
    """A layout that counts, per stage, how many of the nodes it started with have left.

    A mover stops serving its old stage when it is ordered to move, and a node moving in
    serves only once it holds the state: so a rebalance must leave every stage one of the
    replicas it has now, whatever arrives (a chain of moves could otherwise take all of
    them while others are on their way)."""

    def __init__(
        self, rates: Mapping[str, tuple[float, ...]], assignment: Mapping[str, int], n: int
    ) -> None:
        super().__init__(rates, assignment, n)
        self.origin = dict(assignment)
        self.originals = replica_counts(assignment, n)
        self.left = [0] * n

    def move(self, node_id: str, stage: int) -> None:
        src = self.stage_of[node_id]
        home = self.origin.get(node_id)
        if home == src:
            self.left[src] += 1
        if home == stage:
            self.left[stage] -= 1
        super().move(node_id, stage)

    def keeps_a_replica(self, step: Step) -> bool:
        """Whether every stage `step` takes nodes from keeps one it started with."""
        leaving = [0] * len(self.left)
        for node_id, src, _ in step:
            if self.origin.get(node_id) == src:
                leaving[src] += 1
        return all(self.left[s] + k < self.originals[s] for s, k in enumerate(leaving) if k)


Step = list[tuple[str, int, int]]
"""Nodes to move together: (node, from stage, to stage)."""
Judge = Callable[[_Layout, Step], bool]


def _best_stage(rates: tuple[float, ...], totals: Sequence[float], among: Iterable[int]) -> int:
    """The stage among `among` where adding a node of these rates gives the best sorted rates."""
    best, best_key = -1, None
    for s in among:
        trial = list(totals)
        trial[s] += rates[s]
        key = sorted(trial)  # leximin: the slowest stage first, then the next
        if best_key is None or key > best_key:
            best, best_key = s, key
    return best


# A node may join, in `plan`, any stage where its price-weighted rate is within this of
# its best: loose enough that the greedy can balance, tight enough to keep nodes where
# they are worth most.
_PRICE_SLACK = 0.03


def _suits(row: tuple[float, ...], prices: Sequence[float] | None) -> list[int]:
    """The stages a node of these rates may join in `plan` (all of them without prices)."""
    if prices is None:
        return list(range(len(row)))
    worth = [p * r for p, r in zip(prices, row, strict=True)]
    top = max(worth)
    return [s for s, w in enumerate(worth) if w >= (1 - _PRICE_SLACK) * top]


def _best_move(
    layout: _Layout,
    u: int,
    floors: Sequence[int],
    movable: Callable[[str], bool],
    judge: Judge | None,
) -> Step | None:
    """The single move into stage `u` that lifts it highest while the stage it leaves stays
    above `u`'s rate now, or None."""
    totals, rates, members = layout.totals, layout.rates, layout.members
    low = totals[u]
    best_v, best = low * (1 + _EPS) + 1e-12, None
    for s in sorted(range(len(totals)), key=lambda t: -totals[t]):
        if totals[s] <= best_v:
            break  # moving out of s leaves it at most totals[s]: no better than what we have
        if s == u or len(members[s]) <= floors[s]:
            continue
        for node_id in members[s]:
            r = rates[node_id]
            v = min(low + r[u], totals[s] - r[s])
            if v > best_v and movable(node_id):
                step = [(node_id, s, u)]
                if judge is None or judge(layout, step):
                    best_v, best = v, step
    return best


def _best_exchange(
    layout: _Layout,
    u: int,
    floors: Sequence[int],
    movable: Callable[[str], bool],
    judge: Judge | None,
    *,
    group: int,
) -> Step | None:
    """The exchange that lifts stage `u` highest: up to `group` nodes from a faster stage
    into `u`, and up to `group` of `u`'s out to it (a swap is one for one). O(n^(2 group))."""
    totals, rates, members = layout.totals, layout.rates, layout.members
    low = totals[u]
    best_v, best = low * (1 + _EPS) + 1e-12, None
    outs = _groups([m for m in members[u] if movable(m)], group, include_empty=True)
    for s in range(len(totals)):
        if s == u or totals[s] <= best_v:
            continue
        for inward in _groups([n for n in members[s] if movable(n)], group, include_empty=False):
            in_u = sum(rates[n][u] for n in inward)
            in_s = sum(rates[n][s] for n in inward)
            for outward in outs:
                left_s = len(members[s]) - len(inward) + len(outward)
                if left_s < floors[s] or len(members[u]) + len(inward) - len(outward) < floors[u]:
                    continue
                v = min(
                    low + in_u - sum(rates[m][u] for m in outward),
                    totals[s] - in_s + sum(rates[m][s] for m in outward),
                )
                if v > best_v:
                    step = [(n, s, u) for n in inward] + [(m, u, s) for m in outward]
                    if judge is None or judge(layout, step):
                        best_v, best = v, step
    return best


def _groups(items: list[str], most: int, *, include_empty: bool) -> list[tuple[str, ...]]:
    found: list[tuple[str, ...]] = [()] if include_empty else []
    for k in range(1, most + 1):
        found.extend(itertools.combinations(items, k))
    return found


def _improve(
    layout: _Layout,
    floors: Sequence[int],
    *,
    movable: Callable[[str], bool],
    judge: Judge | None,
    swaps: bool,
    once: bool,
    lift_any: bool = False,
) -> Step:
    """Local improvement until no step lifts the bottleneck; the steps taken.

    A step lifts a stage `u` when both stages it touches end above `u`'s rate now; then the
    sorted vector of stage rates rises (leximin), so the search ends. With `lift_any` a step
    may lift any stage, slowest first, not only the bottleneck: a chain of such steps can
    reach a better bottleneck where no single step on it helps (small fleets only: it costs
    S times more per step). `once`: a node moves at most once (a rebalance's mover is
    downloading, not free)."""
    done: Step = []
    moved: set[str] = set()
    group = 2 if len(layout.stage_of) <= _GROUP_EXCHANGE_FLEET else 1

    def can_move(node_id: str) -> bool:
        return not (once and node_id in moved) and movable(node_id)

    # The leximin order rises with each step, so this ends; the cap only bounds the time.
    for _ in range(4 * len(layout.stage_of) + 16):
        order = sorted(range(len(layout.totals)), key=lambda t: (layout.totals[t], t))
        step = None
        for u in order if lift_any else order[:1]:
            step = _best_move(layout, u, floors, can_move, judge)
            if step is None and swaps:
                step = _best_exchange(layout, u, floors, can_move, judge, group=group)
            if step is not None:
                break
        if step is None:
            break
        for node_id, _src, dst in step:
            layout.move(node_id, dst)
            moved.add(node_id)
        done.extend(step)
    return done


def _always(node_id: str) -> bool:
    return True


def _fill_second_replicas(
    layout: _Layout,
    movable: Callable[[str], bool],
    tolerance: float,
    prefer: Callable[[str], bool] = _always,
) -> Step:
    """Give each stage with one replica a second from a stage with three or more, while the
    bound stays within `tolerance` of what it was: a node `prefer` picks if one can go, else
    any node `movable` allows."""
    base = layout.bound()
    done: Step = []
    for at_risk in range(len(layout.totals)):
        if len(layout.members[at_risk]) != 1:
            continue
        for allowed in (lambda n: movable(n) and prefer(n), movable):
            best_v, best = -1.0, None
            for s, members in enumerate(layout.members):
                if len(members) < 3:
                    continue
                for node_id in members:
                    if not allowed(node_id) or any(node_id == d[0] for d in done):
                        continue
                    r = layout.rates[node_id]
                    v = layout.bound_with({s: -r[s], at_risk: r[at_risk]})
                    if v > best_v:
                        best_v, best = v, (node_id, s, at_risk)
            if best is not None and best_v >= (1 - tolerance) * base:
                layout.move(best[0], at_risk)
                done.append(best)
                break
    return done


def _safety_applies(num_nodes: int, num_stages: int, policy: PlacementPolicy) -> bool:
    return policy.safety_tolerance > 0 and num_nodes >= 2 * num_stages


def _floors(layout: _Layout, safe: bool) -> list[int]:
    """How many replicas a throughput move must leave on each stage."""
    return [2 if safe and len(m) >= 2 else 1 for m in layout.members]


def plan(
    nodes: Iterable[NodeCaps], stages: Sequence[StageSpec], policy: PlacementPolicy
) -> dict[str, int]:
    """A whole fleet's assignment from scratch (a new run, or the simulator's start).

    The best plan found, and the best with two replicas on every stage when the fleet has
    enough nodes; the second wins while it is within `safety_tolerance` of the first."""
    fleet = sorted(nodes, key=lambda n: n.node_id)
    rates = rate_table(fleet, stages)
    fast = _search(fleet, rates, len(stages), policy, safe=False)
    if _safety_applies(len(fleet), len(stages), policy) and min(fast.counts()) < 2:
        safe = _search(fleet, rates, len(stages), policy, safe=True)
        if safe.bound() >= (1 - policy.safety_tolerance) * fast.bound():
            return dict(safe.stage_of)
    return dict(fast.stage_of)


def _search(
    fleet: list[NodeCaps],
    rates: Mapping[str, tuple[float, ...]],
    n_stages: int,
    policy: PlacementPolicy,
    *,
    safe: bool,
) -> _Layout:
    """Greedy, fastest node first onto the bottleneck, then local improvement; small fleets
    restart from seeded shuffles and from kicks of the best plan so far (see the module's
    docstring). `safe`: every stage keeps two replicas."""
    small = len(fleet) <= policy.max_swap_fleet
    # Fastest first: the big pieces go in while the stages are far apart, and the small ones
    # even them out (as in longest-processing-time-first scheduling).
    fastest_first = sorted(fleet, key=lambda n: -max(rates[n.node_id]))
    restarts = min(31, _RESTART_BUDGET // len(fleet) ** 2) if small else 0
    shuffler = random.Random(0)  # seeded: the same fleet always gets the same plan
    keep = 2 if safe else 1
    # In a large fleet, where a node goes matters less than which nodes go together: one
    # whose links are slow belongs on the first or last stage (half the traffic), whatever
    # the bottleneck is when its turn comes. So each node may only join stages where it is
    # worth nearly the most at the relaxation's prices (see relaxed_upper_bound).
    prices = None if small else relaxed_upper_bound([rates[n.node_id] for n in fleet])[1]
    best: _Layout | None = None
    for attempt in range(1 + restarts):
        if attempt % 2 == 1 and best is not None:
            # A kick: a quarter of the best plan's nodes to random stages (when safe, swapped
            # with random others, which keeps every stage's count).
            layout = _Layout(rates, best.stage_of, n_stages)
            for node in shuffler.sample(fleet, (len(fleet) + 3) // 4):
                here = layout.stage_of[node.node_id]
                if safe:
                    other = shuffler.choice(fleet).node_id
                    layout.move(node.node_id, layout.stage_of[other])
                    layout.move(other, here)
                elif len(layout.members[here]) > keep:
                    layout.move(node.node_id, shuffler.randrange(n_stages))
        else:
            layout = _Layout(rates, {}, n_stages)
            order = fastest_first if attempt == 0 else shuffler.sample(fleet, len(fleet))
            for node in order:
                row = rates[node.node_id]
                layout.add(node.node_id, _best_stage(row, layout.totals, _suits(row, prices)))
            if safe:
                _fill_second_replicas(layout, _always, 1.0)
        _improve(
            layout,
            _floors(layout, safe),
            movable=_always,
            judge=None,
            swaps=small,
            once=False,
            lift_any=small,
        )
        if min(layout.counts()) >= keep and (best is None or layout.bound() > best.bound()):
            best = layout
    if best is None:  # cannot happen with two nodes a stage; kept total for the type
        best = layout
    return best


def replica_counts(assignment: Mapping[str, int], num_stages: int) -> list[int]:
    """How many nodes hold each stage."""
    counts = [0] * num_stages
    for stage in assignment.values():
        counts[stage] += 1
    return counts


def place_joiner(
    joiner: NodeCaps,
    stages: Sequence[StageSpec],
    policy: PlacementPolicy,
    *,
    rates: Sequence[float],
    replicas: Sequence[int],
    prices: Sequence[float] | None = None,
) -> int:
    """The stage a joining node should serve, given each stage's rate and replica count
    without it (`stage_rates`, `replica_counts`): O(stages^2), whatever the fleet's size.

    The stage where it raises the sorted stage rates most, with two preferences, each
    taken only while it costs the bound at most a set fraction against that choice: a stage
    with one replica (`safety_tolerance`), and, given the fleet's `prices` (the weights of
    `relaxed_upper_bound`, refreshed now and then), a stage where the node is worth nearly
    the most (`_PRICE_SLACK`). In a large fleet the bottleneck moves with every join and
    leave, and a node put wherever it is at its turn drifts the fleet from its best shape:
    one with slow links on a middle stage carries half what it would on the first or last."""
    mine = tuple(effective_rate(joiner, stages, s) for s in range(len(stages)))

    def bound_if(stage: int) -> float:
        return min(r + (mine[s] if s == stage else 0.0) for s, r in enumerate(rates))

    best = _best_stage(mine, rates, range(len(stages)))
    if prices is not None:
        suited = _best_stage(mine, rates, _suits(mine, prices))
        if bound_if(suited) >= (1 - _PRICE_SLACK) * bound_if(best):
            best = suited
    at_risk = [s for s, c in enumerate(replicas) if c == 1]
    if policy.safety_tolerance > 0 and at_risk and min(replicas) >= 1:
        safer = _best_stage(mine, rates, at_risk)
        if bound_if(safer) >= (1 - policy.safety_tolerance) * bound_if(best):
            return safer
    return best


def rebalance(
    assignment: Mapping[str, int],
    nodes: Mapping[str, NodeCaps],
    stages: Sequence[StageSpec],
    policy: PlacementPolicy,
    *,
    now: float,
    last_moved: Mapping[str, float],
    unconfirmed: Collection[str] = frozenset(),
    step_costs: StepCosts | None = None,
) -> list[Move]:
    """The moves to make now: refill empty stages, second replicas, then throughput.

    `assignment` holds every node that holds a stage, serving or still downloading;
    `last_moved` the time each node joined or last moved (absent: long ago). `unconfirmed`:
    nodes whose figures on their stage are still estimates (they moved and have not been
    measured there): every plan's bound leans on them, so no throughput move is planned
    while there is one. `step_costs`: a step's fixed costs, counted in every bound the
    gains are judged on (`step_rate`)."""
    rates = rate_table((nodes[k] for k in assignment), stages)
    layout = _DepartureLayout(rates, assignment, len(stages))
    n_stages = len(stages)
    moves: list[Move] = []
    taken: set[str] = set()

    def record(step: Step, reason: Reason) -> None:
        for node_id, src, dst in step:
            taken.add(node_id)
            dl = download_seconds(nodes[node_id], stages[dst], policy)
            moves.append(
                Move(node_id=node_id, from_stage=src, to_stage=dst, reason=reason, download_s=dl)
            )

    def cooled(node_id: str) -> bool:
        return node_id not in taken and _cooled(node_id, now, last_moved, policy)

    # 1. A stage with no replica trains nothing: fill it at once, from the stage that can
    # spare a node best, preferring stages that keep two replicas.
    for empty in range(n_stages):
        if layout.members[empty]:
            continue
        step = _refill(layout, empty, lambda n: n not in taken)
        if step:
            layout.move(step[0][0], empty)
            record(step, "empty-stage")

    # 2. Second replicas whatever the cool-down, which is there against throughput moves
    # chasing noise: these cannot go round in circles (each takes a node from a stage with
    # three or more to one with one, and throughput moves never take a stage below two), and
    # a stage's one replica cannot wait 15 min for a node that joined the wrong stage
    # because the coordinator had not yet seen the node it replaces die. Still a node out of
    # its cool-down first, where one can go.
    safe = _safety_applies(len(assignment), n_stages, policy)
    if safe:
        step = _fill_second_replicas(
            layout, lambda n: n not in taken, policy.safety_tolerance, prefer=cooled
        )
        record(step, "second-replica")

    if any(node_id in unconfirmed for node_id in assignment):
        return moves
    before = step_rate(layout.bound(), step_costs)

    def worth_it(lay: _Layout, step: Step) -> bool:
        return layout.keeps_a_replica(step) and _pays_off(
            lay, step, nodes, stages, policy, step_costs=step_costs
        )

    steps = _improve(
        layout,
        _floors(layout, safe),
        movable=cooled,
        judge=worth_it,
        swaps=len(assignment) <= policy.max_swap_fleet,
        once=True,
    )
    after = step_rate(layout.bound(), step_costs)
    if steps and (after >= (1 + policy.min_gain) * before if before > 0 else after > 0):
        record(steps, "throughput")
    return moves


def second_replicas(
    assignment: Mapping[str, int],
    nodes: Mapping[str, NodeCaps],
    stages: Sequence[StageSpec],
    policy: PlacementPolicy,
    *,
    now: float,
    last_moved: Mapping[str, float],
) -> list[Move]:
    """Rebalancing's second rule alone: a second replica for each stage with one, from a
    stage with three or more, within `safety_tolerance`. The coordinator calls it whenever
    its members change, so a stage at risk does not wait for the next periodic round."""
    if not _safety_applies(len(assignment), len(stages), policy):
        return []
    layout = _Layout(rate_table((nodes[k] for k in assignment), stages), assignment, len(stages))
    step = _fill_second_replicas(
        layout,
        _always,
        policy.safety_tolerance,
        prefer=lambda n: _cooled(n, now, last_moved, policy),
    )
    return [
        Move(
            node_id=node_id,
            from_stage=src,
            to_stage=dst,
            reason="second-replica",
            download_s=download_seconds(nodes[node_id], stages[dst], policy),
        )
        for node_id, src, dst in step
    ]


def _cooled(
    node_id: str, now: float, last_moved: Mapping[str, float], policy: PlacementPolicy
) -> bool:
    """Whether `node_id` joined or last moved at least the cool-down ago."""
    return now - last_moved.get(node_id, -math.inf) >= policy.cooldown_s


def refill(
    assignment: Mapping[str, int],
    nodes: Mapping[str, NodeCaps],
    stages: Sequence[StageSpec],
    policy: PlacementPolicy,
    *,
    targets: Iterable[int],
) -> list[Move]:
    """Rebalancing's first rule alone: give each of `targets` (stages with no replica in
    `assignment`) the node that costs the rest least, never a stage's last replica. The
    coordinator calls it the moment a stage loses its last replica; `rebalance` does the
    same as its step 1."""
    rates = rate_table((nodes[k] for k in assignment), stages)
    layout = _Layout(rates, assignment, len(stages))
    moves: list[Move] = []
    taken: set[str] = set()
    for empty in targets:
        if layout.members[empty]:
            continue
        step = _refill(layout, empty, lambda n: n not in taken)
        for node_id, src, dst in step:
            layout.move(node_id, dst)
            taken.add(node_id)
            dl = download_seconds(nodes[node_id], stages[dst], policy)
            moves.append(
                Move(
                    node_id=node_id,
                    from_stage=src,
                    to_stage=dst,
                    reason="empty-stage",
                    download_s=dl,
                )
            )
    return moves


def _refill(layout: _Layout, empty: int, movable: Callable[[str], bool]) -> Step:
    """The node to move onto an empty stage: the one that leaves the best bound behind."""
    for min_count in (3, 2):
        best_v: tuple[float, float] = (-1.0, 0.0)
        best = None
        for s, members in enumerate(layout.members):
            if len(members) < min_count:
                continue
            for node_id in members:
                if not movable(node_id):
                    continue
                r = layout.rates[node_id]
                # Ties go to the node slower where it is: its stage loses least.
                v = (min(r[empty], layout.totals[s] - r[s]), -r[s])
                if v > best_v:
                    best_v, best = v, (node_id, s, empty)
        if best is not None:
            return [best]
    return []


def _pays_off(
    layout: _Layout,
    step: Step,
    nodes: Mapping[str, NodeCaps],
    stages: Sequence[StageSpec],
    policy: PlacementPolicy,
    *,
    step_costs: StepCosts | None,
) -> bool:
    """Whether a step gains more samples over the horizon than its downloads lose.

    While the movers download they serve nowhere, and each destination has one replica
    (charged at the stage's mean replica rate) streaming the state instead of serving: a
    pessimistic figure, since the stream only shares that replica's uplink. Rates are
    whole steps' (`step_rate`)."""
    before = step_rate(layout.bound(), step_costs)
    after_changes: dict[int, float] = {}
    during_changes: dict[int, float] = {}
    seconds = 0.0
    for node_id, src, dst in step:
        r = layout.rates[node_id]
        after_changes[src] = after_changes.get(src, 0.0) - r[src]
        after_changes[dst] = after_changes.get(dst, 0.0) + r[dst]
        during_changes[src] = during_changes.get(src, 0.0) - r[src]
        replicas = len(layout.members[dst])
        if replicas:
            during_changes[dst] = during_changes.get(dst, 0.0) - layout.totals[dst] / replicas
        seconds = max(seconds, download_seconds(nodes[node_id], stages[dst], policy))
    if seconds >= policy.horizon_s:
        return False
    gain = step_rate(layout.bound_with(after_changes), step_costs) - before
    loss = before - step_rate(max(0.0, layout.bound_with(during_changes)), step_costs)
    return gain * (policy.horizon_s - seconds) > loss * seconds
