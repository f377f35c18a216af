"""Replica sync: the replicas of a stage sum their gradients before every optimizer step.

At APPLY, each replica sends its flat gradient sum (with its token and sample
counts) to every other replica of its stage over Stage.Reduce, chunked and
lossless, and waits for theirs. Every replica then adds the same
contributions in the same order (sorted by node id), so all of them take a
bit-identical AdamW step and their parameters stay equal. A replica that
leaves the plan (its Last Will fired) while others wait for it is dropped and
the rest finish; one that stays in the plan but sends nothing is dropped when
`pipeline.reduce_timeout_s` runs out.

Known gap, left for state transfer to close: if a replica's send fails while
it still receives the others', it and they sum different sets and drift apart;
the step's parameter digests (reported to the coordinator) make that visible.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import torch

from swarmpipe.errors import PeerError
from swarmpipe.node.compute import BACKWARD
from swarmpipe.node.links import Transfer
from swarmpipe.node.transport import TensorReader, encode
from swarmpipe.protos import stage_pb2, stage_pb2_grpc, tensor_pb2

if TYPE_CHECKING:
    from swarmpipe.node.daemon import NodeDaemon

logger = logging.getLogger(__name__)

Contribution = tuple[torch.Tensor, int, int]  # flat gradient sum, tokens, samples


class ReplicaSync:
    def __init__(self, daemon: NodeDaemon) -> None:
        self.daemon = daemon
        self._inbox: dict[str, Contribution] = {}
        self._inbox_step = -1
        self._arrived = asyncio.Event()

    def _peers(self) -> dict[str, str]:
        """Other live replicas of this node's stage in the current plan: node id -> address."""
        plan = self.daemon.router.plan
        stage = self.daemon.stage
        if plan is None or not 0 <= stage < len(plan.stages):
            return {}
        return {
            r.node_id: r.address
            for r in plan.stages[stage].replicas
            if r.node_id != self.daemon.node_id
        }

    async def receive(
        self, requests: AsyncIterator[stage_pb2.ReduceMessage]
    ) -> stage_pb2.ReduceReply:
        """Take one peer's contribution (the server side of Stage.Reduce)."""
        runtime = self.daemon.runtime
        if runtime is None:
            raise PeerError("this node is still starting")
        header: stage_pb2.ReduceHeader | None = None
        reader: TensorReader | None = None
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "header" and header is None:
                header = message.header
                if header.step != runtime.step:
                    raise PeerError(
                        f"reduce for step {header.step}; this node is at {runtime.step}"
                    )
                if header.sender_node not in self._peers():
                    raise PeerError(f"{header.sender_node!r} is not a replica of this stage")
            elif kind == "tensor" and header is not None and reader is None:
                want = [runtime.n_parameters]
                if list(message.tensor.shape) != want:
                    raise PeerError(f"gradient shape {list(message.tensor.shape)} is not {want}")
                reader = TensorReader(message.tensor, self.daemon.stats)
            elif kind == "chunk" and reader is not None:
                reader.add(message.chunk.data)
            else:
                raise PeerError("a reduce call is a header, a tensor header, then its chunks")
        if header is None or reader is None:
            raise PeerError("the reduce call ended before its headers")
        flat = (await reader.finish()).float()
        if not bool(torch.isfinite(flat).all()):
            raise PeerError("the gradient contains NaN or infinite values")
        if self._inbox_step != header.step:
            self._inbox, self._inbox_step = {}, header.step
        self._inbox[header.sender_node] = (flat, int(header.tokens), int(header.samples))
        self._arrived.set()
        return stage_pb2.ReduceReply()

    async def _send(self, peer: str, address: str, step: int, own: Contribution) -> None:
        d = self.daemon
        config = d.config
        assert config is not None
        codec = d.links.codec_for(
            peer, "reduce", own[0], step=step, requested=tensor_pb2.CODEC_LOSSLESS
        )
        encoded = await encode(own[0], codec, 0)
        header = stage_pb2.ReduceHeader(
            step=step, sender_node=d.node_id, tokens=own[1], samples=own[2]
        )

        async def messages(link: Transfer) -> AsyncIterator[stage_pb2.ReduceMessage]:
            first = [
                stage_pb2.ReduceMessage(header=header),
                stage_pb2.ReduceMessage(tensor=encoded.header),
            ]
            chunks = (
                stage_pb2.ReduceMessage(chunk=tensor_pb2.TensorChunk(data=c))
                for c in encoded.chunks
            )
            for message in itertools.chain(first, chunks):
                await link.pace(message.ByteSize())
                yield message

        stub = stage_pb2_grpc.StageStub(d.router.channel(address))
        try:
            async with d.links.transfer(peer, "reduce") as link:
                await stub.Reduce(messages(link), timeout=config.pipeline.reduce_timeout_s)
            d.stats.record(peer, "reduce", tensor_pb2.CODEC_LOSSLESS, encoded.payload_bytes)
        except grpc.aio.AioRpcError as exc:
            logger.warning("could not send step %d's gradient to %s: %s", step, peer, exc.details())

    async def reduce(self, step: int) -> tuple[Contribution | None, int]:
        """Sum this stage's gradients over its live replicas; (None, 1) when alone."""
        d = self.daemon
        runtime = d.runtime
        config = d.config
        assert runtime is not None and config is not None
        peers = self._peers()
        if not peers:
            return None, 1
        own = await d.compute.run(BACKWARD, runtime.local_gradient)
        sends = [asyncio.create_task(self._send(p, a, step, own)) for p, a in peers.items()]
        deadline = time.monotonic() + config.pipeline.reduce_timeout_s
        while True:
            inbox = self._inbox if self._inbox_step == step else {}
            waiting = [p for p in self._peers() if p in peers and p not in inbox]
            if not waiting:
                break
            if time.monotonic() > deadline:
                logger.warning("step %d: no gradient from %s in time; dropped", step, waiting)
                break
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=0.1)
            except TimeoutError:
                pass
        await asyncio.gather(*sends)
        inbox = dict(self._inbox) if self._inbox_step == step else {}
        contributions = {d.node_id: own, **{p: inbox[p] for p in peers if p in inbox}}
        gone = sorted(set(peers) - set(contributions))
        if gone:
            logger.warning("step %d: replicas %s dropped from the reduce", step, gone)

        def add_up() -> Contribution:
            total = torch.zeros_like(own[0])
            tokens = samples = 0
            for node in sorted(contributions):  # one order on every replica
                flat, t, s = contributions[node]
                total += flat
                tokens += t
                samples += s
            return total, tokens, samples

        return await d.compute.run(BACKWARD, add_up), len(contributions)
