"""`swarmpipe bench netns`: the in-process send limiter against the kernel's shaping.

Runs the same testnet twice in one invocation at `--link-mbit` (10 Mbit/s by default), with
the default model and lossless codecs so that the links are the bottleneck: once with the
senders' own limiter (node/link_limit.py) on loopback, once with `--netns`, where every daemon
has a namespace of its own and the kernel shapes each link (htb per peer, testnet/netns.py)
while the in-process limiter is off; and a third time in namespaces without a limit.
`--rounds` repeats the three in alternating order; the figures are means over the rounds.

Prints, for each: samples/s over whole step cycles (bench latency's measure), lost samples,
and the bytes per second each link direction carried over the training time, from the
senders' counters (wire bytes, framing included); the namespace run adds the kernel's own
count (IP and TCP headers included). `kernel_over_in_process` is the ratio of samples/s
(issue 23: within 10 %); `unlimited_over_in_process`, the same namespaces with no limit,
shows that the limit binds. Linux and root only, like `--netns`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from swarmpipe.bench.latency import cycle_samples_per_second
from swarmpipe.bench.pipeline import run_testnet
from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.testnet.netns import check_available

LOSSLESS = ["pipeline.activation_codec=lossless", "pipeline.gradient_codec=lossless"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-mbit", type=float, default=10.0, help="limit on every link")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per testnet")
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    parser.add_argument(
        "--rounds", type=int, default=1, help="repeat the pair, alternating their order"
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def training_seconds(report: dict[str, Any]) -> float:
    """From step 0's opening to the last step's end, as the coordinator saw them."""
    steps = report["steps"]
    return float(steps[-1]["elapsed_s"] - (steps[0]["elapsed_s"] - steps[0]["seconds"]))


def carried(report: dict[str, Any]) -> dict[str, Any]:
    """Mbit/s each pipeline link direction carried over the training time (senders' wire
    bytes), and the kernel's count where the run was in namespaces."""
    seconds = max(training_seconds(report), 1e-9)
    senders = {
        f"{c['src']}->{c['dst']} {c['direction']}": c["wire_bytes"] * 8 / seconds / 1e6
        for c in report["link_choices"]
        if c["direction"] != "reduce"
    }
    result: dict[str, Any] = {
        "training_seconds": seconds,
        "senders_mbit": senders,
        "busiest_senders_mbit": max(senders.values(), default=0.0),
    }
    netns = report.get("netns")
    if netns:
        kernel = {
            link: sent * 8 / seconds / 1e6 for link, sent in netns["kernel_sent_bytes"].items()
        }
        result["kernel_mbit"] = kernel
        result["busiest_kernel_mbit"] = max(kernel.values(), default=0.0)
    return result


def summary(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "samples_per_second": cycle_samples_per_second(report),
        "lost": report["counters"]["lost"],
        "final_loss": report["final_loss"],
        "links": carried(report),
    }


def serve(args: argparse.Namespace) -> int:
    check_available()
    if args.rounds < 1 or args.steps < 4 or args.link_mbit <= 0:
        raise ConfigError("give --rounds >= 1, --steps >= 4 and --link-mbit > 0")
    settings = [*LOSSLESS, *args.set]
    load_config(None, settings)  # a bad --set fails before any run
    limit = ("--link-mbit", f"{args.link_mbit:g}")
    # The same namespaces without a limit: if it were no faster, neither limit would bind
    # and their agreement would mean nothing.
    runs = {"in_process": limit, "kernel": (*limit, "--netns"), "unlimited": ("--netns",)}
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for name in order:
            report = run_testnet(
                settings, args.steps, args.nodes, args.threads, *runs[name], what=name
            )
            per_round[name].append(summary(report))
    result: dict[str, Any] = {
        "link_mbit": args.link_mbit,
        "steps": args.steps,
        "nodes": args.nodes,
        "settings": settings,
        "target": "kernel_over_in_process within 0.90 to 1.10",
    }
    for name, rounds in per_round.items():
        values = [r["samples_per_second"] for r in rounds]
        result[name] = {
            "samples_per_second": sum(values) / len(values),
            "samples_per_second_per_round": values,
            "lost": sum(r["lost"] for r in rounds),
            "rounds": rounds,
        }
    in_process = result["in_process"]["samples_per_second"]
    result["kernel_over_in_process"] = result["kernel"]["samples_per_second"] / in_process
    result["unlimited_over_in_process"] = result["unlimited"]["samples_per_second"] / in_process
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
