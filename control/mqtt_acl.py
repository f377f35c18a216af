"""Who may publish and read which MQTT topics of a run: one rule for every broker.

The embedded broker applies it through its plugins (coordinator/broker.py) and
`swarmpipe broker-config` writes the same rule as a mosquitto ACL file:

- `coordinator` publishes and reads everything under `swarmpipe/<run>/` (the plan, the step
  state, and it clears link limits);
- `organiser` (the admin token's holder: `swarmpipe link-limit`, the testnet) publishes link
  limits, `swarmpipe/<run>/control/<node>`, and reads the run's topics;
- any other user is a node, named by its node id: it publishes only its own presence and
  telemetry, `swarmpipe/<run>/presence/<itself>` and `.../telemetry/<itself>`, and reads the
  run's topics. It cannot publish a plan, a step state or a link limit.
"""

from __future__ import annotations

COORDINATOR_USER = "coordinator"
ORGANISER_USER = "organiser"
RESERVED_USERS = frozenset({COORDINATOR_USER, ORGANISER_USER})
"""MQTT users that are not nodes: no node may take these ids."""


def _root(run_id: str) -> str:
    return f"swarmpipe/{run_id}/"


def may_publish(user: str, topic: str, run_id: str) -> bool:
    root = _root(run_id)
    if not topic.startswith(root) or "+" in topic or "#" in topic:
        return False
    rest = topic[len(root) :]
    if user == COORDINATOR_USER:
        return True
    if user == ORGANISER_USER:
        kind, _, target = rest.partition("/")
        return kind == "control" and bool(target) and "/" not in target
    return rest in (f"presence/{user}", f"telemetry/{user}")


def may_read(user: str, topic_filter: str, run_id: str) -> bool:
    """Whether `user` may subscribe to `topic_filter` (or receive a message on that topic):
    any topic of its run, none of another's or the broker's."""
    return bool(user) and topic_filter.startswith(_root(run_id))
