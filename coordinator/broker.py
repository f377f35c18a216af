"""The MQTT broker the coordinator embeds by default, so a testnet needs nothing installed.

amqtt runs in-process on the coordinator's event loop. It is fine for a local
swarm and small runs; a large or long-lived swarm should use mosquitto or EMQX
through `--broker mqtt://host:port`, which the project tests as well.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from amqtt.broker import Broker

from swarmpipe.control.bus import BrokerAddress
from swarmpipe.errors import SwarmpipeError

logger = logging.getLogger(__name__)

# amqtt's default plugin set also publishes $SYS statistics and logs every
# packet; the coordinator wants neither. Anonymous access on loopback only.
_PLUGINS: dict[str, Any] = {
    "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
}


class _SnapshotIterDict(dict[str, Any]):
    """A dict whose iteration walks a copy of its keys (or items).

    amqtt 0.12.1 loops over its subscription table with awaits inside the loop
    (replaying retained messages to a client that just connected, fanning a
    publish out). A subscription added meanwhile by another client raises
    "dictionary changed size during iteration", and the broker drops the
    connecting client: a node died at startup with its SUBSCRIBE unanswered.
    Iterating a snapshot makes those loops safe; a subscription that arrives
    during the loop is served by its own retained-message replay.
    """

    def __iter__(self) -> Iterator[str]:
        return iter(list(dict.keys(self)))

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return list(dict.items(self))


class EmbeddedBroker:
    """An amqtt broker bound to host:port (port 0 picks a free one)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._host = host
        self._port = port
        self._broker: Broker | None = None
        self.address: BrokerAddress | None = None

    async def start(self) -> BrokerAddress:
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"{self._host}:{self._port}"}},
            "plugins": _PLUGINS,
        }
        # amqtt logs each connection at INFO; keep the coordinator's log readable.
        logging.getLogger("amqtt").setLevel(logging.WARNING)
        logging.getLogger("transitions").setLevel(logging.WARNING)
        broker = Broker(config)
        # Broker.start() clears the table in place, so the replacement stays.
        broker._subscriptions = _SnapshotIterDict()
        try:
            await broker.start()
        except Exception as exc:
            raise SwarmpipeError(
                f"cannot start the embedded MQTT broker on {self._host}:{self._port}: {exc}"
            ) from exc
        self._broker = broker
        port = self._port
        if port == 0:
            # amqtt exposes no public accessor for the bound port.
            server = broker._servers["default"].instance
            port = int(server.sockets[0].getsockname()[1])
        self.address = BrokerAddress(host=self._host, port=port)
        logger.info("embedded MQTT broker listening on %s", self.address.url)
        return self.address

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None
