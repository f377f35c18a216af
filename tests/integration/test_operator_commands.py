"""`swarmpipe status` and `swarmpipe drain` against a real coordinator and nodes.

One swarm (2 stages, 3 nodes, a run far too long to finish) serves the module: the status
tests only read it, and the drain test, last, takes a replica away. Starting it takes
about 12 s on two cores, so those tests are marked slow; the closed-port test is not.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

pytestmark = pytest.mark.timeout(180)


def swarmpipe(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def rpc_status(address: str) -> coordinator_pb2.StatusReply:
    with grpc.insecure_channel(address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        reply: coordinator_pb2.StatusReply = stub.Status(
            coordinator_pb2.StatusRequest(), timeout=10
        )
        return reply


def _measured(address: str) -> coordinator_pb2.StatusReply | None:
    """A Status in which every node serves and has measured its compute time."""
    status = rpc_status(address)
    nodes = status.nodes
    if len(nodes) == 3 and all(n.serving and n.compute_seconds_per_microbatch > 0 for n in nodes):
        return status
    return None


@pytest.fixture(scope="module")
def swarm(module_procs, tiny_settings) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    coordinator = module_procs.coordinator(
        *tiny_settings,
        "pipeline.stages=2",
        "train.steps=1000",
        "train.eval_every=5",
        "train.eval_samples=8",
        "coordinator.min_nodes=3",
        "checkpoint.every_steps=0",
        # The tests read a running swarm: 100 ms each way between the stages keeps it
        # stepping a few times a second instead of burning both cores (compute rates, and so
        # the bottleneck, are measured inside each node, without the delay).
        "pipeline.link_latency_ms=100",
    )
    nodes = module_procs.nodes(3, coordinator)
    poll_until(lambda: _measured(coordinator), 90, "every node to serve and measure itself")
    return {"coordinator": coordinator, "nodes": nodes}


@pytest.mark.slow
def test_status_prints_every_stage_and_node_and_marks_a_bottleneck(swarm) -> None:  # type: ignore[no-untyped-def]
    done = swarmpipe("status", "--coordinator", swarm["coordinator"])
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    # Between steps the phase is `apply` for a moment.
    assert re.fullmatch(r"run 'testnet': (training|apply), step \d+ of 1000", lines[0]), lines[0]
    assert any(line.startswith("  samples: leased ") and "lost 0" in line for line in lines)
    stage_rows = [line for line in lines if line[:2] in ("0 ", "1 ")]
    assert len(stage_rows) == 2, done.stdout
    assert sum("<- bottleneck" in line for line in stage_rows) == 1, done.stdout
    for node in swarm["nodes"]:
        assert any(line.split()[:2] == [node, "serving"] for line in lines), done.stdout
    assert any(" -> " in line and "activation" in line for line in lines), done.stdout


@pytest.mark.slow
def test_status_json_agrees_with_the_status_rpc(swarm) -> None:  # type: ignore[no-untyped-def]
    before = rpc_status(swarm["coordinator"])
    done = swarmpipe("status", "--coordinator", swarm["coordinator"], "--json")
    after = rpc_status(swarm["coordinator"])
    assert done.returncode == 0, done.stderr
    view = json.loads(done.stdout)
    assert view["run_id"] == before.run_id and view["total_steps"] == 1000
    # The run goes on between the three calls: each counter lies between its neighbours'.
    for key in ("leased", "committed", "replayed", "duplicates", "lost"):
        low, high = getattr(before.counters, key), getattr(after.counters, key)
        assert low <= view["samples"][key] <= high, key
    assert before.step <= view["step"] <= after.step
    replicas = {r["node"]: s["stage"] for s in view["stages"] for r in s["replicas"]}
    assert replicas == {n.node_id: n.stage for n in after.nodes}
    assert sum(s["bottleneck"] for s in view["stages"]) == 1
    assert view["bottleneck_stage"] in (0, 1)
    assert view["loss"]["held_out"] is not None


@pytest.mark.slow
def test_status_watch_redraws_until_ctrl_c_and_exits_0(swarm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "watch.out"
    cmd = [sys.executable, "-m", "swarmpipe", "status", "--coordinator", swarm["coordinator"]]
    with open(out, "w") as stdout:
        watch = subprocess.Popen(
            [*cmd, "--watch", "0.2"], stdout=stdout, stderr=subprocess.PIPE, text=True
        )
        try:
            poll_until(lambda: out.read_text().count("run 'testnet'") >= 2, 30, "two tables")
            watch.send_signal(signal.SIGINT)
            _, stderr = watch.communicate(timeout=30)
        finally:
            watch.kill()
    assert watch.returncode == 0, stderr
    assert "Traceback" not in stderr
    text = out.read_text()
    assert "\n\nrun 'testnet'" in text  # not a terminal: tables apart, no screen clearing
    assert "\x1b[" not in text


@pytest.mark.slow
def test_drain_of_an_unknown_node_is_one_line_and_exit_1(swarm) -> None:  # type: ignore[no-untyped-def]
    done = swarmpipe("drain", "nonesuch", "--coordinator", swarm["coordinator"])
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr == "swarmpipe drain: error: no node 'nonesuch' in run 'testnet'\n"


def test_status_of_a_closed_port_is_one_line_and_exit_3() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for command in (["status"], ["drain", "n0"]):
        done = swarmpipe(*command, "--coordinator", f"127.0.0.1:{port}")
        assert done.returncode == 3, done.stderr
        assert done.stderr.count("\n") == 1 and f"127.0.0.1:{port}" in done.stderr
        assert done.stdout == ""


@pytest.mark.slow
def test_drain_makes_a_replica_leave_and_warns_when_a_stage_loses_its_last(swarm) -> None:  # type: ignore[no-untyped-def]
    coordinator = swarm["coordinator"]
    status = rpc_status(coordinator)
    stages = [n.stage for n in status.nodes]
    doubled = max(set(stages), key=stages.count)  # 3 nodes on 2 stages: one has two
    victim = next(n.node_id for n in status.nodes if n.stage == doubled)
    done = swarmpipe("drain", victim, "--coordinator", coordinator)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"drained {victim} (stage {doubled}) from run 'testnet': ")
    assert done.stdout.count("\n") == 1  # its stage keeps a replica: nothing to warn of
    assert swarm["nodes"][victim].wait(timeout=60) == 0
    view = json.loads(swarmpipe("status", "--coordinator", coordinator, "--json").stdout)
    states = {r["node"]: r["state"] for s in view["stages"] for r in s["replicas"]}
    assert states[victim] == "offline"
    assert view["stages"][doubled]["serving"] == 1
    # The run goes on without it: steps keep finishing on the remaining replicas.
    poll_until(lambda: rpc_status(coordinator).step > view["step"] + 2, 60, "steps to go on")
    # Draining a stage's last replica says that the run will wait.
    last = next(n for n in swarm["nodes"] if n != victim)
    done = swarmpipe("drain", last, "--coordinator", coordinator)
    assert done.returncode == 0, done.stderr
    assert "has no other replica: the run waits for a node to join it" in done.stdout
