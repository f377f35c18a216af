"""The live fleet as the placement policy sees it: nodes' telemetry into NodeCaps and StageSpecs.

Pure (no I/O, no clock), so the coordinator's placement is unit-tested on made-up telemetry.

What each figure comes from (protos/control.proto, `Telemetry`):

- A node's compute rate on its stage: `compute_samples_per_second` (samples over the busy
  seconds of its compute thread, recent window), else the `calibrated_samples_per_second` of
  the short calibration it ran before it took traffic, else the mean of the measured nodes
  (a joiner placed before it says anything is taken as an average node).
- A stage's relative cost: `stage_flops_per_sample` its replicas report (from the modules they
  built), over the mean of the stages reported; 1 where no replica reported. Speed on a unit
  stage is rate x cost, so a rate measured on one stage predicts another.
- Bytes per sample across each cut, per direction: a sender's `wire_bytes` on its activation
  (gradient) links over the samples it processed, the median over a stage's replicas (the
  codecs in use are in those bytes: a link that compresses harder shows fewer).
- The replicas' reduce (gradient sums among a stage's replicas, once a step) is not link
  load per sample: it runs at the step's barrier, and every stage waits for it, so it is
  one of a step's fixed costs (below). Counted on the replicas' own links (as before), a
  replica whose link fell to a tenth was worth nothing to the model (0.001 samples/s) while
  the whole swarm waited 7 s a step for its reduce (bench rebalance: measured 4.4 samples/s
  beside a bound of 8.1).
- A node's outbound bandwidth: what its links carry together at the split of traffic they
  see. Each link has its own meter and carries its own share of the node's bytes (a
  sender spreads microbatches over the next stage's replicas), so the node's links hold it
  to min over links of (link's bandwidth / link's bytes per sample) samples/s; the policy
  takes a node's bandwidth as one figure, so it gets the equivalent: the node's bytes over
  the most any link takes per byte, sum(bytes) / max(bytes / bandwidth). This is right
  where links are limited each on their own (the testnet's per-peer send limits, and paths
  whose narrowest part is not the node's own line) and where they share one uplink while
  they are busy together (each meter then sees its share of the line); the mean of the
  meters, used before, took a node sending to two peers at 1 Mbit/s each for a 1 Mbit/s
  node (bench rebalance: measured 18.9 samples/s beside a bound of 12.8). Its inbound
  bandwidth: the sum of what the links sending to it measured, which its downlink carried
  at least (a sum, not the per-link minimum: a sender whose uplink fell is that sender's
  limit, counted in its outbound, and must not make its receivers look slow). Unmeasured:
  unbounded, so a new node's links are not taken for the bottleneck before anything moved.
  The bytes are the counters' totals, links to peers that since moved included: a link
  that carried a share of the node's bytes once is taken to carry that share again.
- A step's fixed costs (`step_costs`): the design trains in synchronous steps, so each step
  starts with an empty pipeline and ends with a drained one, then waits at the barrier.
  From the coordinator's own clock over the last STEP_COST_STEPS steps: the seconds from a
  step's opening to its first commit (the pipeline filling: a microbatch's trip there and
  back) and from its last commit to the next step's opening (APPLY, the replicas' reduce,
  the optimizer step, StepDone, the opening). The median of each, so one step disturbed
  by a move does not set them. The bound the policy judges moves by and the one Status
  shows are whole steps' rates with these counted (`placement.StepCosts`). They are taken
  as they are under the current plan: a plan that changes which replicas reduce together
  changes the barrier, and the model does not predict that.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarmpipe.coordinator import placement
from swarmpipe.coordinator.step_protocol import StepStats
from swarmpipe.protos import control_pb2

# A step's fixed costs are the median over this many recent steps: enough that one step
# disturbed by a move does not set them, few enough to follow a change of plan within a
# minute of steps of seconds.
STEP_COST_STEPS = 3
# Bytes per sample are counted once a node has processed this many samples: the first
# microbatches carry link set-up and codec probing and overstate the steady figure.
MIN_SAMPLES_FOR_BYTES = 8
_LINK_DIRECTIONS = ("activation", "gradient")


@dataclass(frozen=True, slots=True)
class Observed:
    """One node's stage and its latest telemetry (None: it has not reported yet)."""

    node_id: str
    stage: int
    telemetry: control_pb2.Telemetry | None


def measured_rate(t: control_pb2.Telemetry | None) -> float:
    """Samples/s on the node's own stage: measured, else calibrated, else 0 (unknown)."""
    if t is None:
        return 0.0
    if t.compute_samples_per_second > 0:
        return t.compute_samples_per_second
    return max(t.calibrated_samples_per_second, 0.0)


def since(t: control_pb2.Telemetry, base: control_pb2.Telemetry) -> control_pb2.Telemetry:
    """`t` with its counters (samples, each link's wire bytes) less those of `base`, an
    earlier report of the same node: what it did since, e.g. on the stage it moved to. The
    counters are the process's totals; a node whose counters went back restarted, and its
    report stands as it is."""
    if t.samples < base.samples:
        return t
    before = {(e.peer, e.direction): e.wire_bytes for e in base.link_estimates}
    out = control_pb2.Telemetry()
    out.CopyFrom(t)
    out.samples = t.samples - base.samples
    for e in out.link_estimates:
        e.wire_bytes = max(0, e.wire_bytes - before.get((e.peer, e.direction), 0))
    return out


def stage_costs(fleet: Iterable[Observed], num_stages: int) -> list[float]:
    """Each stage's compute per sample relative to the mean reported stage (1: unknown)."""
    flops: dict[int, list[float]] = {}
    for o in fleet:
        t = o.telemetry
        if t is not None and t.stage == o.stage and t.stage_flops_per_sample > 0:
            flops.setdefault(o.stage, []).append(t.stage_flops_per_sample)
    known = {s: statistics.median(v) for s, v in flops.items() if 0 <= s < num_stages}
    if not known:
        return [1.0] * num_stages
    mean = sum(known.values()) / len(known)
    return [known[s] / mean if s in known else 1.0 for s in range(num_stages)]


def stage_specs(fleet: Sequence[Observed], num_stages: int) -> tuple[placement.StageSpec, ...]:
    """What each stage asks of a node: cost, bytes per sample each way, state bytes."""
    costs = stage_costs(fleet, num_stages)
    per_sample: dict[tuple[int, str], list[float]] = {}
    state: dict[int, list[float]] = {}
    for o in fleet:
        t = o.telemetry
        if t is None or t.stage != o.stage or not 0 <= o.stage < num_stages:
            continue
        if t.stage_state_bytes > 0:
            state.setdefault(o.stage, []).append(t.stage_state_bytes)
        if t.samples < MIN_SAMPLES_FOR_BYTES:
            continue
        sent = dict.fromkeys(_LINK_DIRECTIONS, 0)
        for e in t.link_estimates:
            if e.direction in sent:
                sent[e.direction] += e.wire_bytes
        for direction, total in sent.items():
            per_sample.setdefault((o.stage, direction), []).append(total / t.samples)

    def median(key: tuple[int, str]) -> float:
        values = per_sample.get(key)
        return statistics.median(values) if values else 0.0

    activation = [median((s, "activation")) for s in range(num_stages - 1)]
    gradient = [median((s + 1, "gradient")) for s in range(num_stages - 1)]
    states = [statistics.median(state[s]) if s in state else 0.0 for s in range(num_stages)]
    return placement.stages_from_cuts(costs, activation, gradient, states)


def node_caps(
    fleet: Sequence[Observed], stages: Sequence[placement.StageSpec]
) -> dict[str, placement.NodeCaps]:
    """Each node's capabilities for the policy (see the module's docstring)."""
    # (node, peer) -> [wire bytes, bandwidth] of the link from node to peer, both directions.
    links: dict[tuple[str, str], list[float]] = {}
    for o in fleet:
        if o.telemetry is None:
            continue
        for e in o.telemetry.link_estimates:
            if e.direction in _LINK_DIRECTIONS and e.bytes_per_second > 0:
                # The meter is per link, shared by its directions; the bytes add up.
                link = links.setdefault((o.node_id, e.peer), [0.0, e.bytes_per_second])
                link[0] += e.wire_bytes
    out_links: dict[str, list[tuple[float, float]]] = {}
    meters: dict[tuple[str, str], float] = {}
    for (sender, receiver), (wire, bandwidth) in links.items():
        out_links.setdefault(sender, []).append((wire, bandwidth))
        meters[(sender, receiver)] = bandwidth
    in_bw: dict[str, float] = {}
    for (_, receiver), bandwidth in meters.items():
        in_bw[receiver] = in_bw.get(receiver, 0.0) + bandwidth
    # A rate is measured on the stage the telemetry names: a node that just moved still
    # reports its old stage's figure until it serves the new one.
    measured = {
        o.node_id: (o.telemetry.stage, measured_rate(o.telemetry))
        for o in fleet
        if o.telemetry is not None
        and 0 <= o.telemetry.stage < len(stages)
        and measured_rate(o.telemetry) > 0
    }
    speeds = {k: rate * stages[stage].cost for k, (stage, rate) in measured.items()}
    default_speed = sum(speeds.values()) / len(speeds) if speeds else 1.0
    caps = {}
    for o in fleet:
        rates = [0.0] * len(stages)
        if o.node_id in measured:
            stage, rate = measured[o.node_id]
            rates[stage] = rate
        caps[o.node_id] = placement.NodeCaps(
            node_id=o.node_id,
            speed=speeds.get(o.node_id, default_speed),
            bandwidth_in=in_bw.get(o.node_id, math.inf),
            bandwidth_out=links_carry(out_links.get(o.node_id, [])),
            compute_rates=tuple(rates),
        )
    return caps


def links_carry(links: Sequence[tuple[float, float]]) -> float:
    """Bytes/s a node's pipeline links carry together, given each link's (wire bytes,
    bandwidth). They work at once, so at the split of bytes they saw the busiest (most
    seconds per byte) sets the pace: bytes / max over links of bytes / bandwidth. Links
    that carried nothing yet count at their bandwidth alone (the mean of those, if none
    carried any); none: unbounded."""
    if not links:
        return math.inf
    total = sum(wire for wire, _ in links)
    if total <= 0:
        return sum(bw for _, bw in links) / len(links)
    return total / max(wire / bw for wire, bw in links)


def limited_by(caps: placement.NodeCaps, stage: placement.StageSpec, rate_on_stage: float) -> str:
    """What caps a node's effective rate on a stage: "bandwidth" when its links carry less
    than it computes, else "compute" (the word a throughput move's reason starts with)."""
    links = math.inf
    if stage.bytes_in_per_sample > 0:
        links = min(links, caps.bandwidth_in / stage.bytes_in_per_sample)
    if stage.bytes_out_per_sample > 0:
        links = min(links, caps.bandwidth_out / stage.bytes_out_per_sample)
    return "bandwidth" if links < rate_on_stage else "compute"


def step_costs(history: Sequence[StepStats], *, microbatch: int) -> placement.StepCosts | None:
    """A step's fixed costs as measured (see the module's docstring); None until a step
    past the first (start-up) has finished and the next one opened. `history`: the step
    protocol's steps, oldest first."""
    fills, barriers, samples = [], [], []
    for stats, following in itertools.pairwise(history):
        if (
            stats.step == 0  # start-up: building, connecting, the first codec probes
            or stats.eval_leases  # evaluation leases go first and would count as fill
            or stats.first_commit_at is None
            or stats.finished_at is None
            or stats.samples <= 0
        ):
            continue
        fills.append(stats.first_commit_at - stats.started_at)
        barriers.append(max(0.0, following.started_at - stats.finished_at))
        samples.append(stats.samples)
    if not fills:
        return None
    recent = slice(-STEP_COST_STEPS, None)
    per_step = statistics.median(samples[recent])
    return placement.StepCosts(
        samples=per_step,
        first_samples=min(float(microbatch), per_step),
        fill_s=max(0.0, statistics.median(fills[recent])),
        barrier_s=statistics.median(barriers[recent]),
    )
