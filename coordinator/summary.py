"""The one-screen summary of a finished run, from the coordinator's Status.

The coordinator prints it when the run is done, and so does the testnet: steps, losses,
throughput, bytes by codec, the sample counters, churn, and where the model is with the
command that exports it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from swarmpipe.protos import coordinator_pb2


def move_words(node: str, from_stage: int, to_stage: int, *, past: bool = False) -> str:
    """A move as a reader says it: to another stage, or a re-sync on its own."""
    if from_stage == to_stage:
        return f"{node} {'re-synced' if past else 're-syncs'} stage {to_stage}"
    return f"{'moved ' if past else ''}{node} from stage {from_stage} to {to_stage}"


def _loss(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.4f}"


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def busy_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Seconds during which some step trained, from each step's (opening, last commit): the
    union of the spans, which is their sum unless steps overlap (train.step_overlap)."""
    total, reached = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reached:
            total += end - max(start, reached)
            reached = end
    return total


def _overlapped(steps: list[coordinator_pb2.StepRecord]) -> str:
    """How many steps trained on older parameters (train.step_overlap) and how many steps
    behind at most, or nothing if none."""
    behind = sum(1 for s in steps if s.trains_on < s.step)
    if not behind:
        return ""
    most = max(s.step - s.trains_on for s in steps)
    how = "a step" if most == 1 else f"up to {most} steps"
    return f"; {behind} of {len(steps)} trained {how} behind (step overlap)"


def summary_lines(status: coordinator_pb2.StatusReply) -> list[str]:
    """What an organiser wants to see when a run ends, one fact a line."""
    steps = list(status.steps)
    train_seconds = busy_seconds((s.elapsed_s - s.seconds, s.elapsed_s) for s in steps)
    samples = sum(s.samples for s in steps)
    final_eval = next(
        (e.loss for e in reversed(status.evals) if e.step >= status.total_steps), None
    )
    c = status.counters
    by_codec: dict[str, int] = defaultdict(int)
    for link in status.links:
        by_codec[link.codec] += link.bytes
    lines = [
        f"run {status.run_id!r} {'done' if status.done else status.phase}: "
        f"{len(steps)} of {status.total_steps} steps",
        f"  loss: training {_loss(steps[-1].loss if steps else None)}, "
        f"held-out {_loss(final_eval)}"
        + ("" if final_eval is not None else " (set train.eval_every to measure it)"),
        f"  throughput: {samples / train_seconds if train_seconds else 0.0:.1f} samples/s "
        f"over {train_seconds:.1f} s of steps" + _overlapped(steps),
        "  bytes sent: "
        + (", ".join(f"{codec} {_bytes(n)}" for codec, n in sorted(by_codec.items())) or "none"),
        f"  samples: leased {c.leased}, committed {c.committed}, replayed {c.replayed}, "
        f"duplicates {c.duplicates}, lost {c.lost}",
        f"  churn: {status.joins} joins, {status.departures} departures, "
        f"{len(status.moves)} moves, "
        f"{sum(1 for n in status.nodes if n.online)} of {len(status.nodes)} nodes online",
    ]
    lines += [
        f"    {move_words(m.node_id, m.from_stage, m.to_stage, past=True)} at step {m.step}: "
        f"{m.reason}"
        for m in status.moves[-5:]
    ]
    if status.final_states:
        step = status.final_states[0].step
        lines.append(f"  model: every stage's final state at step {step}:")
        lines += [f"    stage {f.stage}: {f.path}" for f in status.final_states]
        lines.append(
            f"  export it: swarmpipe export --state-dir {status.state_dir} --out model.safetensors"
        )
    else:
        lines.append("  model: no final state stored")
    return lines
