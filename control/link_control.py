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

In auto codec mode the nodes' codec choice follows: the meter sees the new speed in the
transfers themselves. Exit codes: 0 once the broker took the message, 1 when the broker
cannot be reached, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import logging
import os
import re

import aiomqtt
from google.protobuf.message import DecodeError

from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
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


def encode(bytes_per_second: float | None, *, slowdown: float | None = None) -> bytes:
    """The payload that sets `bytes_per_second` (0: no limit), or withdraws it (None), and
    sets the compute slowdown when one is given (the testnet's `profile` churn)."""
    if bytes_per_second is None and slowdown is None:
        return b""  # also what clears a retained message
    message = control_pb2.LinkControl()
    if bytes_per_second is not None:
        message.limit_bytes_per_second = check_limit(bytes_per_second)
    if slowdown is not None:
        message.compute_slowdown = check_slowdown(slowdown)
    return message.SerializeToString()


def decode(payload: bytes) -> float | None:
    """The limit a `LinkControl` payload sets (None: it withdraws); a PeerError when it
    does not parse or its limit is out of range."""
    return decode_both(payload)[0]


def decode_both(payload: bytes) -> tuple[float | None, float | None]:
    """(limit, compute slowdown) a `LinkControl` payload sets, None for what it leaves out;
    a PeerError when it does not parse or a value is out of range."""
    try:
        message = control_pb2.LinkControl.FromString(payload)
    except DecodeError as exc:
        raise PeerError(f"not a LinkControl message ({len(payload)} bytes): {exc}") from exc
    try:
        limit = (
            check_limit(message.limit_bytes_per_second)
            if message.HasField("limit_bytes_per_second")
            else None
        )
        slowdown = (
            check_slowdown(message.compute_slowdown)
            if message.HasField("compute_slowdown")
            else None
        )
    except ConfigError as exc:
        raise PeerError(str(exc)) from exc
    return limit, slowdown


class LinkSettings:
    """The send limit one node applies, from the control messages it was sent.

    Its own topic's setting wins over all's, and all's over the limit it started with.
    """

    def __init__(self, node_id: str, start_limit: float = 0.0) -> None:
        self.node_id = node_id
        self.start_limit = start_limit
        self._own: float | None = None
        self._all: float | None = None
        self._own_slowdown: float | None = None
        self._all_slowdown: float | None = None

    @property
    def limit(self) -> float:
        """Bytes per second this node may send to each peer now (0: no limit)."""
        for setting in (self._own, self._all):
            if setting is not None:
                return setting
        return self.start_limit

    @property
    def slowdown(self) -> float | None:
        """The compute slowdown the messages set (own over all); None: the node's own."""
        return self._own_slowdown if self._own_slowdown is not None else self._all_slowdown

    def on_message(self, target: str, payload: bytes) -> bool:
        """Take one message of `control/<target>`; whether it is for this node.

        A PeerError, and no change, for a malformed message. A message without a slowdown
        leaves the slowdown its topic set before.
        """
        if target not in (self.node_id, ALL):
            return False
        setting, slowdown = decode_both(payload)
        if target == ALL:
            self._all = setting
            if slowdown is not None or not payload:
                self._all_slowdown = slowdown
        else:
            self._own = setting
            if slowdown is not None or not payload:
                self._own_slowdown = slowdown
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
    slowdown: float | None = None,
) -> str:
    """Publish a retained LinkControl for `node` (or `all`); returns the topic.

    A SwarmpipeError when the broker cannot be reached or does not acknowledge in time.
    """
    topic = Topics(run_id).control(check_node(node))
    payload = encode(bytes_per_second, slowdown=slowdown)
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
    parser.add_argument("--broker", required=True, help="mqtt://host:port of the run's broker")
    parser.add_argument("--run", required=True, help="the run's id (run_id in its config)")
    parser.add_argument("--node", required=True, help=f"the node to limit, or {ALL!r}")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument(
        "--mbit", type=float, help="limit its sends to each peer to this many Mbit/s (0: none)"
    )
    what.add_argument(
        "--clear",
        action="store_true",
        help="withdraw the setting: back to the limit the node started with",
    )


async def serve(args: argparse.Namespace) -> int:
    broker = parse_broker_url(args.broker)
    if not args.run or any(c in args.run for c in "/#+ "):
        raise ConfigError(f"--run {args.run!r} must be a run id without '/', '#', '+'")
    limit = None
    if not args.clear:
        limit = check_limit(args.mbit * MBIT, what=f"--mbit {args.mbit}")
    topic = await publish(broker, args.run, args.node, limit)
    print(f"{args.node}: send limit {describe(limit)} (retained on {topic})")
    return 0
