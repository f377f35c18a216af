"""The coordinator rebalances a live swarm when a node's link falls: a move with reason
bandwidth, the run finishes, nothing is lost (`swarmpipe bench rebalance` measures it)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from swarmpipe.bench.rebalance import FAST_REBALANCING, choose_victim
from swarmpipe.control import link_control
from swarmpipe.control.bus import parse_broker_url
from swarmpipe.process.ready import poll_until, read_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.transport.limits import MBIT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# A long, narrow model: 8 KB of activations (and of gradients) per sample across each cut,
# and stages of a few thousand parameters, so the replicas' reduce is small beside the
# activations. At 2 Mbit/s a first or last stage's replica carries about 30 samples/s and a
# middle one half that, under what it computes: the links decide where nodes belong, and
# with 8 nodes the swarm settles on 2, 4 and 2 replicas.
MBIT_PER_LINK = 2.0
NODES = 8
MODEL = ("model.context=128", "model.d_model=16", "model.n_heads=2")


def test_a_node_whose_link_falls_is_compensated_by_a_bandwidth_move(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    target = procs.coordinator(
        *tiny,
        *MODEL,
        "pipeline.stages=3",
        "train.steps=30",
        "train.global_batch=64",
        f"pipeline.link_mbit={MBIT_PER_LINK}",
        f"coordinator.min_nodes={NODES}",
        *FAST_REBALANCING,
    )
    broker = read_ready_file(procs.tmp / "coordinator.ready.json")["broker_url"]  # type: ignore[index]
    procs.nodes(NODES, target)
    with grpc.insecure_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def status() -> coordinator_pb2.StatusReply:
            reply: coordinator_pb2.StatusReply = stub.Status(
                coordinator_pb2.StatusRequest(), timeout=10
            )
            return reply

        # The links make middle replicas worth half: the swarm settles with a victim to
        # choose (a stage with two replicas) and every node serving.
        def settled() -> coordinator_pb2.StatusReply | None:
            s = status()
            calm = len(s.steps) >= 10 and all(n.serving for n in s.nodes)
            return s if calm and choose_victim(s, 3) is not None else None

        before = poll_until(settled, 240, "ten steps with every node serving")
        victim = choose_victim(before, 3)
        assert victim is not None
        assert before.placement.bound > 0 and before.placement.stage_rates
        moves_before = len(before.moves)
        asyncio.run(
            link_control.publish(
                parse_broker_url(broker), before.run_id, victim, MBIT_PER_LINK * MBIT / 10
            )
        )

        def bandwidth_move() -> list[coordinator_pb2.MoveRecord]:
            s = status()
            assert not s.done, f"the run ended without a move: {list(s.moves)}"
            return [m for m in list(s.moves)[moves_before:] if m.reason.startswith("bandwidth")]

        moves = poll_until(bandwidth_move, 240, "a move with reason bandwidth")
        # The mover goes to the victim's stage, or the victim leaves for where it does less harm.
        victim_stage = next(n.stage for n in before.nodes if n.node_id == victim)
        assert any(m.to_stage == victim_stage or m.node_id == victim for m in moves), moves

        def finished() -> coordinator_pb2.StatusReply | None:
            s = status()
            return s if s.done else None

        final = poll_until(finished, 400, "the run to finish")
    assert final.counters.lost == 0
    assert final.counters.committed >= final.total_steps * 64
    # Every stage kept a replica throughout: the run finished all its steps.
    assert len(final.steps) == final.total_steps
    limited = {n.node_id: n.limited_by for n in final.placement.nodes}
    assert limited.get(victim, "bandwidth") == "bandwidth", limited
