"""`swarmpipe bench NAME`: benchmarks that print JSON, each comparing side by side in one run.

Each benchmark is a module of this package with `add_arguments(parser)` and `serve(args)`,
listed in BENCHMARKS. Both sides of every comparison run in the same invocation on the same
machine, so ratios mean something on a noisy shared host; absolute figures do not travel.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

BENCHMARKS: dict[str, str] = {
    "pipeline": "testnet samples/s beside single-process training, wire bytes per codec",
    "churn": "seconds from a replica's SIGKILL until samples/s is back to 90%",
    "join": "seconds from a node's start to taking traffic when it joins a running run",
}
"""Benchmark name (a module of swarmpipe.bench) -> one line of what it measures."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, help_text in BENCHMARKS.items():
        module = importlib.import_module(f"swarmpipe.bench.{name}")
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        p.set_defaults(bench_serve=module.serve)


def serve(args: argparse.Namespace) -> Any:
    return args.bench_serve(args)
