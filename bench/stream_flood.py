"""`swarmpipe bench stream-flood`: one peer opens many streams to a node, with and without
the per-peer limits.

Starts a coordinator and one node on 127.0.0.1 twice: once with the run's per-peer limits
(the defaults, or what `--set` gives) and once with them raised out of reach
(`pipeline.peer_max_streams`, `peer_max_calls` and `peer_calls_per_s` at a million). Each
time one peer without a credential, as a stranger on the internet would be, opens `--streams`
health Watch streams (open to every caller, and a Watch never ends by itself), holds them
all open, and the node's peak resident memory, its growth over the RSS before the flood,
and its thread count are read from /proc. It prints JSON: per side the streams opened and
refused (by status code), the node's memory and threads, and the ratio of the growths.
With two stages and one node no step opens, so the node does nothing but answer the flood.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from swarmpipe.config import add_config_arguments

START_TIMEOUT_S = 120.0
PER_CONNECTION = 100
UNLIMITED = [
    "pipeline.peer_max_streams=1000000",
    "pipeline.peer_max_calls=1000000",
    "pipeline.peer_calls_per_s=1000000",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--streams", type=int, default=3000, help="streams the one peer opens (default 3000)"
    )
    parser.add_argument(
        "--open-timeout-s", type=float, default=60.0, help="give up opening after this long"
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--out", help="write the JSON here too")


def _proc_status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "Threads"):
            fields[key] = int(value.split()[0])
    return fields


async def _flood(
    target: str, streams: int, timeout_s: float
) -> tuple[Counter[str], dict[str, str], list[Any], list[Any]]:
    """Open `streams` Watch calls at once; the codes they got, and the calls left open."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # Over several connections, as a flooder would: one HTTP/2 connection's streams are
    # bounded by its own settings, and every connection is the same peer to the limiter.
    channels = [
        grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(-(-streams // PER_CONNECTION))
    ]
    calls = [
        health_pb2_grpc.HealthStub(channels[i // PER_CONNECTION]).Watch(
            health_pb2.HealthCheckRequest()
        )
        for i in range(streams)
    ]

    examples: dict[str, str] = {}

    async def first(call: Any) -> str:
        try:
            await call.read()
        except grpc.aio.AioRpcError as exc:
            examples.setdefault(exc.code().name, exc.details() or "")
            return str(exc.code().name)
        return "OPEN"

    codes = await asyncio.wait_for(asyncio.gather(*(first(c) for c in calls)), timeout_s)
    return Counter(codes), examples, channels, calls


async def _side(args: argparse.Namespace, settings: list[str], tmp: Path) -> dict[str, Any]:
    from swarmpipe.bench.fuzz_rpc import reset_peak_memory
    from swarmpipe.testnet.processes import ProcessGroup

    group = ProcessGroup(tmp)
    try:
        _, _, node, info = group.coordinator_and_node(list(settings), START_TIMEOUT_S)
        pid = int(info["pid"])
        before = _proc_status(pid)
        reset = reset_peak_memory(pid)
        started = time.perf_counter()
        codes, examples, channels, calls = await _flood(
            f"127.0.0.1:{info['grpc_port']}", args.streams, args.open_timeout_s
        )
        opened_s = time.perf_counter() - started
        during = _proc_status(pid)
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()
        growth = during["VmHWM"] - (before["VmRSS"] if reset else before["VmHWM"])
        return {
            "settings": settings,
            "streams_asked": args.streams,
            "codes": dict(codes),
            "details_by_code": examples,
            "seconds_to_open": round(opened_s, 3),
            "node": {
                "rss_before_kib": before["VmRSS"],
                "peak_rss_kib": during["VmHWM"],
                "peak_growth_kib": max(0, growth),
                "rss_with_streams_open_kib": during["VmRSS"],
                "peak_reset_before_flood": reset,
                "threads_before": before["Threads"],
                "threads_during": during["Threads"],
                "alive": node.alive(),
            },
        }
    finally:
        group.stop_all()


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    sides = {}
    for name, settings in (("limited", list(args.set)), ("unlimited", [*args.set, *UNLIMITED])):
        with tempfile.TemporaryDirectory(prefix=f"swarmpipe-bench-flood-{name}-") as tmp:
            sides[name] = await _side(args, settings, Path(tmp))
    limited, unlimited = (sides[k]["node"]["peak_growth_kib"] for k in ("limited", "unlimited"))
    return {
        "streams": args.streams,
        "sides": sides,
        "peak_growth_ratio_limited_over_unlimited": (
            round(limited / unlimited, 4) if unlimited else None
        ),
    }


def serve(args: argparse.Namespace) -> int:
    if args.streams < 1:
        raise SystemExit("--streams must be >= 1")
    if not args.open_timeout_s > 0:
        raise SystemExit("--open-timeout-s must be > 0")
    result = asyncio.run(_run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
