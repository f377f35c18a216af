"""A raw-bytes fuzz of every RPC a gRPC server lists through server reflection.

The server is asked for its services and their descriptors (grpc_reflection's client
protos), so the fuzz needs none of our protos and covers a new RPC by itself. Each method
gets seeded inputs (`fuzz_inputs`) sent on a raw channel, bytes in and bytes out, with a
deadline per call and a bounded number in flight; after each method the standard health
service must still answer SERVING. Only 127.0.0.1 is ever a target.

A call's outcome is its status code. One that has not ended `HANG_SLACK_S` past its own
deadline counts as a hang: grpc should have ended it at the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from swarmpipe.bench.fuzz_inputs import FuzzInput, fuzz_inputs
from swarmpipe.errors import ConfigError
from swarmpipe.transport.auth import CredentialHolder
from swarmpipe.transport.rpc import open_channel

HANG_SLACK_S = 5.0
MAX_RESPONSES = 1000
"""Responses read from one call before it is cancelled: a fuzz input that starts an endless
stream is the server's right, not a finding."""
BAD_CODES_FOR_UNPARSABLE = ("UNKNOWN", "INTERNAL")
"""Codes that mean a message that does not parse escaped our parsing (grpc's own handling)."""
MAX_FINDINGS = 5
CLIENT_WRITE_RACE = "SendMessageOperation"
"""In the debug string of an INTERNAL that grpc.aio's client makes up, not the server's
answer: a client write that loses the race with the server ending a client-streaming call
overwrites the server's status with INTERNAL "Internal error from Core" (grpc/grpc#36066,
seen on about 1 call in 250 to PutCheckpoint). Counted as CLIENT_WRITE_RACE, apart."""


def check_target(target: str) -> None:
    """Refuse any target but 127.0.0.1: this tool floods what it is pointed at."""
    host = target.rpartition(":")[0]
    if host != "127.0.0.1":
        raise ConfigError(f"the fuzz only targets 127.0.0.1, not {target!r}")


@dataclass(kw_only=True, slots=True)
class MethodResult:
    """What one method answered."""

    method: str
    calls: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    """Status code name -> calls, over all inputs."""
    unparsable_codes: Counter[str] = field(default_factory=Counter)
    """The same, over the inputs with a message that does not parse."""
    kinds: Counter[str] = field(default_factory=Counter)
    hangs: int = 0
    healthy_after: bool = False
    seconds: float = 0.0
    findings: list[dict[str, Any]] = field(default_factory=list)
    """The first `MAX_FINDINGS` calls answered UNKNOWN, INTERNAL or not at all: input number
    (replay it with the same seed), kind, whether it parses, code and details."""

    def as_json(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "codes": dict(sorted(self.codes.items())),
            "unparsable_codes": dict(sorted(self.unparsable_codes.items())),
            "unknown_or_internal_for_unparsable": sum(
                self.unparsable_codes[c] for c in BAD_CODES_FOR_UNPARSABLE
            ),
            "kinds": dict(sorted(self.kinds.items())),
            "hangs": self.hangs,
            "healthy_after": self.healthy_after,
            "seconds": round(self.seconds, 3),
            "findings": self.findings,
        }


async def _reflect(
    channel: grpc.aio.Channel, requests: list[reflection_pb2.ServerReflectionRequest]
) -> list[reflection_pb2.ServerReflectionResponse]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = stub.ServerReflectionInfo(iter(requests), timeout=10)
    return [response async for response in call]


async def list_methods(channel: grpc.aio.Channel) -> list[MethodDescriptor]:
    """Every method of every service the server lists, from descriptors it sends."""
    (listed,) = await _reflect(channel, [reflection_pb2.ServerReflectionRequest(list_services="")])
    names = [s.name for s in listed.list_services_response.service]
    files: dict[str, descriptor_pb2.FileDescriptorProto] = {}
    asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=n) for n in names]
    while asks:
        for response in await _reflect(channel, asks):
            for raw in response.file_descriptor_response.file_descriptor_proto:
                proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
                files[proto.name] = proto
        missing = {d for f in files.values() for d in f.dependency} - files.keys()
        asks = [reflection_pb2.ServerReflectionRequest(file_by_filename=d) for d in missing]
    pool = DescriptorPool()
    added: set[str] = set()

    def add(name: str) -> None:
        if name in added:
            return
        for dependency in files[name].dependency:
            add(dependency)
        pool.Add(files[name])
        added.add(name)

    for name in sorted(files):
        add(name)
    return [m for n in names for m in pool.FindServiceByName(n).methods]


async def healthy(channel: grpc.aio.Channel) -> bool:
    """Whether the server's health service answers SERVING for the whole server."""
    check = channel.unary_unary(
        "/grpc.health.v1.Health/Check",
        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
        response_deserializer=health_pb2.HealthCheckResponse.FromString,
    )
    try:
        reply = await check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    except grpc.aio.AioRpcError:
        return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


async def _write_all(rpc: Any, messages: list[bytes]) -> None:
    """Write a client stream's messages, stopping once the server has ended the call (it
    may answer before it has read them all), then half-close."""
    for message in messages:
        if rpc.done():
            return
        try:
            await rpc.write(message)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call's status says why
    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
        await rpc.done_writing()


async def _call(
    channel: grpc.aio.Channel, method: MethodDescriptor, data: FuzzInput, deadline_s: float
) -> tuple[str, str]:
    """Send one input; returns the status code's name and its details."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kind = ("stream" if method.client_streaming else "unary") + "_"
    kind += "stream" if method.server_streaming else "unary"
    call = getattr(channel, kind)(path, request_serializer=None, response_deserializer=None)
    try:
        if method.client_streaming:
            rpc = call(timeout=deadline_s)
            await _write_all(rpc, data.messages)
        else:
            rpc = call(data.messages[0], timeout=deadline_s)
        if method.server_streaming:
            for _ in range(MAX_RESPONSES):
                if await rpc.read() is grpc.aio.EOF:
                    break
            else:
                rpc.cancel()
        else:
            await rpc
        return str((await rpc.code()).name), str(await rpc.details())
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.INTERNAL and CLIENT_WRITE_RACE in (
            err.debug_error_string() or ""
        ):
            return "CLIENT_WRITE_RACE", str(err.details())
        return str(err.code().name), str(err.details())


async def fuzz_method(
    channel: grpc.aio.Channel,
    method: MethodDescriptor,
    *,
    inputs: int,
    seed: int,
    deadline_s: float,
    in_flight: int,
    stop_at: float,
) -> MethodResult:
    """Fuzz one method with `inputs` inputs (fewer if the clock passes `stop_at`)."""
    result = MethodResult(method=f"/{method.containing_service.full_name}/{method.name}")
    started = time.monotonic()
    slots = asyncio.Semaphore(in_flight)

    async def one(number: int, data: FuzzInput) -> None:
        async with slots:
            try:
                code, details = await asyncio.wait_for(
                    _call(channel, method, data, deadline_s), deadline_s + HANG_SLACK_S
                )
            except TimeoutError:
                result.hangs += 1
                code, details = "HANG", ""
        if code in (*BAD_CODES_FOR_UNPARSABLE, "HANG") and len(result.findings) < MAX_FINDINGS:
            result.findings.append(
                {
                    "input": number,
                    "kind": data.kind,
                    "parses": data.parses,
                    "code": code,
                    "details": details[:300],
                }
            )
        result.calls += 1
        result.codes[code] += 1
        result.kinds[data.kind] += 1
        if not data.parses:
            result.unparsable_codes[code] += 1

    tasks = []
    for number, data in enumerate(
        fuzz_inputs(
            method.input_type, client_streaming=method.client_streaming, count=inputs, seed=seed
        )
    ):
        if time.monotonic() >= stop_at:
            break
        await slots.acquire()  # generate no further ahead than the calls in flight
        slots.release()
        tasks.append(asyncio.create_task(one(number, data)))
    await asyncio.gather(*tasks)
    result.healthy_after = await healthy(channel)
    result.seconds = time.monotonic() - started
    return result


async def fuzz_server(
    target: str,
    *,
    inputs: int,
    seed: int = 0,
    deadline_s: float = 2.0,
    in_flight: int = 8,
    max_seconds: float = 600.0,
    metadata: tuple[tuple[str, str], ...] = (),
) -> dict[str, MethodResult]:
    """Fuzz every method of every service `target` lists, one method at a time; returns each
    method's result by its path. `metadata` rides on every call: a credential the server
    admits, so the fuzz reaches its parsers rather than stopping at UNAUTHENTICATED."""
    check_target(target)
    stop_at = time.monotonic() + max_seconds
    holder = CredentialHolder()
    for key, value in metadata:
        holder.set(key, value)
    async with open_channel(target, holder) as channel:
        results = {}
        for method in await list_methods(channel):
            result = await fuzz_method(
                channel,
                method,
                inputs=inputs,
                seed=seed,
                deadline_s=deadline_s,
                in_flight=in_flight,
                stop_at=stop_at,
            )
            results[result.method] = result
    return results
