"""A coordinator SIGKILLed mid-run and started again on its state database: the run goes on.

The testnet's churn schedule kills the coordinator and starts it again 5 s later with the
same command line; the nodes keep training over their gRPC links, retry their calls and
reconnect to the restarted broker. The run must end with nothing lost and the loss of a run
that was never interrupted (the same seed and data order).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from swarmpipe.config import load_config
from swarmpipe.model.reference import train_single_process

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 40


def _testnet(out: Path, tiny: list[str], *extra: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--out", str(out), "--quiet"]
    cmd.append("--no-picture")
    cmd += ["--nodes", "3", "--stages", "3", "--steps", str(STEPS), *extra]
    for s in tiny:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=360, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_a_coordinator_killed_and_started_again_finishes_the_run(
    tmp_path: Path, tiny: list[str]
) -> None:
    report = _testnet(
        tmp_path / "restarted",
        tiny,
        "--churn",
        "kill coordinator@1s, start coordinator@6s",
    )
    kill, start = report["churn"]
    assert (kill["action"], kill["node"], kill["outcome"]) == ("kill", "coordinator", "killed")
    assert (start["action"], start["outcome"]) == ("start", "started")
    assert kill["step"] < STEPS, "the run ended before the coordinator was killed"
    assert start["at_seconds"] - kill["at_seconds"] >= 5.0

    c = report["counters"]
    assert c["lost"] == 0 and c["outstanding"] == 0, c
    assert c["committed"] == STEPS * 16, c
    assert [s["step"] for s in report["steps"]] == list(range(STEPS))
    # An uninterrupted run ends where single-process training does (test_training.py checks
    # that to 1e-4), so that stands in for a second, uninterrupted testnet here.
    uninterrupted = train_single_process(load_config(None, [*tiny, f"train.steps={STEPS}"]))
    assert report["final_loss"] == pytest.approx(uninterrupted[-1], rel=0.01)
    # The nodes that trained through the restart are the ones that finished it.
    assert {m["node_id"] for m in report["members"]} == {"n0", "n1", "n2"}
    assert all(m["last_step"] == STEPS - 1 for m in report["members"])

    logs = tmp_path / "restarted" / "logs"
    coordinator_log = (logs / "coordinator.log").read_text()
    assert "resuming run 'testnet' live from its state database" in coordinator_log
    assert "did not reconnect" not in coordinator_log
    node_log = (logs / "n0.log").read_text()
    assert "reconnected to the MQTT broker" in node_log


def test_a_node_that_dies_while_the_coordinator_is_away_counts_as_gone_after_the_grace(
    tmp_path: Path, tiny: list[str]
) -> None:
    """4 nodes on 3 stages; n3 is SIGKILLed while the coordinator is dead. The restarted
    coordinator remembers it as online, waits coordinator.restart_grace_s for it (a step's
    APPLY waits for its ack meanwhile), then counts it as gone: its leases, if the kill left
    it holding any, are replayed, and the run finishes without it."""
    report = _testnet(
        tmp_path,
        tiny,
        "--nodes",
        "4",
        "--set",
        "coordinator.restart_grace_s=15",
        "--churn",
        "kill coordinator@1s, kill n3@2s, start coordinator@6s",
    )
    assert [(r["action"], r["node"], r["outcome"]) for r in report["churn"]] == [
        ("kill", "coordinator", "killed"),
        ("kill", "n3", "killed"),
        ("start", "coordinator", "started"),
    ]
    c = report["counters"]
    assert c["lost"] == 0 and c["outstanding"] == 0, c
    assert c["committed"] == STEPS * 16, c
    members = {m["node_id"]: m for m in report["members"]}
    assert not members["n3"]["online"]
    assert all(members[n]["last_step"] == STEPS - 1 for n in ("n0", "n1", "n2"))
    log = (tmp_path / "logs" / "coordinator.log").read_text()
    assert "node n3 did not reconnect within 15 s of the restart" in log
