"""gRPC plumbing shared by every server and client: options, health, reflection.

Every swarmpipe server exposes the standard health service and server
reflection, so `grpcurl` and load balancers can talk to it without our protos.
Every service, ours and these two, is registered through
`request_parsing.add_servicer`, so a request that does not parse is
INVALID_ARGUMENT and one rate-limited log line, never a traceback.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

from swarmpipe.transport.auth import AuthInterceptor, CredentialHolder
from swarmpipe.transport.peer_limits import PeerLimiter
from swarmpipe.transport.request_parsing import add_servicer
from swarmpipe.transport.tls import ChannelTLS

# Tensors travel as 1 MiB chunks, so no message comes near these limits; they
# are raised a little above gRPC's 4 MiB default only to leave room for headers.
MAX_MESSAGE_BYTES = 8 * 1024 * 1024

CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Detect a dead peer on an idle channel within ~30 s instead of hours.
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

SERVER_OPTIONS: list[tuple[str, int]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
]


def create_server(
    auth: AuthInterceptor | None = None,
    *more: grpc.aio.ServerInterceptor,
    limiter: PeerLimiter | None = None,
) -> grpc.aio.Server:
    """A server with the project's options; `limiter` holds each peer to its limits (first,
    so calls the credential check refuses count too), `auth` checks every caller but the
    open services, then `more` (transport/tls.py's certificate binding) in turn."""
    interceptors = [i for i in (limiter, auth, *more) if i is not None]
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors or None)


async def enable_health_and_reflection(
    server: grpc.aio.Server, service_names: list[str]
) -> health.aio.HealthServicer:
    """Register the health service (all SERVING) and reflection for these services."""
    servicer = health.aio.HealthServicer()
    # Registered like our own services, so bytes that do not parse cost one line here too
    # rather than a traceback each (grpc's default; they are on every server, unauthenticated).
    add_servicer(server, servicer, health_pb2.DESCRIPTOR.services_by_name["Health"])
    for name in ["", *service_names]:
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    names = [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME]
    add_servicer(
        server,
        reflection.aio.ReflectionServicer(names),
        reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"],
    )
    return servicer


def bind(
    server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None
) -> int:
    """Bind host:port (port 0 picks a free one), with TLS when `credentials` are given, and
    return the bound port."""
    if credentials is None:
        port = server.add_insecure_port(listen)
    else:
        port = server.add_secure_port(listen, credentials)
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is in use or invalid")
    return int(port)


def open_channel(
    target: str, credential: CredentialHolder | None = None, tls: ChannelTLS | None = None
) -> grpc.aio.Channel:
    """A channel to `target` with the project's options, over TLS when `tls` is given; its
    calls carry what `credential` holds at the time of each call."""
    interceptors = credential.interceptors() if credential is not None else None
    if tls is None:
        return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        target,
        tls.credentials(),
        options=[*CHANNEL_OPTIONS, *tls.options()],
        interceptors=interceptors,
    )
