"""The run's certificate authority and the certificates it issues (transport/tls.py uses them).

The coordinator makes a **run CA** on first start (`<state-dir>/ca.pem` and `ca-key.pem`,
mode 0600), or loads the one the organiser brings (`--tls-ca-cert/--tls-ca-key`). With it
the coordinator signs, in memory at every start, its own server certificate (the name
`swarmpipe-coordinator`, plus localhost, this host's names and `--tls-host` names or IPs, so
`grpcurl -cacert ca.pem HOST:PORT` works too), the MQTT broker's (`swarmpipe-broker`) and,
at Join, a **node certificate**: the node sends only a public key; the coordinator picks the
names, so a node cannot ask for another node's identity or the coordinator's. A node
certificate's common name is the node id and its one DNS name is `swarmpipe-node`, the name
every channel between nodes checks. It lives `NODE_CERT_LIFETIME`.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from swarmpipe.errors import ConfigError

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
COORDINATOR_NAME = "swarmpipe-coordinator"
"""The DNS name in the coordinator's certificate that nodes check."""
BROKER_NAME = "swarmpipe-broker"
"""The DNS name in the MQTT broker's certificate that MQTT clients check."""
BROKER_CERT_FILE = "broker.pem"
BROKER_KEY_FILE = "broker-key.pem"
NODE_NAME = "swarmpipe-node"
"""The DNS name in every node certificate, checked on channels between nodes."""
NODE_CERT_LIFETIME = datetime.timedelta(days=7)
"""How long a node certificate is valid unless told otherwise (the coordinator passes the
run's `coordinator.node_cert_hours`); a node renews its own (RenewCertificate) once two
thirds of it have passed."""
CA_LIFETIME = datetime.timedelta(days=3650)
_BACKDATE = datetime.timedelta(minutes=5)
"""Certificates start a little in the past, so a volunteer's clock a few minutes behind
the coordinator's does not refuse a certificate issued just now."""
MAX_PUBLIC_KEY_BYTES = 4096


class TLSError(ConfigError):
    """A certificate or key is missing, malformed, expired, or for someone else; or plaintext
    where TLS is needed. A ConfigError: the CLI prints one line and exits 2."""


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def new_key() -> ec.EllipticCurvePrivateKey:
    """A fresh P-256 key (fast to make and to handshake with, and every TLS stack takes it)."""
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def public_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def fingerprint(cert_pem: bytes) -> str:
    """`sha256:` and the hex SHA-256 of a certificate's DER form, as openssl prints it."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TLSError(f"not a PEM certificate: {exc}") from exc
    return "sha256:" + hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: Sequence[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in dict.fromkeys(names):
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class RunCA:
    """The run's certificate authority: signs the coordinator's and every node's certificate."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self._key = key
        self.cert_pem = cert.public_bytes(serialization.Encoding.PEM)
        self.fingerprint = fingerprint(self.cert_pem)

    @staticmethod
    def create(run_id: str) -> RunCA:
        key = new_key()
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"swarmpipe run CA {run_id}"[:64]))
            .issuer_name(_name(f"swarmpipe run CA {run_id}"[:64]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(now + CA_LIFETIME)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(key, hashes.SHA256())
        )
        return RunCA(cert, key)

    @staticmethod
    def load(cert_path: str | Path, key_path: str | Path) -> RunCA:
        """A CA the organiser brings (PEM certificate and its unencrypted EC key)."""
        try:
            cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
            key = serialization.load_pem_private_key(Path(key_path).read_bytes(), password=None)
        except OSError as exc:
            raise TLSError(f"cannot read the run CA: {exc}") from None
        except (ValueError, TypeError) as exc:
            raise TLSError(
                f"{cert_path} / {key_path} is not a PEM certificate and key: {exc}"
            ) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise TLSError(f"{key_path}: the run CA's key must be an EC key (P-256)")
        if cert.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ) != key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        ):
            raise TLSError(f"{key_path} is not the key of the certificate {cert_path}")
        return RunCA(cert, key)

    @staticmethod
    def load_or_create(state_dir: str | Path, run_id: str) -> RunCA:
        """The CA in `state_dir` (ca.pem, ca-key.pem), made there on first start."""
        cert_path = Path(state_dir) / CA_CERT_FILE
        key_path = Path(state_dir) / CA_KEY_FILE
        if key_path.exists():
            return RunCA.load(cert_path, key_path)
        ca = RunCA.create(run_id)
        key_path.parent.mkdir(parents=True, exist_ok=True)
        _write_private(key_path, key_pem(ca._key))
        cert_path.write_bytes(ca.cert_pem)
        return ca

    def _leaf(
        self,
        common_name: str,
        *,
        public_key: Any,
        names: Sequence[str],
        lifetime: datetime.timedelta,
        usages: list[x509.ObjectIdentifier],
        now: datetime.datetime | None,
    ) -> bytes:
        now = now or _now()
        not_after = min(now + lifetime, self.cert.not_valid_after_utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _BACKDATE)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(_san(names), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def issue_server(
        self,
        hosts: Sequence[str],
        key: ec.EllipticCurvePrivateKey,
        *,
        name: str = COORDINATOR_NAME,
        now: Any = None,
    ) -> bytes:
        """A server certificate for `key`: `name` (the coordinator's or the broker's fixed
        name), localhost and `hosts`."""
        names = [name, "localhost", "127.0.0.1", "::1", *hosts]
        return self._leaf(
            name,
            public_key=key.public_key(),
            names=[n for n in names if n and n not in ("0.0.0.0", "::", "[::]")],
            lifetime=CA_LIFETIME,
            usages=[ExtendedKeyUsageOID.SERVER_AUTH],
            now=now,
        )

    def issue_node(
        self,
        node_id: str,
        public_key_pem: bytes,
        *,
        lifetime: datetime.timedelta = NODE_CERT_LIFETIME,
        now: datetime.datetime | None = None,
    ) -> bytes:
        """Node `node_id`'s certificate for the public key it sent at Join."""
        if not node_id or node_id in (COORDINATOR_NAME, BROKER_NAME) or len(node_id) > 64:
            raise TLSError(f"node id {node_id!r} cannot be a certificate's name")
        if len(public_key_pem) > MAX_PUBLIC_KEY_BYTES:
            raise TLSError("the node's public key is too long")
        try:
            public_key = serialization.load_pem_public_key(public_key_pem)
        except (ValueError, TypeError) as exc:
            raise TLSError(f"the node's public key is not a PEM public key: {exc}") from None
        if not isinstance(public_key, ec.EllipticCurvePublicKey):
            raise TLSError("the node's public key must be an EC key")
        return self._leaf(
            node_id,
            public_key=public_key,
            names=[NODE_NAME],
            lifetime=lifetime,
            usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            now=now,
        )


def seconds_left(cert_pem: bytes, *, now: datetime.datetime | None = None) -> float:
    """Seconds until the certificate expires (negative once it has)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    now = now or datetime.datetime.now(datetime.UTC)
    return (cert.not_valid_after_utc - now).total_seconds()


def check_node_cert(
    ca_pem: bytes, cert_pem: bytes, node_id: str, *, now: datetime.datetime | None = None
) -> x509.Certificate:
    """The certificate, if the run CA signed it for `node_id` and it is valid `now`."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        cert = x509.load_pem_x509_certificate(cert_pem)
    except ValueError as exc:
        raise TLSError(f"not a PEM certificate: {exc}") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        raise TLSError("the certificate was not issued by the run CA") from None
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    if not names or names[0].value != node_id:
        held = names[0].value if names else "nobody"
        raise TLSError(f"the certificate is for {held!r}, not node {node_id!r}")
    now = now or _now()
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise TLSError(
            f"node {node_id!r}'s certificate is valid from {cert.not_valid_before_utc:%F %T} "
            f"to {cert.not_valid_after_utc:%F %T} UTC, not now"
        )
    return cert


def read_ca_file(path: str | Path) -> bytes:
    """The PEM CA certificate in `path`, checked to be one."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TLSError(f"--ca-file {path}: {exc.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError:
        raise TLSError(f"--ca-file {path} is not a PEM certificate") from None
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise TLSError(f"--ca-file {path} is not a CA certificate (use the run's ca.pem)")
    return data


def local_names() -> list[str]:
    """This machine's host name and FQDN, for the coordinator's certificate."""
    return [n for n in dict.fromkeys([socket.gethostname(), socket.getfqdn()]) if n]


def write_broker_files(ca: RunCA, hosts: Sequence[str], folder: str | Path) -> tuple[Path, Path]:
    """An MQTT broker's certificate and key from the run CA, written (key 0600) into `folder`
    for brokers that read files (amqtt, mosquitto); returns (certificate, key) paths."""
    key = new_key()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = folder / BROKER_CERT_FILE, folder / BROKER_KEY_FILE
    key_path.unlink(missing_ok=True)
    _write_private(key_path, key_pem(key))
    cert_path.write_bytes(ca.issue_server(hosts, key, name=BROKER_NAME) + ca.cert_pem)
    return cert_path, key_path


def throwaway_certificate(name: str) -> tuple[bytes, bytes]:
    """(key, certificate) PEM of a self-signed certificate nobody trusts: what a node's server
    holds until Join gives it one from the run CA."""
    # Not RunCA.create's certificate: its key usage (certificate signing only) is not one a
    # TLS server may present, and grpc then cannot even bind the port.
    key = new_key()
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name[:64]))
        .issuer_name(_name(name[:64]))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _BACKDATE)
        .not_valid_after(now + NODE_CERT_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key_pem(key), cert.public_bytes(serialization.Encoding.PEM)
