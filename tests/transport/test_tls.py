"""The run CA and what it issues; mutual TLS between nodes with the credential bound to the
caller's certificate; who may serve plaintext."""

from __future__ import annotations

import datetime
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from swarmpipe.node.peer_admission import PeerAdmission
from swarmpipe.protos import control_pb2, stage_pb2
from swarmpipe.transport import tls
from swarmpipe.transport.auth import CREDENTIAL_KEY, AuthInterceptor, CredentialHolder, RunKey
from swarmpipe.transport.request_parsing import add_servicer
from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection, open_channel
from tests.transport.test_request_parsing import STAGE, Echo

pytestmark = pytest.mark.timeout(60)


def test_the_run_ca_is_made_once_with_a_private_key_only_its_owner_reads(tmp_path: Path) -> None:
    ca = tls.RunCA.load_or_create(tmp_path, "r1")
    assert (tmp_path / tls.CA_KEY_FILE).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / tls.CA_CERT_FILE).read_bytes() == ca.cert_pem
    again = tls.RunCA.load_or_create(tmp_path, "r1")
    assert again.fingerprint == ca.fingerprint == tls.fingerprint(ca.cert_pem)
    assert tls.read_ca_file(tmp_path / tls.CA_CERT_FILE) == ca.cert_pem


def test_a_ca_the_organiser_brings_must_be_a_matching_ec_pair(tmp_path: Path) -> None:
    a = tls.RunCA.load_or_create(tmp_path / "a", "r1")
    tls.RunCA.load_or_create(tmp_path / "b", "r1")
    brought = tls.RunCA.load(tmp_path / "a" / tls.CA_CERT_FILE, tmp_path / "a" / tls.CA_KEY_FILE)
    assert brought.fingerprint == a.fingerprint
    with pytest.raises(tls.TLSError, match="is not the key of the certificate"):
        tls.RunCA.load(tmp_path / "a" / tls.CA_CERT_FILE, tmp_path / "b" / tls.CA_KEY_FILE)
    with pytest.raises(tls.TLSError, match="cannot read the run CA"):
        tls.RunCA.load(tmp_path / "nope.pem", tmp_path / "a" / tls.CA_KEY_FILE)


def test_a_node_certificate_names_its_node_and_only_the_run_ca_issues_it(tmp_path: Path) -> None:
    ca = tls.RunCA.load_or_create(tmp_path / "a", "r1")
    other = tls.RunCA.load_or_create(tmp_path / "b", "r1")
    key = tls.new_key()
    cert = ca.issue_node("n1", tls.public_pem(key))
    assert tls.check_node_cert(ca.cert_pem, cert, "n1")
    with pytest.raises(tls.TLSError, match="is for 'n1', not node 'n2'"):
        tls.check_node_cert(ca.cert_pem, cert, "n2")
    with pytest.raises(tls.TLSError, match="not issued by the run CA"):
        tls.check_node_cert(other.cert_pem, cert, "n1")
    # The coordinator's name is not a node's to take, and a key must be a key.
    with pytest.raises(tls.TLSError, match="cannot be a certificate's name"):
        ca.issue_node(tls.COORDINATOR_NAME, tls.public_pem(key))
    with pytest.raises(tls.TLSError, match="not a PEM public key"):
        ca.issue_node("n1", b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n")
    with pytest.raises(tls.TLSError, match="not a CA certificate"):
        (tmp_path / "leaf.pem").write_bytes(cert)
        tls.read_ca_file(tmp_path / "leaf.pem")


def test_a_node_certificate_expires(tmp_path: Path) -> None:
    ca = tls.RunCA.load_or_create(tmp_path, "r1")
    issued = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    cert = ca.issue_node(
        "n1",
        tls.public_pem(tls.new_key()),
        lifetime=datetime.timedelta(hours=1),
        now=issued,
    )
    assert tls.check_node_cert(ca.cert_pem, cert, "n1", now=issued)
    later = issued + datetime.timedelta(hours=1, seconds=1)
    with pytest.raises(tls.TLSError, match="not now"):
        tls.check_node_cert(ca.cert_pem, cert, "n1", now=later)
    with pytest.raises(tls.TLSError, match="not now"):
        tls.check_node_cert(ca.cert_pem, cert, "n1", now=issued - datetime.timedelta(hours=1))


def test_plaintext_beyond_loopback_needs_insecure_and_then_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test")
    tls.check_plaintext({"api": "127.0.0.1:0", "broker": "[::1]:1883"}, insecure=False, logger=log)
    with pytest.raises(tls.TLSError, match=r"api 0\.0\.0\.0:7600: plaintext beyond this machine"):
        tls.check_plaintext({"api": "0.0.0.0:7600"}, insecure=False, logger=log)
    with caplog.at_level(logging.WARNING):
        tls.check_plaintext({"api": "10.0.0.1:7600"}, insecure=True, logger=log)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


# -- mutual TLS on a real server ---------------------------------------------


class _Node:
    """What a joined node holds: its key, the certificate the CA issued, its credential."""

    def __init__(self, ca: tls.RunCA, key: RunKey, node_id: str) -> None:
        private = tls.new_key()
        self.key_pem = tls.key_pem(private)
        self.cert = ca.issue_node(node_id, tls.public_pem(private))
        self.credential = key.issue(node_id)


@pytest.fixture
async def mtls_node(
    tmp_path: Path,
) -> AsyncIterator[tuple[tls.RunCA, RunKey, int, tls.NodeServerTLS, _Node]]:
    """A node's Stage server over mutual TLS (not yet given its certificate), admitting n1."""
    ca = tls.RunCA.load_or_create(tmp_path, "r1")
    key = RunKey.load_or_create(tmp_path, "r1")
    admission = PeerAdmission("me")
    admission.verifier = key.verifier()
    admission.plan = control_pb2.Plan(
        stages=[
            control_pb2.StagePlan(
                stage=0,
                replicas=[control_pb2.Replica(node_id="n1"), control_pb2.Replica(node_id="n2")],
            )
        ]
    )
    server_tls = tls.NodeServerTLS("me")
    binding = tls.CertificateBinding(lambda: admission.verifier)
    server = create_server(AuthInterceptor(admission.policy), binding)
    add_servicer(server, Echo(), STAGE)
    await enable_health_and_reflection(server, [STAGE.full_name])
    port = bind(server, "127.0.0.1:0", server_tls.credentials())
    await server.start()
    try:
        yield ca, key, port, server_tls, _Node(ca, key, "me")
    finally:
        await server.stop(grace=None)


async def _info(port: int, channel_tls: tls.ChannelTLS | None, credential: str) -> grpc.StatusCode:
    holder = CredentialHolder()
    holder.set(CREDENTIAL_KEY, credential)
    async with open_channel(f"127.0.0.1:{port}", holder, channel_tls) as channel:
        try:
            await channel.unary_unary(
                "/swarmpipe.v1.Stage/Info",
                request_serializer=stage_pb2.StageInfoRequest.SerializeToString,
            )(stage_pb2.StageInfoRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_mutual_tls_binds_the_credential_to_the_callers_certificate(
    mtls_node: tuple[tls.RunCA, RunKey, int, tls.NodeServerTLS, _Node], tmp_path: Path
) -> None:
    ca, key, port, server_tls, me = mtls_node
    n1, n2 = _Node(ca, key, "n1"), _Node(ca, key, "n2")

    def as_node(node: _Node) -> tls.ChannelTLS:
        return tls.ChannelTLS(ca.cert_pem, tls.NODE_NAME, node.key_pem, node.cert)

    # Before its certificate arrives (Join), the node's server completes no handshake.
    assert await _info(port, as_node(n1), n1.credential) == grpc.StatusCode.UNAVAILABLE
    server_tls.install(me.key_pem, me.cert, ca.cert_pem)
    assert await _info(port, as_node(n1), n1.credential) == grpc.StatusCode.OK
    # n2's certificate with n1's (stolen) credential: the names differ.
    assert await _info(port, as_node(n2), n1.credential) == grpc.StatusCode.PERMISSION_DENIED
    # Plaintext, or TLS without a client certificate, or one from another CA: no handshake.
    assert await _info(port, None, n1.credential) == grpc.StatusCode.UNAVAILABLE
    ca_only = tls.ChannelTLS(ca.cert_pem, tls.NODE_NAME)
    assert await _info(port, ca_only, n1.credential) == grpc.StatusCode.UNAVAILABLE
    stranger_ca = tls.RunCA.load_or_create(tmp_path / "stranger", "r1")
    stranger = _Node(stranger_ca, key, "n1")
    forged = tls.ChannelTLS(ca.cert_pem, tls.NODE_NAME, stranger.key_pem, stranger.cert)
    assert await _info(port, forged, n1.credential) == grpc.StatusCode.UNAVAILABLE
