"""Per-peer limits on a real node (issue 22): a peer that opens more streams than the run
allows gets RESOURCE_EXHAUSTED while the run's own traffic still flows, and a stream that
stops sending is ended."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from swarmpipe.process.ready import poll_until
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc, stage_pb2, stage_pb2_grpc
from tests.conftest import Procs, organiser_channel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STREAMS = 4
"""The run's pipeline.peer_max_streams: small, so the test opens few; the run's own traffic
stays below it (in_flight=2: at most two Forward streams from the head at once)."""


def _step(coordinator: str, procs: Procs) -> int:
    with organiser_channel(coordinator, procs.tmp / "coordinator-state") as channel:
        reply = coordinator_pb2_grpc.CoordinatorStub(channel).Status(
            coordinator_pb2.StatusRequest(), timeout=10
        )
    return int(reply.step)


def _watch(channel: grpc.Channel) -> Any:
    """An open health Watch: a stream any caller may open, credential or not."""
    stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
    next(stream)  # its first status: the stream is open on the node
    return stream


def test_a_peer_over_its_stream_limit_is_refused_while_the_run_trains(
    procs: Procs, tiny: list[str]
) -> None:
    coordinator = procs.coordinator(
        *tiny,
        "pipeline.stages=2",
        "train.steps=100000",
        "pipeline.in_flight=2",
        f"pipeline.peer_max_streams={STREAMS}",
        "pipeline.stream_idle_s=3",
    )
    procs.nodes(2, coordinator)
    last = procs.wait_serving("n1")
    target = f"127.0.0.1:{last['grpc_port']}"
    poll_until(lambda: _step(coordinator, procs) >= 1, 120, "the run to train")

    stranger = grpc.insecure_channel(target)  # no credential: limited by its address
    streams = []
    try:
        streams = [_watch(stranger) for _ in range(STREAMS)]
        with pytest.raises(grpc.RpcError) as refused:
            _watch(stranger)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"peer_max_streams={STREAMS}" in (refused.value.details() or "")
        # The run's own streams are the nodes', counted apart: training goes on.
        at_flood = _step(coordinator, procs)
        poll_until(lambda: _step(coordinator, procs) >= at_flood + 3, 120, "steps past the flood")
        # A stream closed gives its slot back.
        streams.pop().cancel()
        streams.append(poll_until(lambda: _open_or_none(stranger), 30, "a slot freed"))
    finally:
        for stream in streams:
            stream.cancel()
        stranger.close()

    log = (procs.tmp / "n1.log").read_text()
    assert "a call over its peer's limit" in log and "Traceback" not in log

    # The coordinator's server holds its peers to the same run's limits.
    with grpc.insecure_channel(coordinator) as channel:
        held = [_watch(channel) for _ in range(STREAMS)]
        try:
            with pytest.raises(grpc.RpcError) as refused:
                _watch(channel)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        finally:
            for stream in held:
                stream.cancel()


def _open_or_none(channel: grpc.Channel) -> Any:
    try:
        return _watch(channel)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


def test_a_stream_that_stops_sending_is_ended(procs: Procs, tiny: list[str]) -> None:
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=2", "train.steps=100000", "pipeline.stream_idle_s=3"
    )
    procs.nodes(2, coordinator)
    last = procs.wait_serving("n1")
    gate = threading.Event()

    def stalled() -> Iterator[stage_pb2.ForwardMessage]:
        yield stage_pb2.ForwardMessage(microbatch=stage_pb2.MicrobatchHeader(hop=1))
        gate.wait(60)  # a sender that never sends the tensor

    with procs.peer_channel(last["grpc_port"], "staller") as channel:
        replies = stage_pb2_grpc.StageStub(channel).Forward(stalled(), timeout=60)
        try:
            with pytest.raises(grpc.RpcError) as ended:
                next(replies)
        finally:
            gate.set()
    assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "pipeline.stream_idle_s" in (ended.value.details() or "")
    assert "an idle stream" in (procs.tmp / "n1.log").read_text()
