"""`swarmpipe simulate`: end to end on a small swarm, from files, and its bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


def _simulate(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "swarmpipe", "simulate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=100)


def test_a_small_churning_swarm_prints_its_figures_as_json() -> None:
    done = _simulate("--nodes", "200", "--stages", "4", "--hours", "1")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["nodes_at_start"] == 200 and report["stages"] == 4
    assert report["joins"] > 0 and report["leaves"] > 0
    assert 0.9 < report["fraction_of_optimal"] <= 1.0
    assert 1.0 <= report["best_over_initial_plan"] < 1.02  # the bound is tight at the start
    assert report["planning_s_per_rebalance"]["count"] == 59
    assert report["throughput"][-1]["t_s"] == 3600.0
    for point in report["throughput"]:
        assert point["samples_per_s"] <= point["best_samples_per_s"] + 1e-6


def test_a_trace_that_empties_a_stage_gets_it_refilled_at_once(tmp_path: Path) -> None:
    nodes = tmp_path / "nodes.csv"
    nodes.write_text(
        "id,speed,bandwidth_in_mbit,bandwidth_out_mbit\n"
        + "".join(f"n{i},{1 + i % 3},100,100\n" for i in range(12))
    )
    # Nine of twelve nodes leave within nine seconds: whatever the plan, some stage loses
    # its last node, and rebalancing must refill it from a stage that has two.
    trace = tmp_path / "trace.jsonl"
    leaves = [{"t": 100.0 + i, "event": "leave", "node": f"n{i}"} for i in range(9)]
    joins = [{"t": 500.0, "event": "join", "node": "x1", "speed": 2.0}]
    rate = [{"t": 600.0, "event": "rate", "node": "n11", "speed": 9.0}]
    trace.write_text("".join(json.dumps(e) + "\n" for e in leaves + joins + rate))
    done = _simulate(
        "--nodes-file", str(nodes), "--trace-file", str(trace), "--stages", "3", "--hours", "0.5"
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["leaves"], report["joins"], report["rate_changes"]) == (9, 1, 1)
    assert report["nodes_at_end"] == 4
    assert report["moves"]["by_reason"].get("empty-stage", 0) >= 1


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--nodes", "-5"], "--nodes must be >= 1"),
        (["--stages", "0"], "--stages must be >= 1"),
        (["--leave-per-hour", "-0.1"], "must be >= 0"),
        (["--hours", "0"], "--hours and --rebalance-every must be > 0"),
        (["--nodes-file", "/nonexistent/nodes.csv"], "cannot read /nonexistent/nodes.csv"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    done = _simulate(*args)
    assert done.returncode == 2
    assert done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and says in done.stderr


def test_a_bad_trace_line_is_named(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"t": 1, "event": "leave", "node": "n0"}\n{"t": 2, "event": "explode"}\n')
    done = _simulate("--nodes", "10", "--stages", "2", "--trace-file", str(trace))
    assert done.returncode == 2
    assert f"{trace}:2: needs event join, leave or rate" in done.stderr
    trace.write_text('{"t": 1, "event": "leave", "node": "nobody"}\n')
    done = _simulate("--nodes", "10", "--stages", "2", "--trace-file", str(trace))
    assert done.returncode == 2 and "nobody is not in the swarm" in done.stderr
