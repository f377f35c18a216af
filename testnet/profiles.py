"""Per-node profiles for a testnet on one machine: some nodes slower, some links thinner.

`--node-profile n0=mbit:50,slow:2` gives node n0 a send limit of 50 Mbit/s on each of its
links (the node's `--link-mbit`) and makes its compute twice as slow (`--compute-slowdown`),
so a heterogeneous swarm, and what placement should make of it, can be tried on one machine.
`lat:80` delays everything the node sends by 80 ms one way (the node's `--latency-ms`): a
node far from the others.
The flag may be given once per node; a node without one runs as the run config says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from swarmpipe.control.link_control import MAX_SLOWDOWN
from swarmpipe.errors import ConfigError
from swarmpipe.transport.limits import MBIT, check_latency_ms, check_limit


@dataclass(frozen=True, slots=True)
class NodeProfile:
    mbit: float | None = None
    """Send limit on each of the node's links, Mbit/s (0: none); None: the run's."""
    slow: float = 1.0
    """Compute slowdown factor (1: as fast as the machine)."""
    lat: float | None = None
    """One-way delay on each of the node's links, ms (0: none); None: the run's."""

    def node_args(self) -> list[str]:
        args = [] if self.mbit is None else ["--link-mbit", f"{self.mbit:g}"]
        if self.lat is not None:
            args += ["--latency-ms", f"{self.lat:g}"]
        if self.slow != 1.0:
            args += ["--compute-slowdown", f"{self.slow:g}"]
        return args


def parse_profiles(items: list[str], nodes: int) -> dict[str, NodeProfile]:
    """`NODE=key:value,...` items into profiles by node; a ConfigError names a bad item."""
    profiles: dict[str, NodeProfile] = {}
    known = {f"n{i}" for i in range(nodes)}
    for item in items:
        node, sep, rest = item.partition("=")
        if not sep or not rest:
            raise ConfigError(f"--node-profile {item!r}: give NODE=mbit:X,slow:Y,lat:MS")
        if node not in known:
            raise ConfigError(
                f"--node-profile {item!r}: no node {node!r} in this testnet (n0 to n{nodes - 1})"
            )
        if node in profiles:
            raise ConfigError(f"--node-profile: {node} has two profiles; give it one")
        mbit: float | None = None
        slow = 1.0
        lat: float | None = None
        for part in rest.split(","):
            key, sep, value = part.partition(":")
            try:
                number = float(value)
            except ValueError:
                number = math.nan
            if not sep or key not in ("mbit", "slow", "lat") or not math.isfinite(number):
                raise ConfigError(
                    f"--node-profile {item!r}: {part!r} is not mbit:NUMBER, slow:NUMBER or lat:MS"
                )
            if key == "lat":
                lat = check_latency_ms(number, what=f"--node-profile {node} lat:{value}")
            elif key == "mbit":
                check_limit(number * MBIT, what=f"--node-profile {node} mbit:{value}")
                mbit = number
            elif not 1.0 <= number <= MAX_SLOWDOWN:
                raise ConfigError(
                    f"--node-profile {item!r}: slow:{value} must be 1 to {MAX_SLOWDOWN:g} "
                    "(how many times slower than this machine)"
                )
            else:
                slow = number
        profiles[node] = NodeProfile(mbit=mbit, slow=slow, lat=lat)
    return profiles
