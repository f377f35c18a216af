"""Joining a running stage: get the stage's current state, then get into the plan.

A node that joins a run already under way must not serve fresh parameters
beside replicas that have trained. Before it announces itself ready it asks
the coordinator where the run stands (SyncInfo) and takes the state of the
step it can start at (`target`: the current step, or the next one while the
current one is being applied) from, in this order:

1. fresh parameters, when no step has been applied anywhere yet (`target` 0:
   every node builds the same initial parameters from the seed);
2. a live replica of its stage (Stage.FetchState, chunked and checksummed,
   served from a snapshot taken between two compute jobs, so at a step
   boundary; the replica first waits, bounded, until it reaches `target`);
3. the stage's latest checkpoint (node/checkpointing.py), when the stage has
   no live replica left: the stage loses the steps since that checkpoint;
4. fresh parameters with a loud warning, when there is no checkpoint either.

Then it calls Ready with the step it holds. The coordinator accepts only the
state of `target` (see coordinator/service.py); when the swarm moved on during
the download the answer is STALE and the node fetches again, while the next
step boundary waits for it, so a slow link still gets in.

The serving side of FetchState lives here too: one snapshot per step is cached
while fetches of that step are in flight, so several joiners cost one copy.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from swarmpipe.errors import CodecError, PeerError
from swarmpipe.node.checkpointing import Checkpointer
from swarmpipe.node.compute import BACKWARD
from swarmpipe.node.context import StageContext
from swarmpipe.node.stage_state import ReceivedState, StateReceiver, StateSnapshot
from swarmpipe.protos import coordinator_pb2, stage_pb2, stage_pb2_grpc, state_pb2, tensor_pb2
from swarmpipe.storage.checkpoints import state_messages

logger = logging.getLogger(__name__)

SYNC_ATTEMPTS = 20
"""Fetch rounds before a node gives up joining; each STALE answer costs one."""
FETCH_TIMEOUT_S = 900.0
"""Upper bound on one FetchState call: generous, since a large stage over a slow
link takes long; a dead peer is noticed sooner through keepalive."""
MIN_STEP_WAIT_S = 30.0
"""How long a replica waits to reach the step a joiner asked for before refusing."""
READY_WAIT_S = 10.0


class StateTransfer:
    """Serves this stage's state to joiners, and brings this node's stage up to date."""

    def __init__(self, ctx: StageContext, checkpointer: Checkpointer) -> None:
        self.ctx = ctx
        self.checkpointer = checkpointer
        self._snapshot: StateSnapshot | None = None
        self._snapshot_lock = asyncio.Lock()
        self._in_flight = 0
        self._stepped = asyncio.Event()
        self._fresh = True
        self.report: dict[str, Any] = {}
        """What the join cost (for the ready file and `swarmpipe bench join`)."""

    # -- serving side ---------------------------------------------------

    def step_advanced(self) -> None:
        """Called after every applied step: wakes fetches waiting for that step."""
        self._stepped.set()
        self._stepped = asyncio.Event()

    async def _snapshot_now(self) -> StateSnapshot:
        d = self.ctx
        runtime = d.runtime
        async with self._snapshot_lock:
            cached = self._snapshot
            if cached is None or cached.step != runtime.step:
                fresh = await d.compute.run(
                    BACKWARD, lambda: runtime.export_state(node_id=d.node_id)
                )
                cached = await asyncio.to_thread(fresh.seal)
                self._snapshot = cached
            return cached

    async def serve(
        self, request: stage_pb2.FetchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[state_pb2.StateMessage]:
        """The server side of Stage.FetchState."""
        d = self.ctx
        runtime = d.runtime
        if not d.status.serving:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "this node does not serve its stage yet"
            )
        if request.stage != d.stage:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this node serves stage {d.stage}, not {request.stage}",
            )
        deadline = time.monotonic() + MIN_STEP_WAIT_S
        while runtime.step < request.min_step:
            left = deadline - time.monotonic()
            if left <= 0:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"this replica is at step {runtime.step}, not yet {request.min_step}",
                )
            try:
                await asyncio.wait_for(self._stepped.wait(), timeout=min(left, 1.0))
            except TimeoutError:
                pass
        self._in_flight += 1
        try:
            snapshot = await self._snapshot_now()
            logger.info(
                "sending stage %d's state at step %d (%d bytes) to %s",
                d.stage,
                snapshot.step,
                snapshot.manifest.payload_bytes,
                request.node_id or "?",
            )
            for message in state_messages(snapshot.manifest, snapshot.chunks()):
                yield message
            d.stats.record(
                request.node_id or "?",
                "state",
                tensor_pb2.CODEC_LOSSLESS,
                snapshot.manifest.payload_bytes,
            )
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._snapshot = None  # keep a stage's worth of clones only while needed

    # -- joining side ---------------------------------------------------

    async def join(self) -> bool:
        """Bring this node's stage to the swarm's current step and get accepted into the
        plan; False when the run finished meanwhile."""
        d = self.ctx
        runtime = d.runtime
        started = time.time()
        self.report = {"sync_started_at": started, "download_bytes": 0, "download_seconds": 0.0}
        for attempt in range(1, SYNC_ATTEMPTS + 1):
            info: coordinator_pb2.SyncInfoReply = await d.coordinator.call(
                "SyncInfo", coordinator_pb2.SyncInfoRequest(node_id=d.node_id)
            )
            if info.done:
                d.status.request_stop("the run has finished")
                return False
            target = info.step + (1 if info.applying else 0)
            if info.HasField("target"):  # train.step_overlap may name a later step
                target = info.target
            if not await self._obtain(info, target):
                await asyncio.sleep(min(0.2 * attempt, 2.0))
                continue
            digest = await d.compute.run(BACKWARD, runtime.parameter_digest)
            while True:
                reply: coordinator_pb2.ReadyReply = await d.coordinator.call(
                    "Ready",
                    coordinator_pb2.ReadyRequest(
                        node_id=d.node_id,
                        step=runtime.step,
                        param_digest=digest,
                        wait_seconds=READY_WAIT_S,
                    ),
                    timeout=READY_WAIT_S + 15,
                )
                Status = coordinator_pb2.ReadyReply
                if reply.status == Status.STATUS_ACCEPTED:
                    self.report.update(serving_at=time.time(), attempts=attempt, step=runtime.step)
                    logger.info(
                        "serving stage %d from step %d (params %s) after %.2f s, %d attempt%s",
                        d.stage,
                        runtime.step,
                        digest,
                        time.time() - started,
                        attempt,
                        "" if attempt == 1 else "s",
                    )
                    return True
                if reply.status == Status.STATUS_DONE:
                    d.status.request_stop("the run has finished")
                    return False
                if reply.status == Status.STATUS_STALE:
                    logger.info(
                        "the swarm moved on to step %d%s while this node got step %d; again",
                        reply.step,
                        " (applying)" if reply.applying else "",
                        runtime.step,
                    )
                    break
        raise PeerError(
            f"could not catch up with the swarm in {SYNC_ATTEMPTS} attempts; the stage's "
            "replicas may be unreachable from this node, or its link too slow"
        )

    async def _obtain(self, info: coordinator_pb2.SyncInfoReply, target: int) -> bool:
        """Load the state of `target` into the runtime; False when no source worked."""
        d = self.ctx
        runtime = d.runtime
        if target == 0 and self._fresh:
            self.report["source"] = "fresh"
            return True  # no step applied anywhere: the seed's parameters are the state
        replicas = list(info.replicas)
        if replicas:
            random.shuffle(replicas)  # spread joiners over the replicas
            for replica in replicas:
                fetched = await self._fetch(replica.node_id, replica.address, target)
                if fetched is not None:
                    break
            else:
                return False
            await d.compute.run(BACKWARD, lambda: runtime.import_state(fetched))
            self._fresh = False
            self.report["source"] = f"replica {replica.node_id}"
            return True
        restored = await self.checkpointer.restore(at_most=target)
        if restored is not None:
            if restored.step > target:
                logger.warning(
                    "the latest checkpoint is of step %d, ahead of the run's %d; ignoring it",
                    restored.step,
                    target,
                )
            else:
                await d.compute.run(BACKWARD, lambda: runtime.import_state(restored, step=target))
                self._fresh = False
                self.report["source"] = f"checkpoint of step {restored.step}"
                lost = (
                    f"this stage lost the updates of steps {restored.step} to {target - 1}"
                    if target > restored.step
                    else "no update was lost"
                )
                logger.warning(
                    "stage %d had no live replica: resumed from its checkpoint of step %d "
                    "at step %d; %s",
                    d.stage,
                    restored.step,
                    target,
                    lost,
                )
                return True
        runtime.step = target
        self.report["source"] = "fresh (no checkpoint)"
        logger.error(
            "stage %d had no live replica and no checkpoint: it restarts from fresh "
            "parameters at step %d and loses everything it had learnt",
            d.stage,
            target,
        )
        return True

    async def _fetch(self, peer: str, address: str, target: int) -> ReceivedState | None:
        d = self.ctx
        runtime = d.runtime
        config = d.config
        receiver = StateReceiver(
            runtime.module,
            run_id=config.run_id,
            stage=d.stage,
            num_stages=config.pipeline.stages,
        )
        stub = stage_pb2_grpc.StageStub(d.router.channel(address))
        request = stage_pb2.FetchStateRequest(node_id=d.node_id, stage=d.stage, min_step=target)
        started = time.perf_counter()
        try:
            async for message in stub.FetchState(request, timeout=FETCH_TIMEOUT_S):
                receiver.add(message)
                d.stats.add_received(len(message.chunk.data))
            state = await asyncio.to_thread(receiver.finish)
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not fetch the stage's state from %s: %s", peer, exc.details())
            return None
        except (PeerError, CodecError) as exc:
            logger.warning("refused the stage's state from %s: %s", peer, exc)
            return None
        seconds = time.perf_counter() - started
        size = int(state.manifest.payload_bytes)
        self.report["download_bytes"] = self.report.get("download_bytes", 0) + size
        self.report["download_seconds"] = self.report.get("download_seconds", 0.0) + seconds
        logger.info(
            "fetched stage %d's state at step %d from %s: %d bytes in %.2f s (%.1f MB/s), "
            "sha256 ok",
            d.stage,
            state.step,
            peer,
            size,
            seconds,
            size / max(seconds, 1e-9) / 1e6,
        )
        return state
