"""Reports of poisoned tensors, and the nodes benched for them (no I/O, unit-tested).

A node reports a peer whose reduce contribution the robust aggregate dropped
(node/robust_reduce.py) or whose activation or gradient its data plane refused.
Reporters are not authenticated yet (that is the identity part of issue 22), so
one report is not enough to bench a replica on a reduce: every honest replica
of the stage computes the same verdict, so the coordinator waits for a strict
majority of the suspect's other replicas at that step. One hostile replica among
three thus cannot bench an honest one, and two honest replicas bench a hostile
third. A majority verdict is needed at `verdicts` distinct steps within the
last VERDICT_WINDOW (2 by default): the screens are statistical, and an honest
replica's gradient does now and then fail one (the testnet's model has loss
spikes: one honest replica's norm came out 26x the others' and a clean run
benched it; on the tests' tiny model an honest gradient came out as unrelated
as noise at 2-5 % of steps). Its contribution is dropped and reported each
time, so one odd step costs that step's share, not a node for `bench_s`; a
hostile replica fails at every reduce it is judged in, and is benched at its
second. Some verdicts no honest gradient has come near: a contribution as even
across tensors as noise beside a witness that shows honest ones are not (hundreds
of sigma apart), or a norm ten times past the norm screen's bound (honest ones
reached 26x the median, x1000 is 1000x). When a majority calls theirs conclusive
the first one benches, and during a held APPLY its step begins again without it.
A data-plane refusal has only one witness (the receiving node), so one report
benches: a hostile node can bench its neighbours that way, a known limit until
calls carry credentials.

A benched node is drained (out of the plan; it stops) and its Join is refused
until `bench_s` has passed. A data-plane report never benches the only serving
replica of its stage: nobody could take its traffic, so the run would stand still
for `bench_s` on one witness's word (seen in CI: an honest gradient at 111x the
running median, against the 100x bound, stopped a run); its refused tensors stay
refused, the report is logged, and once the stage has another replica the next
report benches it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REDUCE = "reduce"
DATA = "data"
# Steps a reduce verdict counts towards a bench for: a replica of a stage with three replicas
# and four microbatches a step has traffic at ~80 % of steps, so a hostile one is judged at
# two steps of four; an honest one failing a screen now and then rarely fails twice in four.
VERDICT_WINDOW = 4


@dataclass(slots=True)
class Benched:
    node_id: str
    stage: int
    reason: str
    step: int
    reporters: tuple[str, ...]
    at: float
    until: float


@dataclass(slots=True)
class Suspects:
    """Reports per (suspect, step, kind) and the benched nodes."""

    bench_s: float
    verdicts: int = 2
    """Steps within VERDICT_WINDOW at which a majority must have reported a reduce suspect."""
    reports: dict[tuple[str, int, str], dict[str, str]] = field(default_factory=dict)
    benched: dict[str, Benched] = field(default_factory=dict)
    history: list[Benched] = field(default_factory=list)
    convicted: dict[str, set[int]] = field(default_factory=dict)
    """Suspect -> the recent steps at which a majority reported its reduce contribution."""
    sure: dict[tuple[str, int, str], set[str]] = field(default_factory=dict)
    """(suspect, step, kind) -> the reporters that called their verdict conclusive."""
    accepted: int = 0
    spared: int = 0
    """Data-plane reports that would have benched their stage's only serving replica."""

    def report(
        self,
        *,
        reporter: str,
        suspect: str,
        step: int,
        kind: str,
        reason: str,
        stage: int,
        stage_peers: set[str],
        now: float,
        sole_server: bool = False,
        conclusive: bool = False,
    ) -> Benched | None:
        """Record one report; the new bench when it tips the suspect over the threshold.

        `stage_peers` are the suspect's stage's other serving replicas (for a reduce report);
        `sole_server`: the suspect serves its stage alone (a data-plane report spares it);
        `conclusive`: a reduce verdict of a screen no honest gradient has come near, for
        which one majority step is enough.
        """
        self.accepted += 1
        key = (suspect, step, kind)
        witnesses = self.reports.setdefault(key, {})
        witnesses[reporter] = reason
        if conclusive:
            self.sure.setdefault(key, set()).add(reporter)
        # Keep a bounded history: only the latest steps' reports can still count.
        for old in [k for k in self.reports if k[1] < step - 2]:
            del self.reports[old]
            self.sure.pop(old, None)
        for steps in self.convicted.values():
            steps.difference_update([s for s in steps if s <= step - VERDICT_WINDOW])
        if self.is_benched(suspect, now):
            return None
        if kind == REDUCE:
            voters = set(witnesses) & stage_peers
            # At least two voters: in a stage of two replicas either could be the odd one.
            if len(voters) < 2 or 2 * len(voters) <= len(stage_peers):
                return None
            steps = self.convicted.setdefault(suspect, set())
            steps.add(step)
            # A conclusive verdict benches at once, when a majority called it conclusive.
            sure = self.sure.get(key, set()) & stage_peers
            at_once = len(sure) >= 2 and 2 * len(sure) > len(stage_peers)
            if len(steps) < self.verdicts and not at_once:
                return None
        elif sole_server:
            self.spared += 1
            return None
        entry = Benched(
            node_id=suspect,
            stage=stage,
            reason=reason,
            step=step,
            reporters=tuple(sorted(witnesses)),
            at=now,
            until=now + self.bench_s,
        )
        if self.bench_s > 0:
            self.benched[suspect] = entry
        self.history.append(entry)
        return entry

    def forget_reports(self, step: int) -> None:
        """`step` begins again: its reports so far count for no majority of the next attempt
        (the majorities already reached, in `convicted` and `benched`, stay)."""
        for key in [k for k in self.reports if k[1] == step]:
            del self.reports[key]
            self.sure.pop(key, None)

    def is_benched(self, node_id: str, now: float) -> bool:
        entry = self.benched.get(node_id)
        if entry is None:
            return False
        if now >= entry.until:
            del self.benched[node_id]
            return False
        return True

    def refusal(self, node_id: str, now: float) -> str | None:
        """Why `node_id` may not join now, or None."""
        if not self.is_benched(node_id, now):
            return None
        entry = self.benched[node_id]
        return (
            f"node {node_id!r} is benched for {entry.until - now:.0f} s more: at step "
            f"{entry.step} {', '.join(entry.reporters)} reported that {entry.reason}"
        )
