"""`swarmpipe bench latency`: how full the pipeline stays unlimited, on slow links and far away.

Three comparisons, each side by side in this one invocation (issue 23):

- `compute`: no link limit, the 6-block d=256 model: testnet samples/s over single-process
  training of the same model, data and batch on the same machine (target 0.85). The
  single process runs with 1 torch thread and with as many as the testnet's nodes use in
  all (at most the machine's cores), and the faster is the baseline: on a busy machine
  more threads can be several times slower (measured here: 17.7 samples/s with 1, 3.9
  with 2).
- `slow`: every link at 10 Mbit/s, lossless, the default model: samples/s over the link
  bound, the limit divided by the wire bytes per sample on the busiest link direction
  (target 0.90). `pipeline.in_flight` auto beside a fixed 2, and auto with 2-sample
  microbatches (16 a step instead of 4: the same global batch and, lossless, the same
  result to float rounding, with a shorter fill and drain).
- `far`: every link at 100 Mbit/s and 50 ms one way: samples/s over the same run without
  the delay (target 0.90), in_flight auto beside a fixed 2.

`slow` and `far` also run each auto setting with `train.step_overlap = true` (a one-step
gradient delay: the next step's first microbatches fill the pipeline while the last ones
drain; docs/design.md "Overlapping steps"), beside the synchronous runs, and give the same
ratios for it (`*_overlap`). `--quick` leaves out the fixed-window and 2-sample runs.

Samples/s here are over whole step cycles, boundaries included: the samples of steps 2 to
n-1 over the time from step 1's last commit to step n-1's (step 0 pays for start-up). Ends,
not openings: under overlap a step opens while the one before still trains. The
report's `time_breakdown` of each limited run says where the rest went; its summary is
printed beside each figure.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet, single_process
from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.testnet.time_breakdown import link_utilisation

PARTS = ("compute", "slow", "far")
COMPUTE_MODEL = ["model.n_layers=6", "model.d_model=256", "model.n_heads=4"]
LOSSLESS = ["pipeline.activation_codec=lossless", "pipeline.gradient_codec=lossless"]
OVERLAP = "train.step_overlap=true"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS)
    )
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per testnet")
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    parser.add_argument("--slow-mbit", type=float, default=10.0, help="the slow part's limit")
    parser.add_argument("--far-mbit", type=float, default=100.0, help="the far part's limit")
    parser.add_argument("--far-ms", type=float, default=50.0, help="the far part's delay")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the far part's four runs, alternating their order; samples/s are means",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="only the auto window, synchronous and overlapped (no fixed_2, no 2-sample runs)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def cycle_samples_per_second(report: dict[str, Any]) -> float:
    """Samples over whole step cycles (boundaries included), step 0 left out: from one
    step's last commit to a later one's."""
    steps = report["steps"]
    if len(steps) < 3:
        raise SystemExit("bench latency needs at least 3 steps per testnet (--steps)")
    ended = [s["elapsed_s"] for s in steps]
    samples = sum(s["samples"] for s in steps[2:])
    return float(samples / (ended[-1] - ended[1]))


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """samples/s, the busiest link, the heads' windows and where the time went."""
    sps = cycle_samples_per_second(report)
    breakdown = report["time_breakdown"]
    coordinator = {k: v for k, v in breakdown["coordinator"].items() if k != "steps"}
    nodes = {
        node: {
            "stage": n["stage"],
            "shares": {k: round(v, 3) for k, v in n["shares"].items()},
            "drain_s_per_step": n["totals"]["drain_s"] / max(n["steps_counted"], 1),
            "compute_s_per_step": n["totals"]["compute_s"] / max(n["steps_counted"], 1),
        }
        for node, n in breakdown["nodes"].items()
    }
    committed = report["counters"]["committed"]
    links = link_utilisation(report, samples_per_second=sps, committed=committed)
    result: dict[str, Any] = {
        "samples_per_second": sps,
        "steady_samples_per_second_excluding_boundaries": (
            sum(s["samples"] for s in report["steps"][1:])
            / sum(s["seconds"] for s in report["steps"][1:])
        ),
        "in_flight": report.get("in_flight", {}),
        "overlapped_steps": sum(
            1 for s in report["steps"] if s.get("trains_on", s["step"]) < s["step"]
        ),
        "final_loss": report["final_loss"],
        "lost": report["counters"]["lost"],
        "coordinator": coordinator,
        "nodes": nodes,
    }
    if links:
        busiest = max(links, key=lambda k: links[k]["wire_bytes_per_sample"])
        result["busiest_link"] = busiest
        result["links"] = links
    return result


def _link_bound(report: dict[str, Any], mbit: float) -> float:
    committed = max(report["counters"]["committed"], 1)
    busiest = max(c["wire_bytes"] for c in report["link_choices"] if c["direction"] != "reduce")
    return float(mbit * 1e6 / 8 / (busiest / committed))


def serve(args: argparse.Namespace) -> int:
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4 (step 0 and the last are not counted)")
    load_config(None, args.set)  # a bad --set fails before any run
    result: dict[str, Any] = {"steps": args.steps, "nodes": args.nodes, "settings": args.set}

    def testnet(settings: list[str], *flags: str, what: str) -> dict[str, Any]:
        return run_testnet(
            [*settings, *args.set], args.steps, args.nodes, args.threads, *flags, what=what
        )

    if "compute" in parts:
        import torch

        singles = {}
        for threads in sorted({1, min(os.cpu_count() or 1, args.nodes * args.threads)}):
            torch.set_num_threads(threads)
            singles[threads] = single_process([*COMPUTE_MODEL, *args.set], args.steps)
        base = max(singles.values(), key=lambda s: float(s["samples_per_second"]))
        run = summary(testnet(COMPUTE_MODEL, what="compute"))
        result["compute"] = {
            "model": COMPUTE_MODEL,
            "single_process": base,
            "single_process_by_threads": singles,
            "testnet": run,
            "testnet_over_single_process": run["samples_per_second"] / base["samples_per_second"],
            "target": 0.85,
        }
    if "slow" in parts:
        limit = ("--link-mbit", f"{args.slow_mbit:g}")
        slow: dict[str, Any] = {"link_mbit": args.slow_mbit, "target": 0.90}
        slow_runs = [
            ("auto", ["pipeline.in_flight=auto"]),
            ("auto_overlap", ["pipeline.in_flight=auto", OVERLAP]),
            ("fixed_2", ["pipeline.in_flight=2"]),
            ("auto_microbatch_2", ["pipeline.in_flight=auto", "train.microbatch=2"]),
        ]
        for name, settings in slow_runs[:2] if args.quick else slow_runs:
            report = testnet([*LOSSLESS, *settings], *limit, what=f"slow {name}")
            run = summary(report)
            run["link_bound_samples_per_second"] = _link_bound(report, args.slow_mbit)
            run["over_link_bound"] = (
                run["samples_per_second"] / run["link_bound_samples_per_second"]
            )
            slow[name] = run
        result["slow"] = slow
    if "far" in parts:
        limit = ("--link-mbit", f"{args.far_mbit:g}")
        delay = ("--latency-ms", f"{args.far_ms:g}")
        far: dict[str, Any] = {
            "link_mbit": args.far_mbit,
            "latency_ms": args.far_ms,
            "target": 0.90,
            "rounds": args.rounds,
        }
        kinds = ["auto", "auto_overlap"] + ([] if args.quick else ["fixed_2"])
        window = {
            "auto": ["pipeline.in_flight=auto"],
            "auto_overlap": ["pipeline.in_flight=auto", OVERLAP],
            "fixed_2": ["pipeline.in_flight=2"],
        }
        runs = [
            (f"{where}_{kind}", window[kind], flags)
            for kind in kinds
            for where, flags in (("near", limit), ("far", (*limit, *delay)))
        ]
        per_round: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for round_index in range(args.rounds):
            # Alternate the order, so a machine that slows down over the invocation
            # does not always charge the same run.
            for name, settings, flags in runs if round_index % 2 == 0 else runs[::-1]:
                far[name] = summary(testnet(settings, *flags, what=f"far {name}"))
                per_round[name].append(far[name]["samples_per_second"])
        for name, values in per_round.items():
            far[name]["samples_per_second_per_round"] = values
            far[name]["samples_per_second"] = sum(values) / len(values)
        for kind in kinds:
            far[f"{kind}_far_over_near"] = (
                far[f"far_{kind}"]["samples_per_second"] / far[f"near_{kind}"]["samples_per_second"]
            )
            far[f"{kind}_far_over_near_per_round"] = [
                f / n
                for f, n in zip(per_round[f"far_{kind}"], per_round[f"near_{kind}"], strict=True)
            ]
        if "fixed_2" in kinds:
            far["far_fixed_2_over_near_auto"] = (
                far["far_fixed_2"]["samples_per_second"] / far["near_auto"]["samples_per_second"]
            )
        far["far_auto_overlap_over_near_auto"] = (
            far["far_auto_overlap"]["samples_per_second"] / far["near_auto"]["samples_per_second"]
        )
        result["far"] = far
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
