"""CPU seconds a node spends from its exec to serving its stage, and through a short run.

Usage: python scripts/node_start_cpu.py [--repeats 3] [--nodes 2] [--steps 4]

Starts a coordinator on the tests' tiny model (`python -m swarmpipe`, so PYTHONPATH picks the
checkout) and `--nodes` nodes on as many stages, reads each node's user+system CPU time from
/proc when its ready file says it serves, and again just before it exits at the run's end.
CPU time, not wall time: it hardly moves with what else the machine runs. Prints one JSON
line per repeat, then a JSON summary (medians). Every process is killed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TINY = ["model.n_layers=4", "model.d_model=32", "model.n_heads=2", "model.context=32",
        "train.global_batch=16", "train.microbatch=4", "train.device=cpu"]  # fmt: skip


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU of a live process, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except FileNotFoundError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ready(path: Path) -> dict[str, object] | None:
    try:
        data: dict[str, object] = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return data


def one_run(folder: Path, nodes: int, steps: int) -> dict[str, object]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    children: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen[bytes], Path]:
        ready_file = folder / f"{name}.ready.json"
        with open(folder / f"{name}.log", "wb") as log:
            popen = subprocess.Popen(
                [sys.executable, "-m", "swarmpipe", *args, "--ready-file", str(ready_file)],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        children.append(popen)
        return popen, ready_file

    def wait(what: str, check: object) -> object:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            value = check()  # type: ignore[operator]
            if value:
                return value
            time.sleep(0.01)
        raise SystemExit(f"timed out waiting for {what}; logs in {folder}")

    try:
        settings = [*TINY, f"pipeline.stages={nodes}", f"train.steps={steps}"]
        _, coordinator_ready = start(
            "coordinator", "coordinator", "--listen", "127.0.0.1:0", "--state-dir",
            str(folder / "state"), "--stay", *(a for s in settings for a in ("--set", s)),
        )  # fmt: skip
        info = wait("the coordinator", lambda: ready(coordinator_ready))
        target = f"127.0.0.1:{info['grpc_port']}"  # type: ignore[index]
        started = [
            start(f"n{i}", "node", "--coordinator", target, "--node-id", f"n{i}", "--listen",
                  "127.0.0.1:0", "--threads", "1")
            for i in range(nodes)
        ]  # fmt: skip
        at_serving = {}
        for i, (popen, ready_file) in enumerate(started):
            wait(f"n{i} to serve", lambda f=ready_file: (r := ready(f)) and r.get("serving"))
            at_serving[f"n{i}"] = cpu_seconds(popen.pid)
        last: dict[str, float] = {}
        deadline = time.monotonic() + 120
        while any(p.poll() is None for p, _ in started) and time.monotonic() < deadline:
            for i, (popen, _) in enumerate(started):
                seconds = cpu_seconds(popen.pid)
                if seconds is not None and popen.poll() is None:
                    last[f"n{i}"] = seconds
            time.sleep(0.02)
        return {"to_serving_cpu_s": at_serving, "through_run_cpu_s": last}
    finally:
        for popen in children:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    to_serving: list[float] = []
    through: list[float] = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="node-start-cpu-") as folder:
            row = one_run(Path(folder), args.nodes, args.steps)
        print(json.dumps(row), flush=True)
        to_serving += [v for v in row["to_serving_cpu_s"].values() if v is not None]  # type: ignore[attr-defined]
        through += list(row["through_run_cpu_s"].values())  # type: ignore[attr-defined]
    summary = {
        "median_to_serving_cpu_s": round(statistics.median(to_serving), 3),
        "median_through_run_cpu_s": round(statistics.median(through), 3) if through else None,
        "nodes": args.nodes,
        "steps": args.steps,
        "repeats": args.repeats,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
