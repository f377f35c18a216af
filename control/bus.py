"""The MQTT side of the control plane, shared by node and coordinator: topics and connections.

Topics live under `swarmpipe/<run_id>/`; payloads are protobuf messages from
`swarmpipe.protos.control_pb2`. Known failure modes this module works around:
- paho's sockets leave Nagle's algorithm on, which turns a 0.5 ms loopback round
  trip into ~44 ms; every client here sets TCP_NODELAY.
- amqtt (the embedded broker) sends retained messages to clients that never
  subscribed to their topics, so every consumer checks the topic itself
  (`Topics.kind_of`) instead of trusting the subscription.

Credentials for a broker that asks for them (mosquitto with `allow_anonymous false`, as in
deploy/compose.yaml) come from `mqtt://user:password@host:port` or, to keep the password out
of `ps` and shell history, from the environment: `SWARMPIPE_BROKER_USERNAME` when the URL
names no user, and the password from the file named by `SWARMPIPE_BROKER_PASSWORD_FILE` or
else from `SWARMPIPE_BROKER_PASSWORD` when the URL carries none. `BrokerAddress.url` never
includes them, because the coordinator hands its URL to every node in JoinReply: each node
brings its own credentials.

`mqtts://host:port` (default port 8883) is MQTT over TLS. With the run CA in
`BrokerAddress.ca_pem` (a `--tls` run: the embedded broker's certificate, or mosquitto's from
`swarmpipe broker-config`), the client trusts only that CA and checks the name
`swarmpipe-broker` whatever address it dialled, as gRPC does with `swarmpipe-coordinator`;
without it, the system's CAs and the host name, as for any public broker.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiomqtt

from swarmpipe.errors import ConfigError

DEFAULT_PORT = 1883
DEFAULT_TLS_PORT = 8883
USERNAME_ENV = "SWARMPIPE_BROKER_USERNAME"
PASSWORD_ENV = "SWARMPIPE_BROKER_PASSWORD"
PASSWORD_FILE_ENV = "SWARMPIPE_BROKER_PASSWORD_FILE"
# MQTT CONNACK reason codes (v5 numbering, which paho also uses for v3.1.1's 4 and 5) that
# mean the credentials, not the broker's health, are the problem: retrying will not help.
# mosquitto answers a wrong password with 135 (v3.1.1's 5), not 134.
_AUTH_REFUSED = {
    134: "bad user name or password",
    135: "not authorized (a wrong password, or a user it does not know)",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerAddress:
    """Where the MQTT broker listens, and who we are to it (no user: anonymous)."""

    host: str
    port: int
    username: str = ""
    password: str = field(default="", repr=False)
    tls: bool = False
    """MQTT over TLS (`mqtts://`)."""
    ca_pem: bytes = field(default=b"", repr=False)
    """The run CA to trust for TLS (empty: the system's CAs)."""

    @property
    def url(self) -> str:
        """`mqtt[s]://host:port`, without credentials: safe to log and to send to nodes."""
        return f"{'mqtts' if self.tls else 'mqtt'}://{self.host}:{self.port}"


def parse_broker_url(url: str, environ: Mapping[str, str] | None = None) -> BrokerAddress:
    """Parse `mqtt[s]://[user[:password]@]host[:port]` (port defaults to 1883, 8883 for TLS).

    A user or password the URL leaves out is taken from `environ` (default: os.environ),
    as the module docstring says; userinfo may be percent-encoded (`%40` for `@`).
    """
    env = os.environ if environ is None else environ
    parts = urlsplit(url)
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname:
        raise ConfigError(f"broker URL {url!r} must look like mqtt://host:port or mqtts://")
    tls = parts.scheme == "mqtts"
    try:
        port = parts.port or (DEFAULT_TLS_PORT if tls else DEFAULT_PORT)
    except ValueError as exc:
        raise ConfigError(f"broker URL {url!r} has an invalid port") from exc
    username = unquote(parts.username) if parts.username else env.get(USERNAME_ENV, "")
    if parts.password is not None:
        password = unquote(parts.password)
    elif env.get(PASSWORD_FILE_ENV):
        path = Path(env[PASSWORD_FILE_ENV])
        try:
            password = path.read_text().rstrip("\r\n")
        except OSError as exc:
            raise ConfigError(
                f"{PASSWORD_FILE_ENV}={path}: cannot read the broker password ({exc.strerror})"
            ) from exc
    else:
        password = env.get(PASSWORD_ENV, "")
    if password and not username:
        # MQTT has no password without a user name; sending none would look like a
        # broker that refuses us for no reason.
        raise ConfigError(
            f"a broker password is set but no user name: give mqtt://USER@{parts.hostname}:"
            f"{port} or set {USERNAME_ENV}"
        )
    return BrokerAddress(
        host=parts.hostname, port=port, username=username, password=password, tls=tls
    )


@dataclass(frozen=True, slots=True)
class Topics:
    """Topic names of one run."""

    run_id: str

    @property
    def root(self) -> str:
        return f"swarmpipe/{self.run_id}"

    @property
    def plan(self) -> str:
        return f"{self.root}/plan"

    @property
    def step(self) -> str:
        return f"{self.root}/step"

    def presence(self, node_id: str = "+") -> str:
        return f"{self.root}/presence/{node_id}"

    def telemetry(self, node_id: str = "+") -> str:
        return f"{self.root}/telemetry/{node_id}"

    def control(self, node_id: str = "+") -> str:
        """Where `LinkControl` for `node_id` goes; `control("all")` reaches every node."""
        return f"{self.root}/control/{node_id}"

    def kind_of(self, topic: str) -> tuple[str, str] | None:
        """Classify a received topic as (kind, node_id); None if it is not this run's."""
        prefix = self.root + "/"
        if not topic.startswith(prefix):
            return None
        rest = topic[len(prefix) :].split("/")
        if rest == ["plan"]:
            return ("plan", "")
        if rest == ["step"]:
            return ("step", "")
        if len(rest) == 2 and rest[0] in ("presence", "telemetry", "control") and rest[1]:
            return (rest[0], rest[1])
        return None


class BrokerAuthError(aiomqtt.MqttError):
    """The broker refused our user name and password, or refused us without any."""


class _Client(aiomqtt.Client):
    """aiomqtt's client, except that a broker that drops the connection before accepting it
    fails the connect at once, and one that refuses our credentials says so in words.
    aiomqtt ignores a disconnect that comes before the CONNACK and waits out its 10 s
    timeout, so a broker restarting or shedding load cost each try 10 s. If aiomqtt changes
    its internals, this falls back to its own behaviour."""

    def __init__(self, *args: Any, username: str | None, **kwargs: Any) -> None:
        super().__init__(*args, username=username, **kwargs)
        self._auth_user = username

    def _on_connect(
        self, client: Any, userdata: Any, flags: Any, reason_code: Any, *rest: Any
    ) -> None:
        connected = getattr(self, "_connected", None)
        reason = _AUTH_REFUSED.get(getattr(reason_code, "value", -1))
        if reason and isinstance(connected, asyncio.Future) and not connected.done():
            who = (
                f"user {self._auth_user!r}"
                if self._auth_user
                else f"an anonymous client (set {USERNAME_ENV} and {PASSWORD_ENV}, "
                "or give mqtt://USER@host:port)"
            )
            connected.set_exception(BrokerAuthError(f"the broker refused {who}: {reason}"))
            return
        super()._on_connect(client, userdata, flags, reason_code, *rest)

    def _on_disconnect(self, client: Any, userdata: Any, *args: Any, **kwargs: Any) -> None:
        connected = getattr(self, "_connected", None)
        if isinstance(connected, asyncio.Future) and not connected.done():
            reason = args[1] if len(args) > 1 else kwargs.get("reason_code", "?")
            connected.set_exception(
                aiomqtt.MqttError(
                    f"the broker closed the connection before accepting it ({reason})"
                )
            )
            return
        super()._on_disconnect(client, userdata, *args, **kwargs)


def make_client(
    broker: BrokerAddress,
    client_id: str,
    *,
    will: aiomqtt.Will | None = None,
    keepalive: int = 5,
) -> aiomqtt.Client:
    """An aiomqtt client with TCP_NODELAY and a short keepalive.

    The keepalive bounds how long a silently vanished peer (pulled cable) stays
    "online": the broker fires its Last Will after 1.5 keepalive periods.
    """
    tls_context = None
    if broker.tls:
        # Imported here: transport.tls imports grpc, which an MQTT-only command need not load.
        from swarmpipe.transport.tls import mqtt_client_context

        tls_context = mqtt_client_context(broker.ca_pem)
    return _Client(
        broker.host,
        broker.port,
        identifier=client_id,
        username=broker.username or None,
        password=broker.password or None,
        will=will,
        keepalive=keepalive,
        socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
        tls_context=tls_context,
    )
