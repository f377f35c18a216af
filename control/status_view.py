"""What `swarmpipe status` shows: the coordinator's Status as one plain object, and as a table.

`status_view` turns a `StatusReply` into the object `--json` prints, and `status_table`
renders that same object for people, so the two cannot disagree. Pure: no I/O, no gRPC.

Top-level keys of the object (a value is null where the swarm has not measured it yet):

- `run_id`, `phase` (`waiting`, `training`, `apply`, `saving`, `done`), `done`,
  `step` (the step being trained: the number of optimizer steps taken), `total_steps`;
- `loss`: `training` and `training_step` (the last finished step's mean token loss),
  `held_out` and `held_out_step` (the latest evaluation, `train.eval_every`);
- `samples_per_second`: samples over seconds of the last `RECENT_STEPS` finished steps;
- `samples`: the coordinator's counters `leased`, `committed`, `replayed`, `duplicates`,
  `lost`, `outstanding`;
- `nodes_online`, `nodes_known`, `joins`, `departures`;
- `stages`: one object per stage, in order: `stage`, `serving` (replicas taking traffic),
  `samples_per_second` (what its serving replicas achieve, summed),
  `microbatches_per_second` (what they could compute, summed: see `BOTTLENECK_RULE`),
  `bottleneck` (bool) and `replicas`, each with `node`, `address`, `state` (`serving`,
  `syncing` while it downloads its stage's state, or `offline`, which includes drained),
  `samples_per_second`, `compute_ms_per_microbatch`, `last_step`, `samples`,
  `param_digest`;
- `bottleneck_stage` and `bottleneck_reason`;
- `links`: one object per link direction a node has sent on: `src`, `dst`, `direction`
  (`activation`, `gradient`, `reduce`, or `state` for a joiner's download), `codec` (in use
  now), `codec_changes` (the codec switches its sender reports, its last 64 at most), `bytes`
  (tensor bytes sent, all codecs), `wire_bytes` (with framing, as the sender counts them),
  `measured_mbit` and `limit_mbit` (null: not measured yet, no limit);
- `final_states`: each stage's stored final state (`stage`, `step`, `path`) once the run
  saved;
- `moves`: every stage change the coordinator ordered (`node`, `from_stage`, `to_stage`,
  `step`, `reason`), oldest first;
- `benched`: every node taken out for poisoned tensors (`node`, `stage`, `step`,
  `reporters`, `reason`, `seconds_left` until it may join again), and `reports`, the
  reports of poisoned tensors the coordinator accepted.
- `model`: what the coordinator's throughput model (the one placement runs) makes of the
  serving nodes: `bound` (samples/s at most in whole steps: its slowest stage, with a step's
  fill and barrier counted), `best_bound` (the best plan
  for the same nodes; null for fleets over 256), `stage_rates`, and per node `compute`,
  `effective` (capped by its links) and `limited_by` (`compute` or `bandwidth`).

Status names no stage count, so `stages` runs from 0 to the highest stage a node has been
given; a stage above every node's (early in a run) is not shown.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from swarmpipe.coordinator.summary import move_words
from swarmpipe.protos import coordinator_pb2

RECENT_STEPS = 5
"""Steps the header's samples/s is taken over: one step is noisy, the whole run is stale."""

BOTTLENECK_RULE = (
    "The bottleneck is the stage whose serving replicas could compute the fewest microbatches "
    "a second, summed over its replicas (1 / compute time per microbatch, forward plus "
    "backward, as each node measures it; links are not counted); a stage with no serving "
    "replica stalls the run and is the bottleneck. Achieved samples/s cannot tell: every "
    "sample crosses every stage, so each stage achieves the same."
)

_MBIT = 1e6 / 8


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def _replica(node: coordinator_pb2.NodeRecord) -> dict[str, Any]:
    state = "offline" if not node.online else "serving" if node.serving else "syncing"
    compute = node.compute_seconds_per_microbatch
    return {
        "node": node.node_id,
        "address": node.address,
        "state": state,
        "samples_per_second": node.samples_per_second,
        "compute_ms_per_microbatch": compute * 1e3 if compute > 0 else None,
        "last_step": node.last_step,
        "samples": node.samples,
        "param_digest": node.param_digest,
    }


def _stages(status: coordinator_pb2.StatusReply) -> list[dict[str, Any]]:
    count = max((n.stage for n in status.nodes), default=-1) + 1
    stages: list[dict[str, Any]] = []
    for stage in range(count):
        records = [n for n in status.nodes if n.stage == stage]
        serving = [n for n in records if n.serving]
        measured = [n.compute_seconds_per_microbatch for n in serving]
        # One unmeasured replica makes the sum unknown, not smaller.
        capacity = sum(1 / s for s in measured) if measured and min(measured) > 0 else None
        stages.append(
            {
                "stage": stage,
                "serving": len(serving),
                "samples_per_second": sum(n.samples_per_second for n in serving),
                "microbatches_per_second": capacity,
                "bottleneck": False,
                "replicas": [_replica(n) for n in records],
            }
        )
    return stages


def _bottleneck(stages: list[dict[str, Any]], done: bool) -> tuple[int | None, str | None]:
    if done or not stages:
        return None, None
    for s in stages:
        if s["serving"] == 0:
            return s["stage"], "no serving replica"
    if any(s["microbatches_per_second"] is None for s in stages):
        return None, None  # a compute time not measured yet: any pick would be a guess
    slowest = min(stages, key=lambda s: (s["microbatches_per_second"], s["stage"]))
    return slowest["stage"], "slowest compute"


def _links(status: coordinator_pb2.StatusReply) -> list[dict[str, Any]]:
    Key = tuple[str, str, str]
    sent: dict[Key, int] = defaultdict(int)
    codecs: dict[Key, set[str]] = defaultdict(set)
    for record in status.links:
        key = (record.src_node, record.dst_node, record.direction)
        sent[key] += record.bytes
        codecs[key].add(record.codec)
    choices = {(c.src_node, c.dst_node, c.direction): c for c in status.link_choices}
    links = []
    for key in sorted(sent.keys() | choices.keys()):
        choice = choices.get(key)
        # A replica reduce names no codec choice; a link no choice is known for yet may
        # still have used one codec only.
        codec = choice.codec if choice is not None and choice.codec != "unknown" else None
        if codec is None and len(codecs[key]) == 1:
            (codec,) = codecs[key]
        measured = choice.bytes_per_second if choice is not None else 0.0
        limit = choice.limit_bytes_per_second if choice is not None else 0.0
        src, dst, direction = key
        links.append(
            {
                "src": src,
                "dst": dst,
                "direction": direction,
                "codec": codec,
                "codec_changes": len(choice.changes) if choice is not None else 0,
                "bytes": sent[key],
                "wire_bytes": choice.wire_bytes if choice is not None else None,
                "measured_mbit": measured / _MBIT if measured > 0 else None,
                "limit_mbit": limit / _MBIT if limit > 0 else None,
            }
        )
    return links


def sample_counters(c: coordinator_pb2.SampleCounters) -> dict[str, int]:
    """The run's sample counters by name, as the status JSON and report.json carry them."""
    return {
        "leased": c.leased,
        "committed": c.committed,
        "replayed": c.replayed,
        "duplicates": c.duplicates,
        "lost": c.lost,
        "outstanding": c.outstanding,
    }


def status_view(status: coordinator_pb2.StatusReply) -> dict[str, Any]:
    """The swarm as `swarmpipe status --json` prints it (keys in the module docstring)."""
    steps = list(status.steps)
    recent = steps[-RECENT_STEPS:]
    seconds = sum(s.seconds for s in recent)
    last_eval = status.evals[-1] if status.evals else None
    stages = _stages(status)
    bottleneck, reason = _bottleneck(stages, status.done)
    if bottleneck is not None:
        stages[bottleneck]["bottleneck"] = True
    c = status.counters
    return {
        "run_id": status.run_id,
        "phase": status.phase,
        "done": status.done,
        "step": status.step,
        "total_steps": status.total_steps,
        "loss": {
            "training": _number(steps[-1].loss) if steps else None,
            "training_step": steps[-1].step if steps else None,
            "held_out": _number(last_eval.loss) if last_eval else None,
            "held_out_step": last_eval.step if last_eval else None,
        },
        "samples_per_second": sum(s.samples for s in recent) / seconds if seconds > 0 else None,
        "samples": sample_counters(c),
        "nodes_online": sum(1 for n in status.nodes if n.online),
        "nodes_known": len(status.nodes),
        "joins": status.joins,
        "departures": status.departures,
        "stages": stages,
        "bottleneck_stage": bottleneck,
        "bottleneck_reason": reason,
        "links": _links(status),
        "final_states": [
            {"stage": f.stage, "step": f.step, "path": f.path} for f in status.final_states
        ],
        "moves": [
            {
                "node": m.node_id,
                "from_stage": m.from_stage,
                "to_stage": m.to_stage,
                "step": m.step,
                "reason": m.reason,
            }
            for m in status.moves
        ],
        "reports": status.reports,
        "benched": [
            {
                "node": b.node_id,
                "stage": b.stage,
                "step": b.step,
                "reporters": list(b.reporters),
                "reason": b.reason,
                "seconds_left": b.seconds_left,
            }
            for b in status.benched
        ],
        "model": {
            "bound": _number(status.placement.bound) if status.placement.stage_rates else None,
            "best_bound": _number(status.placement.best_bound) or None,
            "stage_rates": [_number(r) for r in status.placement.stage_rates],
            "nodes": {
                n.node_id: {
                    "compute": _number(n.compute),
                    "effective": _number(n.effective),
                    "limited_by": n.limited_by,
                }
                for n in status.placement.nodes
            },
        },
    }


# -- the table ------------------------------------------------------------


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _align(rows: list[list[str]], right: set[int], indent: str = "") -> list[str]:
    """Rows of cells as lines, each column as wide as its widest cell."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def status_table(view: dict[str, Any]) -> list[str]:
    """`status_view`'s object as the lines `swarmpipe status` prints."""
    loss = view["loss"]
    training = (
        f"training {loss['training']:.4f} (step {loss['training_step']})"
        if loss["training"] is not None
        else "training -"
    )
    held_out = (
        f"held-out {loss['held_out']:.4f} (step {loss['held_out_step']})"
        if loss["held_out"] is not None
        else "held-out - (train.eval_every is off or no evaluation ran yet)"
    )
    s = view["samples"]
    lines = [
        f"run {view['run_id']!r}: {view['phase']}, step {view['step']} of {view['total_steps']}",
        f"  loss: {training}, {held_out}",
        f"  throughput: {_fmt(view['samples_per_second'])} samples/s "
        f"over the last {RECENT_STEPS} steps; the model's bound {_fmt(view['model']['bound'])} "
        f"(best plan {_fmt(view['model']['best_bound'])})",
        f"  samples: leased {s['leased']}, committed {s['committed']}, replayed "
        f"{s['replayed']}, duplicates {s['duplicates']}, lost {s['lost']}, "
        f"outstanding {s['outstanding']}",
        f"  nodes: {view['nodes_online']} of {view['nodes_known']} online, "
        f"{_plural(view['joins'], 'join')}, {_plural(view['departures'], 'departure')}",
        "",
    ]
    if not view["stages"]:
        lines.append("no node has joined yet")
    else:
        rows = [["stage", "node", "state", "samples/s", "ms/microbatch", "microbatches/s",
                 "last step"]]  # fmt: skip
        marks: dict[int, str] = {}
        for stage in view["stages"]:
            if stage["bottleneck"]:
                marks[len(rows)] = f"  <- bottleneck: {view['bottleneck_reason']}"
            rows.append(
                [
                    str(stage["stage"]),
                    "",
                    f"{stage['serving']} serving",
                    _fmt(stage["samples_per_second"]),
                    "",
                    _fmt(stage["microbatches_per_second"]),
                    "",
                ]
            )
            for r in stage["replicas"]:
                ms = r["compute_ms_per_microbatch"]
                live = r["state"] != "offline"
                rows.append(
                    [
                        "",
                        r["node"],
                        r["state"],
                        _fmt(r["samples_per_second"]) if live else "-",
                        _fmt(ms) if live else "-",
                        _fmt(1e3 / ms) if live and ms else "-",
                        str(r["last_step"]),
                    ]
                )
        table = _align(rows, right={3, 4, 5, 6})
        lines += [line + marks.get(i, "") for i, line in enumerate(table)]
        lines.append(
            "(samples/s: achieved; microbatches/s: what its serving replicas could compute)"
        )
    if view["links"]:
        lines.append("")
        rows = [["link", "direction", "codec", "sent", "measured", "limit"]]
        for link in view["links"]:
            rows.append(
                [
                    f"{link['src']} -> {link['dst']}",
                    link["direction"],
                    link["codec"] or "-",
                    _bytes(link["bytes"]),
                    f"{_fmt(link['measured_mbit'])} Mbit/s" if link["measured_mbit"] else "-",
                    f"{_fmt(link['limit_mbit'])} Mbit/s" if link["limit_mbit"] else "none",
                ]
            )
        lines += _align(rows, right={3, 4, 5})
    if view["moves"]:
        lines.append("")
        lines.append("recent moves:")
        lines += [
            f"  step {m['step']}: "
            f"{move_words(m['node'], m['from_stage'], m['to_stage'], past=True)} ({m['reason']})"
            for m in view["moves"][-5:]
        ]
    if view["benched"]:
        lines.append("")
        lines.append("benched for poisoned tensors:")
        lines += [
            f"  step {b['step']}: {b['node']} (stage {b['stage']}), reported by "
            f"{', '.join(b['reporters'])}: {b['reason']}"
            for b in view["benched"][-5:]
        ]
    if view["final_states"]:
        lines.append("")
        lines.append(f"final states (step {view['final_states'][0]['step']}):")
        lines += [f"  stage {f['stage']}: {f['path']}" for f in view["final_states"]]
    return lines
