"""The MQTT side of the control plane, shared by node and coordinator: topics and connections.

Topics live under `swarmpipe/<run_id>/`; payloads are protobuf messages from
`swarmpipe.protos.control_pb2`. Known failure modes this module works around:
- paho's sockets leave Nagle's algorithm on, which turns a 0.5 ms loopback round
  trip into ~44 ms; every client here sets TCP_NODELAY.
- amqtt (the embedded broker) sends retained messages to clients that never
  subscribed to their topics, so every consumer checks the topic itself
  (`Topics.kind_of`) instead of trusting the subscription.
"""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiomqtt

from swarmpipe.errors import ConfigError

DEFAULT_PORT = 1883


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerAddress:
    """Where the MQTT broker listens."""

    host: str
    port: int

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"


def parse_broker_url(url: str) -> BrokerAddress:
    """Parse `mqtt://host:port` (port defaults to 1883)."""
    parts = urlsplit(url)
    if parts.scheme != "mqtt" or not parts.hostname:
        raise ConfigError(f"broker URL {url!r} must look like mqtt://host:port")
    try:
        port = parts.port or DEFAULT_PORT
    except ValueError as exc:
        raise ConfigError(f"broker URL {url!r} has an invalid port") from exc
    return BrokerAddress(host=parts.hostname, port=port)


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


class _Client(aiomqtt.Client):
    """aiomqtt's client, except that a broker that drops the connection before accepting it
    fails the connect at once. aiomqtt ignores a disconnect that comes before the CONNACK
    and waits out its 10 s timeout, so a broker restarting or shedding load cost each try
    10 s. If aiomqtt changes its internals, this falls back to its own behaviour."""

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
    return _Client(
        broker.host,
        broker.port,
        identifier=client_id,
        will=will,
        keepalive=keepalive,
        socket_options=((socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),),
    )
