"""What a node's parts share, and who owns each piece of it.

The daemon (node/daemon.py) builds these and hands each part only what it uses:

- `NodeStatus` owns the node's mutable shared state: whether it serves its stage, the
  microbatches in flight, the samples processed, and the request to stop. Other parts change
  it only through its methods (`track_microbatch`, `count_samples`, `start_serving`,
  `request_stop`), so every change has one place to look.
- `CoordinatorClient` is the node's side of the coordinator's gRPC API, with the retry rule
  for a coordinator that restarts.
- `StageContext` bundles the services that exist once the node has joined (its stage, the run
  config, the stage runtime, the compute thread, links, counters, router, coordinator and
  status). It is frozen: the parts read it and never rebind it. The current step is the
  runtime's (`runtime.step`), moved only by the optimizer step on the compute thread.

No module here imports the daemon, so the parts and the daemon form no import circle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from swarmpipe.config import RunConfig, codec_enum
from swarmpipe.errors import CoordinatorUnavailable, NotAdmitted
from swarmpipe.node.compute import ComputeWorker
from swarmpipe.node.links import Links
from swarmpipe.node.router import Router
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.step_times import StepTimes
from swarmpipe.node.transport import LinkStats
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.transport.auth import JOIN_TOKEN_KEY

logger = logging.getLogger(__name__)

COORDINATOR_RETRY_S = 60.0
"""How long calls wait for a coordinator that stopped answering (it may be restarting),
until the run's `coordinator.restart_grace_s` is known."""

_RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class NodeStatus:
    """The node's mutable shared state, with one owner: this object.

    Read freely; change only through the methods, which say what happened.
    """

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self._serving = False
        self._in_flight = 0
        self._samples = 0
        self.microbatch_seconds: deque[float] = deque(maxlen=64)
        """Wall-clock seconds of the head's latest microbatches, lease to commit."""
        self.step_times = StepTimes()
        """Where this node's time went in its latest steps (compute, waiting, boundary)."""
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._failed = False

    @property
    def serving(self) -> bool:
        """Accepted into the plan: holds the stage's state for the swarm's current step.
        Until then the node refuses microbatches and takes no part in the reduce."""
        return self._serving

    def start_serving(self) -> None:
        self._serving = True

    def stop_serving(self) -> None:
        """The node is moving to another stage: it serves nothing until it holds that one."""
        self._serving = False

    @property
    def in_flight(self) -> int:
        """Microbatches this node is working on (as head or as a stage of the pipeline)."""
        return self._in_flight

    @contextlib.contextmanager
    def track_microbatch(self) -> Iterator[None]:
        """Count a microbatch as in flight while the block runs."""
        self._in_flight += 1
        try:
            yield
        finally:
            self._in_flight -= 1

    @property
    def samples_processed(self) -> int:
        return self._samples

    def count_samples(self, samples: int, *, seconds: float | None = None) -> None:
        """Samples whose backward this node finished; the head also gives the seconds."""
        self._samples += samples
        if seconds is not None:
            self.microbatch_seconds.append(seconds)

    def request_stop(self, reason: str, *, failed: bool = False) -> None:
        """Ask the node to leave (drain, last checkpoint, goodbye); the first reason wins."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._failed = failed
            logger.info("stopping: %s", reason)
            self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    async def wait_stop(self) -> None:
        await self._stop.wait()

    @property
    def stop_reason(self) -> str:
        return self._stop_reason

    @property
    def failed(self) -> bool:
        """The node stopped because something went wrong (exit code 1)."""
        return self._failed


class CoordinatorClient:
    """The coordinator's gRPC API as a node uses it."""

    def __init__(self, channel: grpc.aio.Channel, address: str) -> None:
        self.address = address
        self.stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        """For calls with their own retry rule (Lease, checkpoints)."""
        self.retry_s = COORDINATOR_RETRY_S
        """How long a call keeps retrying a coordinator that does not answer; the run's
        coordinator.restart_grace_s once the node has joined."""

    async def call(self, method: str, request: Any, *, timeout: float = 10.0) -> Any:
        """Call a coordinator RPC, retrying while it is unreachable (it may be restarting)."""
        deadline = time.monotonic() + self.retry_s
        delay = 0.1
        while True:
            try:
                return await getattr(self.stub, method)(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRIED:
                    raise
                if time.monotonic() > deadline:
                    raise CoordinatorUnavailable(
                        f"the coordinator at {self.address} stopped answering for "
                        f"{self.retry_s:.0f} s ({exc.code().name})"
                    ) from exc
                logger.debug("%s failed (%s); retrying", method, exc.code().name)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def join(
        self, request: coordinator_pb2.JoinRequest, *, timeout_s: float, token: str = ""
    ) -> coordinator_pb2.JoinReply:
        """Join the run with the organiser's join `token`, waiting up to `timeout_s` for a
        coordinator that is not up yet; NotAdmitted when it refuses the token."""
        # Only Join carries the token: the credential it returns is what later calls carry.
        metadata = ((JOIN_TOKEN_KEY, token),) if token else None
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                reply: coordinator_pb2.JoinReply = await self.stub.Join(
                    request,
                    timeout=max(0.5, min(5.0, deadline - time.monotonic())),
                    wait_for_ready=True,
                    metadata=metadata,
                )
                return reply
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise NotAdmitted(
                        f"the coordinator at {self.address} refused this node: {exc.details()}"
                    ) from exc
                if exc.code() not in _RETRIED:
                    raise CoordinatorUnavailable(
                        f"the coordinator at {self.address} refused to let this node "
                        f"join: {exc.details()}"
                    ) from exc
                last = exc.code().name
                await asyncio.sleep(0.2)
        raise CoordinatorUnavailable(
            f"cannot reach the coordinator at {self.address} within "
            f"{timeout_s:.0f} s ({last or 'no answer'}); is it running, "
            "and is the address right?"
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class StageContext:
    """The services a node's parts share once it has joined the run as `stage`."""

    node_id: str
    stage: int
    config: RunConfig
    runtime: StageRuntime
    """The stage's module, optimizer and step; touched on the compute thread only."""
    compute: ComputeWorker
    links: Links
    """Per-peer send limits, bandwidth meters, codec choice and encoder state."""
    stats: LinkStats
    """Bytes sent and received, by peer, direction and codec."""
    router: Router
    """Channels to peers, the current plan, and sending with rerouting."""
    coordinator: CoordinatorClient
    status: NodeStatus

    @property
    def activation_codec(self) -> int:
        """The run's codec for activations (0: chosen per link)."""
        return codec_enum(self.config.pipeline.activation_codec)

    @property
    def gradient_codec(self) -> int:
        """The run's codec for activation gradients (0: chosen per link)."""
        return codec_enum(self.config.pipeline.gradient_codec)

    def replicas(self) -> list[tuple[str, str]]:
        """(node id, address) of this stage's replicas in the current plan, this node too."""
        plan = self.router.plan
        if plan is None or not 0 <= self.stage < len(plan.stages):
            return []
        return [(r.node_id, r.address) for r in plan.stages[self.stage].replicas]
