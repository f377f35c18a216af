"""A real swarm with one hostile replica among three: it is dropped, benched and reported.

"The same run without it" is defined exactly: the stage's initial parameters
(built from the run's config and seed, as every node builds them) stepped with
AdamW, at every step, on the plain sum, in node-id order, of the honest
replicas' own gradient sums divided by their tokens: what a two-replica stage
given the same microbatches computes. Each node records the contributions it
agreed on (SWARMPIPE_RECORD_REDUCE), and the test replays the honest ones.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.node.robust_reduce import plain_sum
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from tests.conftest import run_to_end, run_to_end_at

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS = 6


def test_a_replica_sending_its_gradient_times_1000_is_dropped_benched_and_reported(
    procs, tiny, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # x1000 is far past any honest norm: a conclusive verdict, so the default rule (two
    # verdicts) benches at the first (the fastest replica leases most microbatches, and nx
    # had traffic at one step of six in one run).
    coordinator, records = _swarm_with_hostile(procs, tiny, tmp_path, "scale:1000", STEPS)
    channel = grpc.insecure_channel(coordinator)
    stub = coordinator_pb2_grpc.CoordinatorStub(channel)
    try:
        final = run_to_end(stub)
        # A benched node cannot come back under its name, and a stranger (no node credential)
        # cannot report.
        with pytest.raises(grpc.RpcError) as refused:
            stub.Join(coordinator_pb2.JoinRequest(node_id="nx", address="127.0.0.1:1"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "is benched for" in (refused.value.details() or "")
        with pytest.raises(grpc.RpcError) as stranger:
            stub.ReportPeer(
                coordinator_pb2.ReportPeerRequest(
                    reporter="nobody",
                    suspect="n0",
                    kind=coordinator_pb2.ReportPeerRequest.KIND_REDUCE,
                ),
                timeout=5,
            )
        assert stranger.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        channel.close()

    # The hostile node was benched on the honest replicas' two reports, and said why.
    assert [b.node_id for b in final.benched] == ["nx"]
    bench = final.benched[0]
    assert list(bench.reporters) == ["n0", "n1"] and "the bound is 10x" in bench.reason
    assert bench.step_begun_again
    assert final.reports >= 2
    coordinator_log = (tmp_path / "coordinator.log").read_text()
    assert "node nx (stage 0) benched" in coordinator_log

    # Every reduce the honest replicas took part in: nx dropped whenever it had traffic,
    # and the honest replicas equal the run without it.
    dropped = _equal_to_the_run_without_nx(records, tiny, STEPS, final)
    assert dropped and dropped[0] == bench.step


def test_a_replica_sending_noise_is_dropped_benched_and_the_honest_ones_stay_equal(
    procs, tiny, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Eight microbatches a step, not four, and one in flight a head: the fastest replica
    # leases what it can, and nx had traffic at one step of eight in one run and at none
    # after step 0 in another. The default screens only: the tensor-scale screen needs no
    # optimizer history, so the noise is dropped from step 0 on, as x1000 is. Its verdict is
    # conclusive, so the default rule (two verdicts) benches at the first one.
    coordinator, records = _swarm_with_hostile(
        procs, tiny, tmp_path, "noise", 12, "train.microbatch=2", "pipeline.in_flight=1",
    )  # fmt: skip
    final = run_to_end_at(coordinator)
    # Benched for its tensors' equal scales, never an honest replica; each drop was reported.
    assert [b.node_id for b in final.benched] == ["nx"]
    bench = final.benched[0]
    assert list(bench.reporters) == ["n0", "n1"] and "as equal a root-mean-square" in bench.reason
    assert bench.step_begun_again
    assert final.reports >= 2
    dropped = _equal_to_the_run_without_nx(records, tiny, 12, final)
    assert dropped and dropped[0] == bench.step


def _equal_to_the_run_without_nx(  # type: ignore[no-untyped-def]
    records: Path, tiny, steps: int, final: coordinator_pb2.StatusReply
) -> list[int]:
    """Check that n0 and n1 agreed on every reduce's inputs and verdict, that nx was dropped
    at every step it had traffic and nobody else ever, that each such step began again
    without it (the reduce it took back is kept under taken-back/) and so lost no sample,
    and that both honest replicas hold the parameters of the same run without nx; the
    steps nx was dropped at."""
    config = load_config(None, [*tiny, "pipeline.stages=1"])
    tokens_per_step = config.train.global_batch * config.model.context
    recorded = sorted(int(p.stem.split("-")[1]) for p in (records / "n0").glob("step-*.pt"))
    assert recorded == list(range(steps))
    replay = StageRuntime(config, 0)
    dropped: list[int] = []
    for step in recorded:
        for folder in ("", "taken-back"):
            paths = [records / n / folder / f"step-{step}.pt" for n in ("n0", "n1")]
            if not any(path.exists() for path in paths):
                continue
            assert all(path.exists() for path in paths), step  # both began again, or neither
            r0, r1 = (torch.load(path) for path in paths)
            assert r0["accepted"] == r1["accepted"] and r0["rejected"] == r1["rejected"]
            assert set(r0["contributions"]) == set(r1["contributions"])
            for node, (flat, tokens, samples) in r0["contributions"].items():
                other = r1["contributions"][node]
                assert torch.equal(flat, other[0]) and (tokens, samples) == other[1:]
            if "nx" in r0["contributions"] and r0["contributions"]["nx"][1] > 0:
                assert set(r0["rejected"]) == {"nx"}, step  # whenever nx had traffic
                assert folder == "taken-back", step  # and then its step began again
                dropped.append(step)
            else:  # nx had no traffic (its zero sum adds nothing), or it was gone
                assert set(r0["rejected"]) == set(), step
        last = torch.load(records / "n0" / f"step-{step}.pt")
        honest = {n: last["contributions"][n] for n in ("n0", "n1")}
        assert sum(c[1] for c in honest.values()) == tokens_per_step, step  # nothing lost
        replay.apply_step(step, plain_sum(honest))
    honest_nodes = [n for n in final.nodes if n.node_id in ("n0", "n1")]
    assert all(n.last_step == steps - 1 for n in honest_nodes)
    assert {n.param_digest for n in honest_nodes} == {replay.parameter_digest()}
    assert final.counters.lost == 0
    return dropped


def _swarm_with_hostile(  # type: ignore[no-untyped-def]
    procs, tiny, tmp_path: Path, mode: str, steps: int, *settings: str
) -> tuple[str, Path]:
    """A coordinator and three replicas of one stage, n0, n1 and the hostile nx, each
    recording the contributions it agreed on; the coordinator's address and the records."""
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=1", f"train.steps={steps}", "coordinator.min_nodes=3",
        "checkpoint.every_steps=0", "pipeline.reduce_timeout_s=20",
        *settings,
    )  # fmt: skip
    records = tmp_path / "records"
    env = {"SWARMPIPE_RECORD_REDUCE": str(records), "SWARMPIPE_HOSTILE": f"nx={mode}"}
    for name in ("n0", "n1", "nx"):
        procs.node(name, coordinator, env=env)
    return coordinator, records
