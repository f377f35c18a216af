"""`swarmpipe bench tls`: a `--tls` testnet's samples/s beside the plaintext one's.

Prints one JSON object. Both testnets run in the same invocation, alternating plaintext and
TLS for `--rounds` rounds so that a noisy neighbour slows both alike; the figure is the
ratio of the medians; which of the two goes first alternates between rounds. Each round
also compares the two runs' losses (TLS must change nothing but the wire). Parameter digests
are compared too, but they are equal only with one microbatch per step: a stage sums its
microbatches' gradients in the order they arrive, which timing decides, plaintext or not
(tests/integration/test_tls.py checks bit-identical parameters that way).

On a shared machine samples/s swings by 2x from run to run, so it also reports each round's
TLS/plaintext ratio (the two ran back to back) and the CPU seconds each testnet's processes
used in all (children's rusage: start-up included, other users' load excluded), the figure
that shows what TLS itself costs.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
from pathlib import Path
from typing import Any

from swarmpipe.bench.pipeline import run_testnet, steady_samples_per_second
from swarmpipe.config import add_config_arguments, load_config

TARGET_RATIO = 0.9
"""Issue 22: a TLS testnet's samples/s must be within 10 % of plaintext's."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per testnet")
    parser.add_argument("--nodes", type=int, default=3, help="testnet nodes")
    parser.add_argument("--rounds", type=int, default=3, help="plaintext + TLS pairs to run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--out", help="write the JSON here too")


def _digests(report: dict[str, Any]) -> list[tuple[int, str]]:
    return sorted((m["stage"], m["param_digest"]) for m in report["members"])


def serve(args: argparse.Namespace) -> int:
    if args.rounds < 1 or args.steps < 2:
        raise SystemExit("give --rounds >= 1 and --steps >= 2 (the first step is not timed)")
    config = load_config(None, args.set)
    runs: dict[str, list[float]] = {"plaintext": [], "tls": []}
    cpu: dict[str, list[float]] = {"plaintext": [], "tls": []}
    identical: list[bool] = []
    loss_gap: list[float] = []
    sides: list[tuple[str, tuple[str, ...]]] = [("plaintext", ()), ("tls", ("--tls",))]
    for round_ in range(args.rounds):
        reports = {}
        for name, flags in sides if round_ % 2 == 0 else sides[::-1]:
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            report = run_testnet(args.set, args.steps, args.nodes, args.threads, *flags, what=name)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
            cpu[name].append(used)
            runs[name].append(steady_samples_per_second(report))
            reports[name] = report
        identical.append(_digests(reports["plaintext"]) == _digests(reports["tls"]))
        pairs = zip(reports["plaintext"]["steps"], reports["tls"]["steps"], strict=True)
        loss_gap.append(max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in pairs))
    plain = statistics.median(runs["plaintext"])
    secure = statistics.median(runs["tls"])
    ratio = secure / plain if plain else 0.0
    result = {
        "model": {
            "n_layers": config.model.n_layers,
            "d_model": config.model.d_model,
            "stages": config.pipeline.stages,
            "global_batch": config.train.global_batch,
            "microbatch": config.train.microbatch,
        },
        "nodes": args.nodes,
        "steps": args.steps,
        "rounds": args.rounds,
        "plaintext_samples_per_second": runs["plaintext"],
        "tls_samples_per_second": runs["tls"],
        "tls_over_plaintext": ratio,
        "tls_over_plaintext_each_round": [
            t / p if p else 0.0 for p, t in zip(runs["plaintext"], runs["tls"], strict=True)
        ],
        "plaintext_cpu_seconds": cpu["plaintext"],
        "tls_cpu_seconds": cpu["tls"],
        "tls_cpu_over_plaintext": statistics.median(cpu["tls"])
        / statistics.median(cpu["plaintext"]),
        "within_10_percent": ratio >= TARGET_RATIO,
        "max_relative_loss_difference_each_round": loss_gap,
        "identical_parameters_each_round": identical,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
