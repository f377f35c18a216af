"""Sending a microbatch to the next stage: replica choice, the Forward call, the gradient back.

The sender keeps its activations until the gradient has come back, so a failed
hop can be sent again: `send_rerouting` resends the same microbatch to another
replica when the plan has one, and benches the peer that failed (see
peer_health.py). Each call's deadline comes from the measured round-trip
times of that peer (or its stage), bounded by `pipeline.hop_timeout_s`.
Next-hop choice is random, weighted by the plan's throughput estimate and
divided by this sender's open calls to each peer, so a slow replica gets less
traffic.

Status codes a hop's receiver returns, and what the sender does with them:
INVALID_ARGUMENT is final (resending the same bytes cannot help); ABORTED
means the receiver is fine but its own downstream failed (resend, no bench);
anything else, a deadline included, benches the peer and resends.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from swarmpipe.config import PipelineConfig
from swarmpipe.errors import CodecError, PeerError
from swarmpipe.node.links import Links
from swarmpipe.node.peer_health import PeerHealth
from swarmpipe.node.tensor_guard import TensorGuard
from swarmpipe.node.transport import LinkStats, TensorReader, encode
from swarmpipe.protos import control_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from swarmpipe.transport.auth import CredentialHolder
from swarmpipe.transport.rpc import open_channel
from swarmpipe.transport.tls import ChannelTLS

logger = logging.getLogger(__name__)


class HopError(PeerError):
    """A hop failed; the sender may try again (the plan may have changed meanwhile)."""

    def __init__(
        self, message: str, *, peer: str, retryable: bool = True, peer_at_fault: bool = True
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.retryable = retryable
        self.peer_at_fault = peer_at_fault


@dataclass(frozen=True, slots=True)
class HopResult:
    grad_input: torch.Tensor | None
    result: stage_pb2.MicrobatchResult
    peer: str


class Router:
    """Holds channels to peers and the latest plan; sends microbatches downstream."""

    def __init__(
        self,
        node_id: str,
        stats: LinkStats,
        links: Links,
        *,
        seed: int | None = None,
        credential: CredentialHolder | None = None,
    ) -> None:
        self.node_id = node_id
        self.credential = credential
        """What every call to a peer carries (the node's credential, once it joined)."""
        self.tls: ChannelTLS | None = None
        """Mutual TLS to peers (the node's certificate from Join); None: plaintext."""
        self.stats = stats
        self.links = links
        self.decode_device: torch.device | None = None
        """Where gradients coming back are decoded: the stage's device, set once joined."""
        self.plan: control_pb2.Plan | None = None
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._in_flight: dict[str, int] = defaultdict(int)
        self._rng = random.Random(seed)
        self._closing: set[asyncio.Task[None]] = set()
        self.reroutes = 0
        self.guard: TensorGuard | None = None
        """Refuses absurd gradients coming back (and, in the servicer, activations coming in);
        set once the node has joined and knows the run's `robust` settings."""
        """Microbatches resent after a failed or overdue hop (`send_rerouting`'s later tries)."""
        defaults = PipelineConfig()
        self.health = PeerHealth(
            min_deadline_s=defaults.hop_timeout_min_s,
            max_deadline_s=defaults.hop_timeout_s,
            rng=random.Random(seed),
        )

    def configure(self, pipeline: PipelineConfig) -> None:
        """Take the run's deadline bounds (the router exists before the node has joined)."""
        self.health.min_deadline_s = pipeline.hop_timeout_min_s
        self.health.max_deadline_s = pipeline.hop_timeout_s

    def set_plan(self, plan: control_pb2.Plan) -> None:
        if self.plan is None or plan.version >= self.plan.version:
            before = (
                {r.node_id for s in self.plan.stages for r in s.replicas} if self.plan else set()
            )
            self.plan = plan
            live = {r.address for s in plan.stages for r in s.replicas}
            self.health.forget(before - {r.node_id for s in plan.stages for r in s.replicas})
            for address in [a for a in self._channels if a not in live]:
                channel = self._channels.pop(address)
                # Closing cancels calls still open on it; they fail and are resent.
                task = asyncio.ensure_future(channel.close(grace=1.0))
                self._closing.add(task)
                task.add_done_callback(self._closing.discard)

    def sole_replica(self, node_id: str) -> bool:
        """Whether `node_id` is the only replica of its stage in the current plan."""
        plan = self.plan
        if plan is None:
            return False
        for stage in plan.stages:
            if any(r.node_id == node_id for r in stage.replicas):
                return len(stage.replicas) == 1
        return False

    def set_tls(self, tls: ChannelTLS) -> None:
        """Call peers with a renewed certificate: new calls get new channels; the old ones
        close once their calls had a hop's deadline to end (a TLS connection outlives the
        certificate it began with, but a reconnect would present the expired one)."""
        self.tls = tls
        old, self._channels = self._channels, {}
        for channel in old.values():
            task = asyncio.ensure_future(channel.close(grace=self.health.max_deadline_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def pick(self, stage: int, avoid: frozenset[str] = frozenset()) -> control_pb2.Replica:
        """Choose a replica of `stage` at random, weighted by plan weight over in-flight calls.

        Replicas in `avoid` (this microbatch already failed there) and benched
        ones are skipped while any other is left; when none is, the least bad
        set is used rather than giving up on a stage that still has a node.
        """
        plan = self.plan
        if plan is None or stage >= len(plan.stages) or not plan.stages[stage].replicas:
            raise HopError(f"the plan has no live replica of stage {stage}", peer="")
        replicas = list(plan.stages[stage].replicas)
        fresh = [r for r in replicas if r.node_id not in avoid]
        healthy = [r for r in fresh if not self.health.benched(r.node_id)]
        unbenched = [r for r in replicas if not self.health.benched(r.node_id)]
        candidates = healthy or fresh or unbenched or replicas
        weights = [max(r.weight, 1e-6) / (1 + self._in_flight[r.node_id]) for r in candidates]
        return self._rng.choices(candidates, weights=weights)[0]

    def in_flight(self, peer: str) -> int:
        return self._in_flight[peer]

    def peers_benched(self) -> dict[str, bool]:
        """Whether each other node of the current plan is benched now."""
        plan = self.plan
        if plan is None:
            return {}
        return {
            r.node_id: self.health.benched(r.node_id)
            for s in plan.stages
            for r in s.replicas
            if r.node_id != self.node_id
        }

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = open_channel(address, self.credential, self.tls)
            self._channels[address] = channel
        return channel

    async def send(
        self,
        stage: int,
        header: stage_pb2.MicrobatchHeader,
        activation: torch.Tensor,
        *,
        codec: int,
        time_left: float | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> HopResult:
        """Send one microbatch to a replica of `stage`; return its input gradient and result.

        `codec` 0 (auto) lets the link to the chosen replica pick one. The call's
        deadline is the peer's measured one, cut to `time_left` (the caller's own
        remaining time) when that is shorter.
        """
        replica = self.pick(stage, avoid)
        peer = replica.node_id
        codec = self.links.codec_for(
            peer, "activation", activation, step=header.step, requested=codec
        )
        encoded = await encode(
            activation,
            codec,
            self.links.options,
            role="activation",
            state=self.links.encoder_state(peer, "activation"),
        )
        stub = stage_pb2_grpc.StageStub(self.channel(replica.address))
        timeout = self.health.deadline(stage, peer)
        if time_left is not None:
            timeout = min(timeout, time_left)
        started = time.monotonic()
        self._in_flight[peer] += 1
        try:
            call = stub.Forward(timeout=timeout)

            async def write(message: stage_pb2.ForwardMessage) -> None:
                try:
                    await call.write(message)
                except asyncio.InvalidStateError:
                    # The peer ended the call while we still wrote (it refused the header,
                    # left its stage, died): through client interceptors grpc says so with
                    # this instead of the call's status. Raise the status, as any failed hop.
                    raise grpc.aio.AioRpcError(
                        await call.code(),
                        await call.initial_metadata(),
                        await call.trailing_metadata(),
                        await call.details(),
                    ) from None

            async with self.links.transfer(peer, "activation") as link:
                await link.write(write, stage_pb2.ForwardMessage(microbatch=header))
                await link.write(write, stage_pb2.ForwardMessage(tensor=encoded.header))
                for chunk in encoded.chunks:
                    message = stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=chunk))
                    await link.write(write, message)
            await call.done_writing()
            self.stats.record(peer, "activation", codec, encoded.payload_bytes)
            reader: TensorReader | None = None
            grad: torch.Tensor | None = None
            async for message in call:
                kind = message.WhichOneof("kind")
                if kind == "tensor":
                    if reader is not None:
                        raise PeerError("peer sent a second gradient header")
                    reader = TensorReader(message.tensor, self.stats, self.decode_device)
                elif kind == "chunk":
                    if reader is None:
                        raise PeerError("peer sent gradient bytes before their header")
                    reader.add(message.chunk.data)
                elif kind == "result":
                    if reader is not None:
                        grad = await reader.finish()
                        if self.guard is not None:
                            self.guard.check(
                                "gradient",
                                grad,
                                sender=peer,
                                step=header.step,
                                sole=self.sole_replica(peer),
                            )
                    self.health.succeeded(stage, peer, time.monotonic() - started)
                    return HopResult(grad, message.result, peer)
            raise PeerError("the stream ended without a result")
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            error = HopError(
                f"stage {stage} at {peer} ({replica.address}) failed after "
                f"{time.monotonic() - started:.2f} s (deadline {timeout:.2f} s): "
                f"{code.name}: {exc.details()}",
                peer=peer,
                retryable=code != grpc.StatusCode.INVALID_ARGUMENT,
                peer_at_fault=code != grpc.StatusCode.ABORTED,
            )
            if error.peer_at_fault:
                self.health.failed(peer)
            raise error from exc
        except (PeerError, CodecError) as exc:
            if isinstance(exc, HopError):
                raise
            self.health.failed(peer)
            raise HopError(f"stage {stage} at {peer} sent a bad reply: {exc}", peer=peer) from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the sender itself is being cancelled: not the hop's failure
            # The call was cancelled under us: `set_plan` closed its channel because the
            # peer left the plan (it moved or went away). grpc.aio says so with
            # CancelledError, which ended the caller as if it had been cancelled: in bench
            # rebalance every worker of a head died that way, silently, at the first moves.
            raise HopError(
                f"stage {stage} at {peer} ({replica.address}): the call was cancelled after "
                f"{time.monotonic() - started:.2f} s (the peer left the plan)",
                peer=peer,
                peer_at_fault=False,
            ) from None
        finally:
            self._in_flight[peer] -= 1

    async def send_rerouting(
        self,
        stage: int,
        header: stage_pb2.MicrobatchHeader,
        activation: torch.Tensor,
        *,
        codec: int,
        attempts: int,
        deadline: float | None = None,
        backoff_s: float = 0.0,
        backoff_max_s: float = 5.0,
        give_up: Callable[[], bool] | None = None,
    ) -> HopResult:
        """Send with up to `attempts` tries, each to a replica this microbatch has not failed on.

        `deadline` (time.monotonic()) bounds the whole; `backoff_s` > 0 waits
        between rounds with exponential backoff and jitter, which also gives the
        coordinator time to publish a plan without a vanished node. `give_up()`
        returning True stops further tries (a sender that is leaving lets the
        coordinator replay the microbatch instead). Raises the last HopError when
        every try failed or one was final.
        """
        avoid: set[str] = set()
        delay = backoff_s
        last: HopError | None = None
        for attempt in range(1, attempts + 1):
            time_left = None if deadline is None else deadline - time.monotonic()
            if time_left is not None and time_left <= 0:
                break
            if attempt > 1 and give_up is not None and give_up():
                break
            if attempt > 1:
                self.reroutes += 1
            try:
                return await self.send(
                    stage,
                    header,
                    activation,
                    codec=codec,
                    time_left=time_left,
                    avoid=frozenset(avoid),
                )
            except HopError as exc:
                if not exc.retryable:
                    raise
                last = exc
                if exc.peer:
                    avoid.add(exc.peer)
                logger.debug("attempt %d for %s failed: %s", attempt, header.microbatch_id, exc)
            if attempt < attempts and delay > 0:
                await asyncio.sleep(delay * (0.5 + self._rng.random()))
                delay = min(delay * 2, backoff_max_s)
        raise last or HopError(
            f"no time left to send {header.microbatch_id} to stage {stage}", peer=""
        )

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
