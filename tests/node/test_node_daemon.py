"""A real node daemon and coordinator: bad input, exit codes, real gRPC and MQTT clients."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from swarmpipe.compression import encode_tensor, iter_chunks
from swarmpipe.control.bus import parse_broker_url
from swarmpipe.process.ready import poll_until
from swarmpipe.protos import (
    control_pb2,
    coordinator_pb2,
    coordinator_pb2_grpc,
    stage_pb2,
    stage_pb2_grpc,
    tensor_pb2,
)
from swarmpipe.transport.auth import CREDENTIAL_KEY
from tests.conftest import GRPCURL

pytestmark = pytest.mark.timeout(180)

CONTEXT, WIDTH = 32, 32


@pytest.fixture(scope="module")
def last_stage(module_procs, tiny_settings):  # type: ignore[no-untyped-def]
    """A 2-stage run whose head was killed: the stage-1 node keeps serving at a fixed step.

    Shared by the tests of this module that only send it microbatches and read its answers:
    each checks that the node still serves a well-formed microbatch after its bad one."""
    procs = module_procs
    coordinator = procs.coordinator(*tiny_settings, "pipeline.stages=2", "train.steps=1000")
    head, _ = procs.node("n0", coordinator)
    _, info = procs.node("n1", coordinator)
    procs.wait_serving("n1")  # until then it refuses microbatches: it is not in the plan
    os.killpg(head.pid, signal.SIGKILL)
    channel = procs.peer_channel(info["grpc_port"])
    stub = stage_pb2_grpc.StageStub(channel)
    poll_until(lambda: _info_or_none(stub), 30, "the stage-1 node to serve")
    yield stub, info
    channel.close()


def _info_or_none(stub: stage_pb2_grpc.StageStub) -> stage_pb2.StageInfoReply | None:
    """The node's Info once it serves its stage (not while it still syncs), else None."""
    try:
        info = stub.Info(stage_pb2.StageInfoRequest(), timeout=2)
    except grpc.RpcError:
        return None
    return info if info.serving else None


def _messages(
    step: int,
    x: torch.Tensor,
    *,
    count: int = 2,
    codec: str = "lossless",
    mangle: str = "",
) -> list[stage_pb2.ForwardMessage]:
    labels = bytes(count * CONTEXT)  # one byte per id: the byte-level vocabulary
    header = stage_pb2.MicrobatchHeader(
        microbatch_id=f"test-{time.monotonic_ns()}",
        step=step,
        sample_count=count,
        labels=labels,
        context=CONTEXT,
        hop=1,
        sender_node="test",
        origin_node="test",
    )
    tensor_header, payload = encode_tensor(x, codec)
    chunks = list(iter_chunks(payload))
    if mangle == "truncate":
        chunks = [chunks[0][: len(chunks[0]) // 2]]
    elif mangle == "extra":
        chunks.append(b"\x00" * 64)
    elif mangle == "crc":
        chunks = [bytes([chunks[0][0] ^ 0xFF]) + chunks[0][1:]]
    return [
        stage_pb2.ForwardMessage(microbatch=header),
        stage_pb2.ForwardMessage(tensor=tensor_header),
        *[stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=c)) for c in chunks],
    ]


def _call(
    stub: stage_pb2_grpc.StageStub, messages: list[stage_pb2.ForwardMessage]
) -> list[stage_pb2.BackwardMessage]:
    return list(stub.Forward(iter(messages), timeout=30))


BAD_INPUTS = {
    "truncated chunk": (lambda: torch.randn(2, CONTEXT, WIDTH), "truncate", "tensor bytes"),
    "bytes past the header": (lambda: torch.randn(2, CONTEXT, WIDTH), "extra", "bytes"),
    "corrupted chunk": (lambda: torch.randn(2, CONTEXT, WIDTH), "crc", "crc"),
    "wrong shape": (lambda: torch.randn(2, CONTEXT, WIDTH + 1), "", "shape"),
    "wrong dtype": (lambda: torch.zeros(2, CONTEXT, WIDTH, dtype=torch.int64), "", "dtype"),
    "NaN": (lambda: torch.full((2, CONTEXT, WIDTH), float("nan")), "", "NaN"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_invalid_argument_and_the_node_keeps_serving(last_stage, case: str) -> None:  # type: ignore[no-untyped-def]
    stub, _ = last_stage
    make, mangle, words = BAD_INPUTS[case]
    step = stub.Info(stage_pb2.StageInfoRequest(), timeout=5).step
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, _messages(step, make(), mangle=mangle))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words.lower() in (err.value.details() or "").lower(), err.value.details()
    # Still serving: a well-formed microbatch gets its gradient back.
    replies = _call(stub, _messages(step, torch.randn(2, CONTEXT, WIDTH)))
    kinds = [r.WhichOneof("kind") for r in replies]
    assert kinds[0] == "tensor" and kinds[-1] == "result"
    assert replies[-1].result.tokens == 2 * CONTEXT


def test_labels_in_the_wrong_width_are_invalid_argument(last_stage) -> None:  # type: ignore[no-untyped-def]
    stub, _ = last_stage
    step = stub.Info(stage_pb2.StageInfoRequest(), timeout=5).step
    messages = _messages(step, torch.randn(2, CONTEXT, WIDTH))
    messages[0].microbatch.labels = bytes(4 * 2 * CONTEXT)  # int32, as senders once sent them
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, messages)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"labels are {8 * CONTEXT} bytes" in (err.value.details() or ""), err.value.details()


def test_malformed_message_order_is_invalid_argument(last_stage) -> None:  # type: ignore[no-untyped-def]
    stub, _ = last_stage
    chunk_first = [stage_pb2.ForwardMessage(chunk=tensor_pb2.TensorChunk(data=b"x"))]
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, chunk_first)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    huge = tensor_pb2.TensorHeader(
        dtype=tensor_pb2.DTYPE_FLOAT32,
        shape=[1 << 40],
        codec=tensor_pb2.CODEC_LOSSLESS,
        payload_bytes=1 << 42,
    )
    header_only = _messages(0, torch.randn(2, CONTEXT, WIDTH))[:1]
    msgs = [*header_only, stage_pb2.ForwardMessage(tensor=huge)]
    with pytest.raises(grpc.RpcError) as err:
        _call(stub, msgs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpcurl_without_a_credential_sees_the_health_service_only(
    last_stage, module_procs
) -> None:  # type: ignore[no-untyped-def]
    _, info = last_stage
    target = f"127.0.0.1:{info['grpc_port']}"

    def grpcurl(*args: str) -> str:
        done = subprocess.run(
            [GRPCURL, "-plaintext", *args], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    # Reflection shows a stranger what a load balancer needs, and nothing of what the
    # node serves.
    listed = grpcurl(target, "list").split()
    assert "grpc.health.v1.Health" in listed and "swarmpipe.v1.Stage" not in listed
    health = grpcurl(
        "-d", '{"service": "swarmpipe.v1.Stage"}', target, "grpc.health.v1.Health/Check"
    )
    assert json.loads(health)["status"] == "SERVING"
    # Reflection is whole for a caller the node admits: a credential of its run.
    credential = module_procs.credential("n9", role="node")
    described = grpcurl(
        "-H", f"{CREDENTIAL_KEY}: {credential}", target, "describe", "swarmpipe.v1.Stage"
    )
    assert "rpc Forward ( stream .swarmpipe.v1.ForwardMessage )" in described


def test_node_exits_with_one_line_when_coordinator_is_unreachable(tmp_path: Path) -> None:
    port = _free_port()  # nobody listens on it
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "swarmpipe",
            "node",
            "--coordinator",
            f"127.0.0.1:{port}",
            "--join-timeout",
            "0.5",
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3
    errors = [line for line in done.stderr.splitlines() if "swarmpipe node" in line]
    assert len(errors) == 1 and "cannot reach the coordinator" in errors[0]
    assert "Traceback" not in done.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _DroppingProxy:
    """Forwards TCP connections to 127.0.0.1:`target`, but cuts the first `drop` of them
    as soon as they arrive: a broker that restarts or sheds load under a node's feet."""

    def __init__(self, target: int, drop: int) -> None:
        self.target, self.drop, self.dropped = target, drop, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return  # closed
            if self.dropped < self.drop:
                self.dropped += 1
                conn.close()
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.listener.close()


def test_a_node_retries_a_broker_that_drops_it_at_start(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    coordinator = procs.coordinator(*tiny, "pipeline.stages=2", "train.steps=1000")
    broker = json.loads((procs.tmp / "coordinator.ready.json").read_text())["broker_url"]
    proxy = _DroppingProxy(parse_broker_url(broker).port, drop=1)
    try:
        procs.node(
            "n0", coordinator, "--broker", f"mqtt://127.0.0.1:{proxy.port}", "--broker-retry", "0.2"
        )
        procs.node("n1", coordinator)
        procs.wait_serving("n0")
        procs.wait_serving("n1")
        assert proxy.dropped == 1
        log = (procs.tmp / "n0.log").read_text()
        assert log.count("retrying in 0.2 s (attempt 1 of 4)") == 1, log
        assert "Traceback" not in log
    finally:
        proxy.close()


def test_a_node_exits_with_one_line_when_the_broker_stays_away(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    coordinator = procs.coordinator(*tiny, "pipeline.stages=2", "train.steps=1000")
    node, _ = procs.node(
        "n0", coordinator, "--broker", f"mqtt://127.0.0.1:{_free_port()}", "--broker-retry", "0.1"
    )
    assert node.wait(timeout=60) == 1
    log = (procs.tmp / "n0.log").read_text()
    errors = [line for line in log.splitlines() if line.startswith("swarmpipe node")]
    assert len(errors) == 1 and "cannot use the MQTT broker" in errors[0], log
    assert "4 attempt(s)" in errors[0]
    assert "Traceback" not in log


def test_a_node_whose_coordinator_stays_away_stops_after_the_grace_with_one_line(
    procs, tiny
) -> None:  # type: ignore[no-untyped-def]
    """The broker dying with the coordinator no longer stops a node at once (it may be
    restarting); one that stays away past coordinator.restart_grace_s does."""
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=2", "train.steps=1000", "coordinator.restart_grace_s=3"
    )
    node, _ = procs.node("n0", coordinator)
    procs.node("n1", coordinator)
    procs.wait_serving("n0")
    coord_popen = procs.children[0][0]
    os.killpg(coord_popen.pid, signal.SIGKILL)  # and its embedded broker with it
    assert node.wait(timeout=60) == 1
    log = (procs.tmp / "n0.log").read_text()
    assert "lost the MQTT broker" in log and "training goes on" in log, log
    stops = [line for line in log.splitlines() if "stopping:" in line]
    assert len(stops) == 1, log
    assert "stayed away for 3 s" in stops[0] or "for 3 s" in stops[0], log
    assert "Traceback" not in log, log


def test_unknown_config_key_is_an_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "swarmpipe", "coordinator", "--set", "train.stepz=3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "unknown config key(s) stepz in [train]" in done.stderr
    assert "Traceback" not in done.stderr


def test_presence_is_visible_to_a_third_party_mqtt_client(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    import paho.mqtt.client as paho

    _, coord = procs.start(
        "coordinator",
        "coordinator",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        str(procs.tmp / "coordinator-state"),
        *[arg for s in tiny for arg in ("--set", s)],
        "--set",
        "train.steps=1000",
        # The nodes train while the test watches their presence: slowly, not on both cores.
        "--set",
        "pipeline.link_latency_ms=100",
    )
    broker = parse_broker_url(coord["broker_url"])
    seen: dict[str, list[bool]] = {}

    def on_message(client: paho.Client, userdata: object, msg: paho.MQTTMessage) -> None:
        if msg.topic.startswith("swarmpipe/testnet/presence/"):
            p = control_pb2.Presence.FromString(msg.payload)
            seen.setdefault(p.node_id, []).append(p.online)

    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="third-party")
    client.on_message = on_message
    client.connect(broker.host, broker.port)
    client.subscribe("swarmpipe/testnet/presence/+", qos=1)
    client.loop_start()
    try:
        target = f"127.0.0.1:{coord['grpc_port']}"
        node, _ = procs.node("watched", target)
        polite, _ = procs.node("polite", target)
        poll_until(lambda: seen.get("watched") == [True], 30, "the node's online presence")
        os.killpg(node.pid, signal.SIGKILL)  # no goodbye: only the Last Will can tell
        poll_until(lambda: seen.get("watched") == [True, False], 30, "the node's Last Will")
        # SIGTERM is a polite stop: the node says goodbye itself and exits 0.
        poll_until(lambda: seen.get("polite") == [True], 30, "the second node's presence")
        polite.send_signal(signal.SIGTERM)
        assert polite.wait(timeout=30) == 0
        poll_until(lambda: seen.get("polite") == [True, False], 10, "the goodbye presence")
    finally:
        client.loop_stop()
        client.disconnect()


def test_a_stage_after_a_bottleneck_needs_well_formed_token_ids(procs, tiny) -> None:  # type: ignore[no-untyped-def]
    k = 4
    coordinator = procs.coordinator(
        *tiny, "pipeline.stages=2", "train.steps=1000", f"model.bottleneck={k}"
    )
    head, _ = procs.node("n0", coordinator)
    _, info = procs.node("n1", coordinator)
    os.killpg(head.pid, signal.SIGKILL)
    with procs.peer_channel(info["grpc_port"]) as channel:
        stub = stage_pb2_grpc.StageStub(channel)
        step = poll_until(lambda: _info_or_none(stub), 30, "the stage-1 node to serve").step
        x = torch.randn(2, CONTEXT, k)
        for firsts, words in [
            (b"", "needs the microbatch's token ids"),
            (bytes(3), "first token ids are 3 bytes; 2 ids of 1 byte"),
        ]:
            messages = _messages(step, x)
            messages[0].microbatch.first_tokens = firsts
            with pytest.raises(grpc.RpcError) as err:
                _call(stub, messages)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in (err.value.details() or ""), err.value.details()
        # One byte per sample, and the gradient that comes back is k wide.
        messages = _messages(step, x)
        messages[0].microbatch.first_tokens = bytes([7, 255])
        replies = _call(stub, messages)
        assert replies[0].WhichOneof("kind") == "tensor"
        assert list(replies[0].tensor.shape) == [2, CONTEXT, k]
        assert replies[-1].result.tokens == 2 * CONTEXT


@pytest.mark.slow
def test_an_absurd_activation_is_invalid_argument_and_its_sender_benched(  # type: ignore[no-untyped-def]
    last_stage, module_procs
) -> None:
    stub, info = last_stage
    step = stub.Info(stage_pb2.StageInfoRequest(), timeout=5).step
    for _ in range(10):  # what the stage has seen: activations of the usual scale
        _call(stub, _messages(step, torch.randn(2, CONTEXT, WIDTH)))
    poisoned = _messages(step, torch.randn(2, CONTEXT, WIDTH) * 10_000)
    # The run's (dead) head, a member it can bench; the caller's credential must name the
    # same node (Forward refuses a sender that is not the caller).
    poisoned[0].microbatch.sender_node = "n0"
    as_n0 = module_procs.peer_channel(info["grpc_port"], node_id="n0")
    with pytest.raises(grpc.RpcError) as err:
        _call(stage_pb2_grpc.StageStub(as_n0), poisoned)
    as_n0.close()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "root-mean-square" in (err.value.details() or ""), err.value.details()
    assert "the bound is 1000x" in (err.value.details() or "")
    ready = json.loads((module_procs.tmp / "coordinator.ready.json").read_text())
    channel = grpc.insecure_channel(f"127.0.0.1:{ready['grpc_port']}")
    try:
        coordinator = coordinator_pb2_grpc.CoordinatorStub(channel)

        def benched() -> list[str]:
            status = coordinator.Status(coordinator_pb2.StatusRequest(), timeout=5)
            return [b.node_id for b in status.benched]

        assert poll_until(lambda: benched() or None, 30, "the report") == ["n0"]
    finally:
        channel.close()
    # The stage still serves a well-formed microbatch.
    assert _call(stub, _messages(step, torch.randn(2, CONTEXT, WIDTH)))[-1].result.tokens
