"""Per-peer limits on a gRPC server: concurrent calls, open streams, call rate, idle streams.

Without them one peer can hold any number of calls open on a server, each with its buffers
and its task, and exhaust the node's memory or its event loop; a stream that stops sending
holds its buffers for ever. `PeerLimiter` is a server interceptor that every swarmpipe
server installs first (transport/rpc.py `create_server`), so it counts calls that the
credential check then refuses too: a stranger flooding with bad credentials is limited like
anyone else.

**Who a peer is.** The node id of the call's credential when it carries a valid one (many
nodes share 127.0.0.1 on a testnet and must not share a budget), else the caller's address
without its port: a stranger can open as many ports as it likes, not as many addresses.

**What is counted.** Each call holds one of the peer's `max_calls` from the moment its
handler starts to the moment it ends, normally, by an error or by cancellation (a `finally`
around the handler); a call with a stream in either direction also holds one of its
`max_streams`. Each call also takes a token from the peer's bucket, refilled at
`calls_per_s` up to `burst`. A call past any of them ends at once with RESOURCE_EXHAUSTED
naming the limit and its config key, before any of its request is read, and one line goes to
the process's rate-limited log of bad calls (one per peer and method per window). Every
check is a dictionary lookup and a few additions: refusing costs O(1).

**Idle streams.** A client-streaming or bidirectional call whose next message does not come
within `stream_idle_s` ends with DEADLINE_EXCEEDED; the request iterator is closed, so what
the servicer buffered for it is dropped with its frame.

The table of peers is bounded (`MAX_PEERS`): a peer with no call open is forgotten first,
oldest first; peers with calls open are bounded by those calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from swarmpipe.transport.auth import CREDENTIAL_KEY, metadata_value
from swarmpipe.transport.limits import CHUNK_BYTES, MBIT
from swarmpipe.transport.request_parsing import BAD_REQUESTS, BadRequestLog, peer_host

if TYPE_CHECKING:
    from swarmpipe.config import PipelineConfig

MAX_PEERS = 4096
"""Peers remembered at once; past it, peers with no call open are forgotten, oldest first."""

MAX_WINDOW = 16
"""The largest window an "auto" head keeps in flight (node/in_flight.py MAX_WINDOW)."""

HEADS_PER_PEER = 4
"""Heads whose microbatches one upstream peer may carry at once. A middle node forwards what
every head of the swarm sends through it, so its Forward streams into the next stage are up
to window x heads; four heads at the full window of 16 is 64 streams."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PeerLimits:
    """The limits each peer of one server is held to."""

    max_calls: int
    """Calls one peer may have open at once, streams included."""
    max_streams: int
    """Streaming calls (either direction) one peer may have open at once."""
    calls_per_s: float
    """Calls one peer may start per second, sustained."""
    burst: float
    """Calls one peer may start at once after a quiet spell (the bucket's size)."""
    stream_idle_s: float
    """Longest wait for a streaming call's next request message."""


def limits_for(pipeline: PipelineConfig) -> PeerLimits:
    """The limits of a run: the config's where it sets them, else derived from the run.

    - streams: the Forward streams one upstream peer opens into a node are the microbatches
      in flight through it, window x HEADS_PER_PEER (64 at the auto window's cap of 16), plus
      a Reduce per step (two across a step boundary), a FetchState and a health Watch;
      the default is twice that, 2 x (window x 4 + 4) = 136.
    - calls: the streams plus as many short unary calls (Info, Lease, Commit, Ready...).
    - rate: `pipeline.peer_calls_per_s` (1000 a second by default; the busiest peer, a head
      of a tiny model, makes a few calls per microbatch at tens of microbatches a second).
    - idle: no sender waits longer than its own deadline (hop_timeout_s for Forward,
      reduce_timeout_s for Reduce) so a stream idle past both is dead; and a 1 MiB chunk at
      `pipeline.link_mbit` must fit twice over.
    """
    window = pipeline.in_flight if isinstance(pipeline.in_flight, int) else MAX_WINDOW
    streams = pipeline.peer_max_streams or 2 * (max(window, MAX_WINDOW) * HEADS_PER_PEER + 4)
    calls = pipeline.peer_max_calls or 2 * streams
    return PeerLimits(
        max_calls=calls,
        max_streams=min(streams, calls),
        calls_per_s=pipeline.peer_calls_per_s,
        burst=max(1.0, pipeline.peer_calls_per_s),
        stream_idle_s=pipeline.stream_idle_s or derived_idle_s(pipeline),
    )


def chunk_seconds(link_mbit: float) -> float:
    """Seconds one full chunk takes at `link_mbit` (0: unlimited, 0 s)."""
    return CHUNK_BYTES / (link_mbit * MBIT) if link_mbit > 0 else 0.0


def derived_idle_s(pipeline: PipelineConfig) -> float:
    """The default `stream_idle_s`: see `limits_for`."""
    return max(
        pipeline.hop_timeout_s, pipeline.reduce_timeout_s, 2 * chunk_seconds(pipeline.link_mbit)
    )


@dataclass(slots=True)
class _Peer:
    calls: int
    streams: int
    tokens: float
    filled_at: float


Identify = Callable[[Any], str]
"""The node id of a call's valid credential from its metadata ("" when it has none)."""


class PeerLimiter(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in grpc
    """Holds each peer of a server to `limits` (see the module's docstring)."""

    def __init__(
        self,
        limits: PeerLimits,
        identify: Identify | None = None,
        *,
        log: BadRequestLog = BAD_REQUESTS,
        clock: Callable[[], float] = time.monotonic,
        max_peers: int = MAX_PEERS,
    ) -> None:
        self.limits = limits
        self.identify = identify
        self.log = log
        self._clock = clock
        self.max_peers = max_peers
        self._peers: OrderedDict[str, _Peer] = OrderedDict()
        self.refused: dict[str, int] = {"calls": 0, "streams": 0, "rate": 0, "idle": 0}
        """Calls ended by each limit, for tests and benchmarks."""

    def configure(self, limits: PeerLimits) -> None:
        """Use `limits` from the next call on (a node learns the run's config at Join)."""
        self.limits = limits

    def open_calls(self, peer: str) -> tuple[int, int]:
        """(calls, streams) `peer` has open now."""
        state = self._peers.get(peer)
        return (state.calls, state.streams) if state is not None else (0, 0)

    def peer_of(self, context: grpc.aio.ServicerContext) -> str:
        metadata = context.invocation_metadata()
        if self.identify is not None and metadata_value(metadata, CREDENTIAL_KEY):
            node_id = self.identify(metadata)
            if node_id:
                return f"node {node_id}"
        return f"address {peer_host(context.peer())}"

    def _state(self, peer: str) -> _Peer:
        state = self._peers.get(peer)
        if state is not None:
            self._peers.move_to_end(peer)
            return state
        state = _Peer(0, 0, self.limits.burst, self._clock())
        self._peers[peer] = state
        self._forget()
        return state

    def _forget(self) -> None:
        """Drop idle peers, oldest first, while the table is over its size; a busy peer met
        on the way goes to the back, and at most one pass is made."""
        for _ in range(len(self._peers)):
            if len(self._peers) <= self.max_peers:
                return
            peer, state = next(iter(self._peers.items()))
            if state.calls:
                self._peers.move_to_end(peer)
            else:
                del self._peers[peer]

    def admit(self, peer: str, streaming: bool) -> str:
        """Take a call for `peer`; "" when admitted (release it later), else the refusal."""
        limits = self.limits
        state = self._state(peer)
        now = self._clock()
        state.tokens = min(
            limits.burst, state.tokens + (now - state.filled_at) * limits.calls_per_s
        )
        state.filled_at = now
        if state.calls >= limits.max_calls:
            self.refused["calls"] += 1
            return (
                f"{peer} has {state.calls} calls open, the most one peer may "
                f"(pipeline.peer_max_calls={limits.max_calls})"
            )
        if streaming and state.streams >= limits.max_streams:
            self.refused["streams"] += 1
            return (
                f"{peer} has {state.streams} streams open, the most one peer may "
                f"(pipeline.peer_max_streams={limits.max_streams})"
            )
        if state.tokens < 1:
            self.refused["rate"] += 1
            return (
                f"{peer} calls faster than {limits.calls_per_s:g} a second "
                f"(pipeline.peer_calls_per_s)"
            )
        state.tokens -= 1
        state.calls += 1
        state.streams += streaming
        return ""

    def release(self, peer: str, streaming: bool) -> None:
        state = self._peers.get(peer)
        if state is None:  # pragma: no cover - a peer with a call open is never forgotten
            return
        state.calls -= 1
        state.streams -= streaming

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return None
        return self._limited(handler, details.method)

    def _limited(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        attr = _BEHAVIOUR[(handler.request_streaming, handler.response_streaming)]
        behaviour = getattr(handler, attr)
        streaming = handler.request_streaming or handler.response_streaming
        request_streaming = handler.request_streaming

        async def enter(context: grpc.aio.ServicerContext) -> str:
            peer = self.peer_of(context)
            refusal = self.admit(peer, streaming)
            if refusal:
                self.log.record(method, context.peer(), f"a call over its peer's limit: {refusal}")
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
            return peer

        def requests(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not request_streaming:
                return request
            return self._idle_bounded(request, context, method)

        if inspect.isasyncgenfunction(behaviour):

            async def responses(request: Any, context: grpc.aio.ServicerContext) -> Any:
                peer = await enter(context)
                try:
                    # Closed here, not by the garbage collector, so the servicer's `finally`
                    # blocks run when the call ends, as they did unwrapped.
                    async with contextlib.aclosing(
                        behaviour(requests(request, context), context)
                    ) as it:
                        async for response in it:
                            yield response
                finally:
                    self.release(peer, streaming)

            wrapped: Callable[..., Any] = responses
        else:

            async def response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                peer = await enter(context)
                try:
                    return await behaviour(requests(request, context), context)
                finally:
                    self.release(peer, streaming)

            wrapped = response
        return handler._replace(**{attr: wrapped})

    async def _idle_bounded(
        self, raws: AsyncIterator[Any], context: grpc.aio.ServicerContext, method: str
    ) -> AsyncIterator[Any]:
        """`raws`, ending the call when the next message is `stream_idle_s` late."""
        idle_s = self.limits.stream_idle_s
        it = aiter(raws)
        while True:
            try:
                async with asyncio.timeout(idle_s):
                    raw = await anext(it)
            except StopAsyncIteration:
                return
            except TimeoutError:
                self.refused["idle"] += 1
                problem = (
                    f"no message on this stream for {idle_s:g} s (pipeline.stream_idle_s); "
                    "ended to free its buffers"
                )
                self.log.record(method, context.peer(), f"an idle stream: {problem}")
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, problem)
            yield raw


_BEHAVIOUR = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}
