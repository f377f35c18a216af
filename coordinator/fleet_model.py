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
- The replicas' reduce (gradient sums among a stage's replicas, once a step) is link load
  too: its `wire_bytes` over the samples, the median over the stage's replicas, is added to
  the stage's bytes each way (a replica receives what the others send it). With few samples
  a step it can outweigh the activations, and a replica whose link fell holds up every
  step's reduce of its stage.
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
  The reduce is a per-step cost: it runs at the step's barrier, once the pipeline's links
  are idle, so its seconds per sample add to theirs instead of overlapping (samples per
  step over (the step's link time + the barrier's)); bench rebalance on 0.3 Mbit/s links
  measured the reduce at several per cent of a step.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from swarmpipe.coordinator import placement
from swarmpipe.protos import control_pb2

# Bytes per sample are counted once a node has processed this many samples: the first
# microbatches carry link set-up and codec probing and overstate the steady figure.
MIN_SAMPLES_FOR_BYTES = 8
_LINK_DIRECTIONS = ("activation", "gradient", "reduce")


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
    specs = placement.stages_from_cuts(costs, activation, gradient, states)
    return tuple(
        replace(
            spec,
            bytes_in_per_sample=spec.bytes_in_per_sample + median((s, "reduce")),
            bytes_out_per_sample=spec.bytes_out_per_sample + median((s, "reduce")),
        )
        for s, spec in enumerate(specs)
    )


def node_caps(
    fleet: Sequence[Observed], stages: Sequence[placement.StageSpec]
) -> dict[str, placement.NodeCaps]:
    """Each node's capabilities for the policy (see the module's docstring)."""
    # (node, peer) -> [wire bytes, bandwidth] of the link from node to peer, all directions.
    # (node, peer, a reduce?) -> [wire bytes, bandwidth] of the link from node to peer.
    links: dict[tuple[str, str, bool], list[float]] = {}
    for o in fleet:
        if o.telemetry is None:
            continue
        for e in o.telemetry.link_estimates:
            if e.direction in _LINK_DIRECTIONS and e.bytes_per_second > 0:
                # The meter is per link, shared by its directions; the bytes add up.
                key = (o.node_id, e.peer, e.direction == "reduce")
                link = links.setdefault(key, [0.0, e.bytes_per_second])
                link[0] += e.wire_bytes
    out_links: dict[str, list[tuple[float, float, bool]]] = {}
    meters: dict[tuple[str, str], float] = {}
    for (sender, receiver, reduce), (wire, bandwidth) in links.items():
        out_links.setdefault(sender, []).append((wire, bandwidth, reduce))
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


def links_carry(links: Sequence[tuple[float, float, bool]]) -> float:
    """Bytes/s a node's links carry together, given each link's (wire bytes, bandwidth, a
    reduce link?). The pipeline's links work at once, so at the split of bytes they saw
    the busiest (most seconds per byte) sets the pace; the reduce runs at the step's
    barrier, after them, so its seconds add: bytes / (max over pipeline links of
    bytes / bandwidth + max over reduce links of the same). Links that carried nothing yet
    count at their bandwidth alone (the mean of those, if none carried any); none:
    unbounded."""
    if not links:
        return math.inf
    total = sum(wire for wire, _, _ in links)
    if total <= 0:
        return sum(bw for _, bw, _ in links) / len(links)
    pipeline = max((wire / bw for wire, bw, reduce in links if not reduce), default=0.0)
    barrier = max((wire / bw for wire, bw, reduce in links if reduce), default=0.0)
    return total / (pipeline + barrier)


def limited_by(caps: placement.NodeCaps, stage: placement.StageSpec, rate_on_stage: float) -> str:
    """What caps a node's effective rate on a stage: "bandwidth" when its links carry less
    than it computes, else "compute" (the word a throughput move's reason starts with)."""
    links = math.inf
    if stage.bytes_in_per_sample > 0:
        links = min(links, caps.bandwidth_in / stage.bytes_in_per_sample)
    if stage.bytes_out_per_sample > 0:
        links = min(links, caps.bandwidth_out / stage.bytes_out_per_sample)
    return "bandwidth" if links < rate_on_stage else "compute"
