"""report.json's `time_breakdown`: where a run's time went, per step and in total.

Two views of the same steps. The coordinator's: each step's training part (open until its
last commit) and its boundary (last commit until the next step opened: APPLY, the nodes'
reduce and optimizer step, StepDone, opening). And each node's (node/step_times.py): its
compute, its waiting inside the step (links and the other stages: fill, drain, gaps) and
its share of the boundary (reduce, apply, StepDone, then until its next first forward). A
node's train window plus its boundary is one step cycle, so its shares add up to 1.

The per-link figures say how busy each limited link direction was at a run's samples/s:
its wire bytes per sample times the samples per second, over its limit.
"""

from __future__ import annotations

from typing import Any

from swarmpipe.protos import coordinator_pb2

NODE_PHASES = ("compute_s", "waiting_s", "reduce_s", "apply_s", "step_done_s", "next_s")
"""A node's step cycle, in order: compute and waiting make its train window, the rest its
boundary."""


def _node_step(t: Any) -> dict[str, Any]:
    return {
        "step": t.step,
        "microbatches": t.microbatches,
        "train_s": t.train_s,
        "compute_s": t.compute_s,
        "waiting_s": max(0.0, t.train_s - t.compute_s),
        "drain_s": t.drain_s,
        "reduce_s": t.reduce_s,
        "apply_s": t.apply_s,
        "step_done_s": t.step_done_s,
        "next_s": t.next_s,
    }


def time_breakdown(
    status: coordinator_pb2.StatusReply, *, skip_first: bool = True
) -> dict[str, Any]:
    """The breakdown of a finished run's Status; totals leave out step 0 when `skip_first`
    (it pays for start-up and warm-up), as the benchmarks' samples/s do."""
    steps = []
    records = list(status.steps)
    for record, following in zip(records, [*records[1:], None], strict=True):
        started = record.elapsed_s - record.seconds
        entry: dict[str, Any] = {"step": record.step, "train_s": record.seconds}
        if following is not None:
            next_started = following.elapsed_s - following.seconds
            entry["boundary_s"] = max(0.0, next_started - record.elapsed_s)
            entry["cycle_s"] = next_started - started
        steps.append(entry)
    counted = [s for s in steps if "cycle_s" in s and not (skip_first and s["step"] == 0)]
    cycle = sum(s["cycle_s"] for s in counted)
    coordinator: dict[str, Any] = {
        "steps_counted": len(counted),
        "cycle_s": cycle,
        "train_s": sum(s["train_s"] for s in counted),
        "boundary_s": sum(s["boundary_s"] for s in counted),
    }
    if cycle > 0:
        coordinator["boundary_share"] = coordinator["boundary_s"] / cycle
    nodes: dict[str, Any] = {}
    for node in status.nodes:
        per_step = [
            _node_step(t)
            for t in node.step_times
            if t.complete and not (skip_first and t.step == 0)
        ]
        totals = {phase: sum(s[phase] for s in per_step) for phase in (*NODE_PHASES, "drain_s")}
        node_cycle = sum(totals[phase] for phase in NODE_PHASES)
        nodes[node.node_id] = {
            "stage": node.stage,
            "steps_counted": len(per_step),
            "totals": totals,
            "shares": {
                phase.removesuffix("_s"): (totals[phase] / node_cycle if node_cycle else 0.0)
                for phase in NODE_PHASES
            },
            "boundary_share": (
                sum(totals[p] for p in NODE_PHASES[2:]) / node_cycle if node_cycle else 0.0
            ),
            "steps": [s for s in (_node_step(t) for t in node.step_times)],
        }
    return {"coordinator": {**coordinator, "steps": steps}, "nodes": nodes}


def link_utilisation(
    report: dict[str, Any], *, samples_per_second: float, committed: int
) -> dict[str, dict[str, float]]:
    """Per limited link direction: wire bytes per sample and the share of the time its
    limit was busy carrying them at `samples_per_second` (1: the link never idled)."""
    busy: dict[str, dict[str, float]] = {}
    for c in report.get("link_choices", []):
        limit = c["limit_mbit"] * 1e6 / 8
        if limit <= 0:
            continue
        per_sample = c["wire_bytes"] / max(committed, 1)
        busy[f"{c['src']}->{c['dst']} {c['direction']}"] = {
            "wire_bytes_per_sample": per_sample,
            "busy_share": per_sample * samples_per_second / limit,
        }
    return busy
