"""`swarmpipe bench join`: how long a node takes from its start to taking traffic in a running run.

Starts a coordinator and one node per stage (the default model unless --set
says otherwise), lets the run train a few steps, then starts one more node
per stage, one after the other, each of which joins the running run and
downloads its stage's state from the live replica. For every node it prints
where the seconds went, from the node's own timestamps in its ready file:

- `start_and_join_s`: process start, imports, and the coordinator's Join;
- `build_s`: building the stage (and, on stage 0, loading the corpus);
- `connect_s`: the MQTT connection and presence;
- `download_s`, `download_bytes`, `download_mb_per_s`: the state transfer;
- `ready_s`: the rest of getting into the plan (Ready, digest, waiting for a boundary).

The first nodes start before the run does, with no download: they are the
baseline beside the joiners, measured in the same invocation on the same machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.process.ready import poll_until, read_ready_file, wait_ready_file
from swarmpipe.testnet.processes import Child, ProcessGroup

START_TIMEOUT_S = 120.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--warmup-steps", type=int, default=3, help="steps the run trains before the first join"
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument("--out", help="write the JSON here too")


def _split(spawned_at: float, info: dict[str, Any]) -> dict[str, Any]:
    """Where one node's seconds from spawn to serving went."""
    download_s = float(info.get("download_seconds", 0.0))
    download_bytes = int(info.get("download_bytes", 0))
    return {
        "stage": info["stage"],
        "source": info.get("source", ""),
        "step": info.get("step", 0),
        "seconds_to_serving": info["serving_at"] - spawned_at,
        "start_and_join_s": info["joined_at"] - spawned_at,
        "build_s": info["built_at"] - info["joined_at"],
        "connect_s": info["sync_started_at"] - info["built_at"],
        "download_s": download_s,
        "download_bytes": download_bytes,
        "download_mb_per_s": download_bytes / download_s / 1e6 if download_s else 0.0,
        "ready_s": info["serving_at"] - info["sync_started_at"] - download_s,
    }


def _serving(child: Child) -> dict[str, Any] | None:
    info = read_ready_file(child.ready_file)
    if not child.alive():
        raise SystemExit(f"{child.name} exited:\n{child.log_tail()}")
    return info if info and info.get("serving") else None


def serve(args: argparse.Namespace) -> int:
    import grpc  # here, not above: `swarmpipe bench join --help` need not wait for it

    from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

    overrides = [*args.set, "train.steps=1000000"]
    config = load_config(None, overrides)
    stages = config.pipeline.stages
    with tempfile.TemporaryDirectory(prefix="swarmpipe-bench-join-") as tmp:
        group = ProcessGroup(Path(tmp))
        try:
            coord_args = ["--log-level", "INFO", "coordinator", "--listen", "127.0.0.1:0"]
            coord_args += ["--state-dir", str(Path(tmp) / "state")]
            for item in [*overrides, f"coordinator.min_nodes={stages}"]:
                coord_args += ["--set", item]
            coordinator = group.start("coordinator", coord_args)
            ready = wait_ready_file(coordinator.ready_file, START_TIMEOUT_S, coordinator.alive)
            target = f"127.0.0.1:{ready['grpc_port']}"

            def start(name: str) -> tuple[float, Child]:
                spawned_at = time.time()
                child = group.start(
                    name,
                    ["--log-level", "INFO", "node", "--coordinator", target, "--node-id", name,
                     "--listen", "127.0.0.1:0", "--threads", str(args.threads)],
                )  # fmt: skip
                return spawned_at, child

            first = [start(f"n{i}") for i in range(stages)]
            fresh = [
                _split(at, poll_until(lambda c=c: _serving(c), START_TIMEOUT_S, c.name))
                for at, c in first
            ]
            with grpc.insecure_channel(target) as channel:
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                poll_until(
                    lambda: (
                        len(stub.Status(coordinator_pb2.StatusRequest(), timeout=10).steps)
                        >= args.warmup_steps
                    ),
                    START_TIMEOUT_S * 5,
                    "the run to train its warm-up steps",
                )
            joins = []
            for i in range(stages):  # placement sends each joiner to the next stage
                at, child = start(f"j{i}")
                info = poll_until(lambda c=child: _serving(c), START_TIMEOUT_S * 5, child.name)
                joins.append(_split(at, info))
        finally:
            group.stop_all()
    result: dict[str, Any] = {
        "model": {
            "n_layers": config.model.n_layers,
            "d_model": config.model.d_model,
            "stages": stages,
        },
        "fresh_start": fresh,
        "join_running_run": joins,
        "median_seconds_to_serving": {
            "fresh_start": statistics.median(r["seconds_to_serving"] for r in fresh),
            "join_running_run": statistics.median(r["seconds_to_serving"] for r in joins),
        },
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0
