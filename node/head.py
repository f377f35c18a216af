"""The head: a stage-0 node's loop that leases samples and pushes microbatches through the pipeline.

Each of `pipeline.in_flight` workers leases a range, runs stage 0, sends the
activations downstream and, when the gradient comes back, runs backward and
commits. With `in_flight = "auto"` the number of workers at work follows the
window node/in_flight.py computes after every microbatch; the others wait.
A failed or overdue hop is resent to another replica (with backoff between
rounds) while the head keeps the activations; the plan may route around the
failure meanwhile. A microbatch that still cannot finish is
released, so the coordinator leases it again.
Nothing is dropped silently: a released lease is logged as an ERROR.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import TYPE_CHECKING

import grpc
import torch

from swarmpipe.errors import CoordinatorUnavailable, PeerError
from swarmpipe.node import fault_points
from swarmpipe.node.compute import BACKWARD, FORWARD
from swarmpipe.node.context import StageContext
from swarmpipe.node.in_flight import InFlightSizer, window_cap
from swarmpipe.node.router import HopError, HopResult
from swarmpipe.node.token_ids import encode_token_ids, first_tokens_of
from swarmpipe.protos import coordinator_pb2, stage_pb2

if TYPE_CHECKING:
    from swarmpipe.data import Corpus

logger = logging.getLogger(__name__)

HOP_ATTEMPTS = 8
BACKOFF_START_S = 0.1
BACKOFF_MAX_S = 5.0
LEASE_WAIT_S = 5.0
RELEASE_WHILE_LEAVING_S = 2.0
PARKED_POLL_S = 1.0
"""How often a worker outside the window looks again (it also wakes when the window
grows or the run ends)."""


class Head:
    """Leases samples and drives microbatches through the pipeline from stage 0."""

    def __init__(self, ctx: StageContext, corpus: Corpus) -> None:
        self.ctx = ctx
        self.corpus = corpus
        self.stopping = asyncio.Event()
        self.finished = asyncio.Event()
        self._warned_short_holdout = False
        setting = ctx.config.pipeline.in_flight
        self.sizer: InFlightSizer | None = None
        """Sizes the window when pipeline.in_flight is "auto"; None for a fixed number."""
        if isinstance(setting, int):
            self._workers = setting
        else:
            train = ctx.config.train
            cap = window_cap(
                microbatches_per_step=-(-train.global_batch // train.microbatch),
                overlap_depth=train.overlap_depth,
            )
            self.sizer = InFlightSizer(maximum=cap)
            self._workers = cap
        self._run_over = False
        self._window_changed = asyncio.Event()

    @property
    def window(self) -> int:
        """Microbatches this head keeps in flight now."""
        return self._workers if self.sizer is None else self.sizer.window

    async def run(self) -> None:
        """Run the lease workers until the run is done or the node stops."""
        workers = [asyncio.create_task(self._worker(i)) for i in range(self._workers)]
        try:
            await asyncio.gather(*workers)
        finally:
            for w in workers:
                w.cancel()
            self.finished.set()

    def _resize(self) -> None:
        """Recompute the auto window from the latest round trip and bottleneck figures."""
        if self.sizer is None:
            return
        d = self.ctx
        plan = d.router.plan
        stage_weights = [[r.weight for r in s.replicas] for s in plan.stages] if plan else []
        heads = len(plan.stages[0].replicas) if plan and plan.stages else 1
        before = self.sizer.window
        window = self.sizer.update(
            samples_per_microbatch=d.config.train.microbatch,
            own_compute_s=d.links.compute.value,
            link_seconds=d.links.seconds_per_tensor(),
            stage_weights=stage_weights,
            heads=heads,
        )
        if window != before:
            logger.info(
                "microbatches in flight: %d -> %d (round trip %.0f ms, bottleneck %.0f ms "
                "per microbatch, %d head%s)",
                before,
                window,
                (self.sizer.round_trip_s or 0.0) * 1e3,
                (self.sizer.bottleneck_s or 0.0) * 1e3,
                heads,
                "" if heads == 1 else "s",
            )
            if window > before:
                self._window_changed.set()
                self._window_changed = asyncio.Event()

    async def _parked(self) -> None:
        """Wait outside the window until it grows, the run ends or a poll's time passed."""
        changed = self._window_changed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), PARKED_POLL_S)

    async def _worker(self, index: int) -> None:
        d = self.ctx
        Reply = coordinator_pb2.LeaseReply
        failing_since: float | None = None
        while not self.stopping.is_set() and not self._run_over:
            if index >= self.window:
                await self._parked()
                continue
            asked = time.perf_counter()
            try:
                lease = await d.coordinator.stub.Lease(
                    coordinator_pb2.LeaseRequest(node_id=d.node_id, wait_seconds=LEASE_WAIT_S),
                    timeout=LEASE_WAIT_S + 10,
                )
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.warning("coordinator refused leases: %s", exc.details())
                    return
                # A coordinator that restarts is away for seconds; one away past the grace
                # is gone, and the node says so instead of asking forever.
                now = time.monotonic()
                failing_since = failing_since or now
                if now - failing_since > d.coordinator.retry_s:
                    raise CoordinatorUnavailable(
                        f"the coordinator at {d.coordinator.address} granted no lease for "
                        f"{d.coordinator.retry_s:.0f} s ({exc.code().name})"
                    ) from exc
                logger.debug("lease request failed (%s); retrying", exc.code().name)
                await asyncio.sleep(1.0)
                continue
            failing_since = None
            if lease.status == Reply.STATUS_DONE:
                self._run_over = True
                self._window_changed.set()
                return
            if lease.status != Reply.STATUS_GRANTED:
                continue
            if await self._process(lease) and self.sizer is not None:
                # Lease to commit, so the control plane's round trips count too.
                self.sizer.add_round_trip(time.perf_counter() - asked)
                self._resize()

    def _header(
        self,
        lease: coordinator_pb2.LeaseReply,
        microbatch_id: str,
        tokens: torch.Tensor,
        labels: torch.Tensor,
    ) -> stage_pb2.MicrobatchHeader:
        d = self.ctx
        config = d.config
        header = stage_pb2.MicrobatchHeader(
            microbatch_id=microbatch_id,
            step=lease.step,
            lease_id=lease.lease_id,
            sample_start=lease.sample_start,
            sample_count=labels.shape[0],
            origin_node=d.node_id,
            labels=encode_token_ids(labels, config.model.vocab),
            context=config.model.context,
            gradient_codec=d.gradient_codec,  # type: ignore[arg-type]
            hop=1,
            sender_node=d.node_id,
            eval=lease.eval,
        )
        if lease.HasField("trains_on"):
            header.trains_on = lease.trains_on
        if config.model.bottleneck and config.pipeline.stages > 1:
            # Stages after a bottleneck boundary re-add token embeddings; they derive the
            # ids from these and the labels (node/token_ids.py).
            header.first_tokens = encode_token_ids(
                first_tokens_of(tokens, labels), config.model.vocab
            )
        return header

    async def _process(self, lease: coordinator_pb2.LeaseReply) -> bool:
        """Run one lease through the pipeline; whether a training microbatch was committed."""
        if lease.eval:
            await self._evaluate(lease)
            return False
        d = self.ctx
        runtime = d.runtime
        tokens, labels = self.corpus.samples(lease.sample_start, lease.sample_count)
        microbatch_id = f"{lease.step}:{lease.sample_start}:{lease.sample_count}"
        step = int(lease.step)
        trains_on = int(lease.trains_on) if lease.HasField("trains_on") else step
        header = self._header(lease, microbatch_id, tokens, labels)
        key = uuid.uuid4().hex
        leased_at = time.monotonic()
        started = time.perf_counter()
        with d.status.track_microbatch():
            try:
                d.status.step_times.forward_started(lease.step)
                if runtime.is_last:  # a one-stage run: the head is the whole model
                    last, seconds = await d.compute.run_timed(
                        FORWARD,
                        lambda: runtime.forward_last(
                            microbatch_id, tokens, labels, step=step, trains_on=trains_on
                        ),
                    )
                    d.status.step_times.computed(lease.step, seconds)
                    loss_sum, n_tokens = last.loss_sum, last.tokens
                else:
                    output, forward_s = await d.compute.run_timed(
                        FORWARD,
                        lambda: runtime.forward(
                            key, microbatch_id, tokens, step=step, trains_on=trains_on
                        ),
                    )
                    hop = await self._send_with_retries(header, output, leased_at=leased_at)
                    if hop is None:
                        await self._release(lease, "every attempt to send it downstream failed")
                        return False
                    await fault_points.reach("head.hop_done", lease.step)
                    grad = hop.grad_input
                    assert grad is not None
                    _, backward_s = await d.compute.run_timed(
                        BACKWARD, lambda: runtime.backward(key, grad)
                    )
                    d.links.record_compute(forward_s + backward_s)
                    d.status.step_times.computed(lease.step, forward_s + backward_s)
                    loss_sum, n_tokens = hop.result.loss_sum, hop.result.tokens
            except PeerError as exc:
                # A lease that outlived its step (it was leased again and the step applied):
                # this node no longer holds the parameters it trains on.
                await self._release(lease, str(exc))
                return False
            finally:
                await asyncio.shield(d.compute.run(BACKWARD, lambda: runtime.discard(key)))
        d.status.count_samples(lease.sample_count, seconds=time.perf_counter() - started)
        return await self._commit(lease, loss_sum, n_tokens)

    async def _commit(
        self, lease: coordinator_pb2.LeaseReply, loss_sum: float, tokens: int
    ) -> bool:
        d = self.ctx
        reply = await d.coordinator.call(
            "Commit",
            coordinator_pb2.CommitRequest(
                node_id=d.node_id, lease_id=lease.lease_id, loss_sum=loss_sum, tokens=tokens
            ),
        )
        if not reply.accepted:
            logger.warning("commit of lease %d refused: %s", lease.lease_id, reply.reason)
        return bool(reply.accepted)

    async def _evaluate(self, lease: coordinator_pb2.LeaseReply) -> None:
        """An evaluation lease: held-out samples forward through the pipeline, loss committed."""
        d = self.ctx
        runtime = d.runtime
        if lease.sample_start >= self.corpus.n_holdout:
            # train.eval_samples asks for more than the corpus holds out: evaluate what
            # there is, and commit the rest as empty so the step can end.
            if not self._warned_short_holdout:
                self._warned_short_holdout = True
                logger.warning(
                    "train.eval_samples exceeds the corpus's %d held-out samples; "
                    "evaluating those only",
                    self.corpus.n_holdout,
                )
            await self._commit(lease, 0.0, 0)
            return
        tokens, labels = self.corpus.heldout_range(lease.sample_start, lease.sample_count)
        microbatch_id = f"eval:{lease.step}:{lease.sample_start}:{lease.sample_count}"
        leased_at = time.monotonic()
        trains_on = int(lease.trains_on) if lease.HasField("trains_on") else int(lease.step)
        with d.status.track_microbatch():
            try:
                if runtime.is_last:
                    last = await d.compute.run(
                        FORWARD,
                        lambda: runtime.evaluate_last(tokens, labels, trains_on=trains_on),
                    )
                else:
                    output = await d.compute.run(
                        FORWARD, lambda: runtime.forward_eval(tokens, trains_on=trains_on)
                    )
            except PeerError as exc:  # a lease that outlived its step's parameters
                await self._release(lease, str(exc))
                return
            if runtime.is_last:
                loss_sum, n_tokens = last.loss_sum, last.tokens
            else:
                header = self._header(lease, microbatch_id, tokens, labels)
                hop = await self._send_with_retries(header, output, leased_at=leased_at)
                if hop is None:
                    await self._release(lease, "every attempt to send it downstream failed")
                    return
                loss_sum, n_tokens = hop.result.loss_sum, hop.result.tokens
        await self._commit(lease, loss_sum, n_tokens)

    async def _send_with_retries(
        self, header: stage_pb2.MicrobatchHeader, output: torch.Tensor, *, leased_at: float
    ) -> HopResult | None:
        """The first hop with its reroutes, within the lease's life: once
        `coordinator.lease_timeout_s` has passed since `leased_at`, the coordinator has
        leased the samples again and a late commit would only be refused as a duplicate.
        Without that bound, HOP_ATTEMPTS tries of up to `pipeline.hop_timeout_s` each (the
        deadline of a peer with no measured round trip, such as one that just moved in)
        could hold a worker of the window for many minutes."""
        d = self.ctx
        try:
            return await d.router.send_rerouting(
                1,
                header,
                output,
                codec=d.activation_codec,
                attempts=HOP_ATTEMPTS,
                deadline=leased_at + d.config.coordinator.lease_timeout_s,
                backoff_s=BACKOFF_START_S,
                backoff_max_s=BACKOFF_MAX_S,
                give_up=self.stopping.is_set,
            )
        except HopError as exc:
            if not exc.retryable:
                logger.error("microbatch %s refused downstream: %s", header.microbatch_id, exc)
            else:
                logger.warning(
                    "microbatch %s: last of %d tries failed: %s",
                    header.microbatch_id,
                    HOP_ATTEMPTS,
                    exc,
                )
            return None

    async def _release(self, lease: coordinator_pb2.LeaseReply, reason: str) -> None:
        d = self.ctx
        logger.error(
            "microbatch of lease %d (samples %d+%d) not finished: %s; released for replay",
            lease.lease_id,
            lease.sample_start,
            lease.sample_count,
            reason,
        )
        request = coordinator_pb2.ReleaseRequest(
            node_id=d.node_id, lease_id=lease.lease_id, reason=reason
        )
        if not self.stopping.is_set():
            await d.coordinator.call("Release", request)
            return
        # Leaving: one quick try. If the coordinator cannot take it, it replays the lease
        # anyway when this node's presence goes offline; the drain need not wait for it.
        try:
            await d.coordinator.stub.Release(request, timeout=RELEASE_WHILE_LEAVING_S)
        except grpc.aio.AioRpcError as exc:
            logger.info("release of lease %d not delivered: %s", lease.lease_id, exc.code().name)
