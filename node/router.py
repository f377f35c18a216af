"""Sending a microbatch to the next stage: replica choice, the Forward call, the gradient back.

The sender keeps its activations until the gradient has come back, so a failed
hop can be sent again (to another replica when the plan has one). Next-hop
choice is random, weighted by the plan's throughput estimate and divided by
this sender's open calls to each peer, so a slow replica gets less traffic.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import defaultdict
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.compression import DEFAULT_LOWRANK_RANK, DEFAULT_TOPK_FRACTION
from swarmpipe.errors import CodecError, PeerError
from swarmpipe.node.transport import LinkStats, TensorReader, encode
from swarmpipe.protos import control_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from swarmpipe.rpc import open_channel

logger = logging.getLogger(__name__)


class HopError(PeerError):
    """A hop failed; the sender may try again (the plan may have changed meanwhile)."""

    def __init__(self, message: str, *, peer: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.peer = peer
        self.retryable = retryable


@dataclass(frozen=True, slots=True)
class HopResult:
    grad_input: torch.Tensor | None
    result: stage_pb2.MicrobatchResult
    peer: str


class Router:
    """Holds channels to peers and the latest plan; sends microbatches downstream."""

    def __init__(self, node_id: str, stats: LinkStats, *, seed: int | None = None) -> None:
        self.node_id = node_id
        self.stats = stats
        self.plan: control_pb2.Plan | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._in_flight: dict[str, int] = defaultdict(int)
        self._rng = random.Random(seed)
        self._closing: set[asyncio.Task[None]] = set()

    def set_plan(self, plan: control_pb2.Plan) -> None:
        if self.plan is None or plan.version >= self.plan.version:
            self.plan = plan
            live = {r.address for s in plan.stages for r in s.replicas}
            for address in [a for a in self._channels if a not in live]:
                channel = self._channels.pop(address)
                # Closing cancels calls still open on it; they fail and are resent.
                task = asyncio.ensure_future(channel.close(grace=1.0))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def pick(self, stage: int) -> control_pb2.Replica:
        plan = self.plan
        if plan is None or stage >= len(plan.stages) or not plan.stages[stage].replicas:
            raise HopError(f"the plan has no live replica of stage {stage}", peer="")
        replicas = list(plan.stages[stage].replicas)
        weights = [max(r.weight, 1e-6) / (1 + self._in_flight[r.node_id]) for r in replicas]
        return self._rng.choices(replicas, weights=weights)[0]

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address)
            self._channels[address] = channel
        return channel

    async def send(
        self,
        stage: int,
        header: stage_pb2.MicrobatchHeader,
        activation: torch.Tensor,
        *,
        codec: int,
        block_size: int,
        channel_blocks: bool = False,
        topk_fraction: float = DEFAULT_TOPK_FRACTION,
        lowrank_rank: int = DEFAULT_LOWRANK_RANK,
        timeout: float,
    ) -> HopResult:
        """Send one microbatch to a replica of `stage`; return its input gradient and result."""
        replica = self.pick(stage)
        peer = replica.node_id
        encoded = await encode(
            activation,
            codec,
            block_size,
            channel_blocks=channel_blocks,
            topk_fraction=topk_fraction,
            lowrank_rank=lowrank_rank,
        )
        stub = stage_pb2_grpc.StageStub(self.channel(replica.address))
        self._in_flight[peer] += 1
        try:
            call = stub.Forward(timeout=timeout)
            await call.write(stage_pb2.ForwardMessage(microbatch=header))
            await call.write(stage_pb2.ForwardMessage(tensor=encoded.header))
            for chunk in encoded.chunks:
                await call.write(stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=chunk)))
            await call.done_writing()
            self.stats.record(peer, "activation", codec, encoded.payload_bytes)
            reader: TensorReader | None = None
            grad: torch.Tensor | None = None
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "tensor":
                    if reader is not None:
                        raise PeerError("peer sent a second gradient header")
                    reader = TensorReader(message.tensor, self.stats)
                elif kind == "chunk":
                    if reader is None:
                        raise PeerError("peer sent gradient bytes before their header")
                    reader.add(message.chunk.data)
                elif kind == "result":
                    if reader is not None:
                        grad = await reader.finish()
                    return HopResult(grad, message.result, peer)
            raise PeerError("the stream ended without a result")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            retryable = code not in (grpc.StatusCode.INVALID_ARGUMENT,)
            raise HopError(
                f"stage {stage} at {peer} ({replica.address}) failed: {code.name}: {exc.details()}",
                peer=peer,
                retryable=retryable,
            ) from exc
        except (PeerError, CodecError) as exc:
            if isinstance(exc, HopError):
                raise
            raise HopError(f"stage {stage} at {peer} sent a bad reply: {exc}", peer=peer) from exc
        finally:
            self._in_flight[peer] -= 1

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
