"""Link control messages: what a node makes of them, and the link-limit command's arguments."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest

from swarmpipe.cli import build_parser
from swarmpipe.control.bus import Topics
from swarmpipe.control.link_control import (
    ALL,
    LinkSetting,
    LinkSettings,
    decode,
    describe,
    encode,
)
from swarmpipe.errors import ConfigError, PeerError
from swarmpipe.protos import control_pb2
from swarmpipe.transport.limits import MBIT


def test_control_topics_are_per_node_and_all() -> None:
    topics = Topics("r1")
    assert topics.control("n1") == "swarmpipe/r1/control/n1"
    assert topics.control() == "swarmpipe/r1/control/+"
    assert topics.kind_of(topics.control(ALL)) == ("control", "all")
    assert topics.kind_of("swarmpipe/r1/control/") is None
    assert topics.kind_of("swarmpipe/other/control/n1") is None


def test_messages_round_trip_and_clearing_is_the_empty_payload() -> None:
    assert decode(encode(2 * MBIT)) == LinkSetting(limit=2 * MBIT)
    # no limit, which is not the same as withdrawn
    assert decode(encode(0.0)) == LinkSetting(limit=0.0)
    assert encode(0.0) != b""
    assert encode(None) == b"" and decode(b"") is None
    assert decode(encode(None, latency_ms=80)) == LinkSetting(latency_ms=80.0)
    assert decode(encode(MBIT, latency_ms=0.0)) == LinkSetting(limit=MBIT, latency_ms=0.0)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xff\xff\xff", "not a LinkControl message"),
        (control_pb2.LinkControl(limit_bytes_per_second=-5).SerializeToString(), "out of range"),
        (control_pb2.LinkControl(limit_bytes_per_second=1e20).SerializeToString(), "out of range"),
        (
            control_pb2.LinkControl(limit_bytes_per_second=float("nan")).SerializeToString(),
            "out of range",
        ),
        (control_pb2.LinkControl(latency_ms=-1).SerializeToString(), "out of range"),
        (control_pb2.LinkControl(latency_ms=1e6).SerializeToString(), "out of range"),
    ],
)
def test_a_bad_message_is_a_peer_error_and_changes_nothing(payload: bytes, message: str) -> None:
    settings = LinkSettings("n1", start_limit=MBIT)
    settings.on_message(ALL, encode(3 * MBIT))
    with pytest.raises(PeerError, match=message):
        settings.on_message("n1", payload)
    assert settings.limit == 3 * MBIT


def test_own_setting_wins_over_all_whatever_the_order() -> None:
    for order in (("n1", ALL), (ALL, "n1")):
        settings = LinkSettings("n1", start_limit=10 * MBIT)
        values = {"n1": 2 * MBIT, ALL: 0.5 * MBIT}
        for target in order:
            assert settings.on_message(target, encode(values[target]))
        assert settings.limit == 2 * MBIT
    assert not settings.on_message("n2", encode(MBIT))  # another node's
    assert not settings.on_message("n2", b"garbage")  # not even looked at
    settings.on_message("n1", encode(None))  # withdrawn: all's applies again
    assert settings.limit == 0.5 * MBIT
    settings.on_message(ALL, encode(None))  # and then the limit it started with
    assert settings.limit == 10 * MBIT
    settings.on_message("n1", encode(0.0))  # lifted outright
    assert settings.limit == 0.0


def test_delay_and_limit_fall_through_each_on_its_own() -> None:
    settings = LinkSettings("n1", start_limit=10 * MBIT, start_latency_ms=5.0)
    settings.on_message(ALL, encode(2 * MBIT, latency_ms=50.0))
    settings.on_message("n1", encode(None, latency_ms=120.0))  # a far node: its own delay
    assert (settings.limit, settings.latency_ms) == (2 * MBIT, 120.0)
    settings.on_message(ALL, encode(None))
    assert (settings.limit, settings.latency_ms) == (10 * MBIT, 120.0)
    settings.on_message("n1", encode(MBIT))  # replaces its topic's earlier message
    assert (settings.limit, settings.latency_ms) == (MBIT, 5.0)


def test_describe() -> None:
    assert (describe(2 * MBIT), describe(0.0), describe(None)) == (
        "2 Mbit/s",
        "no limit",
        "cleared",
    )


def _link_limit(*args: str) -> int:
    """Run `swarmpipe link-limit` in this process, as cli.main would (minus logging)."""
    parsed = build_parser().parse_args(
        ["link-limit", "--broker", "mqtt://127.0.0.1:9", "--run", "r1", *args]
    )
    return int(asyncio.run(parsed.serve(parsed)))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--node", "n1", "--mbit", "-1"], "--mbit -1.0 is out of range"),
        (["--node", "n1", "--mbit", "1e9"], "--mbit 1000000000.0 is out of range"),
        (["--node", "n/1", "--mbit", "1"], "--node 'n/1' must be a node id"),
        (["--node", "n1", "--latency-ms", "-5"], "--latency-ms -5 is out of range"),
        (["--node", "n1", "--mbit", "1", "--clear"], "give --mbit and/or --latency-ms, or"),
        (["--node", "n1"], "give --mbit and/or --latency-ms, or --clear alone"),
    ],
)
def test_link_limit_refuses_bad_values_before_connecting(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _link_limit(*args)


def test_link_limit_says_when_the_broker_is_unreachable() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "link-limit", "--broker", "mqtt://127.0.0.1:9",
         "--run", "r1", "--node", "all", "--clear"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1 and "cannot publish to the broker at mqtt://127.0.0.1:9" in (
        done.stderr
    ), done.stderr


def test_a_slowdown_travels_beside_the_limit_and_stays_until_withdrawn() -> None:
    settings = LinkSettings("n1", start_limit=10 * MBIT)
    assert settings.slowdown is None
    settings.on_message("n1", encode(2 * MBIT, slowdown=3.0))
    assert (settings.limit, settings.slowdown) == (2 * MBIT, 3.0)
    settings.on_message(ALL, encode(None, slowdown=5.0))
    assert settings.slowdown == 3.0  # its own topic's wins
    settings.on_message("n1", encode(MBIT))  # a plain link limit keeps the slowdown
    assert (settings.limit, settings.slowdown) == (MBIT, 3.0)
    settings.on_message("n1", encode(None))  # the empty message withdraws both
    assert (settings.limit, settings.slowdown) == (10 * MBIT, 5.0)
    with pytest.raises(PeerError, match="out of range"):
        settings.on_message("n1", control_pb2.LinkControl(compute_slowdown=0.5).SerializeToString())
    with pytest.raises(ConfigError, match="out of range"):
        encode(None, slowdown=2000.0)
