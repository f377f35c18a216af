"""Send limits and link delays: the units and the ranges every link setting is checked against.

A send limit is kept in bytes per second and given by people in Mbit/s; a one-way delay is
given in milliseconds. The config, the control plane's `LinkControl`, the testnet's churn
schedule and profiles and the node's limiter all check them here, so one figure means the
same everywhere.
"""

from __future__ import annotations

import math

from swarmpipe.errors import ConfigError

MBIT = 1e6 / 8
"""Bytes per second in one Mbit/s."""

CHUNK_BYTES = 1 << 20
"""The largest chunk a tensor or a state stream is sent in (compression/wire.py and
storage/checkpoints.py use this figure; kept here too so the control plane needs no torch):
the unit a stream's idle bound is sized for."""

MIN_LIMIT = 1e3 / 8
"""The slowest send limit accepted, 1 kbit/s, in bytes per second: a 1 MiB chunk already
takes over two hours at that rate, so anything slower is a typo, not an experiment."""

MAX_LIMIT = 10e12 / 8
"""The fastest send limit accepted, 10 Tbit/s, in bytes per second: beyond any real link, so
a larger figure is a unit mistake (bits for bytes, kbit for Mbit)."""


def check_limit(bytes_per_second: float, *, what: str = "") -> float:
    """`bytes_per_second` if it is a usable send limit (0: none), else a ConfigError.

    `what` names the setting in the message (e.g. "pipeline.link_mbit=1e+09").
    """
    if bytes_per_second == 0 or (
        math.isfinite(bytes_per_second) and MIN_LIMIT <= bytes_per_second <= MAX_LIMIT
    ):
        return bytes_per_second
    what = what or f"a send limit of {bytes_per_second / MBIT:g} Mbit/s"
    raise ConfigError(
        f"{what} is out of range: give 0 (no limit) or {MIN_LIMIT / MBIT:g} to "
        f"{MAX_LIMIT / MBIT:g} Mbit/s (1 kbit/s to 10 Tbit/s)"
    )


MAX_LATENCY_MS = 10_000.0
"""The longest one-way delay accepted, 10 s: geostationary satellite hops are about 600 ms,
so more is a unit mistake (microseconds for milliseconds)."""


def check_latency_ms(ms: float, *, what: str = "") -> float:
    """`ms` if it is a usable one-way link delay in milliseconds (0: none), else a
    ConfigError naming `what` (e.g. "pipeline.link_latency_ms=-1")."""
    if math.isfinite(ms) and 0 <= ms <= MAX_LATENCY_MS:
        return ms
    what = what or f"a link latency of {ms:g} ms"
    raise ConfigError(
        f"{what} is out of range: give 0 (none) to {MAX_LATENCY_MS:g} ms of one-way delay"
    )
