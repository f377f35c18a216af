"""The live coordinator's placement: Membership running the placement policy on telemetry."""

from __future__ import annotations

import math
import random
import time

import pytest

from swarmpipe.coordinator import fleet_model, membership, placement
from swarmpipe.coordinator.membership import Membership, MoveOrder
from swarmpipe.coordinator.placement import PlacementPolicy
from swarmpipe.coordinator.step_protocol import StepStats
from swarmpipe.protos import control_pb2

# Bytes per sample across every cut, each way, and the state of a stage.
CUT_BYTES = 1000.0
STATE_BYTES = 1e6
SAMPLES = 1000


def make(stages: int, **policy: float) -> Membership:
    knobs = {"cooldown_s": 0.0, **policy}
    return Membership(
        num_stages=stages,
        activation_codec=1,
        gradient_codec=1,
        policy=PlacementPolicy(**knobs),  # type: ignore[arg-type]
    )


def serve(m: Membership, name: str, stage: int) -> None:
    member = m.assign(name, f"{name}:1")
    member.stage = stage
    member.online = member.announced = member.serving = True


def report(
    m: Membership,
    rates: dict[str, float],
    uplinks: dict[str, float],
    *,
    noise: float = 0.0,
    rng: random.Random | None = None,
) -> None:
    """Give every live node telemetry as a node would send it after one more step: its
    compute rate, and what it sent to each replica of its neighbouring stages, over links
    that share its uplink while they are busy together (each meter sees the uplink times
    its share of the bytes). Counters are totals since the node started, as a node's are,
    and each call adds a step's times."""

    def jitter(x: float) -> float:
        return x * (1 + rng.uniform(-noise, noise)) if rng is not None else x

    live = m.live()
    for member in live:
        s = member.stage
        estimates = []
        for direction, peer_stage in (("activation", s + 1), ("gradient", s - 1)):
            peers = [p for p in live if p.stage == peer_stage]
            for p in peers:
                estimates.append(
                    control_pb2.LinkEstimate(
                        peer=p.node_id,
                        direction=direction,
                        wire_bytes=int(SAMPLES * CUT_BYTES / len(peers)),
                    )
                )
        total = sum(e.wire_bytes for e in estimates)
        for e in estimates:
            e.bytes_per_second = jitter(uplinks[member.node_id] * e.wire_bytes / total)
        last = member.telemetry or control_pb2.Telemetry()
        sent = {(e.peer, e.direction): e.wire_bytes for e in last.link_estimates}
        for e in estimates:
            e.wire_bytes += sent.pop((e.peer, e.direction), 0)
        # Links to peers it no longer sends to keep their totals (and their meters).
        estimates += [e for e in last.link_estimates if (e.peer, e.direction) in sent]
        step = max((t.step for t in last.step_times), default=-1) + 1
        member.telemetry = control_pb2.Telemetry(
            node_id=member.node_id,
            stage=s,
            samples=last.samples + SAMPLES,
            compute_samples_per_second=jitter(rates[member.node_id]),
            link_estimates=estimates,
            stage_flops_per_sample=1e6,
            stage_state_bytes=STATE_BYTES,
            step_times=[*last.step_times[-3:], control_pb2.StepTimes(step=step, complete=True)],
        )


def arrive(m: Membership) -> None:
    """Every mover fetched its new stage's state and serves it."""
    for member in m.members.values():
        member.serving = True


def test_the_fleet_model_reads_bytes_per_sample_bandwidth_and_rates_from_telemetry() -> None:
    m = make(3)
    for name, stage in (("a", 0), ("b", 1), ("c", 1), ("d", 2)):
        serve(m, name, stage)
    report(m, {"a": 10, "b": 5, "c": 5, "d": 10}, {"a": 1e5, "b": 2e4, "c": 1e5, "d": 1e5})
    specs, caps = m.fleet(m.live())
    # A middle stage receives activations and gradients and sends both; an end stage one.
    assert [s.bytes_in_per_sample for s in specs] == [CUT_BYTES, 2 * CUT_BYTES, CUT_BYTES]
    assert [s.bytes_out_per_sample for s in specs] == [CUT_BYTES, 2 * CUT_BYTES, CUT_BYTES]
    assert [s.state_bytes for s in specs] == [STATE_BYTES] * 3
    assert caps["b"].bandwidth_out == 2e4 and caps["b"].compute_rates == (0.0, 5.0, 0.0)
    # Inbound: what the nodes sending to b measured on their links to it.
    assert caps["b"].bandwidth_in == 1e5
    # b's uplink carries 2e4 / 2000 = 10 samples/s on stage 1: compute (5) holds it.
    assert m.effective_rates()["b"] == 5.0


def test_a_calibrated_rate_stands_in_until_the_node_is_measured() -> None:
    assert fleet_model.measured_rate(None) == 0.0
    t = control_pb2.Telemetry(calibrated_samples_per_second=7.0)
    assert fleet_model.measured_rate(t) == 7.0
    t.compute_samples_per_second = 9.0
    assert fleet_model.measured_rate(t) == 9.0


def test_stage_costs_come_from_the_flops_the_replicas_report() -> None:
    fleet = [
        fleet_model.Observed("a", 0, control_pb2.Telemetry(stage=0, stage_flops_per_sample=1.0)),
        fleet_model.Observed("b", 1, control_pb2.Telemetry(stage=1, stage_flops_per_sample=3.0)),
        fleet_model.Observed("c", 2, None),
    ]
    assert fleet_model.stage_costs(fleet, 3) == [0.5, 1.5, 1.0]


def test_a_joiner_goes_where_it_raises_the_bound_not_to_the_emptiest_stage() -> None:
    m = make(3)
    for name, stage in (("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 2), ("f", 2)):
        serve(m, name, stage)
    rates = {"a": 10, "b": 10, "c": 2, "d": 2, "e": 10, "f": 10}
    report(m, rates, dict.fromkeys(rates, 1e9))
    assert m.assign("g", "g:1").stage == 1  # the bottleneck, though every stage has two


def test_a_joiner_gives_a_lone_replica_a_partner_first() -> None:
    m = make(2)
    for name, stage in (("a", 0), ("b", 0), ("c", 0), ("d", 1)):
        serve(m, name, stage)
    report(m, dict.fromkeys("abcd", 10.0), dict.fromkeys("abcd", 1e9))
    assert m.assign("e", "e:1").stage == 1


def test_a_node_whose_link_falls_is_moved_off_the_middle_stage_with_reason_bandwidth() -> None:
    m = make(3)
    layout = {"a": 0, "b": 0, "g": 0, "c": 1, "x": 1, "e": 2, "f": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    rates = dict.fromkeys(layout, 10.0)
    uplinks = dict.fromkeys(layout, 1e6)
    report(m, rates, uplinks)
    now = time.monotonic()  # the clock assign() stamps joins with
    assert m.rebalance(now) == []  # 30, 20, 20: no move lifts the bound
    # x's uplink falls to a hundredth: 1e4 B/s carry 5 samples/s on a middle stage, where
    # it sends activations and gradients (and 10 on an end stage, where it sends one):
    # stage 1 falls to 15, and stage 0 has a node to spare.
    uplinks["x"] = 1e4
    report(m, rates, uplinks)
    assert m.rates_changed()
    orders = m.rebalance(now + 100.0)
    assert orders, "the fall of x's link should call for a move"
    assert all(o.reason.startswith("bandwidth") for o in orders), orders
    assert not m.rates_changed()
    # Never a stage's last replica, and the mover is out of the plan until it is Ready.
    assert m.covered()
    moved = {o.node_id for o in orders}
    assert all(not m.members[n].serving for n in moved)
    assert m.rebalance(now + 200.0) == []  # the batch settles before another is planned


def test_moves_wait_for_the_cooldown() -> None:
    m = make(3, cooldown_s=900.0)
    layout = {"a": 0, "b": 0, "g": 0, "c": 1, "x": 1, "e": 2, "f": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    rates = dict.fromkeys(layout, 10.0)
    uplinks = dict.fromkeys(layout, 1e6)
    uplinks["x"] = 1e4
    report(m, rates, uplinks)
    joined = max(member.moved_at for member in m.members.values())
    assert m.rebalance(joined + 10.0) == []
    assert m.rebalance(joined + 901.0) != []


# Three stages of two replicas each lose one and get a fresh node: the coordinator may see a
# death (the broker's Last Will, seconds after a SIGKILL) before or after any fresh node
# registers, in any order. Of the 720 orders, those where nothing but the time of a death
# decides (the first three went wrong with the cool-down holding second replicas back), and
# the plain ones.
_CHURN_ORDERS = [
    "gone0 join0 join1 gone1 gone2 join2",
    "join0 join1 gone0 join2 gone1 gone2",
    "join2 gone0 join1 gone2 gone1 join0",
    "gone0 join0 gone1 join1 gone2 join2",
    "join0 join1 join2 gone0 gone1 gone2",
    "gone2 gone1 gone0 join2 join1 join0",
]


@pytest.mark.parametrize("order", _CHURN_ORDERS)
def test_after_churn_every_stage_gets_back_two_replicas_in_any_order_of_events(
    order: str,
) -> None:
    """Wherever the fresh nodes land, the coordinator evens the stages out to two replicas
    each as soon as the serving nodes show a stage with one (it calls `second_replicas` at
    every change), though every node joined within the cool-down (integration test:
    tests/integration/test_churn_headline.py)."""
    m = make(3, cooldown_s=900.0)
    for name, stage in (("a", 0), ("b", 0), ("c", 1), ("d", 1), ("e", 2), ("f", 2)):
        serve(m, name, stage)
    rates = dict.fromkeys("abcdef", 10.0)
    report(m, rates, dict.fromkeys(rates, 1e9))
    victims = {0: "b", 1: "d", 2: "f"}
    orders = []
    for what, stage in ((e[:-1], int(e[-1])) for e in order.split()):
        if what == "gone":
            m.members[victims[stage]].online = False
        else:
            fresh = m.assign(f"fresh{stage}", "x:1")
            fresh.online = fresh.announced = True
            assert m.second_replicas(fresh.moved_at) == [], "a node still fetches: no move yet"
            fresh.serving = True
            rates[fresh.node_id] = 10.0
            report(m, rates, dict.fromkeys(rates, 1e9))
        now = max(member.moved_at for member in m.members.values())
        orders += m.second_replicas(now)
        arrive(m)
    assert all(o.reason.startswith("second replica") for o in orders), orders
    assert m.rebalance(now + 1.0) == []
    counts = placement.replica_counts({n.node_id: n.stage for n in m.live()}, 3)
    assert counts == [2, 2, 2], (counts, orders)


def test_a_stable_fleet_with_noisy_rates_makes_no_moves_in_1000_rounds() -> None:
    """Hysteresis through the live path: once the policy has settled a fleet, +-3 % noise
    on every rate and link makes zero moves. (While it settles, the jitter starts the local
    search from different points, and a real gain just under `min_gain` may be tipped over
    it once: here 20.2 -> 22.1 samples/s, seen as 19.7 -> 22.1. That is one batch, not
    thrash: the fleet then stays.)"""
    rng = random.Random(20)
    m = make(4)
    names = [f"n{i}" for i in range(11)]
    rates = {n: rng.choice((4.0, 8.0, 12.0, 20.0)) for n in names}
    uplinks = {n: rng.choice((1e4, 3e4, 1e6)) for n in names}
    for name in names:
        member = m.assign(name, f"{name}:1")
        member.online = member.announced = member.serving = True
    now = time.monotonic()
    quiet = 0
    for _ in range(3000):  # settle: until 300 rounds in a row make no move
        report(m, rates, uplinks, noise=0.03, rng=rng)
        now += 60.0
        quiet = 0 if m.rebalance(now) else quiet + 1
        arrive(m)
        if quiet == 300:
            break
    assert quiet == 300, "the fleet never settled"
    settled = {k: v.stage for k, v in m.members.items()}
    moves = 0
    for _ in range(1000):
        report(m, rates, uplinks, noise=0.03, rng=rng)
        now += 60.0
        moves += len(m.rebalance(now))
        arrive(m)
    assert moves == 0
    assert {k: v.stage for k, v in m.members.items()} == settled


def test_a_lost_last_replica_is_refilled_from_a_stage_that_keeps_one() -> None:
    m = make(3)
    for name, stage in (("a", 0), ("b", 0), ("c", 1), ("d", 2)):
        serve(m, name, stage)
    report(m, dict.fromkeys("abcd", 10.0), dict.fromkeys("abcd", 1e6))
    m.members["c"].online = False
    order = m.heal()
    assert order is not None and order.to_stage == 1 and order.from_stage == 0
    assert order.reason.startswith("empty stage")
    assert m.heal() is None


def test_the_replicas_reduce_is_a_steps_cost_not_link_load_per_sample() -> None:
    """Every stage waits at the barrier for the reduce: counted on the replicas' links, a
    replica whose link fell looked worthless while the whole swarm waited for it."""
    m = make(3)
    for name, stage in (("a", 0), ("b", 1), ("c", 1), ("d", 2)):
        serve(m, name, stage)
    report(m, dict.fromkeys("abcd", 10.0), dict.fromkeys("abcd", 1e6))
    for name, peer in (("b", "c"), ("c", "b")):
        t = m.members[name].telemetry
        assert t is not None
        t.link_estimates.append(
            control_pb2.LinkEstimate(
                peer=peer, direction="reduce", bytes_per_second=1e6, wire_bytes=SAMPLES * 500
            )
        )
    t = m.members["b"].telemetry
    assert t is not None
    t.link_estimates[-1].bytes_per_second = 1.0  # b's reduce link fell
    specs, caps = m.fleet(m.live())
    assert specs[1].bytes_out_per_sample == 2 * CUT_BYTES
    assert specs[1].bytes_in_per_sample == 2 * CUT_BYTES
    assert caps["b"].bandwidth_out == caps["c"].bandwidth_out


def test_the_throughput_view_shows_the_bound_the_best_plan_and_what_limits_each_node() -> None:
    m = make(3)
    layout = {"a": 0, "b": 0, "g": 0, "c": 1, "x": 1, "e": 2, "f": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    uplinks = dict.fromkeys(layout, 1e6)
    uplinks["x"] = 1e4
    report(m, dict.fromkeys(layout, 10.0), uplinks)
    view = m.throughput()
    assert view.stage_rates == pytest.approx([30.0, 15.0, 20.0], rel=1e-3)
    assert view.bound == pytest.approx(15.0, rel=1e-3)
    assert view.best_bound == pytest.approx(20.0, rel=1e-3)  # g on stage 1: 20, 25, 20
    limited = {n.node_id: n.limited_by for n in view.nodes}
    assert limited["x"] == "bandwidth" and limited["c"] == "compute"


def test_moves_that_would_leave_a_stage_unserved_are_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard in Membership, whatever batch the policy plans: a batch taking both serving
    replicas off stage 0 keeps one of them there (movers stop serving at once; arrivals
    serve only once Ready)."""
    m = make(3)
    layout = {"a": 0, "b": 0, "c": 1, "d": 1, "e": 1, "f": 2, "g": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    report(m, dict.fromkeys(layout, 10.0), dict.fromkeys(layout, 1e6))

    def planned(*args: object, **kwargs: object) -> list[placement.Move]:
        return [
            placement.Move(
                node_id=n, from_stage=f, to_stage=t, reason="second-replica", download_s=1.0
            )
            for n, f, t in (("a", 0, 1), ("b", 0, 2), ("c", 1, 0))
        ]

    monkeypatch.setattr(placement, "rebalance", planned)
    orders = m.rebalance(time.monotonic())
    assert [o.node_id for o in orders] == ["c"]
    assert [x.node_id for x in m.replicas(0)] == ["a", "b"]


def test_a_rebalance_leaves_every_stage_one_of_the_replicas_it_had() -> None:
    """Over seeded random fleets and layouts: whatever chain of moves the policy plans, no
    stage sees all its present replicas leave (they stop serving at once, and arrivals serve
    only once they hold the state)."""
    rng = random.Random(7)
    policy = PlacementPolicy(cooldown_s=0.0)
    for _ in range(200):
        n_stages = rng.randint(2, 4)
        stages = placement.stages_from_cuts(
            [1.0] * n_stages, [1000.0] * (n_stages - 1), [1000.0] * (n_stages - 1),
            [1e6] * n_stages,
        )  # fmt: skip
        nodes = {
            f"n{i}": placement.NodeCaps(
                node_id=f"n{i}",
                speed=rng.choice((2.0, 5.0, 10.0, 30.0)),
                bandwidth_in=1e9,
                bandwidth_out=rng.choice((2e3, 1e4, 1e6)),
            )
            for i in range(rng.randint(n_stages, 10))
        }
        assignment = {k: rng.randrange(n_stages) for k in nodes}
        moves = placement.rebalance(assignment, nodes, stages, policy, now=0.0, last_moved={})
        had = placement.replica_counts(assignment, n_stages)
        leaving = placement.replica_counts({m.node_id: m.from_stage for m in moves}, n_stages)
        assert all(leaving[s] < had[s] for s in range(n_stages) if had[s]), (assignment, moves)


def test_links_limited_each_on_their_own_carry_their_sum_at_the_split_they_see() -> None:
    # Two peers at 1e5 B/s each (the testnet's per-peer send limit), an even split: 2e5.
    assert fleet_model.links_carry([(500.0, 1e5), (500.0, 1e5)]) == 2e5
    # A 3:1 split: the link with 3/4 of the bytes fills first, at 1e5 / 0.75 for the node.
    three_to_one = [(750.0, 1e5), (250.0, 1e5)]
    assert fleet_model.links_carry(three_to_one) == pytest.approx(1e5 / 0.75)
    # One uplink shared while busy: each meter sees its share, the node its uplink.
    shared = [(750.0, 7.5e4), (250.0, 2.5e4)]
    assert fleet_model.links_carry(shared) == pytest.approx(1e5)
    assert fleet_model.links_carry([]) == math.inf


def test_a_sender_whose_link_fell_does_not_make_its_receivers_look_slow() -> None:
    m = make(3)
    layout = {"a": 0, "c": 1, "x": 1, "e": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    report(m, dict.fromkeys(layout, 10.0), {"a": 1e6, "c": 1e6, "x": 1e4, "e": 1e6})
    _, caps = m.fleet(m.live())
    assert caps["x"].bandwidth_out == pytest.approx(1e4)
    # a hears from c (1e6 x its half of c's bytes) and from x (1e4 x half): the sum.
    assert caps["a"].bandwidth_in == pytest.approx(0.5e6 + 0.5e4)


def _moved_for_a_slow_uplink(
    m: Membership,
) -> tuple[list[MoveOrder], dict[str, float], dict[str, float]]:
    """Seven nodes serving, x's uplink at a hundredth of the others', one rebalancing round
    and its movers arrived: the orders, and the rates and uplinks to report with."""
    layout = {"a": 0, "b": 0, "g": 0, "c": 1, "x": 1, "e": 2, "f": 2}
    for name, stage in layout.items():
        serve(m, name, stage)
    rates = dict.fromkeys(layout, 10.0)
    uplinks = dict.fromkeys(layout, 1e6)
    uplinks["x"] = 1e4
    report(m, rates, uplinks)
    orders = m.rebalance(time.monotonic() + 100.0)
    assert orders
    arrive(m)
    return orders, rates, uplinks


def test_a_mover_is_unconfirmed_until_it_served_two_whole_steps_on_its_new_stage() -> None:
    """A mover's figures on its new stage are estimates until it has served two whole steps
    there (the first may be partial; placement.rebalance plans no throughput move on them,
    test_placement), and once it is measured its counters start from the move."""
    m = make(3)
    orders, rates, uplinks = _moved_for_a_slow_uplink(m)
    movers = {o.node_id for o in orders}
    assert m.unconfirmed() == movers
    # One whole step on the new stage: the first may have been partial, not yet.
    report(m, rates, uplinks)
    assert m.unconfirmed() == movers
    report(m, rates, uplinks)
    assert m.unconfirmed() == set()
    mover = m.members[next(iter(movers))]
    assert mover.telemetry is not None and mover.moved_from is not None
    observed = fleet_model.since(mover.telemetry, mover.moved_from)
    assert observed.samples == 2 * SAMPLES  # two steps on its new stage, not its old ones


def test_a_mover_that_reports_nothing_counts_as_measured_once_the_swarm_moved_on() -> None:
    m = make(3)
    orders, rates, uplinks = _moved_for_a_slow_uplink(m)
    quiet = {o.node_id: m.members[o.node_id].telemetry for o in orders}
    for _ in range(membership.CONFIRM_WITHIN_STEPS):
        assert m.unconfirmed()
        report(m, rates, uplinks)
        for node_id, telemetry in quiet.items():  # its telemetry is lost
            m.members[node_id].telemetry = telemetry
    assert m.unconfirmed() == set()


def test_a_steps_fixed_costs_come_from_the_coordinators_clock() -> None:
    history = []
    for step in range(5):
        start = 100.0 * step
        history.append(
            StepStats(
                step=step,
                started_at=start,
                samples=64,
                first_commit_at=start + (50.0 if step == 0 else 3.0 + step % 2),
                finished_at=start + 90.0,
            )
        )
    late = history[3]  # step 2's barrier took 15 s
    late.started_at += 5.0
    late.first_commit_at = late.started_at + 4.0
    late.finished_at = late.started_at + 90.0
    costs = fleet_model.step_costs(history, microbatch=4)
    assert costs is not None
    # Steps 1-3 (step 0 is start-up; step 4 has no next opening yet): fills 4, 3, 4 s
    # (from the step's opening), barriers 10, 15, 5 s.
    assert (costs.fill_s, costs.barrier_s) == (4.0, 10.0)
    assert (costs.samples, costs.first_samples) == (64, 4)
    assert fleet_model.step_costs(history[:2], microbatch=4) is None
    # The bound of whole steps: 64 samples at 16/s streaming take 14 + 60 / 16 s.
    assert costs.rate(16.0) == pytest.approx(64 / (4.0 + 10.0 + 60 / 16))


def test_since_counts_what_a_node_did_after_an_earlier_report() -> None:
    def telemetry(samples: int, sent: int) -> control_pb2.Telemetry:
        link = control_pb2.LinkEstimate(
            peer="p", direction="activation", wire_bytes=sent, bytes_per_second=1e3
        )
        return control_pb2.Telemetry(samples=samples, link_estimates=[link])

    later = fleet_model.since(telemetry(300, 9000), telemetry(100, 5000))
    assert later.samples == 200 and later.link_estimates[0].wire_bytes == 4000
    assert later.link_estimates[0].bytes_per_second == 1e3  # the meter is the link's
    # Counters that went back: the node restarted, and its report stands.
    assert fleet_model.since(telemetry(50, 10), telemetry(100, 5000)).samples == 50
