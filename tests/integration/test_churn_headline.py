"""Issue 4's headline: replicas SIGKILLed at different moments, fresh nodes join, nothing lost.

2 replicas per stage, 3 stages. One replica of every stage is SIGKILLed at its
own moment and a fresh node (a new id) is started after each kill; the fresh
nodes download state from the survivors and serve, and every stage is back to two
replicas, whichever stage each fresh node went to: one may register before the
coordinator has seen the node it replaces die, and the next rebalancing round then
moves a replica where one is missing (docs/design.md, placement). The run must
finish with lost == 0, every stage's live replicas bit-identical, and a final loss
(the last ten steps' mean) within 5% of the same run without churn. That run is the
single-process reference: the lossless replicated pipeline equals it to
1e-4 (tests/integration/test_training.py), and it costs one process, not six.
"""

from __future__ import annotations

import os
import signal

import grpc
import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.model.reference import train_single_process
from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Long enough for the kills, three process starts and state downloads before the end: with
# SLOW_LINKS about 1.4 steps a second on 6 nodes (measured on 2 busy cores), so 120 steps
# give the joiners over a minute. Flat out, the tiny model ran 8 steps a second and needed
# 400 steps for the same minute: each step costs the swarm about 0.18 CPU-s either way, so
# the latency cuts the scenario's CPU by more than half, which the other worker gets.
STEPS = 120
SLOW_LINKS = "pipeline.link_latency_ms=100"
# Five layers, not the tiny model's four: cut into 3 stages, four layers give stage 0 half
# the work of stage 1 (model/stage_cost.py), so one stage-0 replica is as fast as two of
# stage 1, and whether the fleet goes back to two replicas a stage is left to noise in
# the measured rates (placement gives a stage its second replica only while that costs the
# throughput bound at most 10 %). With five the cheapest stage does 0.79 of the others'
# work: a stage with one replica is the bottleneck, and safety and throughput agree.
EVEN_STAGES = "model.n_layers=5"


def test_replicas_killed_and_replaced_during_the_run_lose_nothing(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    settings = [*tiny, EVEN_STAGES, "pipeline.stages=3", f"train.steps={STEPS}"]
    target = procs.coordinator(
        *settings, SLOW_LINKS, "coordinator.min_nodes=6", "pipeline.reduce_timeout_s=60"
    )
    nodes = procs.nodes(6, target)
    channel = grpc.insecure_channel(target)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def status() -> coordinator_pb2.StatusReply:
        return stub.Status(coordinator_pb2.StatusRequest(), timeout=10)

    def serving(node_id: str, s: coordinator_pb2.StatusReply) -> bool:
        return any(n.node_id == node_id and n.serving for n in s.nodes)

    try:
        stages = {n.node_id: n.stage for n in status().nodes}
        killed, fresh = [], []
        for stage in range(3):
            at = 3 + 5 * stage  # a different moment for every stage
            poll_until(lambda a=at: len(status().steps) >= a, 300, f"step {at}")
            victim = max(n for n, s in stages.items() if s == stage)
            os.killpg(nodes[victim].pid, signal.SIGKILL)
            killed.append(victim)
            # A fresh node (new id) right away; it downloads its stage's state from a
            # survivor. Starting a process takes tens of seconds on a loaded machine,
            # so they start side by side and may register in any order.
            fresh.append(f"fresh{stage}")
            procs.start(fresh[-1], *procs._node_args(fresh[-1], target), ready=False)

        def healed() -> coordinator_pb2.StatusReply | None:
            now = status()
            replicas = [
                sum(n.online and n.serving and n.stage == s for n in now.nodes) for s in range(3)
            ]
            return now if all(serving(f, now) for f in fresh) and min(replicas) >= 2 else None

        joined = poll_until(healed, 300, "the fresh nodes to serve, two replicas a stage")
        assert len(joined.steps) < STEPS, "the run ended before the joiners served; raise STEPS"
        final: coordinator_pb2.StatusReply = poll_until(
            lambda: (s := status()).done and s, 600, "the run to finish"
        )
        c = final.counters
        assert c.lost == 0 and c.outstanding == 0, c
        assert len(final.steps) == STEPS
        live = [n for n in final.nodes if n.node_id not in killed]
        assert len(live) == 6
        for stage in range(3):
            replicas = [n for n in live if n.stage == stage]
            assert len(replicas) == 2
            assert {n.last_step for n in replicas} == {STEPS - 1}
            assert len({n.param_digest for n in replicas}) == 1, replicas
        # One thread: on a loaded machine torch's default pool spends its time
        # spinning against the other processes (this baseline outran the 900 s
        # test timeout with it).
        torch.set_num_threads(1)
        baseline = train_single_process(load_config(None, settings))
        assert baseline[-1] < 0.8 * baseline[0], "the baseline did not learn"
        # The final loss as the mean of the last ten steps' (the same samples on both sides):
        # one step's loss 120 steps in swings with where a perturbed trajectory's loss spikes
        # land (the last step alone came out 7.8 % off in one run of four).
        got = sum(s.loss for s in final.steps[-10:]) / 10
        want = sum(baseline[-10:]) / 10
        assert abs(got - want) / want < 0.05, f"final loss {got} vs {want} without churn"
    finally:
        channel.close()


def test_a_stage_left_with_one_replica_while_another_has_three_gets_a_second(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    """The order the headline test leaves to chance, made certain: a fresh node joins while
    every stage still has two replicas (as when it registers before the coordinator has seen
    the death of the node it replaces), then a replica of another stage dies. The
    coordinator moves a replica there at once (every node is inside its cool-down)."""
    # Fewer than STEPS: one process start and a move come before the end here (by step 5 on
    # 2 busy cores), where the headline test needs three starts after kills as late as
    # step 13 (it healed by step 20).
    steps = 80
    settings = [*tiny, EVEN_STAGES, "pipeline.stages=3", f"train.steps={steps}"]
    target = procs.coordinator(*settings, SLOW_LINKS, "coordinator.min_nodes=6")
    nodes = procs.nodes(6, target)
    channel = grpc.insecure_channel(target)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)

    def status() -> coordinator_pb2.StatusReply:
        return stub.Status(coordinator_pb2.StatusRequest(), timeout=10)

    try:
        poll_until(lambda: len(status().steps) >= 2, 300, "training to be under way")
        procs.node("fresh", target)
        procs.wait_serving("fresh")
        now = status()
        crowded = next(n.stage for n in now.nodes if n.node_id == "fresh")
        victim = max(n.node_id for n in now.nodes if n.stage != crowded and n.node_id in nodes)
        os.killpg(nodes[victim].pid, signal.SIGKILL)

        def healed() -> coordinator_pb2.StatusReply | None:
            s = status()
            live = [n for n in s.nodes if n.online and n.serving]
            counts = [sum(n.stage == stage for n in live) for stage in range(3)]
            return s if counts == [2, 2, 2] and len(live) == 6 else None

        evened = poll_until(healed, 300, "two serving replicas on every stage")
        assert len(evened.steps) < steps, "the run ended first; raise steps"
        assert [m.reason.split(":")[0] for m in evened.moves] == ["second replica"], evened.moves
        final = poll_until(lambda: (s := status()).done and s, 600, "the run to finish")
        assert final.counters.lost == 0 and final.counters.outstanding == 0, final.counters
        live = [n for n in final.nodes if n.node_id != victim]
        for stage in range(3):
            replicas = [n for n in live if n.stage == stage]
            assert len(replicas) == 2 and {n.last_step for n in replicas} == {steps - 1}
            assert len({n.param_digest for n in replicas}) == 1, replicas
    finally:
        channel.close()
