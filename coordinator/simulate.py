"""Run the coordinator's placement and rebalancing over a synthetic swarm; print JSON.

The same code the coordinator runs (coordinator/placement.py), over thousands of drawn or
read nodes and a churn trace (seeded Poisson joins and leaves, or a file; formats in
coordinator/simulated_swarm.py). It prints the swarm's throughput bound over time against
the best achievable for the fleet alive at each moment, the moves made, and how long each
plan took.

What is simulated: a node serves only once it holds its stage's state, `move_overhead_s` +
state bytes / its inbound bandwidth after it joins or moves, and meanwhile one replica of
that stage is charged as streaming it instead of serving (as the policy's cost model
assumes). The policy sees every rate with `--noise` of uniform jitter, as measurements
come; the throughput counted uses the true rates. Rebalancing runs every
`--rebalance-every` seconds, at once when a stage loses its last node, and when a node's
rate moves by the policy's `rate_change`.

"Best achievable" is an upper bound, the optimum of the linear relaxation (a node may split
its time between stages): for any stage weights y >= 0 summing to 1, a plan of bound T has
T = sum_s y_s T <= sum_s y_s (its rate on s) <= sum_n max_s y_s r(n, s), so every y gives
an upper bound, and we descend to the least we find (exponentiated subgradient steps,
on a smoothed max, warm-started each rebalance; between rebalances a join or leave adds or
removes its node's term, which keeps it an upper bound). The fraction of optimal is
therefore conservative. `best_over_initial_plan` says how tight: the bound over the plan at
the start, which no plan can beat by more than the bound's own slack.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from swarmpipe.errors import ConfigError

# The default swarm: a model cut into equal stages whose state (fp32 parameters and Adam's
# two moments for ~40M parameters) is 500 MB, sending 256 KB of activations and of
# gradients per sample per cut (a 512-token sample at width 512 in int8).
DEFAULT_STATE_MB = 500.0
DEFAULT_CUT_KB = 256.0
# Descent steps toward the least upper bound: many at the start, a few at each rebalance
# (warm-started: the fleet changed by a few nodes).
UPPER_BOUND_START_STEPS = 60
UPPER_BOUND_TICK_STEPS = 4
# How many points of the throughput series to print at most.
SERIES_POINTS = 48


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, help="nodes at the start, drawn (default 1000)")
    parser.add_argument("--stages", type=int, default=8, help="pipeline stages")
    parser.add_argument("--hours", type=float, default=2.0, help="simulated hours")
    parser.add_argument(
        "--leave-per-hour", type=float, default=0.10, help="chance a node leaves within an hour"
    )
    parser.add_argument(
        "--join-per-hour",
        type=float,
        default=0.10,
        help="joins per hour, as a fraction of the starting fleet",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the fleet, churn and noise")
    parser.add_argument(
        "--rebalance-every", type=float, default=60.0, help="seconds between rebalances"
    )
    parser.add_argument(
        "--noise", type=float, default=0.03, help="uniform jitter on the rates the policy sees"
    )
    parser.add_argument("--state-mb", type=float, default=DEFAULT_STATE_MB, help="state per stage")
    parser.add_argument(
        "--cut-kb",
        type=float,
        default=DEFAULT_CUT_KB,
        help="activation and gradient KB per sample across each cut",
    )
    parser.add_argument("--nodes-file", type=Path, help="the starting fleet: JSON lines or CSV")
    parser.add_argument("--trace-file", type=Path, help="churn as JSON lines instead of Poisson")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulationSpec:
    """One simulation's settings, checked."""

    stages: int
    hours: float
    leave_per_hour: float
    join_per_hour: float
    seed: int
    rebalance_every_s: float
    noise: float
    state_mb: float
    cut_kb: float

    def __post_init__(self) -> None:
        if self.stages < 1:
            raise ConfigError(f"--stages must be >= 1, got {self.stages}")
        if not self.hours > 0 or not self.rebalance_every_s > 0:
            raise ConfigError("--hours and --rebalance-every must be > 0")
        if min(self.leave_per_hour, self.join_per_hour, self.state_mb, self.cut_kb) < 0:
            raise ConfigError(
                "--leave-per-hour, --join-per-hour, --state-mb, --cut-kb must be >= 0"
            )
        if not 0 <= self.noise < 1:
            raise ConfigError(f"--noise must be in [0, 1), got {self.noise}")


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.coordinator.simulated_swarm import draw_fleet, read_nodes_file, read_trace_file

    spec = SimulationSpec(
        stages=args.stages,
        hours=args.hours,
        leave_per_hour=args.leave_per_hour,
        join_per_hour=args.join_per_hour,
        seed=args.seed,
        rebalance_every_s=args.rebalance_every,
        noise=args.noise,
        state_mb=args.state_mb,
        cut_kb=args.cut_kb,
    )
    rng = random.Random(spec.seed)
    if args.nodes_file is not None:
        if args.nodes is not None:
            raise ConfigError("give --nodes or --nodes-file, not both")
        fleet = read_nodes_file(args.nodes_file)
    else:
        count = 1000 if args.nodes is None else args.nodes
        if count < 1:
            raise ConfigError(f"--nodes must be >= 1, got {count}")
        fleet = draw_fleet(count, rng)
    trace = None if args.trace_file is None else read_trace_file(args.trace_file, rng)
    print(json.dumps(Simulation(spec, fleet, trace, rng).run(), indent=2))
    return 0


@dataclass(slots=True)
class _Pending:
    """A node downloading its stage's state: it serves from `ready_at`."""

    ready_at: float
    stage: int
    stall: float
    """The rate charged to the stage meanwhile (one replica streaming the state)."""


@dataclass(slots=True)
class _Tally:
    planning_s: list[float] = field(default_factory=list)
    joiner_s: list[float] = field(default_factory=list)
    moves: dict[str, int] = field(default_factory=dict)
    joins: int = 0
    leaves: int = 0
    rate_changes: int = 0
    series: list[dict[str, float]] = field(default_factory=list)


class Simulation:
    """The swarm through time: who serves where, what the policy decides, what it yields."""

    def __init__(
        self,
        spec: SimulationSpec,
        fleet: list[Any],
        trace: list[Any] | None,
        rng: random.Random,
    ) -> None:
        from swarmpipe.coordinator import placement

        self.p = placement
        self.spec = spec
        self.rng = rng
        self.trace = trace
        self.stages = placement.stages_from_cuts(
            [1.0] * spec.stages,
            [spec.cut_kb * 1e3] * (spec.stages - 1),
            [spec.cut_kb * 1e3] * (spec.stages - 1),
            [spec.state_mb * 1e6] * spec.stages,
        )
        self.policy = placement.PlacementPolicy()
        self.start_fleet = fleet
        self.caps: dict[str, placement.NodeCaps] = {}
        self.rows: dict[str, tuple[float, ...]] = {}
        self.assignment: dict[str, int] = {}
        self.alive: list[str] = []  # for a uniform random leaver in O(1)
        self.alive_at: dict[str, int] = {}
        self.assigned_totals = [0.0] * spec.stages  # every node holding a stage
        self.held_counts = [0] * spec.stages
        self.serving_totals = [0.0] * spec.stages  # serving nodes, less streaming replicas
        self.serving_counts = [0] * spec.stages
        self.pending: dict[str, _Pending] = {}
        self.ready_heap: list[tuple[float, str]] = []
        self.last_moved: dict[str, float] = {}
        self.weights = [1.0 / spec.stages] * spec.stages
        self.upper = 0.0
        self.tally = _Tally()

    # -- the fleet's bookkeeping ------------------------------------------------------

    def _add_alive(self, caps: Any) -> None:
        self.caps[caps.node_id] = caps
        self.rows[caps.node_id] = tuple(
            self.p.effective_rate(caps, self.stages, s) for s in range(self.spec.stages)
        )
        self.alive_at[caps.node_id] = len(self.alive)
        self.alive.append(caps.node_id)
        self.upper += self._term(caps.node_id)

    def _term(self, node_id: str) -> float:
        return max(w * r for w, r in zip(self.weights, self.rows[node_id], strict=True))

    def _start_serving_later(self, node_id: str, stage: int, now: float) -> None:
        """`node_id` now holds `stage` and downloads its state."""
        self.assignment[node_id] = stage
        self.held_counts[stage] += 1
        self.assigned_totals[stage] += self.rows[node_id][stage]
        seconds = self.p.download_seconds(self.caps[node_id], self.stages[stage], self.policy)
        count = self.serving_counts[stage]
        stall = self.serving_totals[stage] / count if count else 0.0
        self.serving_totals[stage] -= stall
        self.pending[node_id] = _Pending(ready_at=now + seconds, stage=stage, stall=stall)
        heapq.heappush(self.ready_heap, (now + seconds, node_id))
        self.last_moved[node_id] = now

    def _release(self, node_id: str) -> int:
        """`node_id` stops holding its stage (it leaves or moves); the stage it held."""
        stage = self.assignment.pop(node_id)
        self.held_counts[stage] -= 1
        self.assigned_totals[stage] -= self.rows[node_id][stage]
        waiting = self.pending.pop(node_id, None)
        if waiting is not None:
            self.serving_totals[stage] += waiting.stall
        else:
            self.serving_totals[stage] -= self.rows[node_id][stage]
            self.serving_counts[stage] -= 1
        if self.held_counts[stage] == 0:  # no rounding residue on an empty stage
            self.assigned_totals[stage] = self.serving_totals[stage] = 0.0
        return stage

    def _becomes_ready(self, node_id: str, now: float) -> None:
        waiting = self.pending.get(node_id)
        if waiting is None or waiting.ready_at != now:
            return  # it left or moved again since
        del self.pending[node_id]
        stage = waiting.stage
        self.serving_totals[stage] += waiting.stall + self.rows[node_id][stage]
        self.serving_counts[stage] += 1

    def _leave(self, node_id: str) -> int:
        stage = self._release(node_id)
        self.upper -= self._term(node_id)
        last = self.alive.pop()
        index = self.alive_at.pop(node_id)
        if last != node_id:
            self.alive[index] = last
            self.alive_at[last] = index
        del self.caps[node_id], self.rows[node_id]
        self.last_moved.pop(node_id, None)
        return stage

    # -- the policy ------------------------------------------------------------------

    def _join(self, caps: Any, now: float) -> None:
        self._add_alive(caps)
        started = time.perf_counter()
        stage = self.p.place_joiner(
            caps,
            self.stages,
            self.policy,
            rates=self.assigned_totals,
            replicas=self.held_counts,
            prices=self.weights,
        )
        self.tally.joiner_s.append(time.perf_counter() - started)
        self._start_serving_later(caps.node_id, stage, now)
        self.tally.joins += 1

    def _measured(self) -> dict[str, Any]:
        noise, uniform = self.spec.noise, self.rng.uniform
        if noise == 0:
            return dict(self.caps)
        return {
            k: self.p.NodeCaps(
                node_id=k,
                speed=c.speed * uniform(1 - noise, 1 + noise),
                bandwidth_in=c.bandwidth_in * uniform(1 - noise, 1 + noise),
                bandwidth_out=c.bandwidth_out * uniform(1 - noise, 1 + noise),
                compute_rates=c.compute_rates,
            )
            for k, c in self.caps.items()
        }

    def _rebalance(self, now: float) -> None:
        measured = self._measured()
        started = time.perf_counter()
        moves = self.p.rebalance(
            self.assignment,
            measured,
            self.stages,
            self.policy,
            now=now,
            last_moved=self.last_moved,
        )
        self.tally.planning_s.append(time.perf_counter() - started)
        for move in moves:
            self._release(move.node_id)
            self._start_serving_later(move.node_id, move.to_stage, now)
            self.tally.moves[move.reason] = self.tally.moves.get(move.reason, 0) + 1

    def _refresh_upper_bound(self, iterations: int) -> None:
        """Descend to a lower upper bound from the current stage weights (see the docstring)."""
        rows = [self.rows[k] for k in self.alive]
        self.upper, weights = self.p.relaxed_upper_bound(rows, self.weights, iterations=iterations)
        self.weights = weights or self.weights

    # -- time ------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from swarmpipe.coordinator.simulated_swarm import draw_node

        spec = self.spec
        for caps in self.start_fleet:
            self._add_alive(caps)
        started = time.perf_counter()
        initial = self.p.plan(self.start_fleet, self.stages, self.policy)
        initial_plan_s = time.perf_counter() - started
        for node_id, stage in initial.items():
            self.assignment[node_id] = stage
            self.held_counts[stage] += 1
            self.assigned_totals[stage] += self.rows[node_id][stage]
            self.serving_totals[stage] += self.rows[node_id][stage]
            self.serving_counts[stage] += 1
        self._refresh_upper_bound(UPPER_BOUND_START_STEPS)
        start_gap = self.upper / max(min(self.serving_totals), 1e-12)

        end = spec.hours * 3600.0
        poisson = self.trace is None
        trace = iter(self.trace or [])
        next_trace = next(trace, None)
        join_rate = spec.join_per_hour * len(self.start_fleet) / 3600.0
        joined = 0

        def next_poisson(now: float) -> float:
            rate = join_rate + spec.leave_per_hour * len(self.alive) / 3600.0
            return now + self.rng.expovariate(rate) if rate > 0 else math.inf

        now = 0.0
        next_churn = next_poisson(0.0) if poisson else math.inf
        next_tick = spec.rebalance_every_s
        weighted_fraction = actual_area = upper_area = 0.0
        lowest = math.inf
        self._sample(0.0)
        while now < end:
            churn_at = next_churn if poisson else (next_trace.t if next_trace else math.inf)
            ready_at = self.ready_heap[0][0] if self.ready_heap else math.inf
            at = min(churn_at, ready_at, next_tick, end)
            actual = max(0.0, min(self.serving_totals))
            fraction = actual / self.upper if self.upper > 0 else 1.0
            weighted_fraction += fraction * (at - now)
            actual_area += actual * (at - now)
            upper_area += self.upper * (at - now)
            lowest = min(lowest, fraction)
            now = at
            if now >= end:
                break
            urgent = False
            if at == ready_at:
                _, node_id = heapq.heappop(self.ready_heap)
                self._becomes_ready(node_id, now)
            elif at == next_tick:
                self._refresh_upper_bound(UPPER_BOUND_TICK_STEPS)
                self._rebalance(now)
                self._sample(now)
                next_tick += spec.rebalance_every_s
            elif poisson:
                leave_rate = spec.leave_per_hour * len(self.alive) / 3600.0
                if self.rng.random() * (leave_rate + join_rate) < leave_rate and self.alive:
                    urgent = self._churn_leave(self.rng.choice(self.alive))
                else:
                    joined += 1
                    self._join(draw_node(f"j{joined}", self.rng), now)
                next_churn = next_poisson(now)
            else:
                assert next_trace is not None
                urgent = self._apply_trace_event(next_trace, now)
                next_trace = next(trace, None)
            if urgent:
                self._rebalance(now)
        self._sample(end)
        return self._report(
            initial_plan_s=initial_plan_s,
            start_gap=start_gap,
            fraction=weighted_fraction / end,
            lowest=lowest,
            samples_ratio=actual_area / upper_area if upper_area else 1.0,
        )

    def _churn_leave(self, node_id: str) -> bool:
        """A node leaves; whether its stage is now empty (rebalance at once)."""
        stage = self._leave(node_id)
        self.tally.leaves += 1
        return self.held_counts[stage] == 0 and bool(self.assignment)

    def _apply_trace_event(self, event: Any, now: float) -> bool:
        if event.kind == "join":
            if event.node_id in self.caps:
                raise ConfigError(f"trace: {event.node_id} joins at {event.t} but is in the swarm")
            self._join(event.caps, now)
            return False
        if event.node_id not in self.caps:
            raise ConfigError(f"trace: {event.node_id} is not in the swarm at {event.t}")
        if event.kind == "leave":
            return self._churn_leave(event.node_id)
        old = self.caps[event.node_id]
        self.tally.rate_changes += 1
        node_id = event.node_id
        stage = self.assignment[node_id]
        self.upper -= self._term(node_id)
        before = self.rows[node_id][stage]
        self.caps[node_id] = self.p.NodeCaps(
            node_id=node_id,
            speed=event.speed,
            bandwidth_in=old.bandwidth_in,
            bandwidth_out=old.bandwidth_out,
            compute_rates=old.compute_rates,
        )
        self.rows[node_id] = tuple(
            self.p.effective_rate(self.caps[node_id], self.stages, s)
            for s in range(self.spec.stages)
        )
        self.upper += self._term(node_id)
        change = self.rows[node_id][stage] - before
        self.assigned_totals[stage] += change
        if node_id not in self.pending:
            self.serving_totals[stage] += change
        return self.p.rate_changed(old.speed, event.speed, self.policy)

    def _sample(self, now: float) -> None:
        actual = max(0.0, min(self.serving_totals))
        self.tally.series.append(
            {
                "t_s": round(now, 1),
                "nodes": len(self.alive),
                "samples_per_s": round(actual, 2),
                "best_samples_per_s": round(self.upper, 2),
                "fraction": round(actual / self.upper, 4) if self.upper > 0 else 1.0,
            }
        )

    def _report(self, **figures: float) -> dict[str, Any]:
        tally = self.tally
        every = max(1, math.ceil(len(tally.series) / SERIES_POINTS))
        series = tally.series[::every]
        if series[-1] is not tally.series[-1]:
            series.append(tally.series[-1])
        return {
            "nodes_at_start": len(self.start_fleet),
            "nodes_at_end": len(self.alive),
            "stages": self.spec.stages,
            "hours": self.spec.hours,
            "seed": self.spec.seed,
            "joins": tally.joins,
            "leaves": tally.leaves,
            "rate_changes": tally.rate_changes,
            "initial_plan_s": round(figures["initial_plan_s"], 4),
            "planning_s_per_rebalance": _summary(tally.planning_s),
            "place_joiner_s": _summary(tally.joiner_s),
            "moves": {
                "total": sum(tally.moves.values()),
                "by_reason": dict(sorted(tally.moves.items())),
            },
            "fraction_of_optimal": round(figures["fraction"], 4),
            "fraction_of_optimal_lowest": round(figures["lowest"], 4),
            "samples_over_best_samples": round(figures["samples_ratio"], 4),
            "best_over_initial_plan": round(figures["start_gap"], 4),
            "best_is": "upper bound: the linear relaxation's dual at the best stage weights found",
            "throughput": series,
        }


def _summary(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return {"count": 0}
    ordered = sorted(seconds)
    return {
        "count": len(seconds),
        "mean": round(statistics.fmean(seconds), 5),
        "p50": round(ordered[len(ordered) // 2], 5),
        "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 5),
        "max": round(ordered[-1], 5),
    }
