"""`swarmpipe testnet` as a user runs it: progress, a report, and no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmpipe.process.ready import poll_until, read_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import organiser_channel

pytestmark = pytest.mark.timeout(300)

SLOW_LINKS = ("--set", "pipeline.link_latency_ms=100")
"""For a scenario that must still be training when something happens to it: about 1.5
steps a second on 2 busy cores, where the tiny model runs 8 flat out, so a few dozen steps
cover what took hundreds, at a third of the CPU (each step costs the swarm the same either
way)."""

_started: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _reap_testnets() -> Iterator[None]:
    """Stop a test's testnet when the test fails before `_finish` (a 100000-step one would
    train on for the rest of the session)."""
    yield
    while _started:
        popen = _started.pop()
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()


def _start(out: Path, tiny: list[str], *extra: str, picture: bool = False) -> subprocess.Popen[str]:
    """`swarmpipe testnet`; report.png (about a CPU-second) only where a test looks at it."""
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--out", str(out), *extra]
    if not picture:
        cmd.append("--no-picture")
    for s in tiny:
        cmd += ["--set", s]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    _started.append(popen)
    return popen


def _child_pids(out: Path) -> list[int]:
    pids = []
    for ready in (out / "logs").glob("*.ready.json"):
        data = read_ready_file(ready)
        if data:
            pids.append(int(data["pid"]))
    return pids


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes; its parent (the testnet) is gone too.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


def _finish(popen: subprocess.Popen[str], timeout: float = 240) -> str:
    try:
        output, _ = popen.communicate(timeout=timeout)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    return output


def test_testnet_trains_reports_and_leaves_nothing(tmp_path: Path, tiny: list[str]) -> None:
    popen = _start(tmp_path, tiny, "--steps", "4", "--nodes", "3", picture=True)
    output = _finish(popen)
    assert popen.returncode == 0, output
    assert "samples/s" in output and "loss" in output  # live progress was shown
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["steps"]) == 4 and report["counters"]["lost"] == 0
    assert all(s["samples_per_second"] > 0 for s in report["steps"])
    assert {m["stage"] for m in report["members"]} == {0, 1, 2}
    assert report["links"] and all(link["bytes"] > 0 for link in report["links"])
    # Where the time went: each step's boundary, and each node's phases adding up to 1.
    breakdown = report["time_breakdown"]
    assert [s["step"] for s in breakdown["coordinator"]["steps"]] == [0, 1, 2, 3]
    assert all(s["boundary_s"] >= 0 for s in breakdown["coordinator"]["steps"][:-1])
    assert breakdown["coordinator"]["steps_counted"] == 2  # steps 1 and 2: whole cycles
    for node in breakdown["nodes"].values():
        assert [s["step"] for s in node["steps"]][:3] == [0, 1, 2]
        assert node["steps_counted"] >= 1
        assert sum(node["shares"].values()) == pytest.approx(1.0)
        assert node["totals"]["compute_s"] > 0
    # Each node in the timeline with its stage, and the picture drawn from it all. (Whether
    # a poll saw it online depends on the 0.25 s poll: a 4-step run can end between two.)
    seen = {(t["node"], t["stage"]) for t in report["node_timeline"]}
    assert seen == {(m["node_id"], m["stage"]) for m in report["members"]}
    png = tmp_path / "report.png"
    assert f"picture: {png}" in output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 40_000
    pids = _child_pids(tmp_path)
    assert len(pids) == 4
    poll_until(lambda: not any(_alive(p) for p in pids), 10, "every child to exit")


@pytest.mark.slow
def test_a_coordinator_killed_from_outside_is_started_again_and_the_run_finishes(
    tmp_path: Path, tiny: list[str]
) -> None:
    popen = _start(tmp_path, tiny, "--steps", "40", "--nodes", "3", *SLOW_LINKS)
    logs = tmp_path / "logs"
    poll_until(lambda: read_ready_file(logs / "coordinator.ready.json"), 60, "the coordinator")
    coordinator = read_ready_file(logs / "coordinator.ready.json")
    assert coordinator is not None
    with organiser_channel(
        f"127.0.0.1:{coordinator['grpc_port']}", tmp_path / "coordinator-state"
    ) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        poll_until(
            lambda: len(stub.Status(coordinator_pb2.StatusRequest(), timeout=5).steps) >= 3,
            120,
            "training to be under way",
        )
    os.kill(int(coordinator["pid"]), signal.SIGKILL)
    output = _finish(popen)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counters"]["lost"] == 0 and len(report["steps"]) == 40
    died, started = [r for r in report["churn"] if r["node"] == "coordinator"]
    assert (died["action"], died["outcome"]) == (
        "died",
        "killed by SIGKILL from outside the testnet",
    )
    assert (started["action"], started["planned"], started["outcome"]) == (
        "start",
        "restart",
        "started",
    )
    assert "resuming run 'testnet' live" in (logs / "coordinator.log").read_text()
    pids = _child_pids(tmp_path)
    poll_until(lambda: not any(_alive(p) for p in pids), 20, "every child to exit")


@pytest.mark.slow
def test_a_node_killed_from_outside_is_churn_and_the_run_goes_on(
    tmp_path: Path, tiny: list[str]
) -> None:
    # 4 nodes on 2 stages: every stage has a second replica, so the swarm can go on. 30 slow
    # steps: the kill comes after step 3, and some 20 s of training after it.
    steps = 30
    popen = _start(
        tmp_path, tiny, "--steps", str(steps), "--nodes", "4", "--stages", "2", *SLOW_LINKS
    )
    logs = tmp_path / "logs"
    poll_until(lambda: read_ready_file(logs / "coordinator.ready.json"), 60, "the coordinator")
    coordinator = read_ready_file(logs / "coordinator.ready.json")
    assert coordinator is not None
    target = f"127.0.0.1:{coordinator['grpc_port']}"
    with organiser_channel(target, tmp_path / "coordinator-state") as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        poll_until(
            lambda: len(stub.Status(coordinator_pb2.StatusRequest(), timeout=5).steps) >= 3,
            120,
            "training to be under way",
        )
    node = read_ready_file(logs / "n3.ready.json")
    assert node is not None
    os.kill(int(node["pid"]), signal.SIGKILL)
    output = _finish(popen)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counters"]["lost"] == 0 and len(report["steps"]) == steps
    (died,) = [r for r in report["churn"] if r["action"] == "died"]
    assert died["node"] == "n3" and died["outcome"] == "killed by SIGKILL from outside the testnet"
    assert "churn: died n3" in output, output


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path: Path, tiny: list[str]) -> None:
    popen = _start(tmp_path, tiny, "--steps", "100000", "--nodes", "3")
    poll_until(lambda: len(_child_pids(tmp_path)) == 4, 120, "every child to start")
    os.kill(popen.pid, signal.SIGINT)
    output = _finish(popen)
    assert popen.returncode == 130, output
    pids = _child_pids(tmp_path)
    poll_until(lambda: not any(_alive(p) for p in pids), 20, "every child to be stopped")


def test_testnet_runs_on_an_external_mosquitto_broker(
    tmp_path: Path, tiny: list[str], mosquitto: str
) -> None:
    popen = _start(tmp_path, tiny, "--steps", "3", "--nodes", "3", "--broker", mosquitto)
    output = _finish(popen)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["steps"]) == 3 and report["counters"]["lost"] == 0
    coordinator_log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert mosquitto in coordinator_log and "embedded MQTT broker" not in coordinator_log


def test_too_few_nodes_is_a_clear_error(tmp_path: Path, tiny: list[str]) -> None:
    popen = _start(tmp_path, tiny, "--nodes", "2", "--stages", "3")
    output = _finish(popen, 60)
    assert popen.returncode == 2
    assert "--nodes 2 cannot cover 3 stages" in output


@pytest.mark.slow  # a scenario: slow steps, so the restarted node is back before the end
@pytest.mark.timeout(900)
def test_a_scheduled_kill_is_not_a_crash_and_the_node_rejoins(
    tmp_path: Path, tiny: list[str]
) -> None:
    # 4 nodes on 2 stages: every stage has two replicas, so any one may die.
    # Enough steps after the restart for a process start and a state download
    # on a loaded machine (a minute or more): the run must not end before n3 is back.
    # 120 slow steps last over a minute (400 flat out did, for three times the CPU).
    steps = 120
    schedule = "kill n3@step3, start n3@step5"
    popen = _start(
        tmp_path, tiny, "--steps", str(steps), "--nodes", "4", "--stages", "2",
        "--churn", schedule, *SLOW_LINKS,
    )  # fmt: skip
    output = _finish(popen, 850)
    assert popen.returncode == 0, output
    assert "churn: kill n3 at" in output and "churn: start n3 at" in output
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["steps"]) == steps and report["counters"]["lost"] == 0
    kill, start = report["churn"]
    assert (kill["action"], kill["node"], kill["outcome"]) == ("kill", "n3", "killed")
    assert kill["planned"] == "step3" and kill["step"] >= 3 and kill["stage"] in (0, 1)
    assert (start["action"], start["outcome"], start["planned"]) == ("start", "started", "step5")
    assert start["at_seconds"] > kill["at_seconds"] and report["churn_not_reached"] == []
    seen = [s["seen_at_seconds"] for s in report["steps"]]
    assert seen == sorted(seen) and seen[kill["step"] - 1] <= kill["at_seconds"]
    # The timeline saw n3 go offline after its kill and serve again after its start. It
    # joins again as any joiner does, where placement wants it: on slow links the heads'
    # stage measures slowest, so it may come back there (and a replica then moves to the
    # stage it left: "second replica").
    n3 = [t for t in report["node_timeline"] if t["node"] == "n3"]
    went = next(t for t in n3 if not t["online"] and t["seconds"] >= kill["at_seconds"])
    back = next(t for t in n3 if t["serving"] and t["seconds"] > went["seconds"])
    assert back["seconds"] >= start["at_seconds"] and back["stage"] in (0, 1)
    # The same id came back (state transfer from the survivor) and ended in step with it.
    (again,) = [m for m in report["members"] if m["node_id"] == "n3"]
    peers = [m for m in report["members"] if m["stage"] == again["stage"]]
    assert again["last_step"] == steps - 1, report["members"]
    assert len({m["param_digest"] for m in peers}) == 1, peers


@pytest.mark.slow
def test_a_stage_that_loses_its_last_replica_gets_a_node_moved_to_it(
    tmp_path: Path, tiny: list[str]
) -> None:
    # 4 nodes on 3 stages: one stage has two replicas (which one, the measured rates
    # decide), the others one each. The only replica of one of those is SIGKILLed from
    # outside and no node is started after it. The run stalls from the kill until a node
    # moved there serves, so it cannot end first: 24 slow steps leave some 10 s between
    # step 6 (a checkpoint of every stage) and the end for the test to kill it in.
    steps = 24
    popen = _start(
        tmp_path, tiny, "--steps", str(steps), "--nodes", "4",
        "--set", "checkpoint.every_steps=5", *SLOW_LINKS,
    )  # fmt: skip
    logs = tmp_path / "logs"
    poll_until(lambda: len(_child_pids(tmp_path)) == 5, 120, "every child to start")
    coordinator = read_ready_file(logs / "coordinator.ready.json")
    assert coordinator is not None
    target = f"127.0.0.1:{coordinator['grpc_port']}"
    with organiser_channel(target, tmp_path / "coordinator-state") as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        status = poll_until(
            lambda: (
                (s := stub.Status(coordinator_pb2.StatusRequest(), timeout=5)).steps
                and len(s.steps) >= 6
                and s
            ),
            120,
            "a checkpoint of every stage",
        )
    replicas = {stage: [n.node_id for n in status.nodes if n.stage == stage] for stage in range(3)}
    (donor,) = [stage for stage, nodes in replicas.items() if len(nodes) == 2]
    victim_stage = max(stage for stage, nodes in replicas.items() if len(nodes) == 1)
    (victim,) = replicas[victim_stage]
    node = read_ready_file(logs / f"{victim}.ready.json")
    assert node is not None
    os.kill(int(node["pid"]), signal.SIGKILL)
    output = _finish(popen)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counters"]["lost"] == 0 and len(report["steps"]) == steps
    (move,) = report["moves"]
    assert (move["from_stage"], move["to_stage"]) == (donor, victim_stage), move
    assert f"stage {victim_stage} lost its last replica" in move["reason"]
    assert [r["node"] for r in report["churn"] if r["action"] == "died"] == [victim]
    moved = next(m for m in report["members"] if m["node_id"] == move["node"])
    assert moved["stage"] == victim_stage and moved["last_step"] == steps - 1, report["members"]


@pytest.mark.slow
def test_node_profiles_make_one_node_slow_and_limit_anothers_links(
    tmp_path: Path, tiny: list[str]
) -> None:
    # 6 steps: 24 microbatches a node, and the compute time is their median.
    popen = _start(
        tmp_path, tiny, "--steps", "6", "--nodes", "3",
        "--node-profile", "n1=slow:5", "--node-profile", "n2=mbit:5,lat:30",
    )  # fmt: skip
    output = _finish(popen)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counters"]["lost"] == 0
    ms = report["compute_ms_per_microbatch"]
    assert ms["n1"] > 2 * max(ms["n0"], ms["n2"]), ms  # five times slower, with margin
    limits = {(c["src"], c["dst"]): c["limit_mbit"] for c in report["link_choices"]}
    assert {limit for (src, _), limit in limits.items() if src == "n2"} == {5.0}, limits
    assert all(not limit for (src, _), limit in limits.items() if src != "n2"), limits  # 0: none
    delays = {(c["src"], c["dst"]): c["latency_ms"] for c in report["link_choices"]}
    assert {d for (src, _), d in delays.items() if src == "n2"} == {30.0}, delays
    assert not any(d for (src, _), d in delays.items() if src != "n2"), delays
    cmd = ["testnet", "--nodes", "3", "--node-profile", "n7=slow:2"]
    bad = subprocess.run(
        [sys.executable, "-m", "swarmpipe", *cmd], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 2 and "no node 'n7' in this testnet" in bad.stderr, bad.stderr
