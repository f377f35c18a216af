"""Per-peer limits on a real in-process grpc.aio server: concurrent calls and streams are
released however a call ends, the rate bucket, peers kept apart, and idle streams ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from swarmpipe.config import PipelineConfig
from swarmpipe.errors import ConfigError
from swarmpipe.protos import stage_pb2, state_pb2, tensor_pb2
from swarmpipe.transport.auth import CREDENTIAL_KEY, CredentialHolder, metadata_value
from swarmpipe.transport.limits import CHUNK_BYTES
from swarmpipe.transport.peer_limits import PeerLimiter, PeerLimits, derived_idle_s, limits_for
from swarmpipe.transport.request_parsing import BadRequestLog, add_servicer
from swarmpipe.transport.rpc import bind, create_server, open_channel

pytestmark = pytest.mark.timeout(60)

STAGE = stage_pb2.DESCRIPTOR.services_by_name["Stage"]


class Held:
    """A Stage servicer whose calls stay open until `release` is set (or fail on request)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.started = 0
        self.finished = 0
        self.received: list[stage_pb2.ReduceMessage] = []

    async def Info(
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoReply:
        self.started += 1
        mode = metadata_value(context.invocation_metadata(), "x-mode")
        try:
            if mode == "fail":
                raise RuntimeError("the handler failed")
            if mode == "hold":
                await self.release.wait()
            return stage_pb2.StageInfoReply(node_id="held")
        finally:
            self.finished += 1

    async def FetchState(
        self, request: stage_pb2.FetchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[state_pb2.StateMessage]:
        self.started += 1
        try:
            yield state_pb2.StateMessage(chunk=tensor_pb2.TensorChunk(data=b"x"))
            await self.release.wait()
        finally:
            self.finished += 1

    async def Reduce(
        self, requests: AsyncIterator[stage_pb2.ReduceMessage], context: grpc.aio.ServicerContext
    ) -> stage_pb2.ReduceReply:
        self.started += 1
        try:
            async for message in requests:
                self.received.append(message)
            return stage_pb2.ReduceReply()
        finally:
            self.finished += 1

    async def Forward(
        self, requests: AsyncIterator[stage_pb2.ForwardMessage], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[stage_pb2.BackwardMessage]:
        async for _ in requests:
            yield stage_pb2.BackwardMessage()


def _limits(**changes: Any) -> PeerLimits:
    base = {
        "max_calls": 4,
        "max_streams": 2,
        "calls_per_s": 1e6,
        "burst": 1e6,
        "stream_idle_s": 30.0,
    }
    return PeerLimits(**(base | changes))


def _identify(metadata: Any) -> str:
    """Stands in for the admission's credential check: the credential names the node."""
    return metadata_value(metadata, CREDENTIAL_KEY)


class Server:
    def __init__(self, limiter: PeerLimiter) -> None:
        self.limiter = limiter
        self.servicer = Held()
        self.server = create_server(limiter=limiter)
        add_servicer(self.server, self.servicer, STAGE, limiter.log)
        self.port = bind(self.server, "127.0.0.1:0")
        self.channels: list[grpc.aio.Channel] = []

    def channel(self, node_id: str = "") -> grpc.aio.Channel:
        holder = CredentialHolder()
        if node_id:
            holder.set(CREDENTIAL_KEY, node_id)
        channel = open_channel(f"127.0.0.1:{self.port}", holder)
        self.channels.append(channel)
        return channel


@pytest.fixture
async def make_server() -> AsyncIterator[Callable[[PeerLimits], Any]]:
    servers: list[Server] = []

    async def make(limits: PeerLimits) -> Server:
        server = Server(PeerLimiter(limits, _identify, log=BadRequestLog()))
        await server.server.start()
        servers.append(server)
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.servicer.release.set()
            for channel in server.channels:
                await channel.close()
            await server.server.stop(grace=None)


def _info(channel: grpc.aio.Channel) -> grpc.aio.UnaryUnaryMultiCallable:
    return channel.unary_unary(
        "/swarmpipe.v1.Stage/Info",
        request_serializer=stage_pb2.StageInfoRequest.SerializeToString,
        response_deserializer=stage_pb2.StageInfoReply.FromString,
    )


def _fetch(channel: grpc.aio.Channel) -> grpc.aio.UnaryStreamMultiCallable:
    return channel.unary_stream(
        "/swarmpipe.v1.Stage/FetchState",
        request_serializer=stage_pb2.FetchStateRequest.SerializeToString,
        response_deserializer=state_pb2.StateMessage.FromString,
    )


def _reduce(channel: grpc.aio.Channel) -> grpc.aio.StreamUnaryMultiCallable:
    return channel.stream_unary(
        "/swarmpipe.v1.Stage/Reduce",
        request_serializer=stage_pb2.ReduceMessage.SerializeToString,
        response_deserializer=stage_pb2.ReduceReply.FromString,
    )


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def _code(call: Any) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call
    return err.value.code(), err.value.details() or ""


async def test_calls_over_the_limit_are_refused_and_released_on_a_normal_end(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(max_calls=3))
    info = _info(server.channel("a"))
    held = [
        asyncio.ensure_future(info(stage_pb2.StageInfoRequest(), metadata=(("x-mode", "hold"),)))
        for _ in "123"
    ]
    await _until(lambda: server.servicer.started == 3, "three held calls")
    assert server.limiter.open_calls("node a") == (3, 0)
    code, details = await _code(info(stage_pb2.StageInfoRequest()))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "pipeline.peer_max_calls=3" in details and "node a" in details
    assert server.servicer.started == 3  # refused before the handler ran
    assert server.limiter.log.calls == 1
    server.servicer.release.set()
    for call in held:
        assert (await call).node_id == "held"
    assert server.limiter.open_calls("node a") == (0, 0)
    assert (await info(stage_pb2.StageInfoRequest())).node_id == "held"


async def test_a_failed_or_cancelled_call_gives_its_slot_back(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(max_calls=1))
    info = _info(server.channel("a"))
    code, _ = await _code(info(stage_pb2.StageInfoRequest(), metadata=(("x-mode", "fail"),)))
    assert code == grpc.StatusCode.UNKNOWN
    assert server.limiter.open_calls("node a") == (0, 0)
    call = info(stage_pb2.StageInfoRequest(), metadata=(("x-mode", "hold"),))
    await _until(lambda: server.limiter.open_calls("node a") == (1, 0), "the held call")
    call.cancel()
    await _until(lambda: server.limiter.open_calls("node a") == (0, 0), "the slot back")
    await _until(lambda: server.servicer.finished == 2, "the handler's finally")
    assert (await info(stage_pb2.StageInfoRequest())).node_id == "held"


async def test_open_streams_have_their_own_limit(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(max_calls=10, max_streams=2))
    channel = server.channel("a")
    streams = [_fetch(channel)(stage_pb2.FetchStateRequest()) for _ in range(2)]
    for stream in streams:
        await stream.read()  # the first message: the stream is open on the server
    assert server.limiter.open_calls("node a") == (2, 2)
    third = _fetch(channel)(stage_pb2.FetchStateRequest())
    code, details = await _code(third.read())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "peer_max_streams=2" in details
    # Unary calls still pass: the stream limit is separate from the call limit.
    assert (await _info(channel)(stage_pb2.StageInfoRequest())).node_id == "held"
    streams[0].cancel()
    await _until(lambda: server.limiter.open_calls("node a") == (1, 1), "one stream freed")
    fourth = _fetch(channel)(stage_pb2.FetchStateRequest())
    assert (await fourth.read()).chunk.data == b"x"
    fourth.cancel()
    streams[1].cancel()


async def test_one_peer_at_its_limit_does_not_affect_another(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(max_calls=2, max_streams=1))
    a, b, stranger = server.channel("a"), server.channel("b"), server.channel()
    held = [
        asyncio.ensure_future(
            _info(a)(stage_pb2.StageInfoRequest(), metadata=(("x-mode", "hold"),))
        )
        for _ in range(2)
    ]
    await _until(lambda: server.limiter.open_calls("node a") == (2, 0), "a at its limit")
    code, _ = await _code(_info(a)(stage_pb2.StageInfoRequest()))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await _info(b)(stage_pb2.StageInfoRequest())).node_id == "held"
    # A caller without a credential is its address, apart from the nodes.
    assert (await _info(stranger)(stage_pb2.StageInfoRequest())).node_id == "held"
    assert server.limiter.open_calls("address 127.0.0.1") == (0, 0)
    server.servicer.release.set()
    await asyncio.gather(*held)


async def test_the_rate_bucket_refuses_a_burst_and_refills() -> None:
    now = [100.0]
    limiter = PeerLimiter(_limits(calls_per_s=2.0, burst=3.0), clock=lambda: now[0])
    for _ in range(3):
        assert limiter.admit("p", False) == ""
        limiter.release("p", False)
    refusal = limiter.admit("p", False)
    assert "faster than 2 a second" in refusal and "peer_calls_per_s" in refusal
    assert limiter.admit("q", False) == ""  # another peer has its own bucket
    now[0] += 0.5  # one token back
    assert limiter.admit("p", False) == ""
    limiter.release("p", False)
    assert limiter.admit("p", False) != ""
    now[0] += 60.0  # refills to the burst, no more
    for _ in range(3):
        assert limiter.admit("p", False) == ""
        limiter.release("p", False)
    assert limiter.admit("p", False) != ""
    assert limiter.refused["rate"] == 3


async def test_the_rate_limit_on_a_real_server(make_server: Callable[[PeerLimits], Any]) -> None:
    server = await make_server(_limits(calls_per_s=0.001, burst=2.0))
    info = _info(server.channel("a"))
    for _ in range(2):
        await info(stage_pb2.StageInfoRequest())
    code, details = await _code(info(stage_pb2.StageInfoRequest()))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "peer_calls_per_s" in details


async def test_the_table_of_peers_is_bounded_and_keeps_busy_peers() -> None:
    limiter = PeerLimiter(_limits(), max_peers=3)
    assert limiter.admit("busy", True) == ""
    for i in range(10):
        assert limiter.admit(f"p{i}", False) == ""
        limiter.release(f"p{i}", False)
    assert len(limiter._peers) == 3
    assert limiter.open_calls("busy") == (1, 1)


async def test_an_idle_stream_is_ended_and_its_handler_finishes(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(stream_idle_s=0.5))
    gate = asyncio.Event()

    async def messages() -> AsyncIterator[stage_pb2.ReduceMessage]:
        yield stage_pb2.ReduceMessage(header=stage_pb2.ReduceHeader(sender_node="a"))
        await gate.wait()  # a sender that stops sending

    call = _reduce(server.channel("a"))(messages())
    code, details = await _code(call)
    gate.set()
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "pipeline.stream_idle_s" in details
    assert len(server.servicer.received) == 1
    await _until(lambda: server.servicer.finished == 1, "the handler's finally")
    assert server.limiter.open_calls("node a") == (0, 0)
    assert server.limiter.refused["idle"] == 1


async def test_a_stream_that_keeps_sending_is_not_idle(
    make_server: Callable[[PeerLimits], Any],
) -> None:
    server = await make_server(_limits(stream_idle_s=5.0))

    async def messages() -> AsyncIterator[stage_pb2.ReduceMessage]:
        for _ in range(5):
            yield stage_pb2.ReduceMessage(header=stage_pb2.ReduceHeader(sender_node="a"))

    await _reduce(server.channel("a"))(messages())
    assert len(server.servicer.received) == 5
    assert server.limiter.refused["idle"] == 0


def test_defaults_are_derived_from_the_run() -> None:
    limits = limits_for(PipelineConfig())
    # 16 in flight per head, 4 heads, plus reduce/fetch/watch, twice over.
    assert limits.max_streams == 2 * (16 * 4 + 4)
    assert limits.max_calls == 2 * limits.max_streams
    assert limits.stream_idle_s == 120.0
    wide = limits_for(PipelineConfig(in_flight=64))
    assert wide.max_streams == 2 * (64 * 4 + 4)
    slow = PipelineConfig(link_mbit=0.01)
    assert derived_idle_s(slow) == pytest.approx(2 * CHUNK_BYTES / (0.01e6 / 8))
    chosen = limits_for(PipelineConfig(peer_max_streams=5, peer_max_calls=3, stream_idle_s=9))
    assert (chosen.max_calls, chosen.max_streams, chosen.stream_idle_s) == (3, 3, 9.0)


@pytest.mark.parametrize(
    ("changes", "needle"),
    [
        ({"peer_max_calls": -1}, "peer_max_calls"),
        ({"peer_calls_per_s": 0.0}, "peer_calls_per_s"),
        ({"peer_calls_per_s": float("inf")}, "peer_calls_per_s"),
        ({"stream_idle_s": -1.0}, "stream_idle_s"),
        ({"stream_idle_s": 10.0, "link_mbit": 0.1}, "twice a 1 MiB chunk"),
    ],
)
def test_bad_limits_are_one_clear_config_error(changes: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        PipelineConfig(**changes)


def test_the_chunk_the_idle_bound_is_sized_for_is_the_wire_chunk() -> None:
    from swarmpipe.compression.wire import CHUNK_BYTES as WIRE_CHUNK
    from swarmpipe.storage.checkpoints import CHUNK_BYTES as STATE_CHUNK

    assert CHUNK_BYTES == WIRE_CHUNK == STATE_CHUNK
