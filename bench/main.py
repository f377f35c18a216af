"""`swarmpipe bench NAME`: benchmarks that print JSON, each comparing side by side in one run.

Each benchmark is a module of this package with `add_arguments(parser)` and `serve(args)`,
listed in BENCHMARKS; its module is imported only when the command line names it. Both
sides of every comparison run in the same invocation on the same machine, so ratios mean
something on a noisy shared host; absolute figures do not travel.
"""

from __future__ import annotations

import argparse
from typing import Any

from swarmpipe.process.subcommands import Subcommand, add_subcommands

BENCHMARKS: dict[str, str] = {
    "pipeline": "testnet samples/s beside single-process training, wire bytes per codec",
    "slowlink": "held-out loss against wall-clock time on rate-limited links, as a PNG",
    "links": "lossless against auto codec choice with every link limited, beside both bounds",
    "latency": "how full the pipeline stays: no limit against one process, 10 Mbit/s against "
    "the link bound, 50 ms against no delay; in_flight auto beside 2",
    "netns": "samples/s at a link limit with the in-process limiter beside the kernel's "
    "shaping in network namespaces (Linux, root), and what the links carried",
    "churn": "seconds from a replica's SIGKILL until samples/s is back to 90%",
    "convergence": "held-out loss after N steps per boundary codec and learned bottleneck",
    "join": "seconds from a node's start to taking traffic when it joins a running run",
    "codecs": "each codec's wire bytes, MB/s and error on activation/gradient tensors, "
    "beside hivemind's codecs when importable",
    "hostile": "the loss curve with one replica sending noise (or x F) at every reduce, "
    "beside a clean run, and whom the coordinator benched",
    "state-db": "milliseconds per coordinator state-database transaction, NORMAL beside FULL",
    "stage-balance": "each stage's forward+backward seconds for the cost-model cut beside "
    "equal layer counts, and the model's predicted shares beside the measured",
    "device-codec": "a codec's encode and decode GB/s on a device beside a device-to-host "
    "copy of the same tensor",
    "rebalance": "samples/s before and after one node's link falls to a tenth, and after the "
    "coordinator rebalances, beside the throughput model's bound",
    "fuzz-rpc": "a raw-bytes fuzz of every RPC of a coordinator and a node: status codes, "
    "hangs, crashes, peak memory, log lines",
    "fuzz-decoders": "a coverage-guided fuzz (atheris) of every decoder: inputs, crashes, hangs, "
    "peak memory against its bound",
    "stream-flood": "one peer opening thousands of streams to a node: the node's peak memory "
    "and threads with the per-peer limits beside without",
    "tls": "a --tls testnet's samples/s beside plaintext's, and that both end identical",
}
"""Benchmark name (a module of swarmpipe.bench, `-` spelled `_`) -> one line of what it measures."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benchmarks = {
        name: Subcommand(module=f"swarmpipe.bench.{name.replace('-', '_')}", help=help_text)
        for name, help_text in BENCHMARKS.items()
    }
    add_subcommands(
        parser, benchmarks, dest="benchmark", serve_dest="bench_serve", metavar="BENCHMARK"
    )


def serve(args: argparse.Namespace) -> Any:
    return args.bench_serve(args)
