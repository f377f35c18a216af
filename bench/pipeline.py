"""`swarmpipe bench pipeline`: testnet throughput beside single-process training, bytes per codec.

Prints one JSON object. Both sides run in the same invocation on the same
machine, so their ratio means something even on a noisy shared host; the
absolute figures do not travel between machines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarmpipe.config import CODEC_NAMES, add_config_arguments, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per measurement")
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    parser.add_argument(
        "--codecs",
        default=",".join(CODEC_NAMES),
        help="comma-separated codecs to run the testnet with",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def single_process(overrides: list[str], steps: int) -> dict[str, Any]:
    import torch

    from swarmpipe.model.reference import train_single_process
    from swarmpipe.node.device import resolve_device

    config = load_config(None, [*overrides, f"train.steps={steps + 1}"])
    # Where the testnet's nodes train (train.device), so the ratio compares like with like.
    device = resolve_device(config.train.device, what="train.device")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # One warm-up step outside the timing: the first step pays for allocator
    # growth and lazy initialisation.
    train_single_process(config, steps=1, device=device)
    start = time.perf_counter()
    losses = train_single_process(config, steps=steps, device=device)
    seconds = time.perf_counter() - start
    samples = steps * config.train.global_batch
    return {
        "samples_per_second": samples / seconds,
        "seconds": seconds,
        "final_loss": losses[-1],
        "torch_threads": torch.get_num_threads(),
        "device": str(device),
    }


def run_testnet(
    overrides: list[str], steps: int, nodes: int, threads: int, *flags: str, what: str
) -> dict[str, Any]:
    """Run `swarmpipe testnet` quietly in a temporary folder and return its report."""
    with tempfile.TemporaryDirectory(prefix="swarmpipe-bench-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "swarmpipe",
            "--log-level",
            "WARNING",
            "testnet",
            "--quiet",
            "--no-picture",  # the folder is deleted below
            "--nodes",
            str(nodes),
            "--steps",
            str(steps),
            "--out",
            tmp,
            "--threads",
            str(threads),
            *flags,
        ]
        for item in overrides:
            cmd += ["--set", item]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if done.returncode != 0:
            raise SystemExit(f"testnet {what} failed:\n{done.stderr[-3000:]}")
        report: dict[str, Any] = json.loads((Path(tmp) / "report.json").read_text())
    return report


def steady_samples_per_second(report: dict[str, Any]) -> float:
    """Samples/s over every step but the first, which pays for start-up and warm-up."""
    steps_after_first = report["steps"][1:] or report["steps"]
    samples = sum(s["samples"] for s in steps_after_first)
    seconds = sum(s["seconds"] for s in steps_after_first)
    return samples / seconds if seconds else 0.0


def testnet(
    overrides: list[str], steps: int, nodes: int, codec: str, threads: int
) -> dict[str, Any]:
    codecs = [f"pipeline.activation_codec={codec}", f"pipeline.gradient_codec={codec}"]
    report = run_testnet([*codecs, *overrides], steps, nodes, threads, what=f"with codec {codec}")
    committed = report["counters"]["committed"]
    by_dir: dict[str, int] = {"activation": 0, "gradient": 0}
    for link in report["links"]:
        by_dir[link["direction"]] = by_dir.get(link["direction"], 0) + link["bytes"]
    return {
        "samples_per_second": steady_samples_per_second(report),
        "final_loss": report["final_loss"],
        # Summed over every hop of the pipeline (stages - 1 of them), per sample.
        "bytes_per_sample": {
            "activation": by_dir["activation"] / committed,
            "gradient": by_dir["gradient"] / committed,
            "total": (by_dir["activation"] + by_dir["gradient"]) / committed,
        },
        "lost": report["counters"]["lost"],
    }


def serve(args: argparse.Namespace) -> int:
    codecs = [c for c in args.codecs.split(",") if c]
    for codec in codecs:
        if codec not in CODEC_NAMES:
            raise SystemExit(f"unknown codec {codec!r}; choose from {', '.join(CODEC_NAMES)}")
    config = load_config(None, args.set)
    result: dict[str, Any] = {
        "model": {
            "n_layers": config.model.n_layers,
            "d_model": config.model.d_model,
            "context": config.model.context,
            "stages": config.pipeline.stages,
            "global_batch": config.train.global_batch,
            "microbatch": config.train.microbatch,
        },
        "steps": args.steps,
        "single_process": single_process(args.set, args.steps),
        "testnet": {},
    }
    for codec in codecs:
        result["testnet"][codec] = testnet(args.set, args.steps, args.nodes, codec, args.threads)
    base = result["single_process"]["samples_per_second"]
    result["testnet_over_single_process"] = {
        codec: r["samples_per_second"] / base for codec, r in result["testnet"].items()
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
