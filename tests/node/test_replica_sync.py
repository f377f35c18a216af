"""Two real replicas in this process, over real gRPC: the reduce's agreement and codecs.

Each replica is a node's parts built on a StageContext (the services a daemon hands
them after Join) with its Stage server started, but no coordinator or MQTT: the test
hands each its plan. A one-way broken link
is made honestly, by giving one replica a plan whose address for the other is
a closed port.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator

import grpc
import pytest
import torch

from swarmpipe.config import load_config
from swarmpipe.node.checkpointing import Checkpointer
from swarmpipe.node.compute import ComputeWorker
from swarmpipe.node.context import CoordinatorClient, NodeStatus, StageContext
from swarmpipe.node.links import Links
from swarmpipe.node.replica_sync import ReplicaSync
from swarmpipe.node.router import Router
from swarmpipe.node.server import StageServicer
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.state_transfer import StateTransfer
from swarmpipe.node.transport import LinkStats
from swarmpipe.protos import control_pb2, stage_pb2_grpc
from swarmpipe.transport.rpc import bind, create_server, open_channel

TINY = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.context=8"]


class Replica:
    def __init__(self, name: str, settings: list[str]) -> None:
        self.config = load_config(None, [*TINY, "pipeline.stages=1", *settings])
        stats, links = LinkStats(), Links()
        status = NodeStatus()
        status.start_serving()
        self._coordinator_channel = open_channel("127.0.0.1:1")  # never called here
        self.ctx = StageContext(
            node_id=name,
            stage=0,
            config=self.config,
            runtime=StageRuntime(self.config, 0),
            compute=ComputeWorker(),
            links=links,
            stats=stats,
            router=Router(name, stats, links),
            coordinator=CoordinatorClient(self._coordinator_channel, "127.0.0.1:1"),
            status=status,
        )
        self.replica_sync = ReplicaSync(self.ctx)
        self.servicer = StageServicer(name, status)
        self.servicer.attach(
            self.ctx, self.replica_sync, StateTransfer(self.ctx, Checkpointer(self.ctx))
        )
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        self.server = create_server()
        stage_pb2_grpc.add_StageServicer_to_server(self.servicer, self.server)
        self.address = f"127.0.0.1:{bind(self.server, '127.0.0.1:0')}"
        await self.server.start()

    def train_on(self, seed: int) -> torch.Tensor:
        """Accumulate one microbatch of this replica's own data; returns its flat gradient."""
        runtime = self.ctx.runtime
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 256, (2, 8), generator=g)
        runtime.forward_last(f"0:{seed}:2", tokens, torch.randint(0, 256, (2, 8), generator=g))
        return runtime.local_gradient()[0]

    async def close(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=None)
        await self.ctx.router.close()
        await self._coordinator_channel.close()
        self.ctx.compute.close()


def _plan(addresses: dict[str, str]) -> control_pb2.Plan:
    replicas = [control_pb2.Replica(node_id=n, address=a, weight=1.0) for n, a in addresses.items()]
    return control_pb2.Plan(
        version=1, num_stages=1, stages=[control_pb2.StagePlan(stage=0, replicas=replicas)]
    )


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Replica, Replica]]:
    settings = getattr(request, "param", [])
    a, b = Replica("a", settings), Replica("b", settings)
    try:
        await a.start()
        await b.start()
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_replicas_sum_both_contributions_in_the_same_order(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    grads = a.train_on(1), b.train_on(2)
    plan = _plan({"a": a.address, "b": b.address})
    a.ctx.router.set_plan(plan)
    b.ctx.router.set_plan(plan)
    (sum_a, n_a), (sum_b, n_b) = await asyncio.gather(
        a.replica_sync.reduce(0), b.replica_sync.reduce(0)
    )
    assert n_a == n_b == 2 and sum_a is not None and sum_b is not None
    assert torch.equal(sum_a[0], sum_b[0]) and sum_a[1:] == sum_b[1:] == (32, 4)
    assert torch.equal(sum_a[0], grads[0] + grads[1])


async def test_a_replica_alone_takes_its_own_sum_and_a_step_begun_again_starts_afresh(
    pair: tuple[Replica, Replica],
) -> None:
    a, _ = pair
    a.ctx.router.set_plan(_plan({"a": a.address}))
    grad = a.train_on(1)
    total, replicas = await a.replica_sync.reduce(0)
    assert replicas == 1 and total is not None and total[1:] == (16, 2)
    assert torch.equal(total[0], grad)
    # The coordinator took the step back; the same microbatch comes again: counted once.
    a.train_on(1)
    again, _ = await a.replica_sync.reduce(0)
    assert again is not None and again[1:] == (16, 2) and torch.equal(again[0], grad)


@pytest.mark.parametrize("pair", [["pipeline.reduce_codec=int8"]], indirect=True)
async def test_a_lossy_reduce_codec_still_gives_bit_identical_sums(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    grads = a.train_on(1), b.train_on(2)
    plan = _plan({"a": a.address, "b": b.address})
    a.ctx.router.set_plan(plan)
    b.ctx.router.set_plan(plan)
    (sum_a, _), (sum_b, _) = await asyncio.gather(
        a.replica_sync.reduce(0), b.replica_sync.reduce(0)
    )
    assert sum_a is not None and sum_b is not None
    assert torch.equal(sum_a[0], sum_b[0])
    exact = grads[0] + grads[1]
    assert not torch.equal(sum_a[0], exact)  # int8 did round
    assert torch.allclose(sum_a[0], exact, atol=0.05 * float(exact.abs().max()))


@pytest.mark.parametrize("pair", [["pipeline.reduce_timeout_s=2"]], indirect=True)
async def test_a_replica_whose_sends_fail_but_still_receives_does_not_drift(
    pair: tuple[Replica, Replica],
) -> None:
    a, b = pair
    grad_a = a.train_on(1)
    b.train_on(2)
    a.ctx.router.set_plan(_plan({"a": a.address, "b": b.address}))
    b.ctx.router.set_plan(_plan({"a": _closed_port(), "b": b.address}))  # b -> a is cut
    (sum_a, n_a), (sum_b, n_b) = await asyncio.gather(
        a.replica_sync.reduce(0), b.replica_sync.reduce(0)
    )
    assert sum_a is not None and sum_b is not None
    # b received a's gradient but a never got b's: both must apply a's alone.
    assert n_a == n_b == 1
    assert torch.equal(sum_a[0], sum_b[0]) and torch.equal(sum_a[0], grad_a)


@pytest.mark.parametrize("pair", [["pipeline.reduce_timeout_s=20"]], indirect=True)
async def test_a_replica_still_finishing_its_join_gets_the_contribution_it_refused(
    pair: tuple[Replica, Replica], caplog: pytest.LogCaptureFixture
) -> None:
    # The coordinator let b in (it is in the plan), but b's Ready answer has not reached it
    # yet, so it refuses a's contribution as UNAVAILABLE; a moment later it serves and
    # applies the step. Both must sum both contributions, not wait out the timeout and
    # each apply b's alone.
    a, b = pair
    grads = a.train_on(1), b.train_on(2)
    plan = _plan({"a": a.address, "b": b.address})
    a.ctx.router.set_plan(plan)
    b.ctx.router.set_plan(plan)
    b.ctx.status.stop_serving()
    with caplog.at_level(logging.DEBUG, logger="swarmpipe.node.replica_sync"):
        reduce_a = asyncio.create_task(a.replica_sync.reduce(0))
        deadline = time.monotonic() + 15
        while not any("still syncing" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "a's send was never refused"
            await asyncio.sleep(0.02)
        b.ctx.status.start_serving()
        (sum_a, n_a), (sum_b, n_b) = await asyncio.gather(reduce_a, b.replica_sync.reduce(0))
    assert n_a == n_b == 2 and sum_a is not None and sum_b is not None
    assert torch.equal(sum_a[0], sum_b[0]) and torch.equal(sum_a[0], grads[0] + grads[1])
