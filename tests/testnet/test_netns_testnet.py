"""`swarmpipe testnet --netns` for real: namespaces, a bridge, kernel shaping, nothing left.

Linux and root only (skipped elsewhere with one line). Every test registers the testnets it
starts with `testnets`; its teardown kills them, removes what a SIGKILLed one left (as the
next testnet would) and fails the test if any namespace, veth or bridge of theirs is still
there, so even a failing test proves its own cleanup.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.process.ready import poll_until
from swarmpipe.testnet import netns
from swarmpipe.testnet.netns_commands import tag_for

try:
    netns.check_available()
    _WHY_NOT = ""
except ConfigError as exc:
    _WHY_NOT = str(exc)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(_WHY_NOT), reason=_WHY_NOT or "available"),
]


def _gone(pid: int) -> bool:
    return not netns.leftovers(f"{tag_for(pid)}")


@pytest.fixture
def testnets() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for popen in started:
            if popen.poll() is None:
                os.killpg(popen.pid, signal.SIGKILL)
            popen.communicate()
        netns.remove_stale()
        for popen in started:
            # A deleted namespace frees its veth a moment later, in the kernel's own time.
            poll_until(lambda p=popen: _gone(p.pid), 20, f"testnet {popen.pid}'s namespaces")


def _start(
    testnets: list[subprocess.Popen[str]], out: Path, tiny: list[str], *extra: str
) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--netns", "--quiet", "--out", str(out)]
    cmd.append("--no-picture")
    for s in tiny:
        cmd += ["--set", s]
    popen = subprocess.Popen(
        [*cmd, *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    testnets.append(popen)
    return popen


def test_netns_testnet_trains_shapes_in_the_kernel_and_leaves_nothing(
    tmp_path: Path, tiny: list[str], testnets: list[subprocess.Popen[str]]
) -> None:
    popen = _start(
        testnets,
        tmp_path,
        tiny,
        *("--steps", "4", "--nodes", "3", "--link-mbit", "20"),
        *("--node-profile", "n2=mbit:5", "--churn", "link n0=8@step1"),
    )
    output, _ = popen.communicate(timeout=240)
    assert popen.returncode == 0, output
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["steps"]) == 4 and report["counters"]["lost"] == 0
    ns = report["netns"]
    subnet = ns["subnet"].removesuffix("0/24")
    # Every daemon on its own address, and the nodes advertised theirs.
    assert set(ns["addresses"]) == {"coordinator", "n0", "n1", "n2"}
    assert len(set(ns["addresses"].values())) == 4
    assert all(m["address"].startswith(subnet) for m in report["members"])
    for m in report["members"]:
        assert m["address"].rsplit(":", 1)[0] == ns["addresses"][m["node_id"]]
    # The kernel shaped the links (the churn event changed n0's), the senders did not.
    assert ns["kernel_mbit"] == {"n0": 8.0, "n1": 20.0, "n2": 5.0}
    assert all(c["limit_mbit"] == 0 for c in report["link_choices"])
    assert sum(ns["kernel_sent_bytes"].values()) > 0
    link_events = [c for c in report["churn"] if c["action"] == "link"]
    assert [c["outcome"] for c in link_events] == ["limited to 8 Mbit/s in the kernel"]
    if not ns["netem"]:
        assert "the kernel has no netem" in output
    poll_until(lambda: _gone(popen.pid), 20, "the namespaces to go")


def test_sigterm_mid_run_stops_everything_and_removes_the_namespaces(
    tmp_path: Path, tiny: list[str], testnets: list[subprocess.Popen[str]]
) -> None:
    popen = _start(testnets, tmp_path, tiny, "--steps", "500", "--nodes", "3")
    poll_until((tmp_path / "logs" / "n2.ready.json").exists, 120, "n2 to start")
    assert netns.leftovers(tag_for(popen.pid))  # it did make them
    popen.send_signal(signal.SIGTERM)
    output, _ = popen.communicate(timeout=60)
    assert popen.returncode == 130, output
    poll_until(lambda: _gone(popen.pid), 20, "the namespaces to go")


def test_a_failed_run_removes_the_namespaces_too(
    tmp_path: Path, tiny: list[str], testnets: list[subprocess.Popen[str]]
) -> None:
    # No step can finish within 0.2 s of the start: the run fails as stalled (exit 1).
    popen = _start(testnets, tmp_path, tiny, "--steps", "50", "--stall-timeout", "0.2")
    output, _ = popen.communicate(timeout=120)
    assert popen.returncode == 1 and "no step finished" in output, output
    poll_until(lambda: _gone(popen.pid), 20, "the namespaces to go")


def test_what_a_sigkilled_testnet_left_is_removed_by_the_next(
    tmp_path: Path, tiny: list[str], testnets: list[subprocess.Popen[str]]
) -> None:
    popen = _start(testnets, tmp_path, tiny, "--steps", "500", "--nodes", "3")
    poll_until((tmp_path / "logs" / "n2.ready.json").exists, 120, "n2 to start")
    os.killpg(popen.pid, signal.SIGKILL)  # no cleanup of its own can run
    popen.wait()
    tag = tag_for(popen.pid)
    left = netns.leftovers(tag)
    assert f"{tag}br" in left and f"{tag}-n0" in left
    # The daemons die with their parent (PR_SET_PDEATHSIG); then the namespaces are stale.
    removed = poll_until(netns.remove_stale, 30, "the dead testnet's namespaces to be removed")
    assert f"{tag}br" in removed
    poll_until(lambda: _gone(popen.pid), 20, "the namespaces to go")


def test_netns_with_an_external_broker_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "testnet", "--netns", "--broker", "mqtt://h:1"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--netns" in done.stderr
