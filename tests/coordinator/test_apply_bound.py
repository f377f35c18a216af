"""No step's APPLY waits without end: the coordinator in-process, driven call by call.

The nodes here are the coordinator's real gRPC handlers called directly with a node's
credential, and its MQTT watch fed the messages a broker would deliver; what it publishes
is recorded. So each interleaving is reached exactly, not about then.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pytest

from swarmpipe.config import load_config
from swarmpipe.control.bus import BrokerAddress
from swarmpipe.coordinator.service import CoordinatorService
from swarmpipe.coordinator.step_protocol import Phase
from swarmpipe.protos import control_pb2, coordinator_pb2
from swarmpipe.transport.auth import CREDENTIAL_KEY
from tests.conftest import TINY

NODES = ("n0", "n1", "n2", "n3")


class Aborted(Exception):
    pass


class Context:
    """What a handler reads of a gRPC call: its metadata; abort raises."""

    def __init__(self, credential: str = "") -> None:
        self.metadata = ((CREDENTIAL_KEY, credential),) if credential else ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self.metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise Aborted(f"{code.name}: {details}")


class Broker:
    """Stands in for the MQTT client: keeps what the coordinator publishes."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, topic: str, payload: bytes, **_: Any) -> None:
        self.published.append((topic, payload))

    def last_plan(self, service: CoordinatorService) -> control_pb2.Plan:
        payload = next(p for t, p in reversed(self.published) if t == service.topics.plan)
        return control_pb2.Plan.FromString(payload)


class Swarm:
    """A coordinator of 4 nodes on 2 stages with a clock the test moves."""

    def __init__(self, tmp_path: Path, *settings: str) -> None:
        config = load_config(
            None,
            [
                *TINY,
                "pipeline.stages=2",
                "coordinator.min_nodes=4",
                "train.steps=10",
                "checkpoint.every_steps=0",
                *settings,
            ],
        )
        self.service = CoordinatorService(config, BrokerAddress(host="127.0.0.1", port=1), tmp_path)
        self.now = 1000.0
        self.service.protocol.clock = lambda: self.now
        self.broker = Broker()
        self.service._mqtt = self.broker  # type: ignore[assignment]
        self.service._mqtt_ready.set()
        self.credentials: dict[str, str] = {}

    def ctx(self, node: str) -> Context:
        return Context(self.credentials[node])

    async def join(self, node: str, incarnation: int = 0) -> int:
        request = coordinator_pb2.JoinRequest(
            node_id=node, address=f"127.0.0.1:{50000 + len(node)}", incarnation=incarnation
        )
        reply = await self.service.Join(request, Context())
        self.credentials[node] = reply.credential
        return int(reply.stage)

    async def presence(self, node: str, online: bool, incarnation: int = 0) -> None:
        stage = self.service.membership.members[node].stage
        message = control_pb2.Presence(
            node_id=node, online=online, stage=stage, incarnation=incarnation
        )
        await self.service._on_message(
            self.service.topics.presence(node), message.SerializeToString()
        )

    async def ready(self, node: str, step: int) -> coordinator_pb2.ReadyReply:
        request = coordinator_pb2.ReadyRequest(node_id=node, step=step, wait_seconds=0)
        reply: coordinator_pb2.ReadyReply = await self.service.Ready(request, self.ctx(node))
        return reply

    async def start(self) -> None:
        for node in NODES:
            await self.join(node)
            await self.presence(node, True)
        for node in NODES:
            reply = await self.ready(node, 0)
            assert reply.status == reply.STATUS_ACCEPTED
        assert self.service.protocol.phase is Phase.TRAINING

    async def train_step(self) -> None:
        """Heads lease and commit every microbatch of the open step: it enters APPLY."""
        p = self.service.protocol
        step = p.step
        heads = [n for n in NODES if self.service.membership.members[n].stage == 0]
        while p.phase is Phase.TRAINING and p.step == step:
            for head in heads:
                lease = await self.service.Lease(
                    coordinator_pb2.LeaseRequest(node_id=head, wait_seconds=0), self.ctx(head)
                )
                if lease.status == lease.STATUS_GRANTED:
                    commit = coordinator_pb2.CommitRequest(
                        node_id=head, lease_id=lease.lease_id, loss_sum=1.0, tokens=4
                    )
                    assert (await self.service.Commit(commit, self.ctx(head))).accepted
        assert (p.phase, p.step) == (Phase.APPLY, step)

    async def step_done(self, node: str, step: int) -> None:
        request = coordinator_pb2.StepDoneRequest(
            node_id=node, step=step, samples=8, param_digest="d", replicas=2
        )
        await self.service.StepDone(request, self.ctx(node))


async def test_a_node_that_joins_again_mid_apply_does_not_hang_the_step(tmp_path: Path) -> None:
    # n3 dies after step 0 ended but before it applied it, and comes back (same id) before
    # the coordinator heard of its death; its Last Will arrives after the new Join.
    swarm = Swarm(tmp_path)
    p = swarm.service.protocol
    await swarm.start()
    await swarm.train_step()
    for node in ("n0", "n1", "n2"):
        await swarm.step_done(node, 0)
    assert p.awaiting == {"n3"}

    await swarm.join("n3")
    await swarm.presence("n3", False)  # the earlier incarnation's Last Will, late
    await swarm.presence("n3", True)
    # The new incarnation fetched the state of step 1 from its stage's other replica. The
    # earlier one's acknowledgement is not awaited any more, so step 1 is open, and n3
    # serves in it.
    reply = await swarm.ready("n3", 1)
    assert (p.phase, p.step) == (Phase.TRAINING, 1)
    assert reply.status == reply.STATUS_ACCEPTED
    assert swarm.service.membership.members["n3"].serving
    await swarm.train_step()
    assert p.awaiting == set(NODES)  # the new n3 applies step 1 with the others


async def test_a_late_last_will_of_an_earlier_incarnation_leaves_the_new_one_online(
    tmp_path: Path,
) -> None:
    # As above, but the new n3 announced itself before the old one's Will came, and says
    # nothing more: the Will names the earlier process, so the new one stays online.
    swarm = Swarm(tmp_path)
    p = swarm.service.protocol
    await swarm.start()
    await swarm.train_step()
    for node in ("n0", "n1", "n2"):
        await swarm.step_done(node, 0)
    await swarm.join("n3", incarnation=2)
    await swarm.presence("n3", True, incarnation=2)
    await swarm.presence("n3", False, incarnation=1)  # the earlier process's Will, late
    assert swarm.service.membership.members["n3"].online
    reply = await swarm.ready("n3", 1)
    assert (p.phase, p.step) == (Phase.TRAINING, 1)
    assert reply.status == reply.STATUS_ACCEPTED
    # Its own Will still counts.
    await swarm.presence("n3", False, incarnation=2)
    assert not swarm.service.membership.members["n3"].online


async def test_a_node_that_rejoins_while_the_apply_waits_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    swarm = Swarm(tmp_path)
    await swarm.start()
    await swarm.train_step()
    with caplog.at_level(logging.WARNING, logger="swarmpipe.coordinator.service"):
        await swarm.join("n2")
    lines = [r.getMessage() for r in caplog.records if "joined again" in r.getMessage()]
    assert len(lines) == 1 and "n2" in lines[0] and "no longer awaited" in lines[0]
    assert swarm.service.protocol.awaiting == {"n0", "n1", "n3"}


async def test_a_node_that_never_acknowledges_leaves_the_step_and_resyncs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # n3 stays online and in the plan but never applies step 0 (a lost APPLY, a reduce
    # that never ends): after coordinator.apply_timeout_s the step completes without it.
    swarm = Swarm(tmp_path, "coordinator.apply_timeout_s=50")
    p = swarm.service.protocol
    await swarm.start()
    await swarm.train_step()
    for node in ("n0", "n1", "n2"):
        await swarm.step_done(node, 0)
    swarm.now += 49
    await swarm.service.check_apply()
    assert (p.phase, p.awaiting) == (Phase.APPLY, {"n3"})  # within the bound: it waits

    swarm.now += 2
    with caplog.at_level(logging.WARNING, logger="swarmpipe.coordinator.service"):
        await swarm.service.check_apply()
    assert (p.phase, p.step) == (Phase.TRAINING, 1)
    assert any(
        "node n3 has not acknowledged it 51 s into its APPLY" in r.getMessage()
        for r in caplog.records
    )
    # Out of the plan, and told to fetch its own stage's state again.
    n3 = swarm.service.membership.members["n3"]
    plan = swarm.broker.last_plan(swarm.service)
    assert "n3" not in {r.node_id for s in plan.stages for r in s.replicas}
    (move,) = plan.moves
    assert (move.node_id, move.stage) == ("n3", n3.stage) and "re-sync" in move.reason
    # Its acknowledgement, late, changes nothing; once it holds step 1's state it serves.
    await swarm.step_done("n3", 0)
    assert (p.phase, p.step) == (Phase.TRAINING, 1)
    reply = await swarm.ready("n3", 1)
    assert reply.status == reply.STATUS_ACCEPTED and n3.serving
    await swarm.train_step()
    assert p.awaiting == set(NODES)


async def test_a_lone_replica_that_never_acknowledges_pauses_the_run_until_it_resyncs(
    tmp_path: Path,
) -> None:
    swarm = Swarm(tmp_path, "coordinator.apply_timeout_s=50")
    p = swarm.service.protocol
    await swarm.start()
    # n1 is the last replica of its stage: the other one left.
    members = swarm.service.membership.members
    other = next(n for n in NODES if n != "n1" and members[n].stage == members["n1"].stage)
    await swarm.presence(other, False)
    await swarm.train_step()
    for node in NODES:
        if node not in ("n1", other):
            await swarm.step_done(node, 0)
    swarm.now += 51
    await swarm.service.check_apply()
    # The step is done without n1; the next one waits until its stage has a replica again.
    assert (p.phase, p.step) == (Phase.WAITING, 1)
    assert (await swarm.ready("n1", 1)).status == coordinator_pb2.ReadyReply.STATUS_ACCEPTED
    assert p.phase is Phase.TRAINING


async def test_an_apply_nothing_holds_is_moved_along(tmp_path: Path) -> None:
    # Every acknowledgement came while a joiner held the boundary, and the wake-up at the
    # hold's end was lost: the watch opens the next step.
    swarm = Swarm(tmp_path)
    p = swarm.service.protocol
    await swarm.start()
    await swarm.train_step()
    p.hold("n9", 5)
    for node in NODES:
        await swarm.step_done(node, 0)
    assert (p.phase, p.step) == (Phase.APPLY, 0)
    await swarm.service.check_apply()
    assert p.phase is Phase.APPLY  # still held
    swarm.now += 6
    await swarm.service.check_apply()
    assert (p.phase, p.step) == (Phase.TRAINING, 1)
