"""`swarmpipe bench links`: lossless against per-link auto codec choice on slow links.

Runs the same testnet three times in one invocation: with every link limited to
`--link-mbit` in each direction, once lossless and once with `auto` codecs, and once without
a limit (auto, which sends lossless over loopback) for the compute bound. Prints one JSON
object with the samples/s of each, the codec every link ended on and when it changed, and two
bounds for the limited auto run:

- compute bound: samples/s of the same testnet without a limit (measured, not derived);
- link bound at the codecs chosen: the limit divided by the wire bytes per sample (framing
  included, from the senders' own counters) on the busiest link direction.

`auto_over_bound` says how close auto comes to the lesser of the two. Samples/s skip the
first step, which pays for start-up. On a shared machine the load changes from one minute to
the next, so `--rounds` repeats the three runs in alternating order and the figures are
means over the rounds (each round's own figures are printed too). The default model is
narrow and shallow so that, on a small CPU machine, its activations at 10 Mbit/s take longer
than its compute: the regime the codec choice is for. Override it with --set. Where compute
is slower than the lossless transfer (a busy machine), auto rightly picks light codecs and
cannot beat lossless by much: the compute bound is then close to lossless's link bound.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet, steady_samples_per_second
from swarmpipe.config import add_config_arguments, load_config

BENCH_SETTINGS = [
    # Embedding, one block and the head: one stage per layer, and the least compute per
    # activation byte a transformer stage has.
    "model.n_layers=1",
    "model.d_model=64",
    "model.n_heads=2",
    "model.context=128",
    "train.microbatch=8",
    "train.global_batch=128",
    # Enough microbatches in flight that a stage never waits on the round trip: the
    # pipeline is then bounded by its compute or its links, which is what is compared.
    "pipeline.in_flight=8",
]
"""Run settings the benchmark uses unless --set says otherwise."""

AUTO = ["pipeline.activation_codec=auto", "pipeline.gradient_codec=auto"]
LOSSLESS = ["pipeline.activation_codec=lossless", "pipeline.gradient_codec=lossless"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--link-mbit", type=float, default=10.0, help="limit on every link, each direction"
    )
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per testnet")
    parser.add_argument(
        "--rounds", type=int, default=2, help="repeat the three runs, alternating their order"
    )
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def link_summary(report: dict[str, Any], limit_mbit: float) -> dict[str, Any]:
    """samples/s, per-link codecs and bandwidth, and the link bound of one testnet report."""
    committed = max(report["counters"]["committed"], 1)
    links: dict[str, Any] = {}
    for c in report["link_choices"]:
        links[f"{c['src']}->{c['dst']} {c['direction']}"] = {
            "codec": c["codec"],
            "measured_mbit": round(c["measured_mbit"], 3),
            "wire_bytes_per_sample": c["wire_bytes"] / committed,
            "timeline": [(round(t["seconds"], 2), t["step"], t["codec"]) for t in c["timeline"]],
        }
    summary: dict[str, Any] = {
        "samples_per_second": steady_samples_per_second(report),
        "final_loss": report["final_loss"],
        "lost": report["counters"]["lost"],
        "compute_ms_per_microbatch": {
            node: round(ms, 2) for node, ms in report["compute_ms_per_microbatch"].items()
        },
        "links": links,
    }
    if links and limit_mbit > 0:
        busiest = max(links, key=lambda k: links[k]["wire_bytes_per_sample"])
        summary["busiest_link"] = busiest
        summary["link_bound_samples_per_second"] = (
            limit_mbit * 1e6 / 8 / links[busiest]["wire_bytes_per_sample"]
        )
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def serve(args: argparse.Namespace) -> int:
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    settings = [*BENCH_SETTINGS, *args.set]
    config = load_config(None, [*settings, *AUTO])  # a bad --set fails before any run
    limit = ("--link-mbit", str(args.link_mbit))
    runs: dict[str, tuple[list[str], tuple[str, ...]]] = {
        "lossless": (LOSSLESS, limit),
        "auto": (AUTO, limit),
        "unlimited": (AUTO, ()),
    }
    summaries: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for round_index in range(args.rounds):
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))
        for name in order:
            codecs, flags = runs[name]
            report = run_testnet(
                [*settings, *codecs], args.steps, args.nodes, args.threads, *flags, what=name
            )
            summaries[name].append(link_summary(report, args.link_mbit if flags else 0.0))

    def combined(name: str) -> dict[str, Any]:
        """The last round's details, with samples/s (and link bound) averaged over rounds."""
        rounds = summaries[name]
        summary = dict(rounds[-1])
        per_round = [r["samples_per_second"] for r in rounds]
        summary["samples_per_second"] = _mean(per_round)
        summary["samples_per_second_per_round"] = per_round
        if "link_bound_samples_per_second" in summary:
            bounds = [r["link_bound_samples_per_second"] for r in rounds]
            summary["link_bound_samples_per_second"] = _mean(bounds)
        return summary

    lossless, auto, unlimited = combined("lossless"), combined("auto"), combined("unlimited")
    compute_bound = unlimited["samples_per_second"]
    link_bound = auto.get("link_bound_samples_per_second", float("inf"))
    bound = min(compute_bound, link_bound)
    result: dict[str, Any] = {
        "link_mbit": args.link_mbit,
        "steps": args.steps,
        "rounds": args.rounds,
        "nodes": args.nodes,
        "settings": settings,
        "model": {
            "n_layers": config.model.n_layers,
            "d_model": config.model.d_model,
            "context": config.model.context,
            "stages": config.pipeline.stages,
            "microbatch": config.train.microbatch,
            "global_batch": config.train.global_batch,
            "in_flight": config.pipeline.in_flight,
        },
        "lossless": lossless,
        "auto": auto,
        "unlimited": unlimited,
        "compute_bound_samples_per_second": compute_bound,
        "compute_bound_is": "the same testnet without a link limit (auto: lossless on loopback)",
        "link_bound_samples_per_second": link_bound,
        "link_bound_is": "limit / wire bytes per sample on the auto run's busiest link direction",
        "auto_over_lossless": auto["samples_per_second"] / lossless["samples_per_second"],
        "auto_over_bound": auto["samples_per_second"] / bound,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
