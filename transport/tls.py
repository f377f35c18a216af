"""TLS on the wire: gRPC and MQTT credentials built on the run CA (transport/run_ca.py), the
binding of a credential to the caller's certificate, and who may serve plaintext.

Nodes' Stage servers ask for a client certificate from the run CA (mutual TLS), and
`CertificateBinding` lets a call in only when the credential's node id (transport/auth.py)
is the common name of the certificate the caller presented: a stolen credential is of no
use without that node's key. A node's server starts before Join (its port goes into the
JoinRequest) with a throwaway self-signed certificate that no one trusts, and takes the
issued one at the next handshake after Join (`grpc.dynamic_ssl_server_credentials`). Peers
and the coordinator are dialled by IP, so channels check a fixed name
(`ssl_target_name_override`): `swarmpipe-coordinator`, `swarmpipe-node`, `swarmpipe-broker`.

Bootstrap: a node trusts the coordinator through the CA certificate it gets out of band
(`--ca-file`, copied like an SSH host key; the coordinator logs its SHA-256 fingerprint and
the node logs the one it was given, so the organiser can compare them by eye).
"""

from __future__ import annotations

import ipaddress
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from swarmpipe.transport.auth import OPEN_SERVICES, Refusal, caller_claim
from swarmpipe.transport.run_ca import (
    BROKER_NAME,
    CA_CERT_FILE,
    CA_KEY_FILE,
    COORDINATOR_NAME,
    NODE_NAME,
    RunCA,
    TLSError,
    check_node_cert,
    fingerprint,
    key_pem,
    local_names,
    new_key,
    public_pem,
    read_ca_file,
    seconds_left,
    throwaway_certificate,
    write_broker_files,
)

__all__ = [
    "BROKER_NAME",
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "COORDINATOR_NAME",
    "NODE_NAME",
    "CertificateBinding",
    "ChannelTLS",
    "NodeServerTLS",
    "RunCA",
    "TLSError",
    "check_node_cert",
    "check_plaintext",
    "fingerprint",
    "key_pem",
    "local_names",
    "mqtt_client_context",
    "new_key",
    "peer_common_name",
    "plaintext_exposure",
    "public_pem",
    "read_ca_file",
    "seconds_left",
    "server_credentials",
    "write_broker_files",
]


class _NamedContext(ssl.SSLContext):
    """An SSL context that checks one fixed server name, whatever address was dialled (paho
    passes the host it connects to; brokers are dialled by IP)."""

    expected_name = BROKER_NAME

    def wrap_socket(self, sock: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["server_hostname"] = self.expected_name
        return super().wrap_socket(sock, *args, **kwargs)


def mqtt_client_context(ca_pem: bytes) -> ssl.SSLContext:
    """TLS for an MQTT client: the run CA and the broker's fixed name, or, without a CA,
    the system's CAs and the dialled host name."""
    if not ca_pem:
        return ssl.create_default_context()
    context = _NamedContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cadata=ca_pem.decode())
    return context


# -- gRPC credentials ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class ChannelTLS:
    """How a client reaches a TLS server: the CA it trusts, its own certificate if any, and
    the name the server's certificate must carry (peers are dialled by IP)."""

    ca_pem: bytes
    target_name: str
    key_pem: bytes | None = None
    cert_pem: bytes | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca_pem, self.key_pem, self.cert_pem)

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.target_name)]


def server_credentials(key: bytes, cert: bytes) -> grpc.ServerCredentials:
    """TLS without client certificates: the coordinator (a joining node has none yet)."""
    return grpc.ssl_server_credentials([(key, cert)])


class NodeServerTLS:
    """A node's mutual-TLS server credentials, issued at Join and taken at the next handshake.

    Until `install`, the server holds a self-signed certificate and trusts only itself, so
    every handshake fails; nobody may call a node before it joined anyway.
    """

    def __init__(self, node_id: str) -> None:
        key, cert = throwaway_certificate(f"{node_id} (not joined)")
        self._initial = grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=cert
        )
        self._pending: Any = None

    def install(self, key: bytes, cert: bytes, ca_pem: bytes) -> None:
        """Serve with the issued certificate, and ask callers for one from the run CA."""
        self._pending = grpc.ssl_server_certificate_configuration(
            [(key, cert)], root_certificates=ca_pem
        )

    def _fetch(self) -> Any:
        # grpc calls this at each handshake; None keeps the configuration it has.
        pending, self._pending = self._pending, None
        return pending

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self._fetch, require_client_authentication=True
        )


# -- binding a credential to the caller's certificate -----------------------


def peer_common_name(context: grpc.aio.ServicerContext) -> str:
    """The common name of the certificate the caller presented ("" when none)."""
    values = context.auth_context().get("x509_common_name") or []
    return values[0].decode() if values else ""


class CertificateBinding(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in grpc
    """Refuses a call whose credential names another node than the caller's certificate.

    Installed after `AuthInterceptor`, which has already checked the credential; this one
    checks at call time, when the TLS peer is known (the interceptor's call details do not
    carry it)."""

    def __init__(self, verifier: Callable[[], Any]) -> None:
        self._verifier = verifier

    def _refusal(self, context: grpc.aio.ServicerContext) -> Refusal | None:
        claim = caller_claim(self._verifier(), context.invocation_metadata())
        if isinstance(claim, Refusal):
            return claim
        held = peer_common_name(context)
        if held != claim.node_id:
            return Refusal(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the credential names {claim.node_id!r} but the TLS certificate is {held!r}'s",
            )
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        return _checked(handler, self._refusal)


def _checked(
    handler: grpc.RpcMethodHandler,
    refusal: Callable[[grpc.aio.ServicerContext], Refusal | None],
) -> grpc.RpcMethodHandler:
    """`handler`, ending the call first when `refusal` gives a reason."""
    kinds = {
        (False, False): (grpc.unary_unary_rpc_method_handler, handler.unary_unary),
        (False, True): (grpc.unary_stream_rpc_method_handler, handler.unary_stream),
        (True, False): (grpc.stream_unary_rpc_method_handler, handler.stream_unary),
        (True, True): (grpc.stream_stream_rpc_method_handler, handler.stream_stream),
    }
    make, inner = kinds[(handler.request_streaming, handler.response_streaming)]

    async def respond(request: Any, context: grpc.aio.ServicerContext) -> Any:
        why = refusal(context)
        if why is not None:
            await context.abort(why.code, why.message)
        return await inner(request, context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        why = refusal(context)
        if why is not None:
            await context.abort(why.code, why.message)
        async for response in inner(request, context):
            yield response

    return make(
        stream if handler.response_streaming else respond,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


# -- who may listen without TLS ------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, an address, or one in brackets) is this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def plaintext_exposure(listening: dict[str, str]) -> list[str]:
    """The `what host:port` entries of `listening` (what -> host:port) beyond loopback."""
    return [
        f"{what} {address}"
        for what, address in listening.items()
        if not is_loopback(address.rpartition(":")[0])
    ]


def check_plaintext(listening: dict[str, str], *, insecure: bool, logger: Any) -> None:
    """Refuse to serve plaintext beyond loopback unless `--insecure`, then warn once.

    Raises TLSError (one line) naming what listens where, and the two ways out."""
    exposed = plaintext_exposure(listening)
    if not exposed:
        return
    if not insecure:
        raise TLSError(
            f"{', '.join(exposed)}: plaintext beyond this machine; use TLS (--tls, --ca-file, "
            "an mqtts:// broker) or 127.0.0.1, or give --insecure to allow it"
        )
    logger.warning(
        "--insecure: %s: plaintext beyond this machine; anyone on the path can read and "
        "replay credentials",
        ", ".join(exposed),
    )
