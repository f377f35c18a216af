"""Periodic checkpoints of this node's stage, and restoring a stage from the latest one.

After every `checkpoint.every_steps` steps, one replica per stage (the lowest
node id among the stage's replicas in the plan, so the replicas agree without
talking) snapshots the stage on the compute thread, right after the step,
and uploads it in the background: to the coordinator (PutCheckpoint, which
keeps it under its --state-dir), or straight into `checkpoint.dir` when that
names a shared folder. If the replicas' plans disagree for a moment, two may
upload the same step (the store keeps one) or none does (the next one will).

At the end of the run the coordinator asks one replica of each stage for its
final state (StepState SAVE, `save_from`); `save_final` uploads it to the
coordinator, which checks it and ends the run only once it holds every stage's
(coordinator/service.py). It goes to the coordinator even when
`checkpoint.dir` names a shared folder, so the one that ends the run has seen
it; the folder gets a copy too.

`restore` fetches the stage's latest checkpoint through the same checked
stream a live replica's state comes through (node/stage_state.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from swarmpipe.errors import PeerError
from swarmpipe.node import fault_points
from swarmpipe.node.compute import BACKWARD
from swarmpipe.node.context import StageContext
from swarmpipe.node.stage_state import ReceivedState, StateReceiver, StateSnapshot
from swarmpipe.protos import coordinator_pb2, state_pb2
from swarmpipe.storage.checkpoints import CheckpointStore, state_messages

logger = logging.getLogger(__name__)

UPLOAD_TIMEOUT_S = 900.0
FINAL_UPLOAD_ATTEMPTS = 3


class Checkpointer:
    """Saves this stage's state every few steps and reads back the latest one."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self._upload: asyncio.Task[None] | None = None
        self._final: asyncio.Task[None] | None = None

    def _store(self) -> CheckpointStore | None:
        """The shared folder store, or None when checkpoints go through the coordinator."""
        config = self.ctx.config
        c = config.checkpoint
        return CheckpointStore(c.dir, config.run_id, keep=c.keep) if c.dir else None

    def _is_checkpointer(self) -> bool:
        replicas = sorted(node for node, _ in self.ctx.replicas())
        return bool(replicas) and replicas[0] == self.ctx.node_id

    async def after_step(self, step: int) -> None:
        """Called once the stage holds the state of `step` (the step just applied + 1)."""
        d = self.ctx
        config, runtime = d.config, d.runtime
        every = config.checkpoint.every_steps
        if step >= config.train.steps:
            return  # the final state: the coordinator asks for it once every stage is there
        if not every or step % every or not self._is_checkpointer():
            return
        if self._upload is not None and not self._upload.done():
            logger.warning("checkpoint of step %d skipped: the last one is still uploading", step)
            return
        snapshot = await d.compute.run(
            BACKWARD,
            lambda: runtime.export_state(node_id=d.node_id) if runtime.step == step else None,
        )
        if snapshot is None:
            # Only if the next step was applied first. Checkpoints hold the state of a
            # checkpoint step alone: under train.step_overlap those are drain points, whose
            # state is the version the step trains on, so a resume takes the same steps.
            logger.warning("checkpoint of step %d skipped: the stage is past it", step)
            return
        self._upload = asyncio.create_task(self._save(snapshot))

    async def _save(self, snapshot: StateSnapshot) -> None:
        d = self.ctx
        try:
            await asyncio.to_thread(snapshot.seal)
            store = self._store()
            if store is not None:
                where = await asyncio.to_thread(_write_to_folder, store, snapshot)
            else:
                reply = await self._put(snapshot)
                where = f"the coordinator ({reply.stored_as})"
            logger.info(
                "checkpoint of stage %d at step %d saved to %s (%d bytes)",
                d.stage,
                snapshot.step,
                where,
                snapshot.manifest.payload_bytes,
            )
        except (grpc.aio.AioRpcError, OSError, PeerError) as exc:
            details = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            logger.warning("checkpoint of step %d not saved: %s", snapshot.step, details)

    async def _put(self, snapshot: StateSnapshot) -> coordinator_pb2.PutCheckpointReply:
        """Upload a sealed snapshot to the coordinator. A coordinator that is away (it may be
        restarting) is tried again for coordinator.restart_grace_s, so a restart does not
        cost the checkpoint, nor a run its final state."""
        d = self.ctx
        deadline = time.monotonic() + d.coordinator.retry_s
        delay = 0.2
        while True:
            try:
                reply: coordinator_pb2.PutCheckpointReply = await d.coordinator.stub.PutCheckpoint(
                    _aiter(state_messages(snapshot.manifest, snapshot.chunks())),
                    timeout=UPLOAD_TIMEOUT_S,
                )
                return reply
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                logger.debug("checkpoint upload: the coordinator is away; trying again")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def save_final(self, step: int) -> None:
        """Upload the stage's final state (the coordinator asked this replica for it)."""
        if self._final is not None:
            return  # MQTT delivers at least once: already saving (or saved)
        task = self._final = asyncio.current_task()
        assert task is not None
        d = self.ctx
        runtime = d.runtime
        snapshot = await d.compute.run(BACKWARD, lambda: runtime.export_state(node_id=d.node_id))
        if snapshot.step != step:
            logger.error("asked for the final state of step %d, holds %d", step, snapshot.step)
            return
        await asyncio.to_thread(snapshot.seal)
        await fault_points.reach("checkpoint.final", step)
        for attempt in range(1, FINAL_UPLOAD_ATTEMPTS + 1):
            try:
                reply = await self._put(snapshot)
                logger.info(
                    "final state of stage %d at step %d stored by the coordinator (%s, %d bytes)",
                    d.stage,
                    step,
                    reply.stored_as,
                    snapshot.manifest.payload_bytes,
                )
                break
            except grpc.aio.AioRpcError as exc:
                logger.warning(
                    "final state of step %d not stored (try %d of %d): %s",
                    step,
                    attempt,
                    FINAL_UPLOAD_ATTEMPTS,
                    exc.details(),
                )
                if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                    return
                await asyncio.sleep(attempt)
        store = self._store()
        if store is not None:
            try:
                where = await asyncio.to_thread(_write_to_folder, store, snapshot)
                logger.info("final state of stage %d copied to %s", d.stage, where)
            except (OSError, PeerError) as exc:
                logger.warning("final state not copied to %s: %s", store.stage_dir(d.stage), exc)

    async def restore(self, at_most: int) -> ReceivedState | None:
        """The stage's newest checkpoint of step `at_most` or before, checked against this
        stage; None when there is none."""
        d = self.ctx
        config, runtime = d.config, d.runtime

        def receiver() -> StateReceiver:
            return StateReceiver(
                runtime.module,
                run_id=config.run_id,
                stage=d.stage,
                num_stages=config.pipeline.stages,
            )

        store = self._store()
        if store is not None:
            return await asyncio.to_thread(_read_from_folder, store, d.stage, at_most, receiver)
        r = receiver()
        try:
            call = d.coordinator.stub.GetCheckpoint(
                coordinator_pb2.GetCheckpointRequest(node_id=d.node_id, stage=d.stage),
                timeout=UPLOAD_TIMEOUT_S,
            )
            async for message in call:
                r.add(message)
            return await asyncio.to_thread(r.finish)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:
                logger.warning("could not fetch the stage's checkpoint: %s", exc.details())
            return None
        except PeerError as exc:
            logger.error("the stage's latest checkpoint is unusable: %s", exc)
            return None

    async def close(self) -> None:
        """Let an upload in progress finish (a stopping node's last checkpoint counts)."""
        pending = {t for t in (self._upload, self._final) if t is not None and not t.done()}
        if pending:
            await asyncio.wait(pending, timeout=30)


async def _aiter(messages: Any) -> AsyncIterator[state_pb2.StateMessage]:
    for message in messages:
        yield message


def _write_to_folder(store: CheckpointStore, snapshot: StateSnapshot) -> str:
    writer = store.receive(int(snapshot.manifest.stage))
    for message in state_messages(snapshot.manifest, snapshot.chunks()):
        writer.add(message)
    return str(writer.commit())


def _read_from_folder(
    store: CheckpointStore, stage: int, at_most: int, make_receiver: Any
) -> ReceivedState | None:
    """The newest checkpoint in the folder up to step `at_most` that passes every check
    (older ones as fallback)."""
    for step, path in reversed(store.checkpoints(stage)):
        if step > at_most:
            continue
        receiver: StateReceiver = make_receiver()
        try:
            manifest, chunks = store.read(path)
            try:
                for message in state_messages(manifest, chunks):
                    receiver.add(message)
            finally:
                chunks.close()
            return receiver.finish()
        except (OSError, PeerError, ValueError) as exc:
            logger.error("checkpoint %s (step %d) is unusable: %s", path, step, exc)
    return None
