"""`swarmpipe broker-config` against a real mosquitto, with mosquitto's own clients: strangers
are refused, a node may publish only its own presence and telemetry, the organiser link limits."""

from __future__ import annotations

import base64
import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.control.bus import make_client, parse_broker_url
from swarmpipe.coordinator.broker_config import mosquitto_hash
from swarmpipe.coordinator.tokens import TokenStore
from swarmpipe.transport.auth import RunKey
from tests.conftest import run_mosquitto

RUN = "r1"


def test_the_hash_is_the_one_mosquitto_passwd_writes(tmp_path: Path) -> None:
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        pytest.skip("mosquitto_passwd is not installed")
    subprocess.run([tool, "-c", "-b", str(tmp_path / "p"), "u", "pw"], check=True, timeout=30)
    line = (tmp_path / "p").read_text().strip()
    salt_b64 = line.split("$")[3]
    assert line == "u:" + mosquitto_hash("pw", base64.b64decode(salt_b64))


def _state(tmp_path: Path) -> tuple[Path, RunKey]:
    state = tmp_path / "state"
    (state / "checkpoints" / RUN).mkdir(parents=True)
    key = RunKey.load_or_create(state, RUN)
    store = TokenStore(state)
    record, _ = store.create(expires_s=None)
    store.record_use(record.id, "n1")
    return state, key


def _pub(url: str, topic: str, user: str = "", password: str = "", *flags: str) -> int:
    host, port = url.removeprefix("mqtt://").split(":")
    cmd = ["mosquitto_pub", "-h", host, "-p", port, "-t", topic, "-m", "x", "-q", "1", *flags]
    if user:
        cmd += ["-u", user, "-P", password]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode


def _sub_all(url: str, user: str, password: str, count: int) -> subprocess.Popen[str]:
    host, port = url.removeprefix("mqtt://").split(":")
    return subprocess.Popen(
        ["mosquitto_sub", "-h", host, "-p", port, "-u", user, "-P", password, "-v",
         "-t", f"swarmpipe/{RUN}/#", "-C", str(count), "-W", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


@pytest.mark.slow
def test_mosquitto_with_the_generated_config_enforces_the_run_acl(tmp_path: Path) -> None:
    if shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None:
        pytest.skip("mosquitto clients are not installed")
    state, key = _state(tmp_path)
    out = tmp_path / "broker"
    made = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "broker-config", "--state-dir", str(state),
         "--out", str(out), "--node", "n2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    settings = [
        line
        for line in (out / "mosquitto.conf").read_text().splitlines()
        if line and not line.startswith(("#", "listener"))
    ]
    if os.geteuid() == 0:
        settings.append("user root")
    admin = (state / "admin-token").read_text().strip()
    with run_mosquitto(tmp_path / "run.conf", settings) as url:
        coordinator = ("coordinator", key.mqtt_password("coordinator"))
        # A retained step state first: the watcher's first line says it has subscribed.
        assert _pub(url, f"swarmpipe/{RUN}/step", *coordinator, "-r") == 0
        watcher = _sub_all(url, *coordinator, 3)
        try:
            assert watcher.stdout is not None
            first = watcher.stdout.readline()
            assert first.startswith(f"swarmpipe/{RUN}/step"), first
            assert _pub(url, f"swarmpipe/{RUN}/plan") != 0  # anonymous: refused
            assert _pub(url, f"swarmpipe/{RUN}/plan", "n1", "guess") != 0
            assert _pub(url, f"swarmpipe/{RUN}/plan", "stranger", key.mqtt_password("x")) != 0
            n1 = ("n1", key.mqtt_password("n1"))
            # Accepted by the broker (QoS 1 acknowledged) but delivered to nobody.
            assert _pub(url, f"swarmpipe/{RUN}/plan", *n1) == 0
            assert _pub(url, f"swarmpipe/{RUN}/step", *n1) == 0
            assert _pub(url, f"swarmpipe/{RUN}/presence/n2", *n1) == 0
            assert _pub(url, f"swarmpipe/{RUN}/control/all", *n1) == 0
            # What is allowed arrives: the node's own presence, the organiser's link limit.
            assert _pub(url, f"swarmpipe/{RUN}/presence/n1", *n1) == 0
            assert _pub(url, f"swarmpipe/{RUN}/control/all", "organiser", admin) == 0
            seen, _ = watcher.communicate(timeout=60)
        finally:
            if watcher.poll() is None:
                watcher.kill()
                watcher.wait()
    topics = [line.split(" ")[0] for line in [first, *seen.splitlines()]]
    assert topics == [
        f"swarmpipe/{RUN}/step",
        f"swarmpipe/{RUN}/presence/n1",
        f"swarmpipe/{RUN}/control/all",
    ], seen


@pytest.mark.slow
async def test_mosquitto_with_the_tls_config_takes_only_tls_clients_of_the_run_ca(
    tmp_path: Path,
) -> None:
    if shutil.which("mosquitto_pub") is None:
        pytest.skip("mosquitto clients are not installed")
    state, key = _state(tmp_path)
    out = tmp_path / "broker"
    made = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "broker-config", "--state-dir", str(state),
         "--out", str(out), "--tls"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    conf = (out / "mosquitto.conf").read_text()
    assert "listener 8883" in conf and f"certfile {out.resolve() / 'broker.pem'}" in conf
    assert (out / "broker-key.pem").stat().st_mode & 0o777 == 0o600
    settings = [line for line in conf.splitlines() if line and not line.startswith(("#", "list"))]
    if os.geteuid() == 0:
        settings.append("user root")
    n1 = ("n1", key.mqtt_password("n1"))
    ca_file = str(state / "ca.pem")
    with run_mosquitto(tmp_path / "run.conf", settings) as url:
        topic = f"swarmpipe/{RUN}/presence/n1"
        # mosquitto's own client: with the run CA, in; plaintext or without the CA, refused.
        assert _pub(url, topic, *n1, "--cafile", ca_file) == 0
        assert _pub(url, topic, *n1) != 0
        assert _pub(url, topic, *n1, "--capath", str(tmp_path)) != 0
        # Ours, dialling an IP yet checking the name swarmpipe-broker.
        broker = dataclasses.replace(
            parse_broker_url(url.replace("mqtt://", "mqtts://")),
            username=n1[0],
            password=n1[1],
            ca_pem=(state / "ca.pem").read_bytes(),
        )
        async with make_client(broker, "n1") as client:
            await client.publish(topic, b"x", qos=1)
