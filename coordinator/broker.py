"""The MQTT broker the coordinator embeds by default, so a testnet needs nothing installed.

amqtt runs in-process on the coordinator's event loop. It is fine for a local
swarm and small runs; a large or long-lived swarm should use mosquitto or EMQX
through `--broker mqtt://host:port`, which the project tests as well.

In a closed run (coordinator/admission.py) it refuses anonymous clients: a node logs in
with its node id and the password the coordinator derived for it from the run key (given
at Join), the coordinator and the organiser with theirs, and `control/mqtt_acl.py` decides
what each may publish and read. A publish the ACL refuses is dropped (amqtt acknowledges
it and tells no subscriber). An open loopback run keeps anonymous access.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from swarmpipe.control.bus import BrokerAddress
from swarmpipe.control.mqtt_acl import ORGANISER_USER, may_publish, may_read
from swarmpipe.errors import SwarmpipeError
from swarmpipe.transport.auth import mqtt_password

logger = logging.getLogger(__name__)

# amqtt's default plugin set also publishes $SYS statistics and logs every
# packet; the coordinator wants neither. Anonymous access on loopback only.
_PLUGINS: dict[str, Any] = {
    "amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True},
}


@dataclass(frozen=True, kw_only=True, slots=True)
class BrokerAuth:
    """The logins and ACL of a closed run's embedded broker."""

    run_id: str
    mqtt_key: bytes
    """The run's MQTT key: a user's password is `mqtt_password(mqtt_key, user)`."""
    organiser_password: str
    """The admin token: the `organiser` user's password."""

    def password_ok(self, username: str | None, password: str | None) -> bool:
        if not username or password is None:
            return False
        if username == ORGANISER_USER:
            expected = self.organiser_password
        else:
            expected = mqtt_password(self.mqtt_key, username)
        return hmac.compare_digest(password.encode(), expected.encode())


class RunLoginPlugin(BaseAuthPlugin):  # type: ignore[misc]  # amqtt is untyped here
    """Admits a client only with a run login (no anonymous clients)."""

    @dataclass
    class Config:
        run_id: str
        mqtt_key_hex: str
        organiser_password: str

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        c = self.context.config
        self.auth = BrokerAuth(
            run_id=c.run_id,
            mqtt_key=bytes.fromhex(c.mqtt_key_hex),
            organiser_password=c.organiser_password,
        )

    async def authenticate(self, *, session: Session) -> bool:
        ok = self.auth.password_ok(session.username, session.password)
        if not ok:
            logger.warning(
                "MQTT client %r refused: %s",
                session.client_id,
                "no user name"
                if not session.username
                else f"wrong password for {session.username!r}",
            )
        return ok


class RunTopicPlugin(BaseTopicPlugin):  # type: ignore[misc]  # amqtt is untyped here
    """Applies control/mqtt_acl.py to every publish, subscribe and delivery."""

    @dataclass
    class Config:
        run_id: str

    async def topic_filtering(
        self,
        *,
        session: Session | None = None,
        topic: str | None = None,
        action: Action | None = None,
    ) -> bool:
        user = (session.username if session else None) or ""
        if topic is None:
            return False
        run_id = self.context.config.run_id
        if action == Action.PUBLISH:
            allowed = may_publish(user, topic, run_id)
            if not allowed:
                logger.warning("MQTT user %r may not publish to %s: dropped", user, topic)
            return allowed
        return may_read(user, topic, run_id)


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

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        auth: BrokerAuth | None = None,
        tls_files: tuple[str, str] | None = None,
    ) -> None:
        self._host = host
        self._port = port
        self._auth = auth
        self._tls_files = tls_files
        """(certificate, key) PEM files: serve MQTT over TLS only (transport/tls.py)."""
        self._broker: Broker | None = None
        self.address: BrokerAddress | None = None

    async def start(self) -> BrokerAddress:
        plugins = _PLUGINS
        if self._auth is not None:
            plugins = {
                f"{__name__}.RunLoginPlugin": {
                    "run_id": self._auth.run_id,
                    "mqtt_key_hex": self._auth.mqtt_key.hex(),
                    "organiser_password": self._auth.organiser_password,
                },
                f"{__name__}.RunTopicPlugin": {"run_id": self._auth.run_id},
            }
        listener: dict[str, Any] = {"type": "tcp", "bind": f"{self._host}:{self._port}"}
        if self._tls_files is not None:
            listener.update(ssl=True, certfile=self._tls_files[0], keyfile=self._tls_files[1])
        config = {"listeners": {"default": listener}, "plugins": plugins}
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
        self.address = BrokerAddress(host=self._host, port=port, tls=self._tls_files is not None)
        logger.info("embedded MQTT broker listening on %s", self.address.url)
        return self.address

    async def stop(self) -> None:
        if self._broker is not None:
            await self._broker.shutdown()
            self._broker = None
