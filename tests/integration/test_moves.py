"""An operator moves a node to another stage: it fetches that stage's state and serves it,
and moves that cannot be made are refused with a clear status."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from swarmpipe.process.ready import poll_until, read_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_moved_node_serves_its_new_stage_and_bad_moves_are_refused(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    # 100 ms each way: the swarm needs to keep training while the test moves things, not
    # to burn both cores meanwhile.
    target = procs.coordinator(
        *tiny, "pipeline.stages=3", "train.steps=1000", "pipeline.link_latency_ms=100"
    )
    nodes = procs.nodes(4, target)
    for name in nodes:
        procs.wait_serving(name)
    with grpc.insecure_channel(target) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)

        def status() -> coordinator_pb2.StatusReply:
            reply: coordinator_pb2.StatusReply = stub.Status(
                coordinator_pb2.StatusRequest(), timeout=5
            )
            return reply

        poll_until(lambda: len(status().steps) >= 2, 60, "training to be under way")
        # One stage has two replicas (which one, the measured rates decide), the others one.
        stages = {n.node_id: n.stage for n in status().nodes}
        by_stage = {stage: sorted(n for n, s in stages.items() if s == stage) for stage in range(3)}
        (source,) = [stage for stage, names in by_stage.items() if len(names) == 2]
        alone_stage, dest = [stage for stage in range(3) if stage != source]
        doubled, (alone,) = by_stage[source], by_stage[alone_stage]

        def refused(node: str, stage: int) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as err:
                stub.Move(coordinator_pb2.MoveRequest(node_id=node, stage=stage), timeout=5)
            return err.value

        assert refused("nobody", 1).code() == grpc.StatusCode.NOT_FOUND
        bad_stage = refused(doubled[1], 7)
        assert bad_stage.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stage 7 does not exist" in (bad_stage.details() or "")
        last = refused(alone, dest)
        assert last.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"last replica of stage {alone_stage}" in (last.details() or "")
        assert refused(doubled[1], source).code() == grpc.StatusCode.FAILED_PRECONDITION

        # The command says the same in one line, exit 1, no traceback.
        for args, words in (
            (["nobody", "1"], "no node 'nobody'"),
            ([doubled[1], "7"], "stage 7 does not exist"),
        ):
            done = subprocess.run(
                [sys.executable, "-m", "swarmpipe", "move", *args, "--coordinator", target],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            errors = done.stderr.strip().splitlines()
            assert len(errors) == 1 and words in errors[0], done.stderr

        moved_by = subprocess.run(
            [sys.executable, "-m", "swarmpipe", "move", doubled[1], str(dest),
             "--coordinator", target],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert moved_by.returncode == 0, moved_by.stderr
        assert f"moving {doubled[1]} from stage {source} to stage {dest}" in moved_by.stdout
        ready = procs.tmp / f"{doubled[1]}.ready.json"
        moved = poll_until(
            lambda: (r := read_ready_file(ready)) and r["stage"] == dest and r["serving"] and r,
            60,
            f"the moved node to serve stage {dest}",
        )
        with procs.peer_channel(moved["grpc_port"]) as node_channel:
            info = stage_pb2_grpc.StageStub(node_channel).Info(
                stage_pb2.StageInfoRequest(), timeout=5
            )
        assert (info.stage, info.serving) == (dest, True)
        final = poll_until(
            lambda: (
                (s := status()).moves
                and any(n.node_id == doubled[1] and n.stage == dest and n.serving for n in s.nodes)
                and s
            ),
            60,
            "the coordinator to see the move through",
        )
        (record,) = final.moves
        assert (record.node_id, record.from_stage, record.to_stage) == (doubled[1], source, dest)
        assert record.reason == "moved by the operator"
        step = len(final.steps)
        poll_until(lambda: len(status().steps) >= step + 3, 60, "training to go on")
        assert status().counters.lost == 0
