"""`swarmpipe bench slowlink`: held-out loss against wall-clock time on slow links, as a PNG.

Runs the same testnet (same model, seed, steps and held-out evaluations) once per setting
with every link limited to `--link-mbit` (the sender's token bucket), and plots each run's
evaluation loss against the seconds since its step 0 opened: the figure a user who trains
over home connections cares about. Prints JSON with each run's evaluations, samples/s and
wire bytes, and writes the picture (`--png`). The runs are sequential, so on a noisy host
compare the curves of one invocation, not figures across machines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet, steady_samples_per_second
from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.errors import ConfigError

DEFAULT_SETTINGS = (
    "lossless=pipeline.activation_codec=lossless,pipeline.gradient_codec=lossless",
    "int8=pipeline.activation_codec=int8,pipeline.gradient_codec=int8",
    "bottleneck=model.bottleneck=4,pipeline.activation_codec=int8,pipeline.gradient_codec=int8",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--link-mbit", type=float, default=10.0, help="every link's limit")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between evaluations")
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="NAME=KEY=VALUE,KEY=VALUE",
        help="a run to compare (repeatable); default: lossless, int8 and the learned "
        "bottleneck (k=4) with int8",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--png", default="bench-results/slowlink.png", help="the picture")
    parser.add_argument("--out", help="write the JSON here too")


def parse_setting(text: str) -> tuple[str, list[str]]:
    """`name=key=value,key=value` -> (name, ["key=value", ...])."""
    name, sep, rest = text.partition("=")
    items = [item.strip() for item in rest.split(",") if item.strip()]
    if not sep or not name or not items or any("=" not in item for item in items):
        raise ConfigError(f"--setting {text!r} must look like NAME=section.key=value,...")
    return name, items


def plot(runs: dict[str, dict[str, Any]], link_mbit: float, path: Path) -> None:
    """Eval loss against wall-clock seconds, one line per run."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=150)
    for name, run in runs.items():
        xs = [e["elapsed_s"] for e in run["evals"]]
        ys = [e["loss"] for e in run["evals"]]
        ax.plot(
            xs,
            ys,
            marker="o",
            markersize=3,
            label=f"{name} ({run['samples_per_second']:.0f} samples/s)",
        )
    ax.set_xlabel("wall-clock seconds since step 0")
    ax.set_ylabel("held-out loss (nats per byte)")
    ax.set_title(f"3-stage swarm, every link limited to {link_mbit:g} Mbit/s")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def serve(args: argparse.Namespace) -> int:
    settings = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    common = [*args.set, f"train.eval_every={args.eval_every}"]
    for _, items in settings:
        load_config(None, [*common, *items])  # a bad key fails before any run starts
    runs: dict[str, dict[str, Any]] = {}
    for name, items in settings:
        report = run_testnet(
            [*common, *items],
            args.steps,
            args.nodes,
            args.threads,
            "--link-mbit",
            str(args.link_mbit),
            what=name,
        )
        committed = max(report["counters"]["committed"], 1)
        runs[name] = {
            "settings": items,
            "samples_per_second": steady_samples_per_second(report),
            "wall_seconds": report["wall_seconds"],
            "final_eval_loss": report["final_eval_loss"],
            "evals": report["evals"],
            "wire_bytes_per_sample": sum(link["bytes"] for link in report["links"]) / committed,
            "lost": report["counters"]["lost"],
        }
    png = Path(args.png)
    plot(runs, args.link_mbit, png)
    result = {"link_mbit": args.link_mbit, "steps": args.steps, "png": str(png), "runs": runs}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
