"""Which stage each node served, and when it was online, as the testnet saw it.

The coordinator's Status tells only the present: each node's stage, whether it
is online, and whether it serves (false while a joining node still downloads
its stage's state). The testnet polls it every 0.25 s; this keeps one record
per change, so report.json can show a node killed and back, and later a node
moved to another stage, without storing every poll.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from swarmpipe.protos import coordinator_pb2


@dataclass(frozen=True, slots=True)
class NodeChange:
    """A node as Status showed it from `seconds` on (until its next change)."""

    seconds: float  # since training began; negative for what came before step 0
    step: int  # steps finished when it was seen
    node: str
    stage: int
    online: bool
    serving: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NodeTimeline:
    """Change records of every node the coordinator lists, in the order they were seen."""

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, bool, bool]] = {}
        self._seen: list[tuple[float, int, str, int, bool, bool]] = []
        """(monotonic time, steps, node, stage, online, serving)."""

    def observe(self, now: float, steps: int, nodes: Iterable[coordinator_pb2.NodeRecord]) -> None:
        """Record each node whose stage, online or serving flag differs from the last poll.

        A node that vanishes from Status is not recorded: the coordinator keeps the
        members it has seen, and marks a lost one offline instead.
        """
        for n in nodes:
            state = (n.stage, n.online, n.serving)
            if self._last.get(n.node_id) != state:
                self._last[n.node_id] = state
                self._seen.append((now, steps, n.node_id, *state))

    def records(self, origin: float) -> list[dict[str, Any]]:
        """The changes, with `seconds` counted from `origin` (a monotonic time)."""
        return [
            NodeChange(now - origin, steps, node, stage, online, serving).as_dict()
            for now, steps, node, stage, online, serving in self._seen
        ]
