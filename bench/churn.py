"""`swarmpipe bench churn`: seconds from a replica's SIGKILL until samples/s is back to 90%.

Runs one testnet with replicated stages and a churn schedule that SIGKILLs one
replica after `--kill-at-step` steps (optionally starting a node again
later), then reads the report: each step's finish time (seconds since
training began, to the testnet's 0.25 s poll) gives a samples/s series.
The baseline is samples/s over the `--window` steps before the kill;
recovery is the first moment a window of steps that all finished after the
kill runs at `--threshold` of the baseline or better. Prints JSON with the
series around the kill. Before and after come from the same run, so the
ratio means something on a noisy host; absolute figures do not travel.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet
from swarmpipe.config import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=6, help="testnet nodes (2 per stage)")
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in the run")
    parser.add_argument("--kill-at-step", type=int, default=12, help="kill after this many steps")
    parser.add_argument(
        "--victim",
        default="",
        help="node to kill (default: n{stages+1}, a second replica of some stage; the JSON "
        "says which)",
    )
    parser.add_argument(
        "--restart-after-steps",
        type=int,
        default=0,
        help="start a fresh node this many steps after the kill (0: never; needs joining)",
    )
    parser.add_argument("--window", type=int, default=3, help="steps per throughput window")
    parser.add_argument("--threshold", type=float, default=0.9, help="recovered at this ratio")
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def recovery(
    steps: list[dict[str, Any]], kill_at: float, window: int, threshold: float
) -> dict[str, Any]:
    """Baseline samples/s before `kill_at`, and how long after it a window regains `threshold`.

    `steps` are report records with `samples` and `seen_at_seconds`.
    """
    times = [float(s["seen_at_seconds"]) for s in steps]
    before = [i for i, t in enumerate(times) if t <= kill_at]
    if len(before) < window + 1:
        raise SystemExit(f"only {len(before)} steps finished before the kill; kill later")
    last = before[-1]

    def rate(first: int, end: int) -> float:
        """Samples/s of steps first..end (inclusive), timed from the step before `first`."""
        samples = sum(steps[i]["samples"] for i in range(first, end + 1))
        return float(samples) / max(times[end] - times[first - 1], 1e-9)

    baseline = rate(last - window + 1, last)
    result: dict[str, Any] = {
        "baseline_samples_per_second": baseline,
        "first_step_after_kill_seconds": (
            times[last + 1] - kill_at if last + 1 < len(times) else None
        ),
        "recovered_after_seconds": None,
        "recovered_samples_per_second": None,
    }
    for end in range(last + window, len(steps)):
        first = end - window + 1
        if times[first - 1] < kill_at:
            continue  # the window must hold only steps that began after the kill
        value = rate(first, end)
        if value >= threshold * baseline:
            result["recovered_after_seconds"] = times[end] - kill_at
            result["recovered_samples_per_second"] = value
            break
    return result


def serve(args: argparse.Namespace) -> int:
    # Nodes start together, so which stage each gets varies; n{S+1} is never
    # the only replica of its stage when there are 2 per stage.
    victim = args.victim or f"n{args.stages + 1}"
    schedule = f"kill {victim}@step{args.kill_at_step}"
    if args.restart_after_steps:
        schedule += f", start fresh-{victim}@step{args.kill_at_step + args.restart_after_steps}"
    report = run_testnet(
        args.set,
        args.steps,
        args.nodes,
        args.threads,
        "--stages",
        str(args.stages),
        "--churn",
        schedule,
        what=f"with churn {schedule!r}",
    )
    kills = [e for e in report["churn"] if e["action"] == "kill" and e["outcome"] == "killed"]
    if not kills:
        raise SystemExit(f"the kill never happened: {report['churn']}")
    kill = kills[0]
    steps = report["steps"]
    figures = recovery(steps, kill["at_seconds"], args.window, args.threshold)
    times = [float(s["seen_at_seconds"]) for s in steps]
    series = []
    for end in range(args.window, len(steps)):
        # Over a window of steps: single steps are shorter than the testnet's poll.
        first = end - args.window + 1
        samples = sum(steps[i]["samples"] for i in range(first, end + 1))
        series.append(
            {
                "step": steps[end]["step"],
                "seen_at_seconds": times[end],
                "seconds_from_kill": times[end] - kill["at_seconds"],
                "samples_per_second": samples / max(times[end] - times[first - 1], 1e-9),
            }
        )
    result = {
        "nodes": args.nodes,
        "stages": args.stages,
        "steps": args.steps,
        "schedule": schedule,
        "kill": kill,
        "window_steps": args.window,
        "threshold": args.threshold,
        **figures,
        "counters": report["counters"],
        "churn": report["churn"],
        "series": series,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
