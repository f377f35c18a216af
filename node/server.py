"""The node's Stage service: take a microbatch's activations, run the stage, return the gradient.

A middle stage forwards its output to the next stage on a new call and keeps
this one open until that call's gradient comes back, so a failure anywhere
downstream surfaces as an error on exactly one open call: this one's caller.
Bad input is refused with INVALID_ARGUMENT before any compute. A middle stage
whose downstream hop fails resends once to another replica of the next stage
(within the time its own caller allowed), then answers ABORTED: the caller
may resend, and need not bench this node for a fault further down.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
import torch

from swarmpipe.compression import get_codec
from swarmpipe.errors import CodecError, PeerError
from swarmpipe.node.compute import BACKWARD, FORWARD
from swarmpipe.node.context import NodeStatus, StageContext
from swarmpipe.node.peer_admission import PeerAdmission
from swarmpipe.node.replica_sync import ReplicaSync
from swarmpipe.node.router import HopError, HopResult
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.state_transfer import StateTransfer
from swarmpipe.node.token_ids import decode_token_ids, tokens_from_labels
from swarmpipe.node.transport import LinkStats, TensorReader, encode
from swarmpipe.protos import stage_pb2, stage_pb2_grpc, state_pb2, tensor_pb2
from swarmpipe.transport.request_parsing import BAD_REQUESTS

logger = logging.getLogger(__name__)

# Refusals are logged through the process's rate-limited log of bad calls, by method.
FORWARD_METHOD = "/swarmpipe.v1.Stage/Forward"
REDUCE = "/swarmpipe.v1.Stage/Reduce"
MIDDLE_HOP_ATTEMPTS = 2


HeaderCheck = Callable[[stage_pb2.MicrobatchHeader, tensor_pb2.TensorHeader], None]


def microbatch_check(runtime: StageRuntime) -> HeaderCheck:
    """The checks of a microbatch's headers against the run, made before its payload is
    buffered (PeerError names the problem): its stage, context, sample count and activation
    shape, so a peer cannot make this node hold a tensor it would refuse anyway."""
    config = runtime.config

    def check(header: stage_pb2.MicrobatchHeader, tensor: tensor_pb2.TensorHeader) -> None:
        if header.hop != runtime.stage:
            raise PeerError(
                f"microbatch is for stage {header.hop}; this node serves {runtime.stage}"
            )
        if header.context != config.model.context:
            raise PeerError(
                f"context {header.context} differs from the run's {config.model.context}"
            )
        runtime.check_activation_header(tensor.shape, header.sample_count)

    return check


async def read_forward_request(
    requests: AsyncIterator[stage_pb2.ForwardMessage],
    stats: LinkStats | None = None,
    device: torch.device | None = None,
    check: HeaderCheck | None = None,
) -> tuple[stage_pb2.MicrobatchHeader, torch.Tensor]:
    """Read the header, tensor header and chunks of one Forward call, in that order; the
    tensor is decoded on `device` (None: the host). `check` sees both headers before any
    chunk is taken."""
    header: stage_pb2.MicrobatchHeader | None = None
    reader: TensorReader | None = None
    async for message in requests:
        kind = message.WhichOneof("kind")
        if kind == "microbatch":
            if header is not None:
                raise PeerError("the call carries a second microbatch header")
            header = message.microbatch
        elif kind == "tensor":
            if header is None:
                raise PeerError("the tensor header came before the microbatch header")
            if reader is not None:
                raise PeerError("the call carries a second tensor header")
            if check is not None:
                check(header, message.tensor)
            reader = TensorReader(message.tensor, stats, device)
        elif kind == "chunk":
            if reader is None:
                raise PeerError("tensor bytes came before the tensor header")
            reader.add(message.chunk.data)
        else:
            raise PeerError("empty ForwardMessage: set microbatch, tensor or chunk")
    if header is None or reader is None:
        raise PeerError("the call ended before the microbatch and tensor headers")
    return header, await reader.finish()


def trains_on_of(header: stage_pb2.MicrobatchHeader) -> int:
    """The parameter version a microbatch is computed on: the header's `trains_on`
    (train.step_overlap), else its step's own."""
    return int(header.trains_on) if header.HasField("trains_on") else int(header.step)


def decode_labels_and_tokens(
    header: stage_pb2.MicrobatchHeader, vocab: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The microbatch's labels [B, T] and, when it carries first_tokens, its input ids [B, T];
    PeerError if either is malformed."""
    shape = (header.sample_count, header.context)
    labels = decode_token_ids(header.labels, shape, vocab, "labels")
    if not header.first_tokens:
        return labels, None
    first = decode_token_ids(header.first_tokens, shape[:1], vocab, "first token ids")
    return labels, tokens_from_labels(first, labels)


class StageServicer(stage_pb2_grpc.StageServicer):
    """The Stage service of one node.

    The server starts before the node joins (Join needs its port), so the servicer starts
    empty and answers UNAVAILABLE until the daemon `attach`es the stage it joined as.
    """

    def __init__(
        self, node_id: str, status: NodeStatus, admission: PeerAdmission | None = None
    ) -> None:
        self.node_id = node_id
        self.status = status
        self.admission = admission
        """Who the caller is (its credential); None: a server without admission (tests)."""
        self._ctx: StageContext | None = None
        self._replica_sync: ReplicaSync | None = None
        self._state_transfer: StateTransfer | None = None

    def attach(
        self, ctx: StageContext, replica_sync: ReplicaSync, state_transfer: StateTransfer
    ) -> None:
        """Serve `ctx`'s stage from now on (microbatches only once the status is serving)."""
        self._ctx = ctx
        self._replica_sync = replica_sync
        self._state_transfer = state_transfer

    async def _joined(
        self, context: grpc.aio.ServicerContext
    ) -> tuple[StageContext, ReplicaSync, StateTransfer]:
        if self._ctx is None or self._replica_sync is None or self._state_transfer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is still starting")
            raise AssertionError("unreachable: abort raises")
        return self._ctx, self._replica_sync, self._state_transfer

    async def Info(
        self, request: stage_pb2.StageInfoRequest, context: grpc.aio.ServicerContext
    ) -> stage_pb2.StageInfoReply:
        d = self._ctx
        if d is None:
            return stage_pb2.StageInfoReply(
                node_id=self.node_id, in_flight=self.status.in_flight, serving=False
            )
        return stage_pb2.StageInfoReply(
            node_id=d.node_id,
            stage=d.stage,
            num_stages=d.config.pipeline.stages,
            step=d.runtime.step,
            in_flight=self.status.in_flight,
            serving=self.status.serving,
        )

    async def Reduce(
        self,
        request_iterator: AsyncIterator[stage_pb2.ReduceMessage],
        context: grpc.aio.ServicerContext,
    ) -> stage_pb2.ReduceReply:
        _, replica_sync, _ = await self._joined(context)
        if not self.status.serving:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is still syncing")
        try:
            return await replica_sync.receive(self._sent_by_caller(request_iterator, context))
        except (PeerError, CodecError) as exc:
            BAD_REQUESTS.record(REDUCE, context.peer(), f"a gradient for the reduce: {exc}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises

    async def _sent_by_caller(
        self,
        messages: AsyncIterator[stage_pb2.ReduceMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.ReduceMessage]:
        """`messages`, refusing any whose sender is not the node the credential names: a
        replica in the plan cannot hand in a contribution under another replica's name."""
        caller = self._caller(context)
        async for message in messages:
            kind = message.WhichOneof("kind")
            named = message.header.sender_node if kind == "header" else None
            if kind == "manifest":
                named = message.manifest.sender_node
            if caller is not None and named is not None and named != caller:
                raise PeerError(f"the reduce names sender {named!r} but the caller is {caller!r}")
            yield message

    def _caller(self, context: grpc.aio.ServicerContext) -> str | None:
        if self.admission is None:
            return None
        return self.admission.caller(context.invocation_metadata())

    async def _send_downstream(
        self,
        header: stage_pb2.MicrobatchHeader,
        output: torch.Tensor,
        context: grpc.aio.ServicerContext,
    ) -> HopResult:
        """This stage's output on to the next stage, within the caller's deadline; a failed
        hop aborts the call with ABORTED, not UNAVAILABLE: this node is healthy, so the
        sender resends without benching it."""
        d, _, _ = await self._joined(context)
        downstream = stage_pb2.MicrobatchHeader()
        downstream.CopyFrom(header)
        downstream.hop = d.stage + 1
        downstream.sender_node = d.node_id
        remaining = context.time_remaining()
        try:
            # One reroute here saves the upstream sender from redoing this stage; more
            # would outlast the deadline it measured.
            return await d.router.send_rerouting(
                d.stage + 1,
                downstream,
                output,
                codec=d.activation_codec,
                attempts=MIDDLE_HOP_ATTEMPTS,
                deadline=None if remaining is None else time.monotonic() + remaining,
            )
        except HopError as exc:
            logger.debug("downstream hop failed: %s", exc)
            await context.abort(grpc.StatusCode.ABORTED, f"downstream: {exc}")
            raise  # unreachable: abort raises

    async def _evaluate(
        self,
        header: stage_pb2.MicrobatchHeader,
        activation: torch.Tensor,
        labels: torch.Tensor,
        tokens: torch.Tensor | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.BackwardMessage]:
        """An evaluation microbatch: forward only, the loss comes back without a gradient."""
        d, _, _ = await self._joined(context)
        runtime = d.runtime
        with d.status.track_microbatch():
            if runtime.is_last:
                last = await d.compute.run(
                    FORWARD,
                    lambda: runtime.evaluate_last(
                        activation, labels, tokens, trains_on=trains_on_of(header)
                    ),
                )
                result = stage_pb2.MicrobatchResult(
                    loss_sum=last.loss_sum, tokens=last.tokens, stages_done=1
                )
            else:
                version = trains_on_of(header)
                output = await d.compute.run(
                    FORWARD, lambda: runtime.forward_eval(activation, tokens, trains_on=version)
                )
                hop = await self._send_downstream(header, output, context)
                result = stage_pb2.MicrobatchResult()
                result.CopyFrom(hop.result)
                result.stages_done += 1
        await d.links.propagate(header.sender_node or header.origin_node)
        yield stage_pb2.BackwardMessage(result=result)

    async def FetchState(
        self, request: stage_pb2.FetchStateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[state_pb2.StateMessage]:
        _, _, state_transfer = await self._joined(context)
        async for message in state_transfer.serve(request, context):
            yield message

    async def Forward(
        self,
        request_iterator: AsyncIterator[stage_pb2.ForwardMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.BackwardMessage]:
        d, _, _ = await self._joined(context)
        runtime = d.runtime
        if not d.status.serving:
            # Its parameters are not the stage's yet (it is downloading them).
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node is still syncing")
        try:
            header, activation = await read_forward_request(
                request_iterator, d.stats, d.runtime.device, microbatch_check(runtime)
            )
            caller = self._caller(context)
            if caller is not None and header.sender_node and header.sender_node != caller:
                raise PeerError(
                    f"the microbatch names sender {header.sender_node!r}, not {caller!r}"
                )
            if header.gradient_codec:
                get_codec(header.gradient_codec)  # CodecError names an unknown codec
            # In a thread: its finiteness scan waits for the device when the tensor is on a
            # GPU (behind the compute thread's queued kernels), which the event loop must not.
            await asyncio.to_thread(runtime.check_activation, activation, header.sample_count)
            if d.router.guard is not None:  # the node's one guard (node/tensor_guard.py)
                sender = header.sender_node or header.origin_node
                d.router.guard.check(
                    "activation",
                    activation,
                    sender=sender,
                    step=header.step,
                    sole=d.router.sole_replica(sender),
                )
            labels, tokens = decode_labels_and_tokens(header, d.config.model.vocab)
            runtime.check_tokens(tokens)
        except (PeerError, CodecError) as exc:
            BAD_REQUESTS.record(FORWARD_METHOD, context.peer(), f"a microbatch: {exc}")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # unreachable: abort raises
        trains_on = trains_on_of(header)
        try:
            runtime.check_step(header.step, trains_on)
        except PeerError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        if header.eval:
            async for message in self._evaluate(header, activation, labels, tokens, context):
                yield message
            return
        key = uuid.uuid4().hex
        d.status.step_times.forward_started(header.step)
        with d.status.track_microbatch():
            try:
                if runtime.is_last:
                    last, seconds = await d.compute.run_timed(
                        FORWARD,
                        lambda: runtime.forward_last(
                            header.microbatch_id,
                            activation,
                            labels,
                            tokens,
                            step=header.step,
                            trains_on=trains_on,
                        ),
                    )
                    d.links.record_compute(seconds)
                    d.status.step_times.computed(header.step, seconds)
                    grad_input = last.grad_input
                    result = stage_pb2.MicrobatchResult(
                        loss_sum=last.loss_sum, tokens=last.tokens, stages_done=1
                    )
                else:
                    output, forward_s = await d.compute.run_timed(
                        FORWARD,
                        lambda: runtime.forward(
                            key,
                            header.microbatch_id,
                            activation,
                            tokens,
                            step=header.step,
                            trains_on=trains_on,
                        ),
                    )
                    hop = await self._send_downstream(header, output, context)
                    if hop.grad_input is None:
                        await context.abort(
                            grpc.StatusCode.UNAVAILABLE, "the next stage returned no gradient"
                        )
                    grad_output = hop.grad_input
                    assert grad_output is not None
                    try:
                        grad_input, backward_s = await d.compute.run_timed(
                            BACKWARD, lambda: runtime.backward(key, grad_output)
                        )
                    except PeerError as exc:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"bad gradient: {exc}")
                        raise  # unreachable
                    d.links.record_compute(forward_s + backward_s)
                    d.status.step_times.computed(header.step, forward_s + backward_s)
                    result = stage_pb2.MicrobatchResult()
                    result.CopyFrom(hop.result)
                    result.stages_done += 1
            finally:
                # A call cancelled mid-way must not leave its graph behind.
                await asyncio.shield(d.compute.run(BACKWARD, lambda: runtime.discard(key)))
        assert grad_input is not None
        # The sender's request wins; without one (auto mode), the link to it picks.
        peer = header.sender_node or header.origin_node
        codec = d.links.codec_for(
            peer,
            "gradient",
            grad_input,
            step=header.step,
            requested=header.gradient_codec or d.gradient_codec,
        )
        encoded = await encode(
            grad_input,
            codec,
            d.links.options,
            role="gradient",
            state=d.links.encoder_state(peer, "gradient"),
        )
        async with d.links.transfer(peer, "gradient") as link:
            message = stage_pb2.BackwardMessage(tensor=encoded.header)
            await link.pace(message.ByteSize())
            yield message
            for chunk in encoded.chunks:
                message = stage_pb2.BackwardMessage(chunk=tensor_pb2.TensorChunk(data=chunk))
                await link.pace(message.ByteSize())
                yield message
        d.stats.record(peer, "gradient", codec, encoded.payload_bytes)
        d.status.count_samples(header.sample_count)
        yield stage_pb2.BackwardMessage(result=result)
