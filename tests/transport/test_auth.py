"""Credentials: who can check them and nobody can forge them; the interceptors that carry
and check them on every kind of call; the node's and the coordinator's rules."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from swarmpipe.coordinator.admission import Admission
from swarmpipe.coordinator.tokens import TokenError
from swarmpipe.node.peer_admission import PeerAdmission
from swarmpipe.protos import control_pb2, stage_pb2
from swarmpipe.transport.auth import (
    ADMIN_TOKEN_KEY,
    CREDENTIAL_KEY,
    JOIN_TOKEN_KEY,
    ROLE_COORDINATOR,
    AuthError,
    AuthInterceptor,
    CredentialHolder,
    Refusal,
    RunKey,
    Verifier,
)
from swarmpipe.transport.request_parsing import add_servicer
from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection, open_channel
from tests.transport.test_request_parsing import STAGE, Echo

pytestmark = pytest.mark.timeout(60)


def test_a_credential_names_its_node_and_any_holder_of_the_public_key_checks_it(
    tmp_path: Path,
) -> None:
    key = RunKey.load_or_create(tmp_path, "r1")
    credential = key.issue("n3", token_id="abcd", stage=2)
    claim = Verifier(key.public_bytes, "r1").verify(credential)
    assert (claim.node_id, claim.token_id, claim.stage, claim.role) == ("n3", "abcd", 2, "node")
    # The same key comes back from the state dir (a restarted coordinator).
    again = RunKey.load_or_create(tmp_path, "r1")
    assert again.public_bytes == key.public_bytes
    assert (tmp_path / "run-key.pem").stat().st_mode & 0o777 == 0o600


def test_a_credential_cannot_be_forged_altered_or_used_in_another_run(tmp_path: Path) -> None:
    key = RunKey.load_or_create(tmp_path / "a", "r1")
    other = RunKey.load_or_create(tmp_path / "b", "r1")
    verifier = Verifier(key.public_bytes, "r1")
    body, _, sig = key.issue("n1").partition(".")
    forged_body = other.issue("n2").partition(".")[0]
    with pytest.raises(AuthError, match="not signed"):
        verifier.verify(other.issue("n1"))  # signed by another run's key
    with pytest.raises(AuthError, match="not signed"):
        verifier.verify(f"{forged_body}.{sig}")  # n1's signature on n2's claim
    with pytest.raises(AuthError, match="is for run"):
        Verifier(key.public_bytes, "r2").verify(key.issue("n1"))
    with pytest.raises(AuthError):
        verifier.verify("garbage")
    assert verifier.verify(f"{body}.{sig}").node_id == "n1"


def test_mqtt_passwords_differ_per_user_and_are_stable(tmp_path: Path) -> None:
    key = RunKey.load_or_create(tmp_path, "r1")
    assert key.mqtt_password("n1") != key.mqtt_password("n2")
    assert key.mqtt_password("n1") == RunKey.load_or_create(tmp_path, "r1").mqtt_password("n1")


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[tuple[RunKey, PeerAdmission, int]]:
    """An Echo Stage server behind a node's admission rule, with a plan holding n1."""
    key = RunKey.load_or_create(tmp_path, "r1")
    admission = PeerAdmission("me")
    admission.verifier = key.verifier()
    admission.stage = 1
    admission.plan = control_pb2.Plan(
        stages=[
            control_pb2.StagePlan(stage=0, replicas=[control_pb2.Replica(node_id="n1")]),
            control_pb2.StagePlan(stage=1, replicas=[]),
        ],
        revoked=["gone"],
    )
    server = create_server(AuthInterceptor(admission.policy))
    add_servicer(server, Echo(), STAGE)
    await enable_health_and_reflection(server, [STAGE.full_name])
    port = bind(server, "127.0.0.1:0")
    await server.start()
    try:
        yield key, admission, port
    finally:
        await server.stop(grace=None)


async def _codes(port: int, credential: str) -> dict[str, grpc.StatusCode]:
    """The status of one call of each kind (and the health check) with `credential`."""
    holder = CredentialHolder()
    if credential:
        holder.set(CREDENTIAL_KEY, credential)
    codes = {}
    async with open_channel(f"127.0.0.1:{port}", holder) as channel:
        calls = {
            "Info": lambda: channel.unary_unary(
                "/swarmpipe.v1.Stage/Info",
                request_serializer=stage_pb2.StageInfoRequest.SerializeToString,
            )(stage_pb2.StageInfoRequest(), timeout=5),
            "FetchState": lambda: _drain(
                channel.unary_stream(
                    "/swarmpipe.v1.Stage/FetchState",
                    request_serializer=stage_pb2.FetchStateRequest.SerializeToString,
                )(stage_pb2.FetchStateRequest(stage=1), timeout=5)
            ),
            "Reduce": lambda: channel.stream_unary(
                "/swarmpipe.v1.Stage/Reduce",
                request_serializer=stage_pb2.ReduceMessage.SerializeToString,
            )(iter([stage_pb2.ReduceMessage()]), timeout=5),
            "Forward": lambda: _drain(
                channel.stream_stream(
                    "/swarmpipe.v1.Stage/Forward",
                    request_serializer=stage_pb2.ForwardMessage.SerializeToString,
                )(iter([stage_pb2.ForwardMessage()]), timeout=5)
            ),
            "Health": lambda: channel.unary_unary(
                "/grpc.health.v1.Health/Check", request_serializer=lambda _: b""
            )(None, timeout=5),
        }
        for name, call in calls.items():
            try:
                await call()
                codes[name] = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as exc:
                codes[name] = exc.code()
    return codes


async def _drain(call: grpc.aio.Call) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass


async def test_a_node_admits_only_nodes_of_its_plan_on_every_kind_of_call(
    guarded: tuple[RunKey, PeerAdmission, int], tmp_path: Path
) -> None:
    key, _, port = guarded
    other_dir = tmp_path / "another-run"
    OK, UNAUTH, DENIED = (
        grpc.StatusCode.OK,
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    )
    everything = {"Info", "FetchState", "Reduce", "Forward"}
    none = await _codes(port, "")
    assert {k for k, c in none.items() if c == UNAUTH} == everything
    assert none["Health"] == OK
    stranger = RunKey.load_or_create(other_dir, "r1")
    forged = await _codes(port, stranger.issue("n1"))
    assert {k for k, c in forged.items() if c == UNAUTH} == everything
    member = await _codes(port, key.issue("n1"))
    assert all(member[k] == OK for k in everything), member
    outsider = await _codes(port, key.issue("n9", stage=0))
    assert {k for k, c in outsider.items() if c == DENIED} == everything
    # A joiner admitted to this stage may fetch its state before it is in a plan.
    joiner = await _codes(port, key.issue("n7", stage=1))
    assert joiner["FetchState"] == OK
    assert {k for k, c in joiner.items() if c == DENIED} == everything - {"FetchState"}
    revoked = await _codes(port, key.issue("gone", stage=1))
    assert {k for k, c in revoked.items() if c == DENIED} == everything
    coordinator = await _codes(port, key.issue("coordinator", role=ROLE_COORDINATOR))
    assert all(coordinator[k] == OK for k in everything)


def test_the_coordinator_rule_closed_run(tmp_path: Path) -> None:
    admission = Admission(tmp_path, "r1", loopback_only=True)
    assert admission.open
    _, token = admission.tokens.create(expires_s=None)
    assert not admission.open
    join = "/swarmpipe.v1.Coordinator/Join"
    lease = "/swarmpipe.v1.Coordinator/Lease"
    status = "/swarmpipe.v1.Coordinator/Status"

    def code(method: str, *pairs: tuple[str, str]) -> grpc.StatusCode:
        refusal = admission.policy(method, pairs)
        return grpc.StatusCode.OK if refusal is None else refusal.code

    assert code(join) == grpc.StatusCode.UNAUTHENTICATED
    assert code(join, (JOIN_TOKEN_KEY, "x.y")) == grpc.StatusCode.UNAUTHENTICATED
    assert code(join, (JOIN_TOKEN_KEY, token)) == grpc.StatusCode.OK
    assert code(status) == grpc.StatusCode.UNAUTHENTICATED
    assert code(status, (ADMIN_TOKEN_KEY, "wrong")) == grpc.StatusCode.UNAUTHENTICATED
    assert code(status, (ADMIN_TOKEN_KEY, admission.admin_token)) == grpc.StatusCode.OK
    assert code(lease) == grpc.StatusCode.UNAUTHENTICATED
    token_id = admission.admit("n1", ((JOIN_TOKEN_KEY, token),))
    credential = admission.credential("n1", 0)
    assert code(lease, (CREDENTIAL_KEY, credential)) == grpc.StatusCode.OK
    assert admission.caller(((CREDENTIAL_KEY, credential),)) == "n1"
    # Nobody else may take n1's name with another token.
    _, second = admission.tokens.create(expires_s=None)
    with pytest.raises(TokenError, match="joined with another token"):
        admission.admit("n1", ((JOIN_TOKEN_KEY, second),))
    # Revoked: the node is named once, and its calls are refused from then on.
    admission.tokens.revoke(token_id)
    admission.tokens._mtime_ns = None  # as if the file's mtime moved (same-ns writes)
    assert admission.newly_revoked() == ["n1"]
    refusal = admission.policy(lease, ((CREDENTIAL_KEY, credential),))
    assert isinstance(refusal, Refusal) and refusal.code == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(TokenError, match="revoked"):
        admission.admit("n2", ((JOIN_TOKEN_KEY, token),))


def test_a_coordinator_beyond_loopback_without_tokens_makes_one(tmp_path: Path) -> None:
    admission = Admission(tmp_path, "r1", loopback_only=False)
    assert not admission.open
    token = (tmp_path / "join-token").read_text().strip()
    assert (tmp_path / "join-token").stat().st_mode & 0o777 == 0o600
    assert admission.policy("/swarmpipe.v1.Coordinator/Join", ((JOIN_TOKEN_KEY, token),)) is None
    assert (tmp_path / "admin-token").stat().st_mode & 0o777 == 0o600


def test_a_resumed_coordinator_learns_a_nodes_token_from_its_first_call(tmp_path: Path) -> None:
    first = Admission(tmp_path, "r1", loopback_only=True)
    _, token = first.tokens.create(expires_s=None)
    token_id = first.admit("n1", ((JOIN_TOKEN_KEY, token),))
    credential = first.credential("n1", 0)
    resumed = Admission(tmp_path, "r1", loopback_only=True)  # same state dir, same run key
    lease = "/swarmpipe.v1.Coordinator/Lease"
    assert resumed.policy(lease, ((CREDENTIAL_KEY, credential),)) is None
    resumed.tokens.revoke(token_id)
    resumed.tokens._mtime_ns = None
    assert resumed.newly_revoked() == ["n1"]
