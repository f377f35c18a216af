"""`swarmpipe link-limit`: change nodes' send limits while a run goes on, over MQTT.

    swarmpipe link-limit --broker mqtt://host:1883 --run RUN --node n1 --mbit 2
    swarmpipe link-limit --broker mqtt://host:1883 --run RUN --node all --clear

publishes a retained `LinkControl` on `swarmpipe/<run>/control/<node>` (or `control/all`).
Every node follows `control/+` and applies what is addressed to it or to all: a node that
joins later finds the setting waiting. `--mbit 0` lifts a node's limit; `--clear` withdraws a
setting (and clears it from the broker), so the node goes back to the limit it started with
(`pipeline.link_mbit` or `swarmpipe node --link-mbit`, usually none). A node's own setting
wins over all's, whichever came last, so that both kinds of message may be retained at
once and still mean one thing to a node that joins and gets them in any order.

In a closed run only the organiser may publish link limits: give `--admin-token-file
<state-dir>/admin-token` (the broker login `organiser` with that token as its password).
A user the broker's ACL does not allow cannot change anyone's limit.

In auto codec mode the nodes' codec choice follows: the meter sees the new speed in the
transfers themselves. Exit codes: 0 once the broker took the message, 1 when the broker
cannot be reached, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re

import aiomqtt
from google.protobuf.message import DecodeError

from swarmpipe.control.admin import add_admin_token_argument, read_admin_token
from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
from swarmpipe.control.mqtt_acl import ORGANISER_USER
from swarmpipe.errors import ConfigError, PeerError, SwarmpipeError
from swarmpipe.protos import control_pb2
from swarmpipe.transport.limits import MBIT, check_limit

logger = logging.getLogger(__name__)

ALL = "all"
"""The node name that addresses every node of the run (no node may be called that)."""

_NODE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

PUBLISH_TIMEOUT_S = 10.0
"""How long the command waits for the broker to connect and acknowledge."""


def describe(bytes_per_second: float | None) -> str:
    """A limit as people read it: '2 Mbit/s', 'no limit', or 'cleared'."""
    if bytes_per_second is None:
        return "cleared"
    return f"{bytes_per_second / MBIT:g} Mbit/s" if bytes_per_second else "no limit"


def encode(bytes_per_second: float | None) -> bytes:
    """The payload that sets `bytes_per_second` (0: no limit), or withdraws (None)."""
    if bytes_per_second is None:
        return b""  # also what clears a retained message
    check_limit(bytes_per_second)
    message = control_pb2.LinkControl(limit_bytes_per_second=bytes_per_second)
    return message.SerializeToString()


def decode(payload: bytes) -> float | None:
    """The limit a `LinkControl` payload sets (None: it withdraws); a PeerError when it
    does not parse or its limit is out of range."""
    try:
        message = control_pb2.LinkControl.FromString(payload)
    except DecodeError as exc:
        raise PeerError(f"not a LinkControl message ({len(payload)} bytes): {exc}") from exc
    if not message.HasField("limit_bytes_per_second"):
        return None
    try:
        return check_limit(message.limit_bytes_per_second)
    except ConfigError as exc:
        raise PeerError(str(exc)) from exc


class LinkSettings:
    """The send limit one node applies, from the control messages it was sent.

    Its own topic's setting wins over all's, and all's over the limit it started with.
    """

    def __init__(self, node_id: str, start_limit: float = 0.0) -> None:
        self.node_id = node_id
        self.start_limit = start_limit
        self._own: float | None = None
        self._all: float | None = None

    @property
    def limit(self) -> float:
        """Bytes per second this node may send to each peer now (0: no limit)."""
        for setting in (self._own, self._all):
            if setting is not None:
                return setting
        return self.start_limit

    def on_message(self, target: str, payload: bytes) -> bool:
        """Take one message of `control/<target>`; whether it is for this node.

        A PeerError, and no change, for a malformed message.
        """
        if target not in (self.node_id, ALL):
            return False
        setting = decode(payload)
        if target == ALL:
            self._all = setting
        else:
            self._own = setting
        return True


def check_node(node: str) -> str:
    if not _NODE.match(node):
        raise ConfigError(
            f"--node {node!r} must be a node id (letters, digits, '_', '.', '-') or {ALL!r}"
        )
    return node


async def publish(
    broker: BrokerAddress, run_id: str, node: str, bytes_per_second: float | None
) -> str:
    """Publish a retained LinkControl for `node` (or `all`); returns the topic.

    A SwarmpipeError when the broker cannot be reached or does not acknowledge in time.
    """
    topic = Topics(run_id).control(check_node(node))
    payload = encode(bytes_per_second)
    try:
        async with make_client(broker, f"swarmpipe-link-limit-{os.getpid()}") as client:
            await client.publish(topic, payload, qos=1, retain=True, timeout=PUBLISH_TIMEOUT_S)
    except aiomqtt.MqttError as exc:
        raise SwarmpipeError(
            f"cannot publish to the broker at {broker.url}: {exc}; is it running, and is "
            "the address right?"
        ) from exc
    return topic


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--broker", required=True, help="mqtt[s]://host:port of the run's broker")
    parser.add_argument(
        "--ca-file", default="", help="the run CA (<state-dir>/ca.pem) for an mqtts:// broker"
    )
    parser.add_argument("--run", required=True, help="the run's id (run_id in its config)")
    parser.add_argument("--node", required=True, help=f"the node to limit, or {ALL!r}")
    add_admin_token_argument(parser)
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--mbit", type=float, help="limit its sends to each peer to this many Mbit/s (0: none)"
    )
    what.add_argument(
        "--clear",
        action="store_true",
        help="withdraw the setting: back to the limit the node started with",
    )


def organiser_login(broker: BrokerAddress, admin_token: str) -> BrokerAddress:
    """`broker` with the organiser's login, unless its URL names a user already."""
    if not admin_token or broker.username:
        return broker
    return dataclasses.replace(broker, username=ORGANISER_USER, password=admin_token)


async def serve(args: argparse.Namespace) -> int:
    broker = organiser_login(parse_broker_url(args.broker), read_admin_token(args.admin_token_file))
    if args.ca_file:
        from swarmpipe.transport.tls import read_ca_file

        broker = dataclasses.replace(broker, ca_pem=read_ca_file(args.ca_file))
    if not args.run or any(c in args.run for c in "/#+ "):
        raise ConfigError(f"--run {args.run!r} must be a run id without '/', '#', '+'")
    limit = None
    if not args.clear:
        limit = check_limit(args.mbit * MBIT, what=f"--mbit {args.mbit}")
    topic = await publish(broker, args.run, args.node, limit)
    print(f"{args.node}: send limit {describe(limit)} (retained on {topic})")
    return 0
