"""Requests parsed in our code: a message that does not parse is INVALID_ARGUMENT and one line.

grpc.aio parses each request with its handler's `request_deserializer` before our code runs.
When that raises, grpc logs "Exception deserializing request!" with a full traceback and ends
the call with UNKNOWN or INTERNAL: a raw-bytes fuzz of the coordinator wrote 246 tracebacks
from 308 calls, a cheap way to fill its disk, and the sender learns nothing about its fault.

`add_servicer` registers a servicer the way the generated `add_XServicer_to_server` does,
but from the protobuf service descriptor (so a new RPC is covered without code here) and with
raw-bytes handlers: grpc hands each request over as bytes and `_Parser` parses it with the
same `FromString` the generated code uses, so a valid request reaches the servicer exactly as
before. A message that does not parse ends its call with `INVALID_ARGUMENT` ("request to
/swarmpipe.v1.Coordinator/Join is not a valid JoinRequest"), in a streaming call too: the
servicer's request iterator aborts the call when it meets one, wherever in the stream.
`BadRequestLog` writes one WARNING line, without a traceback, per bad call, at most one per
peer and method per interval and `MAX_LINES` per interval in all, each line with the count of
the calls it stood for since the last, so a flood of bad calls costs bounded log space.

Servicers read requests through the iterator they are handed, never `context.read()`, which
would return the raw bytes.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

logger = logging.getLogger(__name__)

INTERVAL_S = 10.0
"""A peer's bad calls to one method are one line per this many seconds."""
MAX_LINES = 10
"""Lines per interval across all peers and methods: many peers (or one peer cycling its
addresses) cannot flood the log either. One line a second at most, a few MB a day."""
MAX_PEERS = 1024
"""(peer, method) pairs remembered; the oldest is forgotten first, so the table is bounded."""


def peer_host(peer: str) -> str:
    """The address part of grpc's peer string ("ipv4:127.0.0.1:5000" -> "127.0.0.1"):
    a client's every connection has a new port, so the port would defeat the limit."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return peer


@dataclass(slots=True)
class _Seen:
    logged_at: float
    suppressed: int


class BadRequestLog:
    """Writes one WARNING line per bad call, at most one per (peer, method) per `interval_s`
    and `max_lines` per `interval_s` in all; the calls left out are counted on the next line."""

    def __init__(
        self,
        *,
        interval_s: float = INTERVAL_S,
        max_lines: int = MAX_LINES,
        max_peers: int = MAX_PEERS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_lines = max_lines
        self.max_peers = max_peers
        self._clock = clock
        self._seen: OrderedDict[tuple[str, str], _Seen] = OrderedDict()
        self._window_start = -float("inf")
        self._lines = 0
        self._over_cap = 0  # calls left unlogged by the overall cap since the last line
        self.calls = 0
        """Bad calls seen, logged or not."""

    def record(self, method: str, peer: str, problem: str) -> bool:
        """Count one bad call to `method` from `peer`; returns whether it was logged."""
        self.calls += 1
        now = self._clock()
        key = (peer_host(peer), method)
        seen = self._seen.get(key)
        if seen is not None and now - seen.logged_at < self.interval_s:
            seen.suppressed += 1
            return False
        if now - self._window_start >= self.interval_s:
            self._window_start, self._lines = now, 0
        if self._lines >= self.max_lines:
            self._over_cap += 1
            return False
        self._lines += 1
        suppressed = seen.suppressed if seen is not None else 0
        over_cap, self._over_cap = self._over_cap, 0
        self._seen[key] = _Seen(logged_at=now, suppressed=0)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_peers:
            self._seen.popitem(last=False)
        more = ""
        if suppressed:
            more += f"; {suppressed} more from this peer since its last line"
        if over_cap:
            more += f"; {over_cap} more from any peer left out of the log"
        logger.warning("refused a request from %s: %s%s", key[0], problem, more)
        return True


BAD_REQUESTS = BadRequestLog()
"""The process's log of bad calls, shared by its servers so the overall cap holds."""


class _Parser:
    """Parses one method's requests; a message that does not parse aborts the call."""

    def __init__(self, path: str, request_type: type[Message], log: BadRequestLog) -> None:
        self.path = path
        self.request_type = request_type
        self.log = log

    async def parse(self, raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            return self.request_type.FromString(raw)
        except DecodeError as exc:
            problem = f"request to {self.path} is not a valid {self.request_type.DESCRIPTOR.name}"
            reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            self.log.record(self.path, context.peer(), f"{problem} ({reason}, {len(raw)} bytes)")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            raise AssertionError("unreachable: abort raises") from exc

    async def parse_stream(
        self, raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Message]:
        async for raw in raws:
            yield await self.parse(raw, context)

    async def stream(
        self, raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Message]:
        return self.parse_stream(raws, context)


Behaviour = Callable[[Any, grpc.aio.ServicerContext], Any]


def _wrap(
    behaviour: Behaviour,
    take: Callable[[Any, grpc.aio.ServicerContext], Awaitable[Any]],
) -> Behaviour:
    """`behaviour` called with `take(raw request or raw request iterator)`, as the same kind
    of function: grpc.aio tells an async generator (responses yielded) from a coroutine (one
    response, or responses written with `context.write`) by inspecting the handler."""
    if inspect.isasyncgenfunction(behaviour):

        async def responses(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            # Closed here, not when the garbage collector finds it, so the servicer's
            # `finally` blocks run when the call ends, as they did unwrapped.
            async with contextlib.aclosing(behaviour(await take(request, context), context)) as it:
                async for response in it:
                    yield response

        return responses
    if inspect.iscoroutinefunction(behaviour):

        async def response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            return await behaviour(await take(request, context), context)

        return response
    raise TypeError(f"{behaviour!r} is not async: swarmpipe servers are grpc.aio servers")


def _unimplemented(path: str) -> Behaviour:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{path} is not implemented here")

    return refuse


def _is_generated_placeholder(behaviour: Behaviour, method: MethodDescriptor) -> bool:
    """Whether `behaviour` is the generated base class's stand-in for a method the servicer
    does not implement (grpc's aio health servicer has no `List`). It is sync, and it answers
    UNIMPLEMENTED by raising, which grpc logs with a traceback on every call."""
    function = getattr(behaviour, "__func__", behaviour)
    service = method.containing_service.name
    return bool(
        function.__module__.endswith("_pb2_grpc")
        and function.__qualname__ == f"{service}Servicer.{method.name}"
    )


_MAKE_HANDLER = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _handler(servicer: object, method: MethodDescriptor, log: BadRequestLog) -> Any:
    parser = _Parser(
        f"/{method.containing_service.full_name}/{method.name}",
        GetMessageClass(method.input_type),
        log,
    )
    take = parser.stream if method.client_streaming else parser.parse
    make = _MAKE_HANDLER[(method.client_streaming, method.server_streaming)]
    behaviour = getattr(servicer, method.name)
    if _is_generated_placeholder(behaviour, method):
        behaviour = _unimplemented(parser.path)
    return make(
        _wrap(behaviour, take),
        request_deserializer=None,  # the raw bytes: parsing is the wrapper's
        response_serializer=GetMessageClass(method.output_type).SerializeToString,
    )


def method_handlers(
    servicer: object, service: ServiceDescriptor, log: BadRequestLog = BAD_REQUESTS
) -> dict[str, grpc.RpcMethodHandler]:
    """Each method of `service` by name, as the handler `add_servicer` registers."""
    return {method.name: _handler(servicer, method, log) for method in service.methods}


def add_servicer(
    server: grpc.aio.Server,
    servicer: object,
    service: ServiceDescriptor,
    log: BadRequestLog = BAD_REQUESTS,
) -> None:
    """Register `servicer` for every method of `service` (what `add_XServicer_to_server`
    does), parsing requests in our code so a message that does not parse is INVALID_ARGUMENT
    and one rate-limited line."""
    handlers = method_handlers(servicer, service, log)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)
