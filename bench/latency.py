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

`slow` and `far` also run each auto setting at every overlap depth in `--depths` (default
0,1: `train.step_overlap`, steps opened ahead of the current one; at depth 1 the next step's
first microbatches fill the pipeline while the last ones drain; docs/design.md "Overlapping
steps"), side by side: `auto` is depth 0, `auto_overlap` depth 1 and `auto_depth_<k>` depth
k, each far run beside its own near run (without `--quick` the fixed window of 2 too, at
depth 0 and at the deepest depth given), with its ratio (`<name>_far_over_near`), its loss
after the run's steps, and the smallest depth whose far run reaches the target
(`smallest_depth_at_target`, null if none). `--quick` leaves out the fixed-window and
2-sample runs.

`staleness` (not run by default) says what each depth in `--depths` costs in quality, on
its own: the default model trained in one process for `--staleness-steps` steps under the
coordinator's rule on a settled swarm (every step opened as early as the depth allows, the
checkpoint steps drain; `StepProtocol` itself decides), each step's gradient on its recorded
version, as `model/reference.py` replays a lossless testnet to 1e-4. It reports the final
training loss (mean of the last 10 steps) and the held-out loss at the end, per depth.

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
from swarmpipe.config import MAX_OVERLAP_DEPTH, add_config_arguments, load_config
from swarmpipe.coordinator.step_protocol import Phase, StepProtocol
from swarmpipe.testnet.time_breakdown import link_utilisation

PARTS = ("compute", "slow", "far", "staleness")
COMPUTE_MODEL = ["model.n_layers=6", "model.d_model=256", "model.n_heads=4"]
LOSSLESS = ["pipeline.activation_codec=lossless", "pipeline.gradient_codec=lossless"]
OVERLAP = "train.step_overlap=true"


def depth_kind(depth: int) -> str:
    """The run name of the auto window at an overlap depth (0 and 1 keep their old names)."""
    return {0: "auto", 1: "auto_overlap"}.get(depth, f"auto_depth_{depth}")


def depth_settings(depth: int) -> list[str]:
    """The auto window at an overlap depth (1 is written `true`, as configs do)."""
    overlap = {0: [], 1: [OVERLAP]}.get(depth, [f"train.step_overlap={depth}"])
    return ["pipeline.in_flight=auto", *overlap]


def parse_depths(text: str) -> list[int]:
    """--depths: distinct overlap depths 0 to MAX_OVERLAP_DEPTH, in the order given."""
    try:
        depths = [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise SystemExit(
            f"--depths {text!r}: give comma-separated whole numbers, e.g. 0,1,3"
        ) from None
    top = MAX_OVERLAP_DEPTH
    if not depths or len(set(depths)) != len(depths) or not all(0 <= d <= top for d in depths):
        raise SystemExit(f"--depths {text!r}: give distinct depths from 0 to {top}, e.g. 0,1,3")
    return depths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts",
        default=",".join(PARTS[:3]),
        help="comma-separated: " + ", ".join(PARTS) + " (default: all but staleness)",
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
    parser.add_argument(
        "--depths",
        default="0,1",
        help="overlap depths (train.step_overlap) of the auto runs in the slow and far parts, "
        "comma-separated, e.g. 0,1,3",
    )
    parser.add_argument(
        "--staleness-steps",
        type=int,
        default=100,
        help="steps of the staleness part's single-process runs",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def eager_trains_on(steps: int, depth: int, drain_every: int) -> list[int]:
    """What each step trains on when every step opens as early as `depth` allows: the
    coordinator's own bookkeeping (StepProtocol) on a settled swarm whose microbatches all
    come back before each step is applied."""
    p = StepProtocol(
        total_steps=steps,
        global_batch=1,
        microbatch=1,
        lease_timeout_s=1.0,
        depth=depth,
        drain_every=drain_every,
    )
    p.start()
    while p.phase is not Phase.SAVING:
        while p.open_ahead(settled=True):
            pass
        while (lease := p.lease("n")) is not None:
            p.commit("n", lease.lease_id, 0.0, 1)
        p.await_acks({"n"})
        p.ack("n", p.step)
    return [p.trains_on(s) for s in range(steps)]


def staleness(settings: list[str], depths: list[int], steps: int) -> dict[str, Any]:
    """Training loss and held-out loss after `steps` single-process steps per depth."""
    from swarmpipe.model.reference import train_single_process

    rows = []
    for depth in depths:
        config = load_config(
            None,
            [
                *settings,
                *depth_settings(depth),
                f"train.steps={steps}",
                f"train.eval_every={steps}",
            ],
        )
        trains_on = eager_trains_on(steps, depth, config.checkpoint.every_steps)
        evals: list[tuple[int, float]] = []
        losses = train_single_process(config, evals=evals, trains_on=trains_on)
        rows.append(
            {
                "depth": depth,
                "most_steps_behind": max(s - on for s, on in enumerate(trains_on)),
                "mean_steps_behind": sum(s - on for s, on in enumerate(trains_on)) / steps,
                "final_train_loss": sum(losses[-10:]) / len(losses[-10:]),
                "heldout_loss": evals[-1][1],
            }
        )
    return {"steps": steps, "by_depth": rows}


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
        "most_steps_behind": max(
            (s["step"] - s.get("trains_on", s["step"]) for s in report["steps"]), default=0
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
    if args.staleness_steps < 1:
        raise SystemExit("--staleness-steps must be at least 1")
    if args.steps < 4:
        raise SystemExit("--steps must be at least 4 (step 0 and the last are not counted)")
    depths = parse_depths(args.depths)
    load_config(None, args.set)  # a bad --set fails before any run
    for depth in depths:
        load_config(None, [*args.set, *depth_settings(depth)])  # e.g. DiLoCo with overlap
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
        slow_runs = [(depth_kind(d), depth_settings(d)) for d in depths]
        if not args.quick:
            slow_runs += [
                ("fixed_2", ["pipeline.in_flight=2"]),
                ("auto_microbatch_2", ["pipeline.in_flight=auto", "train.microbatch=2"]),
            ]
        for name, settings in slow_runs:
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
        window = {depth_kind(d): depth_settings(d) for d in depths}
        if not args.quick:
            window["fixed_2"] = ["pipeline.in_flight=2"]
            deepest = max(depths)
            if deepest:
                # The fixed window at the deepest overlap too: what sizing it still adds.
                fixed = ["pipeline.in_flight=2", *depth_settings(deepest)[1:]]
                window[f"fixed_2_depth_{deepest}"] = fixed
        kinds = list(window)
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
        if "near_auto" in far:
            # Each run's far samples/s over the synchronous near run: what the delay and the
            # overlap together leave of the synchronous swarm's throughput.
            for kind in kinds:
                if kind != "auto":
                    far[f"far_{kind}_over_near_auto"] = (
                        far[f"far_{kind}"]["samples_per_second"]
                        / far["near_auto"]["samples_per_second"]
                    )
        far["by_depth"] = [
            {
                "depth": d,
                "run": depth_kind(d),
                "far_over_near": far[f"{depth_kind(d)}_far_over_near"],
                "far_over_near_per_round": far[f"{depth_kind(d)}_far_over_near_per_round"],
                "far_samples_per_second": far[f"far_{depth_kind(d)}"]["samples_per_second"],
                "near_samples_per_second": far[f"near_{depth_kind(d)}"]["samples_per_second"],
                "far_final_loss": far[f"far_{depth_kind(d)}"]["final_loss"],
                "near_final_loss": far[f"near_{depth_kind(d)}"]["final_loss"],
                "far_most_steps_behind": far[f"far_{depth_kind(d)}"]["most_steps_behind"],
            }
            for d in depths
        ]
        reached = [row["depth"] for row in far["by_depth"] if row["far_over_near"] >= 0.90]
        far["smallest_depth_at_target"] = min(reached) if reached else None
        result["far"] = far
    if "staleness" in parts:
        result["staleness"] = staleness(args.set, depths, args.staleness_steps)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
