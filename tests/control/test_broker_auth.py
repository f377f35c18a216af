"""A coordinator and a node against Debian's mosquitto with passwords and deploy/'s ACL.

The broker refuses anonymous clients and checks every topic against deploy/mosquitto/acl,
so a run that finishes here also shows that the ACL lets each role do its job.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from swarmpipe.control.bus import PASSWORD_ENV, USERNAME_ENV
from tests.conftest import REPO, Procs

PASSWORDS = {"coordinator": "coord-secret", "node": "node-secret"}


@dataclass(frozen=True)
class SecuredBroker:
    url: str  # mqtt://127.0.0.1:PORT, no credentials


@pytest.fixture
def secured_broker(
    tmp_path: Path, mosquitto_with: Callable[[list[str]], str]
) -> Iterator[SecuredBroker]:
    """mosquitto on a free loopback port with a password file and deploy/mosquitto/acl."""
    passwd_tool = shutil.which("mosquitto_passwd")
    if passwd_tool is None:
        pytest.skip("mosquitto is not installed (scripts/test.sh installs it as root)")
    passwd = tmp_path / "passwd"
    for i, (user, password) in enumerate(PASSWORDS.items()):
        create = ["-c"] if i == 0 else []
        subprocess.run([passwd_tool, *create, "-b", str(passwd), user, password], check=True)
    settings = [
        "allow_anonymous false",
        f"password_file {passwd}",
        f"acl_file {REPO / 'deploy' / 'mosquitto' / 'acl'}",
        "persistence false",
    ]
    if os.geteuid() == 0:
        settings.append("user root")  # else it drops to `mosquitto`, who cannot read tmp_path
    yield SecuredBroker(url=mosquitto_with(settings))


def _credentials(user: str, password: str) -> dict[str, str]:
    return {USERNAME_ENV: user, PASSWORD_ENV: password}


def _start_coordinator(procs: Procs, broker: SecuredBroker, tiny: list[str]) -> str:
    args = ["coordinator", "--listen", "127.0.0.1:0", "--broker", broker.url]
    args += ["--state-dir", str(procs.tmp / "state")]
    for s in [*tiny, "pipeline.stages=1", "train.steps=2", "checkpoint.every_steps=0"]:
        args += ["--set", s]
    _, info = procs.start(
        "coordinator", *args, env=_credentials("coordinator", PASSWORDS["coordinator"])
    )
    # The URL the coordinator hands to nodes carries no credentials of its own.
    assert info["broker_url"] == broker.url
    return f"127.0.0.1:{info['grpc_port']}"


@pytest.mark.timeout(180)
def test_a_run_finishes_through_a_broker_with_passwords_and_acls(
    procs: Procs, secured_broker: SecuredBroker, tiny: list[str]
) -> None:
    coordinator = _start_coordinator(procs, secured_broker, tiny)
    node, _ = procs.node("n0", coordinator, env=_credentials("node", PASSWORDS["node"]))
    assert node.wait(timeout=150) == 0, (procs.tmp / "n0.log").read_text()
    logs = (procs.tmp / "n0.log").read_text() + (procs.tmp / "coordinator.log").read_text()
    # The node applies a step only when the coordinator's retained step state reaches it.
    assert "applied step 1" in logs and "the run has finished" in logs, logs
    for password in PASSWORDS.values():
        assert password not in logs


@pytest.mark.timeout(180)
def test_wrong_passwords_are_one_clear_line(
    procs: Procs, secured_broker: SecuredBroker, tiny: list[str]
) -> None:
    coordinator = _start_coordinator(procs, secured_broker, tiny)
    node, _ = procs.node(
        "n0", coordinator, "--broker-retry", "0.05", env=_credentials("node", "wrong")
    )
    assert node.wait(timeout=120) == 1
    log = (procs.tmp / "n0.log").read_text()
    last = log.splitlines()[-1]
    assert last.startswith("swarmpipe node: error: cannot use the MQTT broker"), log
    assert "the broker refused user 'node': not authorized" in last, log
    assert "Traceback" not in log, log

    # A coordinator with a wrong password at start stops with one line: retrying cannot help.
    args = ["coordinator", "--listen", "127.0.0.1:0", "--broker", secured_broker.url]
    args += ["--state-dir", str(procs.tmp / "state2")]
    bad, _ = procs.start(
        "bad-coordinator", *args, ready=False, env=_credentials("coordinator", "wrong")
    )
    assert bad.wait(timeout=30) == 1
    bad_log = (procs.tmp / "bad-coordinator.log").read_text()
    errors = [line for line in bad_log.splitlines() if line.startswith("swarmpipe coordinator")]
    assert len(errors) == 1, bad_log
    assert "the broker refused user 'coordinator': not authorized" in errors[0], bad_log
    assert "Traceback" not in bad_log
