"""`swarmpipe bench rebalance`: one node's link falls to a tenth mid-run; does the swarm recover?

Runs one testnet with every link limited to `--mbit` and rebalancing on (a short cool-down,
so it fits in minutes). Once `--drop-at-step` steps are done, it picks a node that is one of
two replicas of its stage (a middle stage first: a middle replica sends activations and
gradients, so its link binds first) and limits its sends to a tenth, the way an organiser
would (`swarmpipe link-limit`: a retained LinkControl on the run's broker). Then it watches
the coordinator's Status: its moves, and its throughput model (`placement` in Status: the
bound of where the nodes are, and the best plan's bound for the same nodes, from their
telemetry). Prints JSON with samples/s measured from the step records

- before the drop,
- just after it (steps finished between the drop and the first move),
- after the rebalance (steps that began once every mover served its new stage),

each beside the model's bound for that fleet at that time (whole steps' samples/s: the
slowest stage's rate, `stream_bound`, with a step's measured fill and barrier,
`step_fill_s` and `step_barrier_s`, counted), and `recovered_fraction`: the samples/s after
the rebalance over the best bound the model computes for the fleet with the fallen link
(target: at least 0.8). When the coordinator orders no move after the fall (the model
finds no better plan), "after the rebalance" is the whole time after the fall and
`moves_after_drop` is 0. All three come from one run, so the ratios mean
something on a noisy host; the absolute figures do not travel.

The model counts every node as a machine of its own. A testnet shares this host's cores, so
beside the model's bound each window shows a host bound: the cores over the compute seconds
one sample costs summed over the stages (`host_bound`, from the nodes' measured rates), the
share of the cores the testnet's processes used (`host_busy_share`, from /proc), and
`recovered_fraction_of_host_aware`: samples/s after the rebalance over min(model, host bound).
`time_breakdown` summarises report.json's: where each node's step cycle went. A run in
which no step finishes for `--stall-s` after the fall is stopped, and what was measured is
printed with `stalled_at_step`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.control import link_control
from swarmpipe.control.bus import BrokerAddress, parse_broker_url
from swarmpipe.control.link_control import organiser_login
from swarmpipe.process.ready import read_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.testnet.time_breakdown import time_breakdown
from swarmpipe.transport.auth import ADMIN_TOKEN_KEY
from swarmpipe.transport.limits import MBIT

# Rebalancing settings that fit a run of minutes: a round every 5 s, a node may move again
# 15 s after its last move or join, and a move is costed at 5 s plus its download over a
# 10-minute horizon (the defaults, 15 min and an hour, are for volunteer fleets).
FAST_REBALANCING = (
    "coordinator.rebalance_every_s=5",
    "coordinator.move_cooldown_s=15",
    "coordinator.move_overhead_s=5",
    "coordinator.move_horizon_s=600",
)
# The fleet the bench measures by default (`--set` overrides each): a long, narrow model
# (8 KB of activations per sample, about 2 ms of compute per microbatch) on slow links, so
# the links, not this host's shared cores nor a step's fixed costs, decide the rate.
BENCH_SETTINGS = (
    "model.context=128",
    "model.d_model=16",
    "model.n_heads=2",
    "model.n_layers=4",
    "train.global_batch=128",
    "train.microbatch=4",
    # The auto window (node/in_flight.py) takes a head's time per tensor on one link for
    # its bottleneck and shares it among the heads, while a head sends over a link to each
    # next-stage replica at once: on 0.3 Mbit/s links it kept 3 microbatches in flight
    # where 8 fill them (5.5 samples/s against about 18). A fixed window of 8 fills them.
    "pipeline.in_flight=8",
    # A head that moves with leases in flight can leave its step waiting on leases nobody
    # serves (seen twice, see docs/benchmarks.md) until they expire: 30 s, not 300 s.
    "coordinator.lease_timeout_s=30",
)
POLL_S = 0.5
GONE_AFTER_FAILURES = 3
"""Status calls failing in a row before the bench takes the coordinator for gone."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # Seven: with six equal nodes on two replicas a stage, no plan beats the one the fall
    # leaves (the model's best plan is where the nodes are), so there is no rebalance to
    # measure; a seventh node gives a stage a replica to spare.
    parser.add_argument("--nodes", type=int, default=7, help="testnet nodes")
    parser.add_argument("--stages", type=int, default=3, help="pipeline stages")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps in the run")
    parser.add_argument(
        "--mbit", type=float, default=0.3, help="every node's send limit to each peer"
    )
    parser.add_argument(
        "--node-profile",
        action="append",
        default=[],
        metavar="NODE=mbit:X,slow:Y",
        help="a node of its own (the testnet's --node-profile; repeat), for an unequal fleet",
    )
    parser.add_argument("--fall", type=float, default=10.0, help="the victim's limit falls by")
    parser.add_argument("--drop-at-step", type=int, default=8, help="steps before the fall")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument(
        "--timeout", type=float, default=1800.0, help="give up on the testnet after this long"
    )
    parser.add_argument(
        "--stall-s",
        type=float,
        default=120.0,
        help="after the fall, stop the testnet and print what was measured once no step "
        "has finished for this long",
    )
    add_config_arguments(parser, with_file=False)
    parser.add_argument("--out", help="write the JSON here too")


def choose_victim(status: coordinator_pb2.StatusReply, stages: int) -> str | None:
    """A node that is one of exactly two serving replicas of its stage, a middle stage
    first (lowest node id): losing most of its link then makes its stage the bottleneck."""
    by_stage: dict[int, list[str]] = {}
    for n in status.nodes:
        if n.serving:
            by_stage.setdefault(n.stage, []).append(n.node_id)
    pairs = sorted(
        (s for s, ids in by_stage.items() if len(ids) == 2),
        key=lambda s: (s in (0, stages - 1), s),
    )
    return min(by_stage[pairs[0]]) if pairs else None


def rate_between(
    steps: list[coordinator_pb2.StepRecord], start_s: float, end_s: float
) -> tuple[float | None, int]:
    """Samples/s of the steps that began after `start_s` and finished by `end_s` (seconds
    since step 0 opened), and how many there were."""
    times = [s.elapsed_s for s in steps]
    inside = [
        i for i, s in enumerate(steps) if i > 0 and times[i - 1] >= start_s and times[i] <= end_s
    ]
    if not inside:
        return None, 0
    first, last = inside[0], inside[-1]
    samples = sum(steps[i].samples for i in inside)
    return samples / max(times[last] - times[first - 1], 1e-9), len(inside)


def host_bound(record: coordinator_pb2.PlacementRecord, cores: float) -> float | None:
    """Samples/s this host's cores allow the fleet in `record`: every sample costs each stage
    one replica's compute, so samples/s <= cores / sum over stages of the compute seconds per
    sample there (1 / a replica's measured rate, weighted by the share of the stage's samples
    its effective rate takes). None while a stage has no measured replica."""
    seconds = 0.0
    for stage in range(len(record.stage_rates)):
        replicas = [n for n in record.nodes if n.stage == stage and n.compute > 0]
        total = sum(n.effective for n in replicas)
        if not replicas or total <= 0:
            return None
        seconds += sum(n.effective / total / n.compute for n in replicas)
    return cores / seconds if seconds > 0 else None


def _views(
    samples: list[tuple[float, coordinator_pb2.PlacementRecord]],
    start: float,
    end: float,
    cores: float,
) -> dict[str, Any]:
    """The median of the model's figures polled between `start` and `end`."""
    chosen = [p for t, p in samples if start <= t <= end and p.bound > 0]
    if not chosen:
        return {"bound": None, "best_bound": None, "host_bound": None}
    hosts = [h for h in (host_bound(p, cores) for p in chosen) if h is not None]
    return {
        "bound": statistics.median(p.bound for p in chosen),
        "best_bound": statistics.median(p.best_bound for p in chosen),
        # The model's parts: the slowest stage alone, and a step's fixed costs it counts.
        "stream_bound": statistics.median(p.stream_bound for p in chosen),
        "best_stream_bound": statistics.median(p.best_stream_bound for p in chosen),
        "step_fill_s": statistics.median(p.step_fill_s for p in chosen),
        "step_barrier_s": statistics.median(p.step_barrier_s for p in chosen),
        "host_bound": statistics.median(hosts) if hosts else None,
        "stage_rates": [round(r, 2) for r in chosen[-1].stage_rates],
        "compute_rates": {n.node_id: round(n.compute, 2) for n in chosen[-1].nodes},
        "limited_by": {n.node_id: n.limited_by for n in chosen[-1].nodes},
    }


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds (user + system) used so far by `root` and every live process below it."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may hold spaces: the fields start after its ")".
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone since the listing
        parent[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += used.get(pid, 0.0)
        todo += [child for child, up in parent.items() if up == pid]
    return total


def _host_busy(
    cpu: list[tuple[float, float, float]], start: float, end: float, cores: float
) -> float | None:
    """The share of the cores the testnet used between `start` and `end` (steps' clock),
    from (steps' clock, monotonic, CPU seconds) polls."""
    inside = [c for c in cpu if start <= c[0] <= end]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return (inside[-1][2] - inside[0][2]) / (inside[-1][1] - inside[0][1]) / cores


def summarise_breakdown(breakdown: dict[str, Any]) -> dict[str, Any]:
    """report.json's time_breakdown without its per-step lists: each node's shares of its
    step cycle and the coordinator's boundary share."""
    coordinator = breakdown.get("coordinator", {})
    return {
        "boundary_share": coordinator.get("boundary_share"),
        "nodes": {
            node_id: {"stage": node["stage"]} | {k: round(v, 3) for k, v in node["shares"].items()}
            for node_id, node in breakdown.get("nodes", {}).items()
        },
    }


class _Watch:
    """The bench's view of the running testnet: Status polls and what it did."""

    def __init__(
        self, stub: coordinator_pb2_grpc.CoordinatorStub, admin_token: str, testnet_pid: int
    ) -> None:
        self.stub = stub
        self.metadata = ((ADMIN_TOKEN_KEY, admin_token),)
        self.testnet_pid = testnet_pid
        self.views: list[tuple[float, coordinator_pb2.PlacementRecord]] = []
        self.cpu: list[tuple[float, float, float]] = []
        self.status = coordinator_pb2.StatusReply()
        self.gone = False
        self.failures = 0

    def poll(self) -> coordinator_pb2.StatusReply:
        """The latest Status; the last one seen when the coordinator is gone (the testnet
        stops it once the run is done: `_alive_or_fail` says whether that was a failure)."""
        try:
            status: coordinator_pb2.StatusReply = self.stub.Status(
                coordinator_pb2.StatusRequest(), timeout=10, metadata=self.metadata
            )
        except grpc.RpcError:
            # One slow answer from a coordinator busy with a move is not its end.
            self.failures += 1
            self.gone = self.failures >= GONE_AFTER_FAILURES
            return self.status
        self.failures = 0
        self.status = status
        # On the steps' clock: seconds since step 0 opened, as of the last finished step.
        now = status.steps[-1].elapsed_s if status.steps else 0.0
        self.views.append((now, status.placement))
        self.cpu.append((now, time.monotonic(), tree_cpu_seconds(self.testnet_pid)))
        return status


def serve(args: argparse.Namespace) -> int:
    overrides = [*BENCH_SETTINGS, *FAST_REBALANCING, *args.set]
    load_config(None, overrides)  # a bad --set fails before anything starts
    if args.fall <= 1 or args.drop_at_step < 3 or args.drop_at_step >= args.steps - 10:
        raise SystemExit("give --fall > 1 and 3 <= --drop-at-step <= --steps - 10")
    with tempfile.TemporaryDirectory(prefix="swarmpipe-bench-rebalance-") as tmp:
        result = _run(args, overrides, Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def _run(args: argparse.Namespace, overrides: list[str], out: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "swarmpipe", "--log-level", "WARNING", "testnet", "--quiet",
        "--no-picture",  # the folder is a temporary one
        "--nodes", str(args.nodes), "--stages", str(args.stages), "--steps", str(args.steps),
        "--link-mbit", f"{args.mbit:g}", "--threads", str(args.threads), "--out", str(out),
        # A step that waits on a fallen link takes long on a loaded host: not a stall.
        "--stall-timeout", "600",
    ]  # fmt: skip
    for item in overrides:
        cmd += ["--set", item]
    for profile in args.node_profile:
        cmd += ["--node-profile", profile]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + args.timeout
    try:
        ready_path = out / "logs" / "coordinator.ready.json"
        while (ready := read_ready_file(ready_path)) is None:
            _alive_or_fail(proc, deadline)
            time.sleep(POLL_S)
        # Status and the link limit are the organiser's: the testnet keeps its token there.
        admin_token = (out / "coordinator-state" / "admin-token").read_text().strip()
        broker = organiser_login(parse_broker_url(ready["broker_url"]), admin_token)
        with grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}") as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            watch = _Watch(stub, admin_token, proc.pid)
            figures = _drop_and_watch(args, watch, broker, proc, deadline)
        if figures["stalled_at_step"] is None:
            _, stderr = proc.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            if proc.returncode != 0:
                raise SystemExit(f"the testnet failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            proc.terminate()  # the testnet stops its children on SIGTERM
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # From the last Status, as report.json has it: a stalled run writes none.
    figures["time_breakdown"] = summarise_breakdown(time_breakdown(watch.status))
    figures["counters"] = {
        k: getattr(watch.status.counters, k)
        for k in ("leased", "committed", "replayed", "duplicates", "lost", "outstanding")
    }
    figures["moves"] = [
        {
            "node": m.node_id,
            "from": m.from_stage,
            "to": m.to_stage,
            "at_seconds": round(m.elapsed_s, 1),
            "reason": m.reason,
        }
        for m in watch.status.moves
    ]
    return figures


def _alive_or_fail(proc: subprocess.Popen[str], deadline: float, *, done: bool = False) -> None:
    if proc.poll() is not None and not (done and proc.returncode == 0):
        stderr = proc.stderr.read() if proc.stderr else ""
        raise SystemExit(f"the testnet ended early (exit {proc.returncode}):\n{stderr[-3000:]}")
    if time.monotonic() > deadline:
        raise SystemExit("the testnet took longer than --timeout")


def _drop_and_watch(
    args: argparse.Namespace,
    watch: _Watch,
    broker: BrokerAddress,
    proc: subprocess.Popen[str],
    deadline: float,
) -> dict[str, Any]:
    while len(watch.poll().steps) < args.drop_at_step:
        _alive_or_fail(proc, deadline)
        if watch.gone:
            raise SystemExit("the coordinator went away before the drop")
        time.sleep(POLL_S)
    status = watch.status
    victim = choose_victim(status, args.stages)
    if victim is None:
        raise SystemExit(f"no stage has exactly two serving replicas: {status.nodes}")
    t_drop = status.steps[-1].elapsed_s
    moves_before = len(status.moves)
    limit = args.mbit * MBIT / args.fall
    asyncio.run(link_control.publish(broker, status.run_id, victim, limit))
    # Wait for the rebalance: moves ordered after the drop, and every mover serving again.
    t_moved = t_served = None
    stall = _Stall(args.stall_s)
    while t_served is None and not stall.seen(status):
        _alive_or_fail(proc, deadline, done=watch.gone)
        time.sleep(POLL_S)
        status = watch.poll()
        if status.done or watch.gone:
            break
        new = list(status.moves)[moves_before:]
        if new and t_moved is None:
            t_moved = new[0].elapsed_s
        movers = {m.node_id for m in new}
        serving = {n.node_id for n in status.nodes if n.serving}
        if new and movers <= serving and status.steps and t_moved is not None:
            # The steps' clock moves only when a step finishes: no earlier than the move.
            t_served = max(status.steps[-1].elapsed_s, t_moved)
    while not stall.stalled and not watch.poll().done and not watch.gone:  # to the run's end
        _alive_or_fail(proc, deadline, done=watch.gone)
        stall.seen(watch.status)
        time.sleep(POLL_S)
    if not watch.status.done and not stall.stalled:
        _alive_or_fail(proc, deadline)
        raise SystemExit("the coordinator went away before the run was done")
    steps = list(watch.status.steps)
    end = steps[-1].elapsed_s if steps else 0.0
    warmup = steps[min(2, len(steps) - 1)].elapsed_s if steps else 0.0
    cores = float(len(os.sched_getaffinity(0)))
    # No move after the fall: the model found no plan better than where the nodes are, so
    # the swarm as it stands is "after the rebalance" (said by moves_after_drop: 0).
    unmoved = t_moved is None and not stall.stalled
    windows = {
        "before": (warmup, t_drop),
        "after_drop": (t_drop, t_moved if t_moved is not None else end),
        "after_rebalance": (t_drop if unmoved else (t_served or end), end),
    }
    figures: dict[str, Any] = {}
    for name, (start, stop) in windows.items():
        rate, n = rate_between(steps, start, stop)
        if name == "after_rebalance" and t_served is None and not unmoved:
            rate, n = None, 0
        view = _views(watch.views, start, stop, cores)
        figures[name] = {"samples_per_second": rate, "steps": n} | view
        busy = _host_busy(watch.cpu, start, stop, cores)
        figures[name]["host_busy_share"] = busy
        if busy and rate:
            # What the whole testnet (codecs, gRPC, Python, compute) spends per sample.
            figures[name]["cpu_seconds_per_sample"] = busy * cores / rate
    after = figures["after_rebalance"]
    best, host = after.get("best_bound"), after.get("host_bound")
    aware = min(best, host) if best and host else best
    return {
        "nodes": args.nodes,
        "stages": args.stages,
        "mbit": args.mbit,
        "cores": cores,
        "victim": victim,
        "victim_mbit_after": args.mbit / args.fall,
        "drop_at_seconds": t_drop,
        "first_move_at_seconds": t_moved,
        "movers_serving_at_seconds": t_served,
        "moves_after_drop": len(watch.status.moves) - moves_before,
        "stalled_at_step": len(steps) if stall.stalled else None,
        **figures,
        "recovered_fraction": _ratio(after["samples_per_second"], best),
        "recovered_fraction_of_host_aware": _ratio(after["samples_per_second"], aware),
        "before_fraction": _ratio(
            figures["before"]["samples_per_second"], figures["before"].get("best_bound")
        ),
        "target_fraction": 0.8,
    }


class _Stall:
    """Whether the run stopped finishing steps: none finished for `limit_s` seconds."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.steps = -1
        self.since = time.monotonic()
        self.stalled = False

    def seen(self, status: coordinator_pb2.StatusReply) -> bool:
        if len(status.steps) != self.steps:
            self.steps, self.since = len(status.steps), time.monotonic()
        self.stalled = self.stalled or time.monotonic() - self.since > self.limit_s
        return self.stalled


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None
