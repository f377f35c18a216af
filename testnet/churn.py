"""Churn scenarios for the testnet: which node to SIGKILL or start, and when.

A schedule is written on the command line, e.g.

    --churn "kill n1@8s, start n1@15s, kill n4@step12, start n9@step14"

`kill NODE@T` SIGKILLs the node's whole process group (no polite stop, so its
Last Will fires and its leases are replayed); `start NODE@T` starts a node
with that name, the same id as a killed one (it rejoins) or a fresh one. T is
`Ns` (seconds since training began, i.e. since step 0 opened) or `stepN`
(once N steps have finished).

`kill coordinator@T` and `start coordinator@T` do the same to the coordinator: started
again with the same command line, it takes the run up from its state database
(coordinator/state_db.py) on the same ports, and the nodes, which kept training, reconnect.

`link NODE=MBIT@T` limits what NODE sends to each peer to MBIT Mbit/s from T
on (`link all=0.5@20s` every node; `=0` no limit), and `link NODE=off@T`
withdraws that setting, so the node goes back to the limit it started with
(`--link-mbit`, usually none). It is the same retained MQTT message
`swarmpipe link-limit` publishes (see control/link_control.py), so it reaches the
nodes as a real organiser's would; the testnet clears it when the run ends.

`profile NODE=mbit:X,slow:Y@T` changes a node's profile (as `--node-profile` sets it at
start) from T on: `mbit` its send limit (as `link` does), `slow` its compute slowdown
factor (1: as fast as the machine). Keys left out keep their setting. It travels in the
same retained `LinkControl` message as `link` (its `compute_slowdown` field), so a node that
restarts finds it waiting; the testnet sends each node's send limit and slowdown together.

`--churn-random RATE --churn-seed S` adds kills at random: a Poisson process
of RATE kills per minute, each of a node picked at random (seeded) among
those whose stage has another replica online, each restarted with the same
id `--churn-downtime` seconds later. Given the seed, the sequence of choices
is the same on every run; when they land depends on the machine's speed.

Every event performed is recorded with when it happened (seconds since
training began, and the step) for the report.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import asdict, dataclass
from typing import Any

from swarmpipe.control.link_control import check_slowdown
from swarmpipe.errors import ConfigError
from swarmpipe.transport.limits import MBIT, check_limit

_WHEN = r"\s*@\s*(?:(\d+(?:\.\d+)?)s|step(\d+))$"
_EVENT = re.compile(r"^(kill|start)\s+([A-Za-z0-9_.-]{1,64})" + _WHEN)
_PROFILE = re.compile(r"^profile\s+([A-Za-z0-9_.-]{1,64})\s*=\s*([^@]+?)" + _WHEN)
# A comma also parts a profile's keys: a part that starts with one belongs to the item before.
_PROFILE_KEY = re.compile(r"^\s*(mbit|slow)\s*:")
_LINK = re.compile(r"^link\s+([A-Za-z0-9_.-]{1,64})\s*=\s*(off|\d+(?:\.\d+)?(?:e-?\d+)?)" + _WHEN)


@dataclass(frozen=True, slots=True)
class ChurnEvent:
    """One planned action: at `seconds` into training or after `after_steps` steps."""

    action: str  # "kill", "start" or "link"
    node: str  # for "link", also "all"
    seconds: float | None = None
    after_steps: int | None = None
    mbit: float | None = None  # "link": the limit in Mbit/s (0: none); None: withdraw it
    # "profile": the send limit in Mbit/s and compute slowdown it sets; None: left as is
    slow: float | None = None

    def due(self, elapsed: float, steps_done: int) -> bool:
        if self.seconds is not None:
            return elapsed >= self.seconds
        assert self.after_steps is not None
        return steps_done >= self.after_steps

    @property
    def when(self) -> str:
        return f"{self.seconds:g}s" if self.seconds is not None else f"step{self.after_steps}"

    @property
    def label(self) -> str:
        """The event as the schedule writes it."""
        if self.action == "link":
            setting = "off" if self.mbit is None else f"{self.mbit:g}"
            return f"link {self.node}={setting}@{self.when}"
        if self.action == "profile":
            keys = [f"mbit:{self.mbit:g}"] if self.mbit is not None else []
            keys += [f"slow:{self.slow:g}"] if self.slow is not None else []
            return f"profile {self.node}={','.join(keys)}@{self.when}"
        return f"{self.action} {self.node}@{self.when}"


@dataclass(frozen=True, slots=True)
class ChurnRecord:
    """An action the testnet performed, for report.json."""

    action: str
    node: str
    planned: str  # the schedule's time ("8s", "step12") or "random"
    at_seconds: float  # since training began
    step: int  # steps finished when it happened
    stage: int  # the node's stage (-1 when not known yet)
    outcome: str  # "killed", "started", "not running", "limited", "skipped: ..."
    mbit: float | None = None  # "link": the limit set in Mbit/s (0: none); None: withdrawn
    slow: float | None = None  # "profile": the compute slowdown set; None: not changed

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_schedule(text: str) -> list[ChurnEvent]:
    """Parse `kill n1@8s, start n1@step5, link n1=2@step8` into events; a ConfigError names
    a bad item."""
    items: list[str] = []
    for part in filter(None, (part.strip() for part in text.split(","))):
        if items and items[-1].startswith("profile") and _PROFILE_KEY.match(part):
            items[-1] += "," + part
        else:
            items.append(part)
    events = []
    for item in items:
        mbit: float | None = None
        slow: float | None = None
        if match := _EVENT.match(item):
            action, node, seconds, steps = match.groups()
        elif match := _PROFILE.match(item):
            node, spec, seconds, steps = match.groups()
            action = "profile"
            mbit, slow = _profile_settings(item, spec)
        elif match := _LINK.match(item):
            node, setting, seconds, steps = match.groups()
            action = "link"
            if setting != "off":
                mbit = float(setting)
                check_limit(mbit * MBIT, what=f"--churn item {item!r}: {mbit:g} Mbit/s")
        else:
            raise ConfigError(
                f"--churn item {item!r} must look like 'kill NODE@8s', 'start NODE@step5', "
                "'link NODE=2@step8' (Mbit/s; NODE may be all), 'link NODE=off@20s' or "
                "'profile NODE=mbit:5,slow:2@20s'"
            )
        events.append(
            ChurnEvent(
                action=action,
                node=node,
                seconds=float(seconds) if seconds is not None else None,
                after_steps=int(steps) if steps is not None else None,
                mbit=mbit,
                slow=slow,
            )
        )
    return events


def _profile_settings(item: str, spec: str) -> tuple[float | None, float | None]:
    """(Mbit/s, slowdown) a profile event's `mbit:X,slow:Y` sets; a ConfigError names a
    bad key or value."""
    mbit: float | None = None
    slow: float | None = None
    for part in spec.split(","):
        key, sep, value = (x.strip() for x in part.partition(":"))
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not sep or key not in ("mbit", "slow") or not math.isfinite(number):
            raise ConfigError(
                f"--churn item {item!r}: {part.strip()!r} is not mbit:NUMBER or slow:NUMBER"
            )
        if key == "mbit":
            check_limit(number * MBIT, what=f"--churn item {item!r}: mbit:{value}")
            mbit = number
        else:
            slow = check_slowdown(number, what=f"--churn item {item!r}: slow:{value}")
    return mbit, slow


class ChurnPlan:
    """Hands out the events due now: the fixed schedule plus seeded random kills."""

    def __init__(
        self,
        schedule: list[ChurnEvent],
        *,
        random_rate_per_min: float = 0.0,
        seed: int = 0,
        downtime_s: float = 5.0,
    ) -> None:
        if random_rate_per_min < 0 or downtime_s < 0:
            raise ConfigError("--churn-random and --churn-downtime must be >= 0")
        self.pending = list(schedule)
        self.rate_per_s = random_rate_per_min / 60.0
        self.downtime_s = downtime_s
        self.rng = random.Random(seed)
        self.next_random = self._gap() if self.rate_per_s else None

    def _gap(self) -> float:
        return self.rng.expovariate(self.rate_per_s)

    @property
    def active(self) -> bool:
        return bool(self.pending) or self.next_random is not None

    def due(self, elapsed: float, steps_done: int) -> list[ChurnEvent]:
        """Scheduled events whose time has come, in schedule order (removed from the plan)."""
        ready = [e for e in self.pending if e.due(elapsed, steps_done)]
        self.pending = [e for e in self.pending if e not in ready]
        return ready

    def random_victim(self, elapsed: float, eligible: list[str]) -> str | None:
        """The node a random kill takes now, if one is due; schedules its restart.

        `eligible` are nodes whose stage keeps another live replica. When none
        is, the kill is skipped (returns "") rather than stalling the run.
        """
        if self.next_random is None or elapsed < self.next_random:
            return None
        self.next_random = elapsed + self._gap()
        if not eligible:
            return ""
        victim = self.rng.choice(sorted(eligible))
        self.pending.append(
            ChurnEvent(action="start", node=victim, seconds=elapsed + self.downtime_s)
        )
        return victim
