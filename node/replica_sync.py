"""Replica sync: the replicas of a stage agree on one update, so their parameters stay equal.

Two modes (`pipeline.sync`). In "every_step", at APPLY each replica sends its
flat gradient sum (with its token and sample counts) to every other replica
of its stage over Stage.Reduce, chunked and encoded with
`pipeline.reduce_codec`, and every replica adds the agreed contributions in
the same order (sorted by node id), so all of them take a bit-identical AdamW
step. In "diloco" the same exchange carries each replica's parameter delta at
the end of an outer round instead (see diloco.py). A lossy reduce codec stays
bit-identical because each replica adds the decoded form of its own
contribution, exactly what the others decode.

Agreement. A contribution can reach some replicas and not others (a send
fails one way, a replica is SIGKILLed halfway through its sends). So the
exchange has a second round: each replica sends a manifest of the
contributions it holds, and applies only those that its own and every
manifest it received list; so a replica whose sends fail while it still
receives the others' applies what they apply (their manifests lack its
contribution). Every replica still in the plan is waited for; one that
leaves it (its Last Will fired) is not; one that stays in the plan but sends
nothing is given up on when `pipeline.reduce_timeout_s` runs out, and if our
own contribution never reached it, we leave ours out too, since it cannot
have added it.

Robustness. The manifest lists a sha256 of each contribution it holds, and
a contribution counts as agreed only if every manifest saw the same bytes:
so all replicas hold identical inputs, and a sender that tells replicas
different things is dropped by all of them. The agreed contributions then
pass robust_reduce.aggregate (finite, count and norm screens against the
others' median; a centred clip with three or more), identically everywhere,
so every replica drops the same senders; each replica reports the dropped
senders to the coordinator (ReportPeer), which benches one that a majority
of its stage's other replicas reported. A digest mismatch is dropped but not
reported: it cannot tell the lying sender from a lying manifest.

Known limit: two replicas that cannot reach each other in either direction
while both stay in the plan can still decide differently (agreement under
partitions needs more rounds than this); the parameter digests each node
reports after every step make that visible, and the coordinator re-syncs the
replica that differs (coordinator/membership.py, `Membership.diverged`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc
import torch

from swarmpipe.compression import EncoderState, decode_tensor
from swarmpipe.compression.codec import describe
from swarmpipe.config import codec_enum
from swarmpipe.errors import PeerError
from swarmpipe.node import fault_points, hostile
from swarmpipe.node.compute import BACKWARD
from swarmpipe.node.context import StageContext
from swarmpipe.node.links import Transfer
from swarmpipe.node.robust_reduce import Aggregate, Per, aggregate
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.transport import EncodedTensor, TensorReader, encode
from swarmpipe.protos import coordinator_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2

logger = logging.getLogger(__name__)

Contribution = tuple[torch.Tensor, int, int]  # flat vector, tokens, samples
MAX_MANIFEST_ENTRIES = 1024
WAIT_SLICE_S = 0.1
# A report is one small call; the step's StepDone waits behind it, so keep it short.
REPORT_TIMEOUT_S = 5.0
# A contribution a peer refused as UNAVAILABLE is sent again after this long, doubling up to
# RESEND_MAX_S, through the first half of pipeline.reduce_timeout_s.
RESEND_FIRST_S = 0.1
RESEND_MAX_S = 1.0
# The manifests are waited for this share of pipeline.reduce_timeout_s past the
# contributions' deadline: a peer's own wait for contributions ends at its deadline, up to
# the skew of the replicas' APPLY starts after ours.
MANIFEST_EXTRA = 0.5


def gradient_momentum(runtime: StageRuntime, moment: str = "exp_avg") -> torch.Tensor | None:
    """AdamW's first moment (or `moment="exp_avg_sq"`, its second) as one flat vector (equal
    on every replica), or None before it has one. DiLoCo's inner moments are each replica's
    own, so it passes none."""
    state = runtime.optimizer.state
    parameters = list(runtime.module.parameters())
    if not any(moment in state.get(p, {}) for p in parameters):
        return None
    return torch.cat(
        [
            (state[p][moment] if moment in state.get(p, {}) else torch.zeros_like(p))
            .reshape(-1)
            .float()
            for p in parameters
        ]
    )


def contribution_digest(c: Contribution) -> bytes:
    """sha256 of a contribution's vector bytes and counts, as manifests list it."""
    h = hashlib.sha256()
    h.update(c[0].detach().float().contiguous().numpy().tobytes())
    h.update(int(c[1]).to_bytes(8, "little") + int(c[2]).to_bytes(8, "little"))
    return h.digest()


@dataclass(slots=True)
class _Round:
    """What arrived from peers for one (step, kind) exchange."""

    contributions: dict[str, Contribution] = field(default_factory=dict)
    manifests: dict[str, dict[str, bytes]] = field(default_factory=dict)
    """Sender -> the contributions its manifest lists, with their digests."""


class ReplicaSync:
    """Sums the stage's gradients (or DiLoCo deltas) with its other replicas at each APPLY."""

    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self._rounds: dict[tuple[int, bool], _Round] = {}
        self._arrived = asyncio.Event()
        # With a topk or lowrank reduce_codec: what it dropped from this replica's sums,
        # carried into the next one (error feedback).
        self._encoder = EncoderState(error_feedback=True)
        self.hostile = hostile.from_env(ctx.node_id)
        """Test-only: tamper with what this replica sends (node/hostile.py)."""

    def _peers(self) -> dict[str, str]:
        """Other live replicas of this node's stage in the current plan: node id -> address."""
        return {node: address for node, address in self.ctx.replicas() if node != self.ctx.node_id}

    def _round(self, step: int, delta: bool) -> _Round:
        key = (step, delta)
        if key not in self._rounds:
            # Keep only exchanges that can still be running: this step's and the next.
            for old in [k for k in self._rounds if k[0] < step - 1]:
                del self._rounds[old]
            self._rounds[key] = _Round()
        return self._rounds[key]

    def forget(self, step: int) -> None:
        """The coordinator took `step` back (a held APPLY that benched a replica): what
        arrived for its reduce belongs to a sum nobody applies, and so does what a stateful
        codec kept back from ours."""
        for key in [k for k in self._rounds if k[0] == step]:
            del self._rounds[key]
        self._encoder.reset()

    def _check_step(self, step: int, delta: bool) -> None:
        runtime = self.ctx.runtime
        # Both exchanges happen before the step number moves past `step` (a
        # DiLoCo round's last inner step leaves it for the outer step to move).
        if step != runtime.step:
            raise PeerError(f"reduce for step {step}; this node is at step {runtime.step}")
        if delta != (runtime.outer is not None):
            raise PeerError("the peer's sync mode (every_step or diloco) differs from this node's")

    async def receive(
        self, requests: AsyncIterator[stage_pb2.ReduceMessage]
    ) -> stage_pb2.ReduceReply:
        """Take one peer's contribution or manifest (the server side of Stage.Reduce)."""
        runtime = self.ctx.runtime
        header: stage_pb2.ReduceHeader | None = None
        reader: TensorReader | None = None
        async for message in requests:
            kind = message.WhichOneof("kind")
            if kind == "manifest" and header is None:
                self._take_manifest(message.manifest)
                return stage_pb2.ReduceReply()
            if kind == "header" and header is None:
                header = message.header
                self._check_step(header.step, header.parameter_delta)
                if header.sender_node not in self._peers():
                    raise PeerError(f"{header.sender_node!r} is not a replica of this stage")
            elif kind == "tensor" and header is not None and reader is None:
                want = [runtime.n_parameters]
                if list(message.tensor.shape) != want:
                    # describe() shows at most 64 dimensions: a header can carry a million.
                    raise PeerError(f"tensor of {describe(message.tensor)} is not of shape {want}")
                reader = TensorReader(message.tensor, self.ctx.stats, runtime.device)
            elif kind == "chunk" and reader is not None:
                reader.add(message.chunk.data)
            else:
                raise PeerError(
                    "a reduce call is a manifest, or a header, a tensor header, then its chunks"
                )
        if header is None or reader is None:
            raise PeerError("the reduce call ended before its headers")
        # Non-finite values are kept: the robust screen drops them after the
        # agreement, identically on every replica, and reports the sender.
        flat = (await reader.finish()).float()
        exchange = self._round(header.step, header.parameter_delta)
        exchange.contributions[header.sender_node] = (
            flat,
            int(header.tokens),
            int(header.samples),
        )
        self._arrived.set()
        return stage_pb2.ReduceReply()

    def _take_manifest(self, manifest: stage_pb2.ReduceManifest) -> None:
        self._check_step(manifest.step, manifest.parameter_delta)
        if manifest.sender_node not in self._peers():
            raise PeerError(f"{manifest.sender_node!r} is not a replica of this stage")
        if len(manifest.received) > MAX_MANIFEST_ENTRIES:
            raise PeerError(f"a manifest lists at most {MAX_MANIFEST_ENTRIES} replicas")
        if len(manifest.digests) != len(manifest.received):
            raise PeerError(
                f"a manifest lists {len(manifest.received)} contributions but "
                f"{len(manifest.digests)} digests"
            )
        exchange = self._round(manifest.step, manifest.parameter_delta)
        exchange.manifests[manifest.sender_node] = dict(
            zip(manifest.received, manifest.digests, strict=True)
        )
        self._arrived.set()

    async def _call(
        self,
        peer: str,
        address: str,
        messages: list[stage_pb2.ReduceMessage],
        what: str,
        *,
        retry_until: float = 0.0,
    ) -> bool:
        """One Reduce call to a peer; False (logged) when it failed. Until `retry_until`
        a peer that answers UNAVAILABLE is tried again while it stays in the plan: a
        replica the coordinator has just let in refuses reduces until its Ready answer
        reaches it, and a contribution it never gets costs both sides the whole
        reduce_timeout_s and the step its gradient."""
        d = self.ctx

        async def stream(link: Transfer) -> AsyncIterator[stage_pb2.ReduceMessage]:
            for message in messages:
                await link.pace(message.ByteSize())  # the link's send limit covers the reduce
                yield message

        delay = RESEND_FIRST_S
        while True:
            stub = stage_pb2_grpc.StageStub(d.router.channel(address))
            try:
                async with d.links.transfer(peer, "reduce") as link:
                    await stub.Reduce(stream(link), timeout=d.config.pipeline.reduce_timeout_s)
                return True
            except grpc.aio.AioRpcError as exc:
                again = (
                    exc.code() == grpc.StatusCode.UNAVAILABLE
                    and peer in self._peers()
                    and time.monotonic() + delay < retry_until
                )
                if not again:
                    logger.warning("could not send %s to %s: %s", what, peer, exc.details())
                    return False
                logger.debug("could not send %s to %s yet: %s", what, peer, exc.details())
                await asyncio.sleep(delay)
                delay = min(2 * delay, RESEND_MAX_S)

    async def _send_contribution(
        self,
        peer: str,
        address: str,
        header: stage_pb2.ReduceHeader,
        encoded: EncodedTensor,
        *,
        retry_until: float = 0.0,
    ) -> bool:
        messages = [
            stage_pb2.ReduceMessage(header=header),
            stage_pb2.ReduceMessage(tensor=encoded.header),
            *(
                stage_pb2.ReduceMessage(chunk=tensor_pb2.TensorChunk(data=chunk))
                for chunk in encoded.chunks
            ),
        ]
        what = f"step {header.step}'s contribution"
        sent = await self._call(peer, address, messages, what, retry_until=retry_until)
        if sent:
            self.ctx.stats.record(peer, "reduce", encoded.header.codec, encoded.payload_bytes)
        return sent

    async def _wait(
        self, missing: Callable[[], list[str]], deadline: float, step: int, what: str
    ) -> None:
        """Wait until `missing()` is empty or the deadline passes (then log who was dropped)."""
        while waiting := missing():
            if time.monotonic() > deadline:
                logger.warning("step %d: no %s from %s in time; dropped", step, what, waiting)
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout=WAIT_SLICE_S)
            except TimeoutError:
                pass

    async def exchange(
        self, step: int, own: Contribution, *, delta: bool
    ) -> dict[str, Contribution]:
        """Swap contributions with the stage's other replicas; return the agreed set by node."""
        d = self.ctx
        config = d.config
        peers = self._peers()
        codec = codec_enum(config.pipeline.reduce_codec)
        if self.hostile is not None:
            tampered = self.hostile.tamper(own[0], node_id=d.node_id, step=step)
            own = (tampered, own[1], own[2])
        encoded = await encode(own[0], codec, d.links.options, role="reduce", state=self._encoder)
        if codec != tensor_pb2.CODEC_LOSSLESS:
            # Add what the others will decode, not the exact vector, so every
            # replica sums the very same numbers.
            decoded = await asyncio.to_thread(
                decode_tensor,
                encoded.header,
                b"".join(encoded.chunks),
                device=d.runtime.device,
            )
            own = (decoded.float().reshape(-1), own[1], own[2])
        if not peers:
            return {d.node_id: own}
        exchange = self._round(step, delta)
        header = stage_pb2.ReduceHeader(
            step=step, sender_node=d.node_id, tokens=own[1], samples=own[2], parameter_delta=delta
        )
        unreachable: set[str] = set()
        deadline = time.monotonic() + config.pipeline.reduce_timeout_s
        # Sends refused as UNAVAILABLE are retried through the first half of the exchange's
        # time, so the manifests still have the second half.
        resend_until = time.monotonic() + config.pipeline.reduce_timeout_s / 2

        async def send(peer: str, address: str, first: bool) -> None:
            sent = await self._send_contribution(
                peer, address, header, encoded, retry_until=resend_until
            )
            if not sent:
                unreachable.add(peer)
                self._arrived.set()
            elif first:
                await fault_points.reach("reduce.sent_one", step)

        # Sorted and one after another when a test armed the pause, so "sent
        # to one peer only" is a state the test can reach; otherwise at once.
        ordered = sorted(peers.items())
        if fault_points.armed("reduce.sent_one"):
            for i, (peer, address) in enumerate(ordered):
                await send(peer, address, i == 0)
            sends: list[asyncio.Task[None]] = []
        else:
            sends = [asyncio.create_task(send(p, a, False)) for p, a in ordered]

        def live_peers() -> set[str]:
            # Peers we could not reach are waited for too: if they are alive,
            # their manifest tells what they lack; if dead, their Last Will
            # takes them out of the plan within a second or two.
            return set(self._peers()) & set(peers)

        await self._wait(
            lambda: sorted(live_peers() - set(exchange.contributions)),
            deadline,
            step,
            "contribution",
        )
        await asyncio.gather(*sends)
        held = {d.node_id: own} | {
            p: exchange.contributions[p] for p in peers if p in exchange.contributions
        }
        digests = await asyncio.to_thread(
            lambda: {node: contribution_digest(held[node]) for node in sorted(held)}
        )
        manifest = stage_pb2.ReduceManifest(
            step=step,
            sender_node=d.node_id,
            received=sorted(held),
            digests=[digests[node] for node in sorted(held)],
            parameter_delta=delta,
        )
        await asyncio.gather(
            *(
                self._call(p, peers[p], [stage_pb2.ReduceMessage(manifest=manifest)], "a manifest")
                for p in sorted(live_peers())
            )
        )
        # A peer that lacked a contribution sends its manifest only when its own wait for
        # contributions ends, at its deadline: waiting for manifests until the same deadline
        # decided without it, and the replicas applied different sets (seen with three
        # replicas, one silent in the plan). The manifests get MANIFEST_EXTRA more.
        await self._wait(
            lambda: sorted(live_peers() - set(exchange.manifests)),
            deadline + MANIFEST_EXTRA * config.pipeline.reduce_timeout_s,
            step,
            "manifest",
        )
        agreed = set(held)
        for sender, listed in exchange.manifests.items():
            if sender in peers:
                differ = sorted(n for n in agreed & set(listed) if listed[n] != digests[n])
                if differ:
                    logger.warning(
                        "step %d: %s's manifest saw other bytes from %s than this replica; dropped",
                        step,
                        sender,
                        differ,
                    )
                agreed &= set(listed) - set(differ)
        if unreachable & live_peers() - set(exchange.manifests):
            # A live peer lacks this replica's contribution and its manifest
            # did not come to say what it holds: withdrawing ours is the one
            # choice that peer is sure to share.
            agreed.discard(d.node_id)
        if d.node_id not in agreed:
            # Our contribution is not in the sum, so the part a stateful codec kept back
            # would be added to a tensor that was never applied: start afresh.
            self._encoder.reset()
        dropped = sorted((set(peers) | {d.node_id}) - agreed)
        if dropped:
            logger.warning("step %d: contributions of %s dropped from the reduce", step, dropped)
        return {node: held[node] for node in sorted(agreed)}

    async def _combine(
        self,
        step: int,
        contributions: dict[str, Contribution],
        per: Per,
        *,
        reference: torch.Tensor | None = None,
        profile: torch.Tensor | None = None,
        sizes: list[int] | None = None,
    ) -> Aggregate:
        """The robust aggregate of the agreed contributions (the same on every replica)."""
        robust = self.ctx.config.robust
        result: Aggregate = await self.ctx.compute.run(
            BACKWARD,
            lambda: aggregate(
                contributions,
                per=per,
                norm_ratio=robust.reduce_norm_ratio,
                clip_radius=robust.clip_radius,
                clip_iterations=robust.clip_iterations,
                direction_sigmas=robust.direction_sigmas,
                reference=reference,
                profile=profile,
                sizes=sizes,
                tensor_sigmas=robust.tensor_sigmas,
            ),
        )
        hostile.record(
            step,
            self.ctx.node_id,
            contributions,
            accepted=result.accepted,
            rejected=result.rejected,
        )
        if self.ctx.node_id in result.rejected:
            # What a stateful codec kept back belongs to a vector nobody applied.
            self._encoder.reset()
        await self._report(step, result.rejected, set(result.conclusive))
        return result

    async def _report(self, step: int, rejected: dict[str, str], conclusive: set[str]) -> None:
        """Log each dropped contribution and report its sender to the coordinator."""
        d = self.ctx
        for node, reason in sorted(rejected.items()):
            if node == d.node_id:
                logger.warning(
                    "step %d: this replica's own contribution was dropped: %s", step, reason
                )
                continue
            logger.warning("step %d: dropped %s's contribution: %s", step, node, reason)
            request = coordinator_pb2.ReportPeerRequest(
                reporter=d.node_id,
                suspect=node,
                step=step,
                kind=coordinator_pb2.ReportPeerRequest.KIND_REDUCE,
                reason=reason,
                conclusive=node in conclusive,
            )
            try:
                await d.coordinator.stub.ReportPeer(request, timeout=REPORT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                logger.warning("could not report %s to the coordinator: %s", node, exc.details())

    async def reduce(
        self, step: int, trains_on: int | None = None
    ) -> tuple[Contribution | None, int]:
        """Combine this stage's gradients of `step` (on version `trains_on`, default its own)
        over its live replicas; its own sum, and 1, when alone.

        Returns the (sum, tokens, samples) to apply and how many contributions it holds.
        """
        d = self.ctx
        runtime = d.runtime
        version = step if trains_on is None else trains_on
        # Taken even when alone: a step that begins again (a held APPLY taken back) must
        # start this replica's sum afresh, as it does its peers' (StageRuntime).
        own = await d.compute.run(BACKWARD, lambda: runtime.gradient_for_reduce(step, version))
        if not self._peers():
            return own, 1
        agreed = await self.exchange(step, own, delta=False)
        momentum = await d.compute.run(BACKWARD, lambda: gradient_momentum(runtime))
        profile = await d.compute.run(BACKWARD, lambda: gradient_momentum(runtime, "exp_avg_sq"))
        # The tensor-scale screen cuts the flat gradient where local_gradient joined it.
        sizes = [p.numel() for p in runtime.module.parameters()]
        result = await self._combine(
            step, agreed, "tokens", reference=momentum, profile=profile, sizes=sizes
        )
        return result.total, len(result.accepted)

    async def average_parameters(self, step: int) -> int:
        """DiLoCo: average the replicas' deltas and take the outer step; returns replicas."""
        d = self.ctx
        runtime = d.runtime
        own = await d.compute.run(BACKWARD, runtime.parameter_delta)
        agreed = await self.exchange(step, own, delta=True)
        result = await self._combine(step, agreed, "samples")
        await d.compute.run(BACKWARD, lambda: runtime.outer_step(step, result.total))
        return len(result.accepted)
