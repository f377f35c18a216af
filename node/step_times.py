"""Where a node's time goes in each step: compute, waiting inside the step, and the boundary.

A synchronous step has a fill (the first microbatches crossing an empty pipeline), a steady
part and a drain (the last ones leaving it), then the boundary: APPLY reaches the node, the
replicas exchange gradients, the optimizer steps, StepDone goes to the coordinator, and the
next step's first microbatch arrives. The clocks below follow one node through those
phases, on its own monotonic clock, so that a run's report can say which of them the time
went to (testnet/main.py sums them per node and per step).

- train: from this node's first forward of the step until APPLY arrived. Its compute is
  the forward plus backward seconds of the step's microbatches here; the rest of it is
  waiting on links and on the other stages (fill, drain and any gap between).
- drain: from the end of its last compute of the step until APPLY arrived: the time the
  other stages, the commits and the coordinator took to finish the step after this node
  had nothing left to do.
- reduce, apply, step_done: the boundary's phases on this node.
- next: from StepDone's answer until its first forward of the next step: the coordinator
  opening the step, the head leasing, and for later stages the fill up to them. 0 when the
  next step's first forward came before StepDone's answer (train.step_overlap): then the
  next step's train window overlaps this step's boundary, and a node's phases of
  consecutive steps add up to more than its wall time.

Nothing here does I/O; the daemon, the head and the servicer call it on the event loop.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from swarmpipe.protos import control_pb2

KEEP_STEPS = 64
"""Steps kept (the oldest go first): telemetry carries them all, so it stays small."""


@dataclass(slots=True)
class _Step:
    first_forward: float
    compute_s: float = 0.0
    microbatches: int = 0
    last_compute_end: float | None = None
    apply_at: float | None = None
    reduced_at: float | None = None
    applied_at: float | None = None
    acked_at: float | None = None
    next_s: float | None = None


class StepTimes:
    """One node's time per step, phase by phase (see the module docstring)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._steps: OrderedDict[int, _Step] = OrderedDict()

    def _get(self, step: int, *, now: float) -> _Step:
        entry = self._steps.get(step)
        if entry is None:
            entry = self._steps[step] = _Step(first_forward=now)
            previous = self._steps.get(step - 1)
            if previous is not None and previous.acked_at is not None:
                previous.next_s = max(0.0, now - previous.acked_at)
            while len(self._steps) > KEEP_STEPS:
                self._steps.popitem(last=False)
        return entry

    def forward_started(self, step: int) -> None:
        """A training microbatch of `step` starts its forward here."""
        self._get(step, now=self._clock())

    def computed(self, step: int, seconds: float) -> None:
        """A training microbatch of `step` finished its forward and backward here."""
        now = self._clock()
        entry = self._get(step, now=now)
        entry.compute_s += seconds
        entry.microbatches += 1
        entry.last_compute_end = now

    def _mark(self, step: int, what: str) -> None:
        entry = self._steps.get(step)
        if entry is not None and getattr(entry, what) is None:
            setattr(entry, what, self._clock())

    def apply_arrived(self, step: int) -> None:
        self._mark(step, "apply_at")

    def reduced(self, step: int) -> None:
        self._mark(step, "reduced_at")

    def applied(self, step: int) -> None:
        self._mark(step, "applied_at")

    def acked(self, step: int) -> None:
        self._mark(step, "acked_at")
        entry = self._steps.get(step)
        if entry is not None and entry.next_s is None and step + 1 in self._steps:
            entry.next_s = 0.0  # the next step began here before this one was acknowledged

    def snapshot(self) -> list[control_pb2.StepTimes]:
        """Every step kept that reached APPLY, oldest first, for telemetry."""
        records = []
        for step, e in self._steps.items():
            if e.apply_at is None:
                continue
            end = e.last_compute_end if e.last_compute_end is not None else e.first_forward
            reduced = e.reduced_at if e.reduced_at is not None else e.apply_at
            applied = e.applied_at if e.applied_at is not None else reduced
            acked = e.acked_at if e.acked_at is not None else applied
            records.append(
                control_pb2.StepTimes(
                    step=step,
                    train_s=e.apply_at - e.first_forward,
                    compute_s=e.compute_s,
                    drain_s=max(0.0, e.apply_at - end),
                    reduce_s=reduced - e.apply_at,
                    apply_s=applied - reduced,
                    step_done_s=acked - applied,
                    next_s=e.next_s or 0.0,
                    microbatches=e.microbatches,
                    complete=e.next_s is not None,
                )
            )
        return records
