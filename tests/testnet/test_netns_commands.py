"""The ip/tc command lists of `testnet --netns` (testnet/netns_commands.py), built and
recorded without running any."""

from __future__ import annotations

import pytest

from swarmpipe.errors import ConfigError
from swarmpipe.testnet import netns
from swarmpipe.testnet import netns_commands as commands
from swarmpipe.testnet.netns import NetnsLab
from swarmpipe.testnet.netns_commands import Plan


def _plan() -> Plan:
    return Plan(tag="swp4242", subnet=17)


def test_names_and_addresses_carry_the_tag_and_fit_the_kernel() -> None:
    plan = _plan()
    coord, n0, n99 = plan.member("coordinator"), plan.member("n0"), plan.member("n99")
    assert (coord.netns, coord.veth, coord.address) == (
        "swp4242-coordinator",
        "swp4242v1",
        "10.77.17.1",
    )
    assert (n0.netns, n0.veth, n0.address) == ("swp4242-n0", "swp4242v2", "10.77.17.2")
    assert n99.address == "10.77.17.101"
    assert plan.bridge == "swp4242br" and plan.bridge_address == "10.77.17.254"
    # Interface names: at most 15 characters even for a 7-digit pid and node n99.
    long = Plan(tag=commands.tag_for(4194304), subnet=0)
    assert max(len(long.bridge), len(long.member("n99").veth)) <= 15


def test_node_names_outside_the_address_plan_are_refused() -> None:
    with pytest.raises(ConfigError, match="n0 to n99"):
        _plan().member("n100")
    with pytest.raises(ConfigError, match="node names"):
        _plan().member("worker")


def test_member_commands_put_eth0_in_the_namespace_on_the_bridge() -> None:
    plan = _plan()
    m = plan.member("n1")
    assert plan.member_commands(m) == [
        ["ip", "netns", "add", "swp4242-n1"],
        [
            "ip",
            "link",
            "add",
            "swp4242v3",
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            "swp4242-n1",
        ],
        ["ip", "link", "set", "swp4242v3", "master", "swp4242br", "up"],
        ["ip", "-n", "swp4242-n1", "addr", "add", "10.77.17.3/24", "dev", "eth0"],
        ["ip", "-n", "swp4242-n1", "link", "set", "lo", "up"],
        ["ip", "-n", "swp4242-n1", "link", "set", "eth0", "up"],
    ]
    assert commands.exec_prefix(m) == ["ip", "netns", "exec", "swp4242-n1"]


def test_teardown_deletes_veths_then_namespaces_then_the_bridge() -> None:
    plan = _plan()
    cmds = plan.teardown_commands([plan.member("coordinator"), plan.member("n0")])
    assert cmds == [
        ["ip", "link", "del", "swp4242v1"],
        ["ip", "link", "del", "swp4242v2"],
        ["ip", "netns", "del", "swp4242-coordinator"],
        ["ip", "netns", "del", "swp4242-n0"],
        ["ip", "link", "del", "swp4242br"],
    ]


def test_peer_class_shapes_what_goes_to_that_peer_only() -> None:
    plan = _plan()
    n0, n1 = plan.member("n0"), plan.member("n1")
    cls, flt = commands.peer_class_commands(n0, n1, 10.0, None)
    assert cls[:3] == ["tc", "-n", "swp4242-n0"]
    assert cls[3:10] == ["class", "add", "dev", "eth0", "parent", "1:", "classid"]
    assert cls[10:13] == ["1:13", "htb", "rate"]  # host 3 -> minor 0x13
    assert cls[cls.index("rate") + 1] == "10000kbit" and cls[cls.index("ceil") + 1] == "10000kbit"
    assert flt[-7:] == ["u32", "match", "ip", "dst", "10.77.17.3/32", "flowid", "1:13"]
    with_delay = commands.peer_class_commands(n0, n1, 10.0, 50.0)
    assert with_delay[-1][-9:] == [
        "parent",
        "1:13",
        "handle",
        "13:",
        "netem",
        "delay",
        "50ms",
        "limit",
        "100000",
    ]


def test_rates_bursts_and_changes() -> None:
    assert commands.rate_arg(0) == commands.UNLIMITED
    assert commands.rate_arg(2.5) == "2500kbit"
    assert commands.burst_arg(10) == "16000b"  # the floor
    assert commands.burst_arg(1000) == "1250000b"  # 10 ms at 1 Gbit/s
    plan = _plan()
    change = commands.rate_change_command(plan.member("n2"), plan.member("n0"), 0)
    assert change[3:9] == ["class", "change", "dev", "eth0", "parent", "1:"]
    assert change[change.index("rate") + 1] == commands.UNLIMITED
    root = commands.shaping_root_commands(plan.member("n2"))
    assert root[0][3:] == [
        "qdisc",
        "add",
        "dev",
        "eth0",
        "root",
        "handle",
        "1:",
        "htb",
        "default",
        "1",
    ]


def test_subnet_choice_skips_those_in_use_and_wraps() -> None:
    used = ["127.0.0.1", "10.77.5.254", "10.77.6.1", "10.78.7.1"]
    assert commands.pick_subnet(used, 5) == 7
    assert commands.pick_subnet(used, 253) == 253
    assert commands.pick_subnet([f"10.77.{k}.1" for k in range(253)], 100) == 253
    with pytest.raises(Exception, match="in use"):
        commands.pick_subnet([f"10.77.{k}.1" for k in range(254)], 0)


def test_stale_tags_are_those_of_dead_testnets_only() -> None:
    names = ["swp10-n0", "swp10br", "swp11v3", "swp12-coordinator", "eth0", "swpx", "swp13vx"]
    alive = {12}
    assert commands.stale_tags(names, lambda pid: pid in alive) == {"swp10", "swp11"}


def test_parse_class_bytes() -> None:
    text = (
        "class htb 1:13 root prio 0 rate 10Mbit ceil 10Mbit burst 16000b cburst 16000b \n"
        " Sent 5120 bytes 4 pkt (dropped 0, overlimits 0 requeues 0) \n"
        "class htb 1:1 root prio 0 rate 10Gbit ceil 10Gbit burst 0b cburst 0b \n"
        " Sent 77 bytes 1 pkt (dropped 0, overlimits 0 requeues 0) \n"
    )
    assert commands.parse_class_bytes(text) == {"1:13": 5120, "1:1": 77}


def test_lab_shapes_each_new_node_both_ways_and_churn_changes_the_rate() -> None:
    ran: list[list[str]] = []
    lab = NetnsLab(_plan(), run=ran.append, default_mbit=10.0)
    lab.set_start("n0", 10.0, 0.0)
    lab.set_start("n1", 2.0, 0.0)  # a profile's mbit:2
    lab.ensure("coordinator")
    lab.ensure("n0")
    lab.ensure("n1")
    peer_classes = [c for c in ran if c[3:5] == ["class", "add"] and c[10] != "1:1"]
    # n1 -> n0 at 2 Mbit/s, n0 -> n1 at 10; no class towards the coordinator.
    by_ns = {(c[2], c[10]): c[c.index("rate") + 1] for c in peer_classes}
    assert by_ns == {("swp4242-n1", "1:12"): "2000kbit", ("swp4242-n0", "1:13"): "10000kbit"}
    ran.clear()
    assert lab.set_rate("all", 1.0) == ["n0", "n1"]
    assert [(c[2], c[c.index("rate") + 1]) for c in ran] == [
        ("swp4242-n0", "1000kbit"),
        ("swp4242-n1", "1000kbit"),
    ]
    ran.clear()
    assert lab.set_rate("n1", None) == ["n1"]  # off: back to its start limit
    assert ran[0][ran[0].index("rate") + 1] == "2000kbit"
    assert lab.set_rate("n7", 3.0) == []  # not started: nothing to change
    lab.ensure("n7")  # started later by the churn schedule: the run's limit
    assert lab.nodes_mbit["n7"] == 10.0
    assert lab.node_flags() == ["--link-mbit", "0"]  # no netem: the sender keeps the delay


def test_netem_moves_the_delay_into_the_kernel() -> None:
    ran: list[list[str]] = []
    lab = NetnsLab(_plan(), run=ran.append, netem=True)
    lab.set_start("n0", 0.0, 50.0)
    lab.set_start("n1", 0.0, 0.0)
    lab.ensure("n0")
    lab.ensure("n1")
    netem_cmds = [c for c in ran if "netem" in c]
    assert len(netem_cmds) == 1 and netem_cmds[0][2] == "swp4242-n0"
    assert lab.node_flags() == ["--link-mbit", "0", "--latency-ms", "0"]


def test_not_root_or_not_linux_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns.sys, "platform", "darwin")
    with pytest.raises(netns.NetnsUnavailable, match="needs Linux network namespaces"):
        netns.check_available()
    monkeypatch.setattr(netns.sys, "platform", "linux")
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    with pytest.raises(netns.NetnsUnavailable, match="needs root"):
        netns.check_available()
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool == "tc" else "/x")
    with pytest.raises(netns.NetnsUnavailable, match="`tc` command"):
        netns.check_available()
