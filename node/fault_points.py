"""Named places where a test can make a node stop dead, so a SIGKILL lands exactly there.

Failures that matter (a replica dying inside the all-reduce, a head dying
with a microbatch in flight) last milliseconds; a test that kills a node
"about then" tests luck. A test arms a point through the environment:

    SWARMPIPE_PAUSE_AT="reduce.sent_one:2:/tmp/run/n2.paused"

meaning: the first time this node reaches point `reduce.sent_one` at step 2
or later, write the marker file (JSON with the point and step), then never
return. The test waits for the marker and kills the node. Several points may
be armed, separated by commas. Unset (every real deployment), `reach` is a
dictionary lookup.

One point does not pause: `apply.drift` nudges the node's parameters once after it
applies that step (`drift_due`), as a bad memory bit would, so a test can see the
coordinator notice replicas that differ and re-sync the odd one out.
"""

from __future__ import annotations

import asyncio
import logging
import os

from swarmpipe.process.ready import write_ready_file

logger = logging.getLogger(__name__)

ENV = "SWARMPIPE_PAUSE_AT"

POINTS = frozenset(
    {
        "reduce.sent_one",  # a replica sent its contribution to one peer, not yet the others
        "head.hop_done",  # a head got a microbatch's gradient back but has not committed it
        "checkpoint.final",  # a replica asked for its stage's final state, before it uploads
        "apply.drift",  # not a pause: nudge the parameters once after applying (drift_due)
    }
)


def _parse(text: str) -> dict[str, tuple[int, str]]:
    armed: dict[str, tuple[int, str]] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        point, _, rest = item.partition(":")
        step, _, marker = rest.partition(":")
        if point not in POINTS or not step.isdigit() or not marker:
            raise ValueError(
                f"{ENV} item {item!r} must be POINT:MIN_STEP:MARKER_FILE with POINT one of "
                f"{', '.join(sorted(POINTS))}"
            )
        armed[point] = (int(step), marker)
    return armed


_armed = _parse(os.environ.get(ENV, ""))


def armed(point: str) -> bool:
    """Whether a test armed `point` (callers may then take a slower, ordered path)."""
    return point in _armed


async def reach(point: str, step: int) -> None:
    """Pause here forever if a test armed `point` for this step; otherwise return at once."""
    target = _armed.get(point)
    if target is None or step < target[0]:
        return
    del _armed[point]
    logger.warning("pausing at fault point %s (step %d) for a test", point, step)
    write_ready_file(target[1], {"point": point, "step": step, "pid": os.getpid()})
    await asyncio.Event().wait()


def drift_due(step: int) -> bool:
    """Whether a test armed `apply.drift` for this step: True once (the marker file is
    written), then never again; the caller nudges its parameters."""
    target = _armed.get("apply.drift")
    if target is None or step < target[0]:
        return False
    del _armed["apply.drift"]
    logger.warning("fault point apply.drift (step %d): nudging the parameters for a test", step)
    write_ready_file(target[1], {"point": "apply.drift", "step": step, "pid": os.getpid()})
    return True
