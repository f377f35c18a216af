"""`swarmpipe bench hostile`: the loss curve with one hostile replica, beside a clean run.

Runs two testnets of one stage served by `--nodes` replicas (so every node is a
replica of it), on the same config and seed: a clean one, and one in which
node `--hostile` misbehaves at every reduce (`SWARMPIPE_HOSTILE`, node/hostile.py:
`noise` sends random noise of its gradient's norm, `scale:F` its gradient times
F). The coordinator leases the same samples at every step in both runs, so their
per-step training losses compare directly. Prints JSON: both loss curves, the
relative difference per step, its mean and maximum, the final losses, and whom
the coordinator benched and why. The hostile replica is dropped from the first
reduce it is judged in and benched there; that step begins again without it
(a held APPLY, coordinator/step_protocol.py), so no sample leaves the update
and the two curves agree to float rounding.

A second clean run (`--clean-runs 2`, the default) is the floor to read the
figures against: which replica gets which microbatch depends on timing, which
changes only the order of float sums now that honest replicas take the plain
mean (robust.clip_radius).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet
from swarmpipe.config import add_config_arguments
from swarmpipe.node import hostile


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", default="noise", help="noise, or scale:FACTOR")
    parser.add_argument("--nodes", type=int, default=3, help="replicas of the one stage")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--hostile", default="n2", help="the node that misbehaves")
    parser.add_argument(
        "--clean-runs",
        type=int,
        choices=(1, 2),
        default=2,
        help="2 runs the clean testnet twice, to show how far two clean runs differ",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def _run(args: argparse.Namespace, switch: str, what: str) -> dict[str, Any]:
    before = os.environ.get(hostile.ENV)
    os.environ[hostile.ENV] = switch  # inherited by the testnet's children
    try:
        # The direction screen is opt-in; a --set of its own wins (it comes later).
        overrides = [
            "robust.direction_sigmas=3",
            *args.set,
            "pipeline.stages=1",
            f"coordinator.min_nodes={args.nodes}",
        ]
        return run_testnet(overrides, args.steps, args.nodes, args.threads, what=what)
    finally:
        if before is None:
            os.environ.pop(hostile.ENV, None)
        else:
            os.environ[hostile.ENV] = before


def compare(clean: list[dict[str, Any]], poisoned: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step relative difference of the poisoned run's loss from the clean one's."""
    rows = []
    for c, p in zip(clean, poisoned, strict=False):
        rows.append(
            {
                "step": c["step"],
                "clean_loss": c["loss"],
                "hostile_loss": p["loss"],
                "relative_difference": (p["loss"] - c["loss"]) / c["loss"],
            }
        )
    diffs = [abs(r["relative_difference"]) for r in rows]
    return {
        "steps_compared": len(rows),
        "mean_abs_relative_difference": sum(diffs) / len(diffs) if diffs else None,
        "max_abs_relative_difference": max(diffs) if diffs else None,
        "steps_over_2_percent": [r["step"] for r in rows if abs(r["relative_difference"]) > 0.02],
        "final_clean_loss": rows[-1]["clean_loss"] if rows else None,
        "final_hostile_loss": rows[-1]["hostile_loss"] if rows else None,
        "curve": rows,
    }


def serve(args: argparse.Namespace) -> int:
    switch = f"{args.hostile}={args.mode}"
    try:
        hostile.parse(switch, args.hostile)
    except ValueError as exc:
        raise SystemExit(f"--mode: {exc}") from None
    if args.nodes < 3:
        raise SystemExit("--nodes must be >= 3: the robust aggregate needs three replicas")
    clean = _run(args, "", "clean")
    poisoned = _run(args, switch, f"with {switch}")
    figures = compare(clean["steps"], poisoned["steps"])
    floor: dict[str, Any] = {}
    if args.clean_runs == 2:
        again = _run(args, "", "clean, again")
        floor = {k: v for k, v in compare(clean["steps"], again["steps"]).items() if k != "curve"}
        floor["benched"] = again.get("benched", [])
    result = {
        "mode": args.mode,
        "hostile": args.hostile,
        "nodes": args.nodes,
        "steps": args.steps,
        **{k: v for k, v in figures.items() if k != "curve"},
        "mean_within_2_percent": (
            figures["mean_abs_relative_difference"] is not None
            and figures["mean_abs_relative_difference"] <= 0.02
        ),
        "every_step_within_2_percent": (
            figures["max_abs_relative_difference"] is not None
            and figures["max_abs_relative_difference"] <= 0.02
        ),
        "benched": poisoned.get("benched", []),
        "reports": poisoned.get("reports", 0),
        "clean_benched": clean.get("benched", []),
        "second_clean_run": floor or None,
        "curve": figures["curve"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
