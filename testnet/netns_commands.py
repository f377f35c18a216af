"""The names, addresses and ip/tc command lists of a namespace testnet (testnet/netns.py).

Pure functions, no I/O: what `NetnsLab` runs is built here, so it is unit-tested without
root. Layout: a bridge `swp<pid>br` (address .254) in the root namespace; per daemon a
namespace `swp<pid>-NAME` whose `eth0` pairs with `swp<pid>v<host>` on the bridge, at
10.77.SUBNET.HOST (coordinator .1, node nK .K+2). Shaping: an htb root on each node's eth0,
one class per peer node (minor 0x10 + the peer's host, u32 match on its address), the
default class 1:1 unshaped, and a netem leaf per class for a delay where the kernel has it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from swarmpipe.errors import ConfigError, SwarmpipeError

PREFIX = "swp"
NET = "10.77"
BRIDGE_HOST = 254
COORDINATOR_HOST = 1
MAX_NODES = 100
UNLIMITED = "10gbit"
"""The rate of a class with no limit: far above what a veth on this machine carries."""
TAG_PATTERN = re.compile(rf"^{PREFIX}(\d+)(?:-|br$|v\d+$)")


def tag_for(pid: int) -> str:
    return f"{PREFIX}{pid}"


def address(subnet: int, host: int) -> str:
    return f"{NET}.{subnet}.{host}"


def host_index(name: str, coordinator: str) -> int:
    """A daemon's host number on the /24: the coordinator .1, node nK .K+2."""
    if name == coordinator:
        return COORDINATOR_HOST
    match = re.fullmatch(r"n(\d+)", name)
    if match is None or int(match.group(1)) >= MAX_NODES:
        raise ConfigError(f"--netns: node names are n0 to n{MAX_NODES - 1}; got {name!r}")
    return int(match.group(1)) + 2


def pick_subnet(used: Iterable[str], start: int) -> int:
    """The first /24 of 10.77.0.0/16 from `start` on (wrapping) that no address in `used`
    (dotted quads already on this machine) is in."""
    taken = set()
    for addr in used:
        parts = addr.split(".")
        if len(parts) == 4 and f"{parts[0]}.{parts[1]}" == NET:
            taken.add(int(parts[2]))
    for offset in range(254):
        subnet = (start + offset) % 254
        if subnet not in taken:
            return subnet
    raise SwarmpipeError(f"--netns: every /24 of {NET}.0.0/16 is in use on this machine")


def stale_tags(names: Iterable[str], alive: Callable[[int], bool]) -> set[str]:
    """Tags (`swp<pid>`) among namespace and link names whose testnet pid is no longer alive."""
    found = set()
    for name in names:
        match = TAG_PATTERN.match(name)
        if match is not None and not alive(int(match.group(1))):
            found.add(tag_for(int(match.group(1))))
    return found


@dataclass(frozen=True, slots=True)
class Member:
    """One daemon's namespace: its name, namespace, root-side veth and address."""

    name: str
    netns: str
    veth: str
    address: str
    host: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Names and addresses of one namespace testnet, and the ip/tc commands that build it."""

    tag: str
    subnet: int
    coordinator: str = "coordinator"

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def bridge_address(self) -> str:
        return address(self.subnet, BRIDGE_HOST)

    def member(self, name: str) -> Member:
        host = host_index(name, self.coordinator)
        return Member(
            name=name,
            netns=f"{self.tag}-{name}",
            veth=f"{self.tag}v{host}",
            address=address(self.subnet, host),
            host=host,
        )

    def bridge_commands(self) -> list[list[str]]:
        return [
            ["ip", "link", "add", self.bridge, "type", "bridge"],
            ["ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge],
            ["ip", "link", "set", self.bridge, "up"],
        ]

    def member_commands(self, m: Member) -> list[list[str]]:
        """Namespace, veth pair (eth0 inside), address, links up."""
        ns = ["ip", "-n", m.netns]
        return [
            ["ip", "netns", "add", m.netns],
            ["ip", "link", "add", m.veth, "type", "veth", "peer", "name", "eth0", "netns", m.netns],
            ["ip", "link", "set", m.veth, "master", self.bridge, "up"],
            [*ns, "addr", "add", f"{m.address}/24", "dev", "eth0"],
            [*ns, "link", "set", "lo", "up"],
            [*ns, "link", "set", "eth0", "up"],
        ]

    def teardown_commands(self, members: Iterable[Member]) -> list[list[str]]:
        """Deleting the root-side veth takes its peer with it at once (a deleted namespace
        frees its veth only later); then the namespaces, then the bridge."""
        members = list(members)
        cmds = [["ip", "link", "del", m.veth] for m in members]
        cmds += [["ip", "netns", "del", m.netns] for m in members]
        cmds.append(["ip", "link", "del", self.bridge])
        return cmds


def exec_prefix(m: Member) -> list[str]:
    """What goes before a daemon's command line to run it in its namespace. `ip netns exec`
    execs the command in its own process, so PR_SET_PDEATHSIG and the pid stay the child's."""
    return ["ip", "netns", "exec", m.netns]


def class_id(host: int) -> str:
    """The htb class of traffic to peer host `host` (tc minor numbers are hex)."""
    return f"1:{host + 0x10:x}"


def rate_arg(mbit: float) -> str:
    """tc's spelling of a rate; 0 Mbit/s means no limit."""
    return UNLIMITED if mbit <= 0 else f"{mbit * 1000:.0f}kbit"


def burst_arg(mbit: float) -> str:
    """10 ms of the rate, at least 16 KB: enough for the kernel's timer, small beside the
    tensors a link carries, so the rate holds over a transfer."""
    bytes_ = 16_000 if mbit <= 0 else max(16_000, int(mbit * 1e6 / 8 * 0.01))
    return f"{bytes_}b"


def tc_in(m: Member, *args: str) -> list[str]:
    """A tc command run in the member's namespace."""
    return ["tc", "-n", m.netns, *args]


def _htb_rate(mbit: float) -> list[str]:
    rate, burst = rate_arg(mbit), burst_arg(mbit)
    return ["rate", rate, "ceil", rate, "burst", burst, "cburst", burst]


def shaping_root_commands(m: Member) -> list[list[str]]:
    """htb root on the node's eth0; unclassified traffic (coordinator, testnet) unshaped."""
    return [
        tc_in(m, "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "htb", "default", "1"),
        tc_in(
            m, "class", "add", "dev", "eth0", "parent", "1:", "classid", "1:1", "htb", *_htb_rate(0)
        ),
    ]


def peer_class_commands(
    m: Member, peer: Member, mbit: float, delay_ms: float | None
) -> list[list[str]]:
    """The class for what `m` sends to `peer`: its rate, a filter on the peer's address, and
    a netem leaf for the delay when `delay_ms` is given (the kernel has netem)."""
    cid = class_id(peer.host)
    match = ["u32", "match", "ip", "dst", f"{peer.address}/32", "flowid", cid]
    cmds = [
        tc_in(
            m,
            "class",
            "add",
            "dev",
            "eth0",
            "parent",
            "1:",
            "classid",
            cid,
            "htb",
            *_htb_rate(mbit),
        ),
        tc_in(
            m, "filter", "add", "dev", "eth0", "parent", "1:", "protocol", "ip", "prio", "1", *match
        ),
    ]
    if delay_ms is not None:
        cmds.append(netem_command(m, peer, delay_ms, "add"))
    return cmds


def netem_command(m: Member, peer: Member, delay_ms: float, verb: str) -> list[str]:
    """A netem leaf under the peer's class: `verb` add, or change."""
    handle = f"{peer.host + 0x10:x}:"
    netem = ["netem", "delay", f"{delay_ms:g}ms", "limit", "100000"]
    return tc_in(
        m, "qdisc", verb, "dev", "eth0", "parent", class_id(peer.host), "handle", handle, *netem
    )


def rate_change_command(m: Member, peer: Member, mbit: float) -> list[str]:
    cid = class_id(peer.host)
    return tc_in(
        m, "class", "change", "dev", "eth0", "parent", "1:", "classid", cid, "htb", *_htb_rate(mbit)
    )


def parse_class_bytes(text: str) -> dict[str, int]:
    """`tc -s class show` output into bytes sent by class id."""
    found: dict[str, int] = {}
    current = ""
    for line in text.splitlines():
        head = re.match(r"class htb (\S+) ", line)
        if head is not None:
            current = head.group(1)
            continue
        sent = re.match(r"\s*Sent (\d+) bytes", line)
        if sent is not None and current:
            found[current] = int(sent.group(1))
            current = ""
    return found
