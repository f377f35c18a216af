"""A closed run with real clients (issue 22): grpcurl without credentials, a node without a
token, a revoked node, and MQTT clients the embedded broker must refuse or restrain."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from typing import Any

import aiomqtt
import pytest

from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
from swarmpipe.coordinator.tokens import TokenStore
from swarmpipe.protos import control_pb2, coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.transport.auth import ADMIN_TOKEN_KEY, RunKey
from tests.conftest import GRPCURL, Procs, grpcurl_protos, organiser_channel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "testnet"
"""The default config's run_id."""


def _closed_run(procs: Procs, *settings: str) -> tuple[str, str, dict[str, Any]]:
    """A coordinator whose state dir has a join token; returns its address, the token and
    its ready file."""
    _, token = TokenStore(procs.tmp / "coordinator-state").create(expires_s=None, note="test")
    coordinator = procs.coordinator(*settings)
    ready = json.loads((procs.tmp / "coordinator.ready.json").read_text())
    return coordinator, token, ready


def _grpcurl(*args: str, data: str = "{}") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [GRPCURL, "-plaintext", "-max-time", "20", "-d", data, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _listed(*args: str) -> list[str]:
    listed = subprocess.run(
        [GRPCURL, "-plaintext", *args, "list"], capture_output=True, text=True, timeout=30
    )
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.split()


def test_grpcurl_without_credentials_is_unauthenticated_everywhere_but_health(
    procs: Procs, tiny: list[str]
) -> None:
    # 100 ms each way between the stages: the swarm runs through the grpcurl calls without
    # burning both cores meanwhile.
    coordinator, token, _ = _closed_run(
        procs, *tiny, "pipeline.stages=2", "train.steps=1000", "pipeline.link_latency_ms=100"
    )
    env = {"SWARMPIPE_TOKEN": token}
    procs.node("n0", coordinator, env=env)
    _, info = procs.node("n1", coordinator, env=env)
    procs.wait_serving("n1")
    node = f"127.0.0.1:{info['grpc_port']}"
    # Naming itself as a replica of the stage (the names are in the plan) changes nothing.
    as_replica = {
        "swarmpipe.v1.Stage.Reduce": '{"header": {"step": 0, "sender_node": "n1"}}',
        "swarmpipe.v1.Stage.Forward": '{"microbatch": {"sender_node": "n0", "hop": 1}}',
        "swarmpipe.v1.Stage.FetchState": '{"node_id": "n1", "stage": 1}',
        "swarmpipe.v1.Coordinator.Lease": '{"node_id": "n0"}',
        "swarmpipe.v1.Coordinator.Drain": '{"node_id": "n1"}',
        "swarmpipe.v1.Coordinator.Join": '{"node_id": "n9", "address": "127.0.0.1:9"}',
    }
    # Reflection shows a stranger the health service alone; our services come from the
    # .proto files, as anyone with the source has them.
    protos = grpcurl_protos(procs.tmp)
    checked = []
    for target, service in [
        (coordinator, "swarmpipe.v1.Coordinator"),
        (node, "swarmpipe.v1.Stage"),
    ]:
        assert service not in _listed(target), target
        assert "grpc.health.v1.Health" in _listed(target), target
        methods = subprocess.run(
            [GRPCURL, *protos, "list", service], capture_output=True, text=True, check=True
        ).stdout.split()
        assert len(methods) >= 4, methods
        for method in methods:
            done = _grpcurl(*protos, target, method, data=as_replica.get(method, "{}"))
            assert done.returncode != 0, (method, done.stdout)
            assert "Code: Unauthenticated" in done.stderr, (method, done.stderr)
            # A stranger learns nothing about the coordinator's machine (its folders).
            assert str(procs.tmp) not in done.stderr, (method, done.stderr)
            checked.append(method)
        health = _grpcurl(target, "grpc.health.v1.Health/Check")
        assert health.returncode == 0 and "SERVING" in health.stdout, health.stderr
    # The organiser's token shows the coordinator's whole schema through reflection.
    admin = (procs.tmp / "coordinator-state" / "admin-token").read_text().strip()
    assert "swarmpipe.v1.Coordinator" in _listed("-H", f"{ADMIN_TOKEN_KEY}: {admin}", coordinator)
    assert "swarmpipe.v1.Stage.Reduce" in checked and "swarmpipe.v1.Coordinator.Status" in checked
    # The swarm itself still trains: its nodes hold credentials.
    status = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "status", "--json", "--coordinator", coordinator,
         "--admin-token-file", str(procs.tmp / "coordinator-state" / "admin-token")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    without = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "status", "--coordinator", coordinator],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert without.returncode == 1 and "admin-token" in without.stderr, without.stderr
    assert without.stderr.count("\n") == 1, without.stderr


def test_a_node_without_a_valid_token_exits_4_with_one_line(procs: Procs, tiny: list[str]) -> None:
    coordinator, token, _ = _closed_run(procs, *tiny, "pipeline.stages=2", "train.steps=1000")
    for name, env, words in [
        ("nobody", {}, "no join token"),
        ("guesser", {"SWARMPIPE_TOKEN": token[:-3] + "abc"}, "not one of this run's tokens"),
    ]:
        args = [*procs._node_args(name, coordinator), "--join-timeout", "20"]
        popen, _ = procs.start(name, *args, ready=False, env=env)
        assert popen.wait(timeout=60) == 4
        lines = (procs.tmp / f"{name}.log").read_text().strip().splitlines()
        assert "Traceback" not in "\n".join(lines)
        assert words in lines[-1] and lines[-1].startswith("swarmpipe node: not admitted"), lines


def test_a_revoked_node_is_out_of_the_plan_within_one_step_and_exits_4(
    procs: Procs, tiny: list[str]
) -> None:
    coordinator, token, ready = _closed_run(procs, *tiny, "pipeline.stages=2", "train.steps=1000")
    state = procs.tmp / "coordinator-state"
    procs.node("n0", coordinator, env={"SWARMPIPE_TOKEN": token})
    procs.node("n1", coordinator, env={"SWARMPIPE_TOKEN": token})
    store = TokenStore(state)
    _, second = store.create(expires_s=None, note="the one we revoke")
    bad, _ = procs.node("bad", coordinator, env={"SWARMPIPE_TOKEN": second})
    for name in ("n0", "n1", "bad"):
        procs.wait_serving(name)
    topics = Topics(RUN)
    key = RunKey.load_or_create(state, RUN)
    watcher = parse_broker_url(ready["broker_url"])
    watcher = BrokerAddress(
        host=watcher.host, port=watcher.port, username="w", password=key.mqtt_password("w")
    )

    async def revoke_and_watch() -> tuple[int, int]:
        async with make_client(watcher, "watcher") as client:
            await client.subscribe(topics.step, qos=1)
            await client.subscribe(topics.plan, qos=1)
            step_at_revoke, step = -1, -1
            async with asyncio.timeout(120):
                async for message in client.messages:
                    assert isinstance(message.payload, bytes)
                    if message.topic.matches(topics.step):
                        step = control_pb2.StepState.FromString(message.payload).step
                        if step_at_revoke < 0 and step >= 2:
                            step_at_revoke = step
                            record_id = second.partition(".")[0]
                            await asyncio.to_thread(store.revoke, record_id)
                    elif step_at_revoke >= 0:
                        plan = control_pb2.Plan.FromString(message.payload)
                        replicas = {r.node_id for s in plan.stages for r in s.replicas}
                        if "bad" in plan.revoked and "bad" not in replicas:
                            return step_at_revoke, step
            raise AssertionError("unreachable")

    step_at_revoke, step_out = asyncio.run(revoke_and_watch())
    assert step_out - step_at_revoke <= 1, (step_at_revoke, step_out)
    assert bad.wait(timeout=60) == 4
    bad_log = (procs.tmp / "bad.log").read_text()
    assert "Traceback" not in bad_log, bad_log[-3000:]
    last = bad_log.strip().splitlines()[-1]
    assert "revoked" in last and last.startswith("swarmpipe node: not admitted"), last
    with organiser_channel(coordinator, state) as channel:
        reply = coordinator_pb2_grpc.CoordinatorStub(channel).Status(
            coordinator_pb2.StatusRequest(), timeout=10
        )
    assert "bad" not in {n.node_id for n in reply.nodes if n.serving}
    log = (procs.tmp / "coordinator.log").read_text()
    assert "node bad put out of the run: its join token was revoked" in log
    assert step_at_revoke >= 2


def test_the_embedded_broker_refuses_strangers_and_nodes_cannot_publish_a_plan(
    procs: Procs, tiny: list[str]
) -> None:
    _, _, ready = _closed_run(procs, *tiny, "pipeline.stages=2", "train.steps=1000")
    broker = parse_broker_url(ready["broker_url"])
    key = RunKey.load_or_create(procs.tmp / "coordinator-state", RUN)
    topics = Topics(RUN)

    def login(user: str, password: str | None = None) -> BrokerAddress:
        return BrokerAddress(
            host=broker.host,
            port=broker.port,
            username=user,
            password=key.mqtt_password(user) if password is None else password,
        )

    async def scenario() -> None:
        for who, address in [
            ("anonymous", broker),
            ("a wrong password", login("n1", "guess")),
            ("the coordinator's name", login("coordinator", "guess")),
        ]:
            with pytest.raises(aiomqtt.MqttError):
                async with make_client(address, f"stranger-{who}") as client:
                    await client.publish(topics.plan, b"x", qos=1)
        async with make_client(login("watcher"), "watcher") as watcher:
            await watcher.subscribe(f"swarmpipe/{RUN}/#", qos=1)
            async with make_client(login("n1"), "n1-hostile") as node:
                hostile = control_pb2.Plan(version=10**9).SerializeToString()
                await node.publish(topics.plan, hostile, qos=1, retain=True)
                await node.publish(topics.step, b"hostile", qos=1, retain=True)
                await node.publish(topics.control("all"), b"hostile", qos=1, retain=True)
                await node.publish(topics.presence("n2"), b"hostile", qos=1, retain=True)
                # Its own presence goes through: the marker that the rest was dropped.
                await node.publish(topics.presence("n1"), b"marker", qos=1)
            seen = []
            async with asyncio.timeout(30):
                async for message in watcher.messages:
                    seen.append((str(message.topic), message.payload))
                    if message.payload == b"marker":
                        break
            hostile_seen = [(t, p) for t, p in seen if p in (hostile, b"hostile")]
            assert not hostile_seen, hostile_seen

    asyncio.run(scenario())
    log = (procs.tmp / "coordinator.log").read_text()
    assert "may not publish to swarmpipe/testnet/plan" in log


def test_link_limit_needs_the_organisers_token_in_a_closed_run(
    procs: Procs, tiny: list[str]
) -> None:
    _, _, ready = _closed_run(procs, *tiny, "pipeline.stages=2", "train.steps=1000")
    base = [sys.executable, "-m", "swarmpipe", "link-limit", "--broker", ready["broker_url"],
            "--run", RUN, "--node", "all", "--mbit", "0.2"]  # fmt: skip
    refused = subprocess.run(base, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    admin = str(procs.tmp / "coordinator-state" / "admin-token")
    allowed = subprocess.run(
        [*base, "--admin-token-file", admin], capture_output=True, text=True, timeout=60
    )
    assert allowed.returncode == 0, allowed.stderr
