"""`swarmpipe link-limit`: change nodes' send limits and delays while a run goes on, over MQTT.

    swarmpipe link-limit --broker mqtt://host:1883 --run RUN --node n1 --mbit 2
    swarmpipe link-limit --broker mqtt://host:1883 --run RUN --node all --mbit 100 --latency-ms 50
    swarmpipe link-limit --broker mqtt://host:1883 --run RUN --node all --clear

publishes a retained `LinkControl` on `swarmpipe/<run>/control/<node>` (or `control/all`).
Every node follows `control/+` and applies what is addressed to it or to all: a node that
joins later finds the setting waiting. `--mbit 0` lifts a node's limit; `--clear` withdraws a
setting (and clears it from the broker), so the node goes back to the limit it started with
(`pipeline.link_mbit` or `swarmpipe node --link-mbit`, usually none). `--latency-ms` sets
the one-way delay the same way (`pipeline.link_latency_ms`, `--latency-ms`). A message sets
what it names and replaces its topic's earlier message; for each of the two settings a
node's own topic wins over all's, whichever came last, so that both kinds of message may be
retained at once and still mean one thing to a node that joins and gets them in any order.

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
from dataclasses import dataclass

import aiomqtt
from google.protobuf.message import DecodeError

from swarmpipe.control.admin import add_admin_token_argument, read_admin_token
from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
from swarmpipe.control.mqtt_acl import ORGANISER_USER
from swarmpipe.errors import ConfigError, PeerError, SwarmpipeError
from swarmpipe.protos import control_pb2
from swarmpipe.transport.limits import MBIT, check_latency_ms, check_limit

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


MAX_SLOWDOWN = 1000.0
"""The most a compute slowdown may be (`compute_slowdown`: 1 to this)."""


def check_slowdown(factor: float, *, what: str = "") -> float:
    """`factor` when it is a slowdown a node accepts (1 to MAX_SLOWDOWN); a ConfigError
    saying so otherwise. `what` names the setting in the message."""
    if not 1.0 <= factor <= MAX_SLOWDOWN:  # NaN fails too
        what = what or f"a compute slowdown of {factor:g}"
        raise ConfigError(
            f"{what} is out of range: give 1 to {MAX_SLOWDOWN:g} (how many times slower than "
            "the machine computes)"
        )
    return factor


@dataclass(frozen=True, slots=True)
class LinkSetting:
    """What one control message sets; a field left None falls through to all's or the start."""

    limit: float | None = None
    """Send limit in bytes per second (0: no limit)."""
    latency_ms: float | None = None
    """One-way delay in ms (0: none)."""
    slowdown: float | None = None
    """Compute slowdown, the testnet's `profile NODE=slow:F` churn (1: the machine's speed)."""


def encode(
    bytes_per_second: float | None,
    *,
    latency_ms: float | None = None,
    slowdown: float | None = None,
) -> bytes:
    """The payload that sets `bytes_per_second` (0: no limit), `latency_ms` and/or the
    compute `slowdown`, or withdraws the topic's setting (all None)."""
    if bytes_per_second is None and latency_ms is None and slowdown is None:
        return b""  # also what clears a retained message
    message = control_pb2.LinkControl()
    if bytes_per_second is not None:
        message.limit_bytes_per_second = check_limit(bytes_per_second)
    if latency_ms is not None:
        message.latency_ms = check_latency_ms(latency_ms)
    if slowdown is not None:
        message.compute_slowdown = check_slowdown(slowdown)
    return message.SerializeToString()


def decode(payload: bytes) -> LinkSetting | None:
    """What a `LinkControl` payload sets (None: it withdraws); a PeerError when it does not
    parse or a value is out of range."""
    try:
        message = control_pb2.LinkControl.FromString(payload)
    except DecodeError as exc:
        raise PeerError(f"not a LinkControl message ({len(payload)} bytes): {exc}") from exc
    has_limit = message.HasField("limit_bytes_per_second")
    has_latency = message.HasField("latency_ms")
    has_slowdown = message.HasField("compute_slowdown")
    if not (has_limit or has_latency or has_slowdown):
        return None
    try:
        return LinkSetting(
            limit=check_limit(message.limit_bytes_per_second) if has_limit else None,
            latency_ms=check_latency_ms(message.latency_ms) if has_latency else None,
            slowdown=check_slowdown(message.compute_slowdown) if has_slowdown else None,
        )
    except ConfigError as exc:
        raise PeerError(str(exc)) from exc


class LinkSettings:
    """The send limit and delay one node applies, from the control messages it was sent.

    For each, its own topic's setting wins over all's, and all's over what it started with.
    """

    def __init__(
        self, node_id: str, start_limit: float = 0.0, start_latency_ms: float = 0.0
    ) -> None:
        self.node_id = node_id
        self.start_limit = start_limit
        self.start_latency_ms = start_latency_ms
        self._own: LinkSetting | None = None
        self._all: LinkSetting | None = None

    @property
    def limit(self) -> float:
        """Bytes per second this node may send to each peer now (0: no limit)."""
        for setting in (self._own, self._all):
            if setting is not None and setting.limit is not None:
                return setting.limit
        return self.start_limit

    @property
    def latency_ms(self) -> float:
        """One-way delay in ms on what this node sends to each peer now (0: none)."""
        for setting in (self._own, self._all):
            if setting is not None and setting.latency_ms is not None:
                return setting.latency_ms
        return self.start_latency_ms

    @property
    def slowdown(self) -> float | None:
        """The compute slowdown the messages set (own over all); None: the node's own."""
        for setting in (self._own, self._all):
            if setting is not None and setting.slowdown is not None:
                return setting.slowdown
        return None

    def on_message(self, target: str, payload: bytes) -> bool:
        """Take one message of `control/<target>`; whether it is for this node.

        A PeerError, and no change, for a malformed message. A message that names no
        slowdown keeps the one its topic set before (a `link` event after a `profile`
        event changes the limit, not the node's speed); an empty one withdraws it all.
        """
        if target not in (self.node_id, ALL):
            return False
        setting = decode(payload)
        previous = self._all if target == ALL else self._own
        if setting is not None and setting.slowdown is None and previous is not None:
            setting = dataclasses.replace(setting, slowdown=previous.slowdown)
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
    broker: BrokerAddress,
    run_id: str,
    node: str,
    bytes_per_second: float | None,
    *,
    latency_ms: float | None = None,
    slowdown: float | None = None,
) -> str:
    """Publish a retained LinkControl for `node` (or `all`); returns the topic.

    A SwarmpipeError when the broker cannot be reached or does not acknowledge in time.
    """
    topic = Topics(run_id).control(check_node(node))
    payload = encode(bytes_per_second, latency_ms=latency_ms, slowdown=slowdown)
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
    parser.add_argument(
        "--mbit", type=float, help="limit its sends to each peer to this many Mbit/s (0: none)"
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        help="delay its sends to each peer by this many ms one way (0: none)",
    )
    parser.add_argument(
        "--clear",
        action="store_true",
        help="withdraw the setting: back to the limit and delay the node started with",
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
    named = args.mbit is not None or args.latency_ms is not None
    if args.clear == named:
        raise ConfigError("give --mbit and/or --latency-ms, or --clear alone")
    limit = latency_ms = None
    if args.mbit is not None:
        limit = check_limit(args.mbit * MBIT, what=f"--mbit {args.mbit}")
    if args.latency_ms is not None:
        latency_ms = check_latency_ms(args.latency_ms, what=f"--latency-ms {args.latency_ms:g}")
    topic = await publish(broker, args.run, args.node, limit, latency_ms=latency_ms)
    if args.clear:
        print(f"{args.node}: link setting cleared (on {topic})")
    else:
        said = [f"send limit {describe(limit)}"] if limit is not None else []
        said += [f"delay {latency_ms:g} ms"] if latency_ms is not None else []
        print(f"{args.node}: {', '.join(said)} (retained on {topic})")
    return 0
