"""The head: a stage-0 node's loop that leases samples and pushes microbatches through the pipeline.

Each of `pipeline.in_flight` workers leases a range, runs stage 0, sends the
activations downstream and, when the gradient comes back, runs backward and
commits. A failed hop is retried with backoff while the head keeps the
activations (the plan may route around the failure meanwhile); a microbatch
that still cannot finish is released, so the coordinator leases it again.
Nothing is dropped silently: a released lease is logged as an ERROR.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from typing import TYPE_CHECKING

import grpc
import torch

from swarmpipe.node.compute import BACKWARD, FORWARD
from swarmpipe.node.router import HopError, HopResult
from swarmpipe.protos import coordinator_pb2, stage_pb2

if TYPE_CHECKING:
    from swarmpipe.data import Corpus
    from swarmpipe.node.daemon import NodeDaemon

logger = logging.getLogger(__name__)

HOP_ATTEMPTS = 8
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
LEASE_WAIT_S = 5.0


class Head:
    def __init__(self, daemon: NodeDaemon, corpus: Corpus) -> None:
        self.daemon = daemon
        self.corpus = corpus
        self.stopping = asyncio.Event()
        self.finished = asyncio.Event()

    async def run(self) -> None:
        """Run the lease workers until the run is done or the node stops."""
        assert self.daemon.config is not None
        workers = [
            asyncio.create_task(self._worker(i))
            for i in range(self.daemon.config.pipeline.in_flight)
        ]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            self.finished.set()

    async def _worker(self, index: int) -> None:
        d = self.daemon
        Reply = coordinator_pb2.LeaseReply
        while not self.stopping.is_set():
            try:
                lease = await d.coordinator.Lease(
                    coordinator_pb2.LeaseRequest(node_id=d.node_id, wait_seconds=LEASE_WAIT_S),
                    timeout=LEASE_WAIT_S + 10,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.warning("coordinator refused leases: %s", exc.details())
                    return
                logger.debug("lease request failed (%s); retrying", exc.code().name)
                await asyncio.sleep(1.0)
                continue
            if lease.status == Reply.STATUS_DONE:
                return
            if lease.status != Reply.STATUS_GRANTED:
                continue
            await self._process(lease)

    async def _process(self, lease: coordinator_pb2.LeaseReply) -> None:
        d = self.daemon
        runtime = d.runtime
        config = d.config
        assert runtime is not None and config is not None
        tokens, labels = self.corpus.samples(lease.sample_start, lease.sample_count)
        microbatch_id = f"{lease.step}:{lease.sample_start}:{lease.sample_count}"
        header = stage_pb2.MicrobatchHeader(
            microbatch_id=microbatch_id,
            step=lease.step,
            lease_id=lease.lease_id,
            sample_start=lease.sample_start,
            sample_count=lease.sample_count,
            origin_node=d.node_id,
            labels=labels.numpy().astype("<i4").tobytes(),
            context=config.model.context,
            gradient_codec=d.gradient_codec,  # type: ignore[arg-type]
            hop=1,
            sender_node=d.node_id,
        )
        key = uuid.uuid4().hex
        d.in_flight += 1
        started = time.perf_counter()
        try:
            if runtime.is_last:  # a one-stage run: the head is the whole model
                last = await d.compute.run(
                    FORWARD, lambda: runtime.forward_last(microbatch_id, tokens, labels)
                )
                loss_sum, n_tokens = last.loss_sum, last.tokens
            else:
                output = await d.compute.run(
                    FORWARD, lambda: runtime.forward(key, microbatch_id, tokens)
                )
                hop = await self._send_with_retries(header, output)
                if hop is None:
                    await self._release(lease, "every attempt to send it downstream failed")
                    return
                grad = hop.grad_input
                assert grad is not None
                await d.compute.run(BACKWARD, lambda: runtime.backward(key, grad))
                loss_sum, n_tokens = hop.result.loss_sum, hop.result.tokens
        finally:
            d.in_flight -= 1
            await asyncio.shield(d.compute.run(BACKWARD, lambda: runtime.discard(key)))
        d.samples_processed += lease.sample_count
        d.microbatch_seconds.append(time.perf_counter() - started)
        reply = await d.call_coordinator(
            "Commit",
            coordinator_pb2.CommitRequest(
                node_id=d.node_id, lease_id=lease.lease_id, loss_sum=loss_sum, tokens=n_tokens
            ),
        )
        if not reply.accepted:
            logger.warning("commit of lease %d refused: %s", lease.lease_id, reply.reason)

    async def _send_with_retries(
        self, header: stage_pb2.MicrobatchHeader, output: torch.Tensor
    ) -> HopResult | None:
        d = self.daemon
        config = d.config
        assert config is not None
        delay = BACKOFF_START_S
        for attempt in range(1, HOP_ATTEMPTS + 1):
            try:
                return await d.router.send(
                    1,
                    header,
                    output,
                    codec=d.activation_codec,
                    block_size=config.pipeline.int8_block_size,
                    channel_blocks=config.pipeline.int8_channel_blocks,
                    topk_fraction=config.pipeline.topk_fraction,
                    lowrank_rank=config.pipeline.lowrank_rank,
                    timeout=config.pipeline.hop_timeout_s,
                )
            except HopError as exc:
                if not exc.retryable:
                    logger.error("microbatch %s refused downstream: %s", header.microbatch_id, exc)
                    return None
                logger.debug("attempt %d for %s failed: %s", attempt, header.microbatch_id, exc)
                # Exponential backoff with jitter: the wait also gives the
                # coordinator time to publish a plan without a vanished node.
                await asyncio.sleep(delay * (0.5 + random.random()))
                delay = min(delay * 2, BACKOFF_MAX_S)
        return None

    async def _release(self, lease: coordinator_pb2.LeaseReply, reason: str) -> None:
        d = self.daemon
        logger.error(
            "microbatch of lease %d (samples %d+%d) not finished: %s; released for replay",
            lease.lease_id,
            lease.sample_start,
            lease.sample_count,
            reason,
        )
        await d.call_coordinator(
            "Release",
            coordinator_pb2.ReleaseRequest(
                node_id=d.node_id, lease_id=lease.lease_id, reason=reason
            ),
        )
