"""`swarmpipe testnet --netns`: every daemon in a Linux network namespace of its own, on a bridge.

Each daemon (the coordinator, each node) runs under `ip netns exec NS` in a namespace with
one veth onto a bridge in the root namespace, and its own address on a /24 of 10.77.0.0/16
(the coordinator .1, node nK .K+2, the bridge .254 so the testnet itself reaches the
coordinator). The embedded broker and every gRPC call then cross real (virtual) interfaces.

Links are shaped in the kernel: each node's egress (its veth, inside its namespace) gets an
htb root with one class per peer node, matched on the destination address, so that "X Mbit/s
on each link", what the in-process limiter (node/link_limit.py) does per peer, is what the
kernel does too. Traffic to the coordinator and the testnet takes the unshaped default
class. A one-way delay goes in a netem leaf under each peer class where the kernel has netem;
where it does not (`Specified qdisc kind is unknown`), the sender's delay stays on.

Names carry the testnet's pid (`swp<pid>`: namespaces `swp<pid>-NAME`, bridge `swp<pid>br`,
root-side veths `swp<pid>v<index>`), so two testnets do not collide, and a testnet that was
SIGKILLed is recognised by the next one, which deletes what it left behind. Interface names
stay within the kernel's 15 characters for pids up to 7 digits and 100 nodes.

The command lists are built in netns_commands.py (pure, unit-tested); `NetnsLab` runs them.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from swarmpipe.errors import ConfigError, SwarmpipeError
from swarmpipe.testnet.netns_commands import (
    PREFIX,
    TAG_PATTERN,
    Member,
    Plan,
    address,
    class_id,
    parse_class_bytes,
    peer_class_commands,
    pick_subnet,
    rate_change_command,
    shaping_root_commands,
    stale_tags,
    tag_for,
    tc_in,
)
from swarmpipe.testnet.profiles import NodeProfile

logger = logging.getLogger(__name__)

_CMD_TIMEOUT_S = 20.0


class NetnsUnavailable(ConfigError):
    """This machine cannot run a namespace testnet (not Linux, not root, no ip/tc)."""


def check_available() -> None:
    """One line saying why `--netns` cannot run here, as a NetnsUnavailable; None if it can."""
    if not sys.platform.startswith("linux"):
        raise NetnsUnavailable(f"--netns needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetnsUnavailable("--netns needs root (it creates namespaces, veths and a bridge)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"--netns needs the `{tool}` command (iproute2); none found")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class NetnsLab:
    """The namespaces, veths and bridge of one testnet, and its links' shaping; `close` (safe
    to call twice, and after a half-done setup) removes every one of them."""

    plan: Plan
    run: Callable[[list[str]], None] | None = None
    members: dict[str, Member] = field(default_factory=dict)
    nodes_mbit: dict[str, float] = field(default_factory=dict)
    """Each node's kernel limit on each of its links now, Mbit/s (0: none)."""
    start_mbit: dict[str, float] = field(default_factory=dict)
    delay_ms: dict[str, float] = field(default_factory=dict)
    """Each node's one-way delay, where the kernel applies it (netem); empty otherwise."""
    netem: bool = False
    bridge_made: bool = False
    default_mbit: float = 0.0
    """The run's limit, for a node the churn schedule starts that was not there at first."""
    default_delay_ms: float = 0.0

    @classmethod
    def open(
        cls,
        coordinator: str,
        nodes: int,
        *,
        run_mbit: float,
        run_latency_ms: float,
        profiles: dict[str, NodeProfile],
    ) -> tuple[NetnsLab, str]:
        """Delete what dead testnets left, pick a free /24, make the bridge and the
        coordinator's namespace, probe netem, note each node's start limit and delay.

        Returns the lab and a line for the user when the kernel has no netem ('' if it
        has). Everything made so far is removed when a step fails."""
        check_available()
        remove_stale()
        used = re.findall(r"inet (\d+\.\d+\.\d+\.\d+)/", _output(["ip", "-o", "-4", "addr"]))
        pid = os.getpid()
        lab = cls(Plan(tag_for(pid), pick_subnet(used, pid % 254), coordinator))
        try:
            lab.bridge_made = True  # a half-made bridge is deleted too
            for cmd in lab.plan.bridge_commands():
                lab._run(cmd)
            note = lab.probe_netem()
            lab.default_mbit, lab.default_delay_ms = run_mbit, run_latency_ms
            for i in range(nodes):
                profile = profiles.get(f"n{i}", NodeProfile())
                mbit = run_mbit if profile.mbit is None else profile.mbit
                lat = run_latency_ms if profile.lat is None else profile.lat
                lab.set_start(f"n{i}", mbit, lat)
        except BaseException:
            lab.close()
            raise
        return lab, note

    def node_flags(self) -> list[str]:
        """Flags after a node's own: the in-process limiter off (the kernel shapes instead,
        and the two must not stack), and the sender's delay off where netem has it."""
        flags = ["--link-mbit", "0"]
        if self.netem:
            flags += ["--latency-ms", "0"]
        return flags

    def _run(self, cmd: list[str]) -> None:
        if self.run is not None:
            self.run(cmd)
        else:
            _check(cmd)

    def ensure(self, name: str) -> Member:
        """The daemon's namespace, made (and its links shaped to its peers) on first use."""
        if name in self.members:
            return self.members[name]
        m = self.plan.member(name)
        self.members[name] = m
        for cmd in self.plan.member_commands(m):
            self._run(cmd)
        if name != self.plan.coordinator:
            if name not in self.start_mbit:
                self.set_start(name, self.default_mbit, self.default_delay_ms)
            self._shape_new_node(m)
        return m

    def probe_netem(self) -> str:
        """Whether the kernel has netem, tried on the coordinator's veth; '' when it has,
        else the line saying why the delay stays in the sender."""
        m = self.ensure(self.plan.coordinator)
        tc = ["tc", "-n", m.netns, "qdisc"]
        done = _try([*tc, "add", "dev", "eth0", "root", "netem", "delay", "1ms"])
        if done.returncode == 0:
            _try([*tc, "del", "dev", "eth0", "root"])
            self.netem = True
            return ""
        reason = (done.stderr.strip().splitlines() or ["no reason given"])[-1]
        return f"--netns: the kernel has no netem ({reason}); the delay stays in the sender"

    def set_start(self, node: str, mbit: float, delay_ms: float) -> None:
        """A node's limit and delay before its namespace exists (applied by `ensure`)."""
        self.start_mbit[node] = mbit
        self.nodes_mbit[node] = mbit
        if self.netem and delay_ms > 0:
            self.delay_ms[node] = delay_ms

    def _node_members(self) -> list[Member]:
        return [m for name, m in self.members.items() if name != self.plan.coordinator]

    def _shape_new_node(self, m: Member) -> None:
        for cmd in shaping_root_commands(m):
            self._run(cmd)
        for peer in self._node_members():
            if peer.name == m.name:
                continue
            mine = self.nodes_mbit[m.name]
            for cmd in peer_class_commands(m, peer, mine, self.delay_ms.get(m.name)):
                self._run(cmd)
            theirs = self.nodes_mbit[peer.name]
            for cmd in peer_class_commands(peer, m, theirs, self.delay_ms.get(peer.name)):
                self._run(cmd)

    def set_rate(self, node: str, mbit: float | None) -> list[str]:
        """A churn `link` event in the kernel: NODE (or "all") to `mbit` on each of its links,
        0 none, None back to its starting limit. Returns the nodes changed."""
        names = [m.name for m in self._node_members()] if node == "all" else [node]
        changed = []
        for name in names:
            m = self.members.get(name)
            if m is None:
                continue  # not started yet: its start limit applies when it is
            rate = self.start_mbit.get(name, 0.0) if mbit is None else mbit
            self.nodes_mbit[name] = rate
            for peer in self._node_members():
                if peer.name != name:
                    self._run(rate_change_command(m, peer, rate))
            changed.append(name)
        return changed

    def sent_bytes(self) -> dict[str, int]:
        """What the kernel passed through each node's peer classes: `SRC->DST` -> bytes, IP
        and TCP headers included, since the namespace was made."""
        nodes = self._node_members()
        sent = {}
        for m in nodes:
            done = _try(tc_in(m, "-s", "class", "show", "dev", "eth0"))
            by_class = parse_class_bytes(done.stdout)
            for peer in nodes:
                if peer.name != m.name and class_id(peer.host) in by_class:
                    sent[f"{m.name}->{peer.name}"] = by_class[class_id(peer.host)]
        return sent

    def describe(self) -> dict[str, object]:
        """For report.json: where each daemon was, how its links were shaped, and what the
        kernel carried on each."""
        return {
            "kernel_sent_bytes": self.sent_bytes(),
            "bridge": self.plan.bridge,
            "subnet": f"{address(self.plan.subnet, 0)}/24",
            "addresses": {name: m.address for name, m in self.members.items()},
            "kernel_mbit": dict(self.nodes_mbit),
            "kernel_delay_ms": dict(self.delay_ms),
            "netem": self.netem,
        }

    def close(self) -> None:
        """Remove every veth, namespace and the bridge; failures are logged, not raised, so
        that one leftover does not keep the rest."""
        members = list(self.members.values())
        cmds = self.plan.teardown_commands(members)
        if not self.bridge_made:
            cmds = cmds[:-1]
        for cmd in cmds:
            done = _try(cmd)
            if done.returncode != 0 and "Cannot find" not in done.stderr:
                logger.warning("--netns cleanup: %s: %s", " ".join(cmd), done.stderr.strip())
        self.members.clear()
        self.bridge_made = False


def _try(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S, check=False)


def _check(cmd: list[str]) -> None:
    done = _try(cmd)
    if done.returncode != 0:
        raise SwarmpipeError(f"--netns: `{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _output(cmd: list[str]) -> str:
    done = _try(cmd)
    if done.returncode != 0:
        raise SwarmpipeError(f"--netns: `{' '.join(cmd)}` failed: {done.stderr.strip()}")
    return done.stdout


def leftovers(tag: str = PREFIX) -> list[str]:
    """Namespaces and links whose names start with `tag` (every testnet's by default)."""
    return [name for name in _names() if name.startswith(tag)]


def _names() -> list[str]:
    names = [line.split()[0] for line in _output(["ip", "netns", "list"]).splitlines() if line]
    for line in _output(["ip", "-o", "link", "show"]).splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def remove_stale() -> list[str]:
    """Delete the namespaces, veths and bridges of testnets whose process is gone; returns
    what was deleted (a SIGKILLed testnet runs no cleanup of its own)."""
    tags = stale_tags(_names(), _pid_alive)
    removed = []
    for name in _names():
        match = TAG_PATTERN.match(name)
        if match is None or tag_for(int(match.group(1))) not in tags:
            continue
        if name.endswith("br") or re.search(r"v\d+$", name):
            cmd = ["ip", "link", "del", name]
        else:
            cmd = ["ip", "netns", "del", name]
        if _try(cmd).returncode == 0:
            removed.append(name)
    # Bridges after veths: sort puts "...br" before "...v1", so do bridges in a second pass.
    for name in _names():
        match = TAG_PATTERN.match(name)
        if (
            match
            and tag_for(int(match.group(1))) in tags
            and _try(["ip", "link", "del", name]).returncode == 0
        ):
            removed.append(name)
    if removed:
        logger.warning("--netns: removed what a dead testnet left: %s", ", ".join(removed))
    return removed
