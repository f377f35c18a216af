"""The router against real gRPC peers in this process: rerouting, benching, deadlines, weights.

The peers are minimal Stage servers that refuse, hang or answer; the thing under
test, the Router, is the real one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.node.links import Links
from swarmpipe.node.router import HopError, Router
from swarmpipe.node.server import read_forward_request
from swarmpipe.node.transport import EncodeOptions, LinkStats, encode
from swarmpipe.protos import control_pb2, stage_pb2, stage_pb2_grpc, tensor_pb2
from swarmpipe.transport.auth import CredentialHolder
from swarmpipe.transport.rpc import bind, create_server

LOSSLESS = tensor_pb2.CODEC_LOSSLESS


class Peer(stage_pb2_grpc.StageServicer):
    """A stage-1 replica that behaves as told: 'ok', 'refuse', 'early', 'abort' or 'hang'."""

    def __init__(self, behaviour: str) -> None:
        self.behaviour = behaviour
        self.calls = 0

    async def Forward(
        self,
        request_iterator: AsyncIterator[stage_pb2.ForwardMessage],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[stage_pb2.BackwardMessage]:
        self.calls += 1
        if self.behaviour == "early":  # refuses at the header, before the tensor is sent
            await request_iterator.__anext__()
            await context.abort(grpc.StatusCode.UNAVAILABLE, "refused at the header")
        _, activation = await read_forward_request(request_iterator)
        if self.behaviour == "refuse":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        if self.behaviour == "abort":
            await context.abort(grpc.StatusCode.ABORTED, "downstream: stage 2 vanished")
        if self.behaviour == "hang":
            await asyncio.sleep(3600)
        encoded = await encode(
            torch.ones_like(activation), LOSSLESS, EncodeOptions(), role="gradient"
        )
        yield stage_pb2.BackwardMessage(tensor=encoded.header)
        for chunk in encoded.chunks:
            yield stage_pb2.BackwardMessage(chunk=tensor_pb2.TensorChunk(data=chunk))
        yield stage_pb2.BackwardMessage(
            result=stage_pb2.MicrobatchResult(loss_sum=1.0, tokens=4, stages_done=1)
        )


class Swarm:
    def __init__(self) -> None:
        self.servers: list[grpc.aio.Server] = []
        self.peers: dict[str, Peer] = {}
        self.addresses: dict[str, str] = {}
        self.version = 0

    async def add(self, name: str, behaviour: str) -> None:
        server = create_server()
        peer = Peer(behaviour)
        stage_pb2_grpc.add_StageServicer_to_server(peer, server)
        port = bind(server, "127.0.0.1:0")
        await server.start()
        self.servers.append(server)
        self.peers[name] = peer
        self.addresses[name] = f"127.0.0.1:{port}"

    def plan(self, weights: dict[str, float]) -> control_pb2.Plan:
        self.version += 1
        replicas = [
            control_pb2.Replica(node_id=n, address=self.addresses[n], weight=w)
            for n, w in weights.items()
        ]
        return control_pb2.Plan(
            version=self.version,
            num_stages=2,
            stages=[
                control_pb2.StagePlan(stage=0),
                control_pb2.StagePlan(stage=1, replicas=replicas),
            ],
        )

    async def close(self) -> None:
        for server in self.servers:
            await server.stop(grace=None)


@pytest.fixture
async def swarm() -> AsyncIterator[Swarm]:
    s = Swarm()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
def router() -> Iterator[Router]:
    r = Router("head", LinkStats(), Links(), seed=7)
    r.configure(
        load_config(None, ["pipeline.hop_timeout_min_s=0.3", "pipeline.hop_timeout_s=60"]).pipeline
    )
    yield r


def _header(n: int = 0) -> stage_pb2.MicrobatchHeader:
    return stage_pb2.MicrobatchHeader(microbatch_id=f"0:{n}:2", step=0, sample_count=2, hop=1)


async def _send(router: Router, attempts: int = 3, n: int = 0) -> str:
    hop = await router.send_rerouting(
        1, _header(n), torch.randn(2, 4), codec=LOSSLESS, attempts=attempts
    )
    assert hop.grad_input is not None and torch.equal(hop.grad_input, torch.ones(2, 4))
    return hop.peer


async def test_a_failing_replica_is_rerouted_around_and_benched(
    swarm: Swarm, router: Router
) -> None:
    await swarm.add("bad", "refuse")
    await swarm.add("good", "ok")
    router.set_plan(swarm.plan({"bad": 1000.0, "good": 1.0}))
    assert await _send(router) == "good"  # the weights all but force "bad" first
    assert swarm.peers["bad"].calls == 1 and router.health.benched("bad")
    assert router.reroutes == 1  # what the node's metrics report
    assert router.peers_benched() == {"bad": True, "good": False}
    # Benched: not picked while another replica is left, whatever its weight.
    # (Picks, not sends: the bench lasts about half a second, and five sends on
    # a loaded machine can outlast it.)
    assert {router.pick(1).node_id for _ in range(200)} == {"good"}
    await router.close()


async def test_a_peer_whose_downstream_failed_is_not_benched(swarm: Swarm, router: Router) -> None:
    await swarm.add("middle", "abort")
    await swarm.add("good", "ok")
    router.set_plan(swarm.plan({"middle": 1000.0, "good": 1.0}))
    assert await _send(router) == "good"
    assert swarm.peers["middle"].calls == 1 and not router.health.benched("middle")
    await router.close()


async def test_the_only_replica_is_still_tried_when_benched(swarm: Swarm, router: Router) -> None:
    await swarm.add("only", "refuse")
    router.set_plan(swarm.plan({"only": 1.0}))
    with pytest.raises(HopError, match="UNAVAILABLE"):
        await _send(router, attempts=3)
    assert swarm.peers["only"].calls == 3
    assert router.reroutes == 2  # the second and third tries
    await router.close()


async def test_a_hanging_replica_is_cut_off_by_the_measured_deadline(
    swarm: Swarm, router: Router
) -> None:
    await swarm.add("good", "ok")
    await swarm.add("stuck", "hang")
    router.set_plan(swarm.plan({"good": 1.0}))
    for i in range(5):  # learn the stage's round-trip time
        await _send(router, n=i)
    learned = router.health.deadline(1, "stuck")
    assert learned < 60.0  # measured, far below the upper bound
    router.set_plan(swarm.plan({"stuck": 1000.0, "good": 1.0}))
    started = time.monotonic()
    assert await _send(router, n=9) == "good"
    assert swarm.peers["stuck"].calls == 1 and router.health.benched("stuck")
    assert time.monotonic() - started < learned + 30.0  # not the 60 s upper bound
    await router.close()


async def test_picks_follow_plan_weight_over_open_calls(swarm: Swarm, router: Router) -> None:
    await swarm.add("heavy", "hang")
    await swarm.add("light", "hang")
    router.set_plan(swarm.plan({"heavy": 3.0, "light": 1.0}))
    counts = Counter(router.pick(1).node_id for _ in range(4000))
    assert 0.70 < counts["heavy"] / 4000 < 0.80  # 3:1
    # Two open calls to "heavy" divide its weight by three: now about even.
    router.set_plan(swarm.plan({"heavy": 3.0}))
    stuck = [asyncio.create_task(_send(router, attempts=1, n=i)) for i in range(2)]
    await asyncio.wait_for(_until(lambda: router.in_flight("heavy") == 2), 30)
    router.set_plan(swarm.plan({"heavy": 3.0, "light": 1.0}))
    counts = Counter(router.pick(1).node_id for _ in range(4000))
    assert 0.42 < counts["heavy"] / 4000 < 0.58
    for task in stuck:
        task.cancel()
    await asyncio.gather(*stuck, return_exceptions=True)
    await router.close()


async def _until(predicate: object) -> None:
    assert callable(predicate)
    while not predicate():
        await asyncio.sleep(0.01)


async def test_a_sender_that_gives_up_makes_no_further_tries(swarm: Swarm, router: Router) -> None:
    await swarm.add("bad", "refuse")
    await swarm.add("worse", "refuse")
    router.set_plan(swarm.plan({"bad": 1.0, "worse": 1.0}))
    with pytest.raises(HopError):
        await router.send_rerouting(
            1, _header(), torch.randn(2, 4), codec=LOSSLESS, attempts=5, give_up=lambda: True
        )
    # The first try always goes out; none after it, though another replica was left.
    assert swarm.peers["bad"].calls + swarm.peers["worse"].calls == 1
    await router.close()


async def test_a_peer_that_ends_the_call_while_we_write_is_a_failed_hop(swarm: Swarm) -> None:
    # Through the credential's client interceptors, grpc answers a write to a call the
    # server already ended with InvalidStateError; it once escaped the router and took the
    # whole node down ("internal error") when a downstream replica died mid-transfer.
    await swarm.add("early", "early")
    await swarm.add("ok", "ok")
    router = Router("head", LinkStats(), Links(), seed=7, credential=CredentialHolder())
    router.configure(load_config(None, ["pipeline.hop_timeout_s=60"]).pipeline)
    router.set_plan(swarm.plan({"early": 1000.0, "ok": 1.0}))
    activation = torch.randn(2, 1 << 20)  # 8 MiB: writes go on after the refusal
    for n in range(3):
        hop = await router.send_rerouting(1, _header(n), activation, codec=LOSSLESS, attempts=3)
        assert hop.peer == "ok"
    assert swarm.peers["early"].calls >= 1


async def test_a_call_cut_when_its_peer_leaves_the_plan_is_a_failed_hop(
    swarm: Swarm, router: Router
) -> None:
    """A peer that moves leaves the plan, and its channel is closed with the call open:
    grpc.aio then raises CancelledError in the sender, which must come out as a failed hop
    that reroutes, not as the sender's own cancellation (a head's workers all ended so)."""
    await swarm.add("mover", "hang")
    await swarm.add("ok", "ok")
    router.set_plan(swarm.plan({"mover": 1.0}))
    sending = asyncio.ensure_future(_send(router, attempts=1))
    await _until(lambda: swarm.peers["mover"].calls == 1)
    router.set_plan(swarm.plan({"ok": 1.0}))  # the mover left: its channel closes
    with pytest.raises(HopError, match="left the plan"):
        await sending
    assert not router.health.benched("mover")  # it did nothing wrong
    assert await _send(router, n=1) == "ok"
    # The sender's own cancellation stays a cancellation.
    router.set_plan(swarm.plan({"mover": 1.0}))
    sending = asyncio.ensure_future(_send(router, attempts=1, n=2))
    await _until(lambda: swarm.peers["mover"].calls == 2)
    sending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await sending
    await router.close()
