"""The swarm `swarmpipe simulate` runs: drawn or read nodes, and a churn trace.

Drawn nodes: speed lognormal around 4 samples/s on a unit stage (sigma 0.5: a few nodes
three times the median, a few a third of it); inbound and outbound bandwidth each lognormal
around 32 Mbit/s (sigma 0.7, so about two in three fall between 15 and 65 Mbit/s, home and
office links).

Nodes file (`--nodes-file`), JSON lines or CSV with a header, one node a line:

    {"id": "n1", "speed": 4.2, "bandwidth_in_mbit": 50, "bandwidth_out_mbit": 20}
    id,speed,bandwidth_in_mbit,bandwidth_out_mbit

A JSON line may add `"rates": [..]`, measured samples/s per stage (0: speed / cost).

Trace file (`--trace-file`), JSON lines in time order:

    {"t": 120.0, "event": "leave", "node": "n1"}
    {"t": 300.0, "event": "join", "node": "x7", "speed": 3.0, "bandwidth_in_mbit": 40,
     "bandwidth_out_mbit": 40}      (capabilities left out are drawn)
    {"t": 900.0, "event": "rate", "node": "n2", "speed": 1.5}

Without one, churn is seeded Poisson: each live node leaves at `leave_per_hour`, and nodes
join at `join_per_hour` times the starting fleet's size per hour.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from swarmpipe.coordinator.placement import NodeCaps
from swarmpipe.errors import ConfigError

MBIT = 1e6 / 8  # bytes/s

EventKind = Literal["join", "leave", "rate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ChurnEvent:
    """One thing that happens to the swarm at time `t` (seconds from the start)."""

    t: float
    kind: EventKind
    node_id: str
    caps: NodeCaps | None = None
    """A joiner's capabilities (drawn when the trace leaves them out)."""
    speed: float = 0.0
    """A rate event's new speed."""


def draw_node(node_id: str, rng: random.Random) -> NodeCaps:
    """One node from the default distributions."""
    return NodeCaps(
        node_id=node_id,
        speed=rng.lognormvariate(1.386, 0.5),  # median e^1.386 = 4 samples/s
        bandwidth_in=rng.lognormvariate(3.45, 0.7) * MBIT,  # median e^3.45 = 32 Mbit/s
        bandwidth_out=rng.lognormvariate(3.45, 0.7) * MBIT,
    )


def draw_fleet(count: int, rng: random.Random) -> list[NodeCaps]:
    return [draw_node(f"n{i}", rng) for i in range(count)]


def _number(row: dict[str, Any], key: str, where: str) -> float:
    try:
        value = float(row[key])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{where}: needs a number for {key!r}") from None
    if value < 0:
        raise ConfigError(f"{where}: {key} must be >= 0, got {value}")
    return value


def _caps(row: dict[str, Any], node_id: str, where: str) -> NodeCaps:
    rates = row.get("rates", ())
    if not isinstance(rates, list | tuple) or not all(isinstance(r, int | float) for r in rates):
        raise ConfigError(f"{where}: rates must be a list of numbers")
    return NodeCaps(
        node_id=node_id,
        speed=_number(row, "speed", where),
        bandwidth_in=_number(row, "bandwidth_in_mbit", where) * MBIT,
        bandwidth_out=_number(row, "bandwidth_out_mbit", where) * MBIT,
        compute_rates=tuple(float(r) for r in rates),
    )


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None


def _json_rows(path: Path, lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: each line must be a JSON object")
        rows.append((where, row))
    return rows


def read_nodes_file(path: Path) -> list[NodeCaps]:
    """Nodes from JSON lines or CSV (see the module's docstring)."""
    lines = _read_lines(path)
    first = next((line for line in lines if line.strip()), "")
    if first.lstrip().startswith("{"):
        rows = _json_rows(path, lines)
    else:
        reader = csv.DictReader(lines)
        rows = [(f"{path}:{i + 2}", dict(row)) for i, row in enumerate(reader)]
    nodes, seen = [], set()
    for where, row in rows:
        node_id = str(row.get("id", "")).strip()
        if not node_id or node_id in seen:
            raise ConfigError(f"{where}: each node needs an id of its own")
        seen.add(node_id)
        nodes.append(_caps(row, node_id, where))
    if not nodes:
        raise ConfigError(f"{path}: no nodes in it")
    return nodes


def read_trace_file(path: Path, rng: random.Random) -> list[ChurnEvent]:
    """Churn events from JSON lines (see the module's docstring), in time order."""
    events = []
    last = 0.0
    for where, row in _json_rows(path, _read_lines(path)):
        t = _number(row, "t", where)
        kind = row.get("event")
        node_id = str(row.get("node", "")).strip()
        if kind not in ("join", "leave", "rate") or not node_id:
            raise ConfigError(f"{where}: needs event join, leave or rate, and a node")
        if t < last:
            raise ConfigError(f"{where}: events must be in time order ({t} after {last})")
        last = t
        if kind == "join":
            drawn = draw_node(node_id, rng)
            full = {
                "speed": drawn.speed,
                "bandwidth_in_mbit": drawn.bandwidth_in / MBIT,
                "bandwidth_out_mbit": drawn.bandwidth_out / MBIT,
            } | row
            events.append(
                ChurnEvent(t=t, kind="join", node_id=node_id, caps=_caps(full, node_id, where))
            )
        elif kind == "leave":
            events.append(ChurnEvent(t=t, kind="leave", node_id=node_id))
        else:
            events.append(
                ChurnEvent(t=t, kind="rate", node_id=node_id, speed=_number(row, "speed", where))
            )
    return events
