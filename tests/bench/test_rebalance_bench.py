"""`bench rebalance`'s arithmetic: the host-aware bound and the testnet's CPU use."""

from __future__ import annotations

import os
import time

import pytest

from swarmpipe.bench.rebalance import host_bound, summarise_breakdown, tree_cpu_seconds
from swarmpipe.protos import coordinator_pb2


def _record(*nodes: tuple[str, int, float, float]) -> coordinator_pb2.PlacementRecord:
    stages = 1 + max(stage for _, stage, _, _ in nodes)
    return coordinator_pb2.PlacementRecord(
        bound=1.0,
        stage_rates=[0.0] * stages,
        nodes=[
            coordinator_pb2.NodeRate(node_id=n, stage=s, compute=c, effective=e)
            for n, s, c, e in nodes
        ],
    )


def test_the_host_bound_is_the_cores_over_the_compute_seconds_a_sample_costs() -> None:
    # Stage 0: two replicas computing 10/s, each taking half the samples: 0.1 s a sample.
    # Stage 1: one replica computing 20/s whose link holds it to 5/s: 0.05 s a sample.
    record = _record(("a", 0, 10.0, 4.0), ("b", 0, 10.0, 4.0), ("c", 1, 20.0, 5.0))
    assert host_bound(record, cores=2) == pytest.approx(2 / 0.15)


def test_a_replica_takes_the_share_of_its_stage_that_its_effective_rate_gives() -> None:
    # Stage 0: a slow replica (5/s) takes 1/4 of the samples, a fast one (20/s) 3/4.
    record = _record(("a", 0, 5.0, 1.0), ("b", 0, 20.0, 3.0))
    assert host_bound(record, cores=1) == pytest.approx(1 / (0.25 / 5 + 0.75 / 20))


def test_no_host_bound_while_a_stage_has_no_measured_replica() -> None:
    assert host_bound(_record(("a", 0, 10.0, 10.0), ("b", 1, 0.0, 0.0)), cores=2) is None


def test_the_cpu_of_a_process_tree_counts_its_own_work() -> None:
    before = tree_cpu_seconds(os.getpid())
    end = time.process_time() + 0.05
    while time.process_time() < end:
        pass
    assert tree_cpu_seconds(os.getpid()) >= before + 0.03


def test_the_breakdown_summary_keeps_the_shares_and_drops_the_steps() -> None:
    breakdown = {
        "coordinator": {"boundary_share": 0.25, "steps": [{"step": 1}]},
        "nodes": {"n0": {"stage": 1, "shares": {"compute": 0.5, "waiting": 0.5}, "steps": []}},
    }
    assert summarise_breakdown(breakdown) == {
        "boundary_share": 0.25,
        "nodes": {"n0": {"stage": 1, "compute": 0.5, "waiting": 0.5}},
    }
