"""TLS with real clients (issue 22): a --tls testnet trains to the plaintext one's parameters;
grpcurl plaintext, or with the CA but no client certificate, gets nothing from a node; a
credential under another node's certificate is refused; MQTT over TLS refuses plaintext;
plaintext beyond loopback needs --insecure."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from swarmpipe.control.bus import make_client, parse_broker_url
from swarmpipe.transport import tls
from swarmpipe.transport.auth import CREDENTIAL_KEY, RunKey
from tests.conftest import Procs, grpcurl_protos

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
RUN = "testnet"
"""The default config's run_id."""
# Four microbatches a step: a stage sums them in float64 (node/stage_runtime.py), so the
# order their gradients come back in, which timing decides, does not show in the bits.
MICROBATCHES = ["train.global_batch=16", "train.microbatch=4"]


def _testnet(out: Path, tiny: list[str], *flags: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "swarmpipe", "testnet", "--quiet", "--no-picture", "--nodes", "3",
           "--stages", "3", "--steps", "4", "--out", str(out), *flags]  # fmt: skip
    for s in [*tiny, *MICROBATCHES]:
        cmd += ["--set", s]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        output, _ = popen.communicate(timeout=300)
    finally:
        if popen.poll() is None:
            os.killpg(popen.pid, signal.SIGKILL)
            popen.wait()
    assert popen.returncode == 0, output.decode(errors="replace")
    report: dict[str, Any] = json.loads((out / "report.json").read_text())
    return report


def test_a_tls_testnet_trains_to_the_plaintext_ones_parameters(
    tmp_path: Path, tiny: list[str]
) -> None:
    plain = _testnet(tmp_path / "plain", tiny)
    secure = _testnet(tmp_path / "tls", tiny, "--tls")

    def digests(report: dict[str, Any]) -> list[tuple[int, int, str]]:
        return sorted((m["stage"], m["last_step"], m["param_digest"]) for m in report["members"])

    assert digests(secure) == digests(plain)
    assert [m[1] for m in digests(plain)] == [3, 3, 3]
    assert [s["loss"] for s in secure["steps"]] == [s["loss"] for s in plain["steps"]]
    # It really ran over TLS: the CA the coordinator made, and MQTT over TLS.
    state = tmp_path / "tls" / "coordinator-state"
    assert (state / tls.CA_KEY_FILE).stat().st_mode & 0o777 == 0o600
    log = (tmp_path / "tls" / "logs" / "coordinator.log").read_text()
    assert "broker mqtts://127.0.0.1:" in log and tls.fingerprint((state / "ca.pem").read_bytes())


def _grpcurl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, "-max-time", "20", *args], capture_output=True, text=True, timeout=60
    )


def test_grpcurl_needs_tls_and_a_node_needs_a_client_certificate_of_the_caller(
    procs: Procs, tiny: list[str]
) -> None:
    # Steps enough that the run outlasts the checks (1000 tiny steps once ended first and
    # the nodes left: "connection refused"); the fixture stops it. 100 ms each way between
    # the stages: the checks need a swarm that runs, not one that burns both cores meanwhile.
    coordinator, ca_file, info, token = procs.tls_pair(
        *tiny, "train.steps=1000000", "pipeline.link_latency_ms=100"
    )
    state = procs.tmp / "coordinator-state"
    assert ca_file == str((state / "ca.pem").resolve())
    node = f"127.0.0.1:{info['grpc_port']}"
    health = "grpc.health.v1.Health/Check"
    info_rpc = "swarmpipe.v1.Stage/Info"

    # Plaintext: neither answers, not even the health check.
    for target in (coordinator, node):
        done = _grpcurl("-plaintext", target, health)
        assert done.returncode != 0 and "SERVING" not in done.stdout, done.stdout
    # The coordinator with its CA: TLS, and its name checked; Status still needs the token.
    as_coordinator = ["-cacert", ca_file, "-servername", tls.COORDINATOR_NAME]
    done = _grpcurl(*as_coordinator, coordinator, health)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    protos = grpcurl_protos(procs.tmp)
    done = _grpcurl(*as_coordinator, *protos, coordinator, "swarmpipe.v1.Coordinator/Status")
    assert "Code: Unauthenticated" in done.stderr, done.stderr
    # A node with only the CA (no client certificate): no handshake, no call of any kind.
    as_node = ["-cacert", ca_file, "-servername", tls.NODE_NAME]
    for method in (health, info_rpc):
        done = _grpcurl(*as_node, node, method)
        assert done.returncode != 0 and "SERVING" not in done.stdout, done.stdout
        assert "Code:" not in done.stderr, done.stderr  # refused before any RPC
    # A certificate from the run CA for n7, carrying n1's credential (stolen): refused.
    ca = tls.RunCA.load_or_create(state, RUN)
    key = tls.new_key()
    (procs.tmp / "n7.key").write_bytes(tls.key_pem(key))
    (procs.tmp / "n7.pem").write_bytes(ca.issue_node("n7", tls.public_pem(key)))
    stolen = RunKey.load_or_create(state, RUN).issue("n1", stage=1)
    with_cert = [*as_node, "-cert", str(procs.tmp / "n7.pem"), "-key", str(procs.tmp / "n7.key")]
    done = _grpcurl(*with_cert, *protos, "-H", f"{CREDENTIAL_KEY}: {stolen}", node, info_rpc)
    assert "Code: PermissionDenied" in done.stderr and "'n7'" in done.stderr, done.stderr
    # The same certificate passes the handshake: the health check answers over mutual TLS.
    done = _grpcurl(*with_cert, node, health)
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    # A node without the CA cannot join, and says what it lacks in one line.
    lost, _ = procs.start(
        "lost",
        *procs._node_args("lost", coordinator),
        "--join-timeout",
        "3",
        ready=False,
        env={"SWARMPIPE_TOKEN": token},
    )
    assert lost.wait(timeout=120) == 3
    last = (procs.tmp / "lost.log").read_text().strip().splitlines()[-1]
    assert last.startswith("swarmpipe node: ") and "--ca-file" in last, last
    # The organiser's commands reach a TLS coordinator with --ca-file, and say so without it.
    status = [sys.executable, "-m", "swarmpipe", "status", "--json", "--coordinator",
              coordinator, "--admin-token-file", str(state / "admin-token")]  # fmt: skip
    done = subprocess.run(
        [*status, "--ca-file", ca_file], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and json.loads(done.stdout)["run_id"] == RUN, done.stderr
    done = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3 and "--ca-file" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


async def test_the_tls_broker_refuses_plaintext_clients(procs: Procs, tiny: list[str]) -> None:
    state = procs.tmp / "coordinator-state"
    args = ["coordinator", "--listen", "127.0.0.1:0", "--tls", "--state-dir", str(state),
            "--stay", "--set", "train.steps=1000"]  # fmt: skip
    for s in tiny:
        args += ["--set", s]
    _, ready = procs.start("coordinator", *args)
    broker = parse_broker_url(ready["broker_url"])
    assert broker.tls
    # An open loopback run lets anonymous clients in, but only over TLS.
    with pytest.raises(aiomqtt.MqttError):
        async with make_client(dataclasses.replace(broker, tls=False), "plain", keepalive=2):
            pass
    with pytest.raises(aiomqtt.MqttError):  # the system's CAs do not know the run CA
        async with make_client(broker, "no-ca", keepalive=2):
            pass
    ca_pem = (state / "ca.pem").read_bytes()
    async with make_client(dataclasses.replace(broker, ca_pem=ca_pem), "ca", keepalive=2) as client:
        await client.subscribe(f"swarmpipe/{RUN}/#")


def test_plaintext_beyond_loopback_refuses_to_start_without_insecure(procs: Procs) -> None:
    state = str(procs.tmp / "state")
    for args in (
        ["coordinator", "--listen", "0.0.0.0:0", "--state-dir", state],
        ["coordinator", "--listen", "127.0.0.1:0", "--broker-listen", "0.0.0.0:0",
         "--state-dir", state],
        ["node", "--coordinator", "127.0.0.1:9", "--listen", "0.0.0.0:0"],
        ["node", "--coordinator", "192.0.2.1:9"],  # a remote coordinator: 0.0.0.0 by default
        ["coordinator", "--listen", "127.0.0.1:0", "--broker", "mqtt://192.0.2.1:1883",
         "--state-dir", state],
    ):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "swarmpipe", *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "--insecure" in lines[0] and "--tls" in lines[0], lines
    popen, ready = procs.start(
        "insecure", "coordinator", "--listen", "0.0.0.0:0", "--insecure", "--state-dir", state
    )
    assert ready["grpc_port"] > 0
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(timeout=60) == 0
    log = (procs.tmp / "insecure.log").read_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "--insecure" in line]
    assert len(warnings) == 1, log


def test_a_ca_the_organiser_brings_signs_the_coordinator(procs: Procs) -> None:
    brought = tls.RunCA.load_or_create(procs.tmp / "my-ca", "anything")
    cert, key = procs.tmp / "my-ca" / tls.CA_CERT_FILE, procs.tmp / "my-ca" / tls.CA_KEY_FILE
    state = procs.tmp / "state"
    half = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "coordinator", "--listen", "127.0.0.1:0", "--tls",
         "--tls-ca-cert", str(cert), "--state-dir", str(state)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert half.returncode == 2 and half.stderr.count("\n") == 1, half.stderr
    assert "--tls-ca-key" in half.stderr
    _, ready = procs.start(
        "coordinator", "coordinator", "--listen", "127.0.0.1:0", "--tls", "--state-dir",
        str(state), "--tls-ca-cert", str(cert), "--tls-ca-key", str(key), "--stay",
    )  # fmt: skip
    assert ready["ca_file"] == str(cert.resolve())
    assert not (state / tls.CA_KEY_FILE).exists()  # no CA of its own
    done = _grpcurl("-cacert", str(cert), "-servername", tls.COORDINATOR_NAME,
                    f"127.0.0.1:{ready['grpc_port']}", "grpc.health.v1.Health/Check")  # fmt: skip
    assert done.returncode == 0 and "SERVING" in done.stdout, done.stderr
    assert brought.fingerprint in (procs.tmp / "coordinator.log").read_text()
