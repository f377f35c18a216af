"""A --tls run outlives its nodes' certificates: each node renews its own before it expires
(a new key each time) and the swarm keeps training over fresh connections."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import grpc
import pytest

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.transport import tls
from tests.conftest import GRPCURL, Procs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

LIFETIME_S = 36.0
"""coordinator.node_cert_hours=0.01: renewed after 24 s, expired after 36 s."""


def test_nodes_renew_their_certificates_and_train_past_the_first_ones_expiry(
    procs: Procs, tiny: list[str]
) -> None:
    state = procs.tmp / "coordinator-state"
    # The wait is for the clock, not for steps: 100 ms each way between the stages keeps
    # the swarm training a few steps a second, not burning both cores for a minute (with
    # the other pytest worker's tests on them).
    coordinator, ca_file, info, _ = procs.tls_pair(
        *tiny,
        "train.steps=1000000",
        "coordinator.node_cert_hours=0.01",
        "pipeline.link_latency_ms=100",
    )
    joined = time.monotonic()

    def renewals(name: str) -> int:
        return (procs.tmp / f"{name}.log").read_text().count("renewed its TLS certificate")

    # Two renewals each: the second comes after the first certificate expired.
    poll_until(lambda: min(renewals("n0"), renewals("n1")) >= 2, 240, "two renewals a node")
    assert time.monotonic() - joined > LIFETIME_S
    admin = (state / "admin-token").read_text().strip()
    channel = grpc.secure_channel(
        coordinator,
        grpc.ssl_channel_credentials(Path(ca_file).read_bytes()),
        options=[("grpc.ssl_target_name_override", tls.COORDINATOR_NAME)],
    )
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    metadata = (("swarmpipe-admin-token", admin),)

    def steps() -> int:
        return len(
            stub.Status(coordinator_pb2.StatusRequest(), timeout=10, metadata=metadata).steps
        )

    # Training goes on, and a new connection to a node finds a certificate valid now.
    before = steps()
    poll_until(lambda: steps() >= before + 5, 120, "steps after the renewals")
    for name in ("n0", "n1"):
        log = (procs.tmp / f"{name}.log").read_text()
        assert "could not renew" not in log and "expired" not in log, log[-3000:]
    ca = tls.RunCA.load_or_create(state, "testnet")
    key = tls.new_key()
    (procs.tmp / "n7.key").write_bytes(tls.key_pem(key))
    (procs.tmp / "n7.pem").write_bytes(ca.issue_node("n7", tls.public_pem(key)))
    health = subprocess.run(
        [GRPCURL, "-max-time", "20", "-cacert", ca_file, "-servername", tls.NODE_NAME,
         "-cert", str(procs.tmp / "n7.pem"), "-key", str(procs.tmp / "n7.key"),
         f"127.0.0.1:{info['grpc_port']}", "grpc.health.v1.Health/Check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    channel.close()
