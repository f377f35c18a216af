"""`swarmpipe bench state-db`: what the coordinator's state database costs per event.

Drives a step protocol and a membership through a run as the coordinator does (every lease
grant, commit and acknowledgement is one `StateDB.save`, as in coordinator/service.py) and
prints the wall time of those transactions, which run on the coordinator's event loop:
median, 99th percentile and maximum, with SQLite's `synchronous=NORMAL` (what the
coordinator uses: a commit survives the process dying) beside `FULL` (an fsync per commit:
it would survive a power cut too), in the same invocation on the same disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from swarmpipe.config import load_config
from swarmpipe.coordinator.membership import Membership
from swarmpipe.coordinator.state_db import Extras, StateDB
from swarmpipe.coordinator.step_protocol import Lease, StepProtocol


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=100, help="steps of the simulated run")
    parser.add_argument("--microbatches", type=int, default=16, help="leases per step")
    parser.add_argument("--members", type=int, default=32, help="nodes in the membership")
    parser.add_argument("--out", help="write the JSON here too")


def _run(folder: Path, args: argparse.Namespace, synchronous: str) -> dict[str, Any]:
    micro = 4
    config = load_config(None, [f"train.steps={args.steps}"])
    protocol = StepProtocol(
        total_steps=args.steps,
        global_batch=micro * args.microbatches,
        microbatch=micro,
        lease_timeout_s=300.0,
    )
    membership = Membership(num_stages=4, activation_codec=1, gradient_codec=1)
    for i in range(args.members):
        member = membership.assign(f"n{i}", f"10.0.0.{i}:7000")
        member.online = member.announced = member.serving = True
    db = StateDB.create(folder / f"{synchronous}.sqlite", config, synchronous=synchronous)
    extras = Extras(joins=args.members)
    nodes = sorted(membership.members)
    protocol.start()
    for step in range(args.steps):
        leases: list[Lease] = []
        while (lease := protocol.lease(nodes[len(leases) % len(nodes)])) is not None:
            leases.append(lease)
            db.save(protocol, membership, extras)
        for lease in leases:
            protocol.commit(lease.node_id, lease.lease_id, 1.0, 4 * lease.sample_count)
            db.save(protocol, membership, extras)
        protocol.await_acks(set(nodes))
        for node in nodes:
            protocol.ack(node, step)
            db.save(protocol, membership, extras)
    seconds = list(db.commit_seconds)
    db.close()
    size = (folder / f"{synchronous}.sqlite").stat().st_size
    ordered = sorted(seconds)
    return {
        "transactions": len(seconds),
        "median_ms": 1e3 * statistics.median(seconds),
        "p99_ms": 1e3 * ordered[int(0.99 * (len(ordered) - 1))],
        "max_ms": 1e3 * ordered[-1],
        "database_bytes": size,
    }


def serve(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="swarmpipe-bench-state-db-") as tmp:
        normal = _run(Path(tmp), args, "NORMAL")
        full = _run(Path(tmp), args, "FULL")
    result = {
        "benchmark": "state-db",
        "steps": args.steps,
        "microbatches": args.microbatches,
        "members": args.members,
        "note": "commit_seconds keeps the last 1000 transactions of each side",
        "normal": normal,
        "full": full,
        "full_over_normal_median": full["median_ms"] / normal["median_ms"],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0
