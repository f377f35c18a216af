"""Requests parsed in our code: valid ones reach the servicer as before, bad ones are
INVALID_ARGUMENT naming the method and one rate-limited line, in every kind of call."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
import pytest

from swarmpipe.protos import stage_pb2, stage_pb2_grpc, state_pb2, tensor_pb2
from swarmpipe.transport.request_parsing import BadRequestLog, add_servicer, peer_host
from swarmpipe.transport.rpc import bind, create_server, open_channel

pytestmark = pytest.mark.timeout(60)

STAGE = stage_pb2.DESCRIPTOR.services_by_name["Stage"]
# Field 1, length-delimited, promising 5 bytes and carrying 2: no message parses from it.
NOT_A_MESSAGE = b"\x0a\x05ab"


class Echo:
    """A Stage servicer that records what it was handed, one of each kind of call."""

    def __init__(self) -> None:
        self.seen: list[object] = []
        self.closed = 0

    async def Info(
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoReply:
        self.seen.append(request)
        return stage_pb2.StageInfoReply(node_id="echo", step=7)

    async def FetchState(
        self, request: stage_pb2.FetchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[state_pb2.StateMessage]:
        self.seen.append(request)
        try:
            for i in range(3):
                yield state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=bytes([i])))
        finally:
            self.closed += 1

    async def Reduce(
        self, requests: AsyncIterator[stage_pb2.ReduceMessage], context: grpc.aio.ServicerContext
    ) -> stage_pb2.ReduceReply:
        async for message in requests:
            self.seen.append(message)
        return stage_pb2.ReduceReply()

    async def Forward(
        self, requests: AsyncIterator[stage_pb2.ForwardMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.BackwardMessage]:
        async for message in requests:
            self.seen.append(message)
            yield stage_pb2.BackwardMessage(
                result=stage_pb2.MicrobatchResult(stages_done=len(self.seen))
            )


@pytest.fixture
async def echo() -> AsyncIterator[tuple[Echo, grpc.aio.Channel, BadRequestLog]]:
    servicer, log = Echo(), BadRequestLog()
    server = create_server()
    add_servicer(server, servicer, STAGE, log)
    port = bind(server, "127.0.0.1:0")
    await server.start()
    channel = open_channel(f"127.0.0.1:{port}")
    try:
        yield servicer, channel, log
    finally:
        await channel.close()
        await server.stop(grace=None)


def _raw(channel: grpc.aio.Channel, method: str, kind: str) -> grpc.aio.MultiCallable:
    make = getattr(channel, kind)
    return make(f"/swarmpipe.v1.Stage/{method}", request_serializer=None)


async def _status(call: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call  # type: ignore[misc]
    return err.value.code(), err.value.details() or ""


async def test_valid_requests_reach_the_servicer_as_before(
    echo: tuple[Echo, grpc.aio.Channel, BadRequestLog],
) -> None:
    servicer, channel, log = echo
    info = channel.unary_unary(
        "/swarmpipe.v1.Stage/Info",
        request_serializer=stage_pb2.StageInfoRequest.SerializeToString,
        response_deserializer=stage_pb2.StageInfoReply.FromString,
    )
    assert await info(stage_pb2.StageInfoRequest()) == stage_pb2.StageInfoReply(
        node_id="echo", step=7
    )
    fetch = channel.unary_stream(
        "/swarmpipe.v1.Stage/FetchState",
        request_serializer=stage_pb2.FetchStateRequest.SerializeToString,
        response_deserializer=state_pb2.StateMessage.FromString,
    )
    got = [m.chunk.data async for m in fetch(stage_pb2.FetchStateRequest(min_step=3))]
    assert got == [b"\x00", b"\x01", b"\x02"]
    reduce = channel.stream_unary(
        "/swarmpipe.v1.Stage/Reduce",
        request_serializer=stage_pb2.ReduceMessage.SerializeToString,
        response_deserializer=stage_pb2.ReduceReply.FromString,
    )
    sent = [stage_pb2.ReduceMessage(header=stage_pb2.ReduceHeader(step=s)) for s in (1, 2)]
    assert await reduce(iter(sent)) == stage_pb2.ReduceReply()
    assert servicer.seen[:2] == [
        stage_pb2.StageInfoRequest(),
        stage_pb2.FetchStateRequest(min_step=3),
    ]
    assert servicer.seen[2:] == sent
    assert all(type(m) is not bytes for m in servicer.seen)
    assert servicer.closed == 1
    assert log.calls == 0


@pytest.mark.parametrize(
    ("method", "kind"),
    [
        ("Info", "unary_unary"),
        ("FetchState", "unary_stream"),
        ("Reduce", "stream_unary"),
        ("Forward", "stream_stream"),
    ],
)
async def test_a_message_that_does_not_parse_is_invalid_argument(
    echo: tuple[Echo, grpc.aio.Channel, BadRequestLog],
    caplog: pytest.LogCaptureFixture,
    method: str,
    kind: str,
) -> None:
    servicer, channel, log = echo
    call = _raw(channel, method, kind)
    caplog.set_level(logging.WARNING)
    for _ in range(5):
        arg = iter([NOT_A_MESSAGE]) if kind.startswith("stream") else NOT_A_MESSAGE
        code, details = await _status(call(arg))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        request_type = STAGE.methods_by_name[method].input_type.name
        assert details == f"request to /swarmpipe.v1.Stage/{method} is not a valid {request_type}"
    assert servicer.seen == []
    assert log.calls == 5
    # One line for the five calls (same peer, same method, within the interval), no traceback.
    lines = [r for r in caplog.records if r.name == "swarmpipe.transport.request_parsing"]
    assert len(lines) == 1
    assert lines[0].levelno == logging.WARNING and lines[0].exc_info is None
    assert f"/swarmpipe.v1.Stage/{method}" in lines[0].getMessage()
    assert "Traceback" not in caplog.text and "Exception deserializing" not in caplog.text


@pytest.mark.parametrize(
    ("method", "kind"), [("Reduce", "stream_unary"), ("Forward", "stream_stream")]
)
async def test_a_bad_message_mid_stream_ends_the_call(
    echo: tuple[Echo, grpc.aio.Channel, BadRequestLog], method: str, kind: str
) -> None:
    servicer, channel, _ = echo
    good = stage_pb2.ReduceMessage(header=stage_pb2.ReduceHeader(step=1)).SerializeToString()
    if method == "Forward":
        good = stage_pb2.ForwardMessage(
            microbatch=stage_pb2.MicrobatchHeader(step=1)
        ).SerializeToString()
    call = _raw(channel, method, kind)(iter([good, good, NOT_A_MESSAGE, good]))
    code, details = await _status(call)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"request to /swarmpipe.v1.Stage/{method} is not a valid ")
    assert len(servicer.seen) == 2  # the two before it, never the one after


async def test_a_method_the_servicer_lacks_is_unimplemented_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class InfoOnly(stage_pb2_grpc.StageServicer):
        async def Info(
            self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
        ) -> stage_pb2.StageInfoReply:
            return stage_pb2.StageInfoReply()

    server = create_server()
    add_servicer(server, InfoOnly(), STAGE, BadRequestLog())
    port = bind(server, "127.0.0.1:0")
    await server.start()
    try:
        async with open_channel(f"127.0.0.1:{port}") as channel:
            call = _raw(channel, "Reduce", "stream_unary")(iter([b""]))
            code, details = await _status(call)
    finally:
        await server.stop(grace=None)
    assert code == grpc.StatusCode.UNIMPLEMENTED
    assert details == "/swarmpipe.v1.Stage/Reduce is not implemented here"
    assert "Traceback" not in caplog.text


def test_the_log_is_one_line_per_peer_and_method_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = BadRequestLog(interval_s=10, max_lines=3, max_peers=3, clock=lambda: now[0])
    caplog.set_level(logging.WARNING)
    assert log.record("/s/A", "ipv4:10.0.0.1:5000", "bad")
    assert not log.record("/s/A", "ipv4:10.0.0.1:5001", "bad")  # a new port, the same peer
    assert not log.record("/s/A", "ipv4:10.0.0.1:5002", "bad")
    assert log.record("/s/B", "ipv4:10.0.0.1:5000", "bad")  # another method
    assert log.record("/s/A", "ipv6:[::1]:7", "bad")  # another peer
    assert not log.record("/s/A", "ipv4:10.0.0.2:1", "bad")  # over the overall cap
    now[0] += 10
    assert log.record("/s/A", "ipv4:10.0.0.1:5000", "bad")
    assert log.calls == 7
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert messages[-1] == (
        "refused a request from 10.0.0.1: bad; 2 more from this peer since its last line; "
        "1 more from any peer left out of the log"
    )
    assert log.record("/s/C", "ipv4:10.0.0.3:1", "bad")
    assert len(log._seen) == 3  # bounded: the oldest pair was forgotten


def test_peer_host_drops_the_port() -> None:
    assert peer_host("ipv4:127.0.0.1:43210") == "127.0.0.1"
    assert peer_host("ipv6:[::1]:43210") == "::1"
    assert peer_host("unix:/tmp/sock") == "unix:/tmp/sock"
