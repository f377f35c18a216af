"""Who is calling: node credentials, and the interceptors that carry and check them.

At Join the coordinator hands a node a **credential**: a small JSON claim (run id, node id,
role, the join token it came with, when it was issued) signed with the run's Ed25519 key,
which the coordinator creates on first start (`<state-dir>/run-key.pem`, mode 0600). Every
node also receives the run's public key at Join, so any node can check any other's credential
and none can forge one. The coordinator checks them with the same public key: one kind of
credential for every call, to the coordinator or between nodes.

A credential travels as the gRPC metadata `swarmpipe-credential` on every call
(`CredentialHolder` + the client interceptors that `transport.rpc.open_channel` installs).
Servers check it in `AuthInterceptor` before any of the request is read: no credential or
a bad one is UNAUTHENTICATED; a valid one that the server's policy refuses (a node not in the
plan, a revoked token) is PERMISSION_DENIED. The standard health check stays open. Server
reflection answers everyone, but what it shows depends on the caller: a caller the policy
admits to reflection (a node of the run; the organiser at the coordinator) sees every
service, anyone else sees only the health service, so `grpcurl host
grpc.health.v1.Health/Check` works for a load balancer or a stranger while a port shows a
stranger nothing of what it serves (a stranger with our .proto files still meets
UNAUTHENTICATED on every method).

Without TLS a credential is a bearer secret: whoever sees it on the wire can replay it. The
claim is the place to bind it to more when TLS arrives (a certificate fingerprint, checked
against the peer's certificate), without changing who issues or checks it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarmpipe.errors import SwarmpipeError

CREDENTIAL_KEY = "swarmpipe-credential"
"""Metadata carrying a node's (or the coordinator's) signed credential."""
JOIN_TOKEN_KEY = "swarmpipe-join-token"
"""Metadata carrying a join token, on Join only."""
ADMIN_TOKEN_KEY = "swarmpipe-admin-token"
"""Metadata carrying the organiser's token, for Status, Drain and Move."""

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
"""Methods every caller may use, credential or not."""
REFLECTION = ("/grpc.reflection.v1alpha.ServerReflection/", "/grpc.reflection.v1.ServerReflection/")
"""Server reflection: whole for the callers a policy admits, the health service alone for
the rest."""

ROLE_NODE = "node"
ROLE_COORDINATOR = "coordinator"
RUN_KEY_FILE = "run-key.pem"
MAX_CREDENTIAL_BYTES = 2048
_CACHE = 4096


class AuthError(SwarmpipeError):
    """A credential is missing, malformed, not signed by the run's key, or for another run."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """What a credential says about its holder."""

    run_id: str
    node_id: str
    role: str
    token_id: str
    """The join token it was issued for ("" for the coordinator and open runs)."""
    stage: int
    """The stage the coordinator admitted the node to at Join (-1: none), so a joiner
    that is in no plan yet may fetch that stage's state."""
    issued_at: float

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "run": self.run_id,
                "sub": self.node_id,
                "role": self.role,
                "tok": self.token_id,
                "stg": self.stage,
                "iat": self.issued_at,
            },
            sort_keys=True,
            separators=(",", ":"),
        ).encode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class RunKey:
    """The run's signing key: issues credentials and derives per-node MQTT passwords."""

    def __init__(self, private: Ed25519PrivateKey, run_id: str) -> None:
        self._private = private
        self.run_id = run_id
        self.public_bytes = private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        raw = private.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        # A separate key for MQTT passwords, so a password says nothing about the signing key.
        self.mqtt_key = hashlib.sha256(b"swarmpipe mqtt passwords\0" + raw).digest()

    @staticmethod
    def load_or_create(state_dir: str | Path, run_id: str) -> RunKey:
        """The key in `state_dir/run-key.pem`, made (mode 0600) if there is none yet."""
        path = Path(state_dir) / RUN_KEY_FILE
        if path.exists():
            try:
                key = serialization.load_pem_private_key(path.read_bytes(), password=None)
            except (OSError, ValueError) as exc:
                raise SwarmpipeError(f"{path} is not a readable Ed25519 key: {exc}") from exc
            if not isinstance(key, Ed25519PrivateKey):
                raise SwarmpipeError(f"{path} is not an Ed25519 key")
            return RunKey(key, run_id)
        key = Ed25519PrivateKey.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        return RunKey(key, run_id)

    def issue(
        self, node_id: str, *, role: str = ROLE_NODE, token_id: str = "", stage: int = -1
    ) -> str:
        claim = Claim(
            run_id=self.run_id,
            node_id=node_id,
            role=role,
            token_id=token_id,
            stage=stage,
            issued_at=round(time.time(), 3),
        )
        body = claim.to_bytes()
        return f"{_b64(body)}.{_b64(self._private.sign(body))}"

    def mqtt_password(self, username: str) -> str:
        """The MQTT password of `username` (a node id, or "coordinator"), derived, not stored."""
        return mqtt_password(self.mqtt_key, username)

    def verifier(self) -> Verifier:
        return Verifier(self.public_bytes, self.run_id)


def mqtt_password(mqtt_key: bytes, username: str) -> str:
    """The password of MQTT user `username` under the run's MQTT key."""
    return _b64(hmac.new(mqtt_key, username.encode(), hashlib.sha256).digest())


class Verifier:
    """Checks credentials against the run's public key; remembers the ones it checked."""

    def __init__(self, public_key: bytes, run_id: str) -> None:
        try:
            self._key = Ed25519PublicKey.from_public_bytes(public_key)
        except ValueError as exc:
            raise AuthError(f"the run's public key is malformed: {exc}") from exc
        self.run_id = run_id
        self._seen: OrderedDict[str, Claim] = OrderedDict()

    def verify(self, credential: str) -> Claim:
        claim = self._seen.get(credential)
        if claim is not None:
            self._seen.move_to_end(credential)
            return claim
        if len(credential) > MAX_CREDENTIAL_BYTES:
            raise AuthError("the credential is too long")
        body_text, dot, sig_text = credential.partition(".")
        try:
            body, sig = _unb64(body_text), _unb64(sig_text)
        except (binascii.Error, ValueError) as exc:
            raise AuthError("the credential is not base64") from exc
        if not dot:
            raise AuthError("the credential is malformed")
        try:
            self._key.verify(sig, body)
        except InvalidSignature as exc:
            raise AuthError("the credential is not signed by this run's coordinator") from exc
        raw = json.loads(body)
        claim = Claim(
            run_id=str(raw["run"]),
            node_id=str(raw["sub"]),
            role=str(raw["role"]),
            token_id=str(raw["tok"]),
            stage=int(raw["stg"]),
            issued_at=float(raw["iat"]),
        )
        if claim.run_id != self.run_id:
            raise AuthError(f"the credential is for run {claim.run_id!r}, not {self.run_id!r}")
        self._seen[credential] = claim
        while len(self._seen) > _CACHE:
            self._seen.popitem(last=False)
        return claim


def metadata_value(metadata: Any, key: str) -> str:
    """The first value of `key` in a call's invocation metadata ("" when absent)."""
    for item in metadata or ():
        k, v = item
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return ""


# -- the client side -----------------------------------------------------


class CredentialHolder:
    """The metadata a process's calls carry; the daemon fills it in after Join."""

    def __init__(self) -> None:
        self.pairs: dict[str, str] = {}

    def set(self, key: str, value: str) -> None:
        self.pairs[key] = value

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if not self.pairs:
            return details
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in self.pairs.items():
            if key not in metadata:
                metadata.add(key, value)
        return grpc.aio.ClientCallDetails(
            details.method,
            details.timeout,
            metadata,
            details.credentials,
            details.wait_for_ready,
        )

    def interceptors(self) -> list[grpc.aio.ClientInterceptor]:
        return [
            _UnaryUnary(self),
            _UnaryStream(self),
            _StreamUnary(self),
            _StreamStream(self),
        ]


class _UnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, holder: CredentialHolder) -> None:
        self.holder = holder

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.holder._details(details), request)


class _UnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, holder: CredentialHolder) -> None:
        self.holder = holder

    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self.holder._details(details), request)


class _StreamUnary(grpc.aio.StreamUnaryClientInterceptor):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, holder: CredentialHolder) -> None:
        self.holder = holder

    async def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.holder._details(details), requests)


class _StreamStream(grpc.aio.StreamStreamClientInterceptor):  # type: ignore[misc]  # grpc ships no types
    def __init__(self, holder: CredentialHolder) -> None:
        self.holder = holder

    async def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return await continuation(self.holder._details(details), requests)


# -- the server side -----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    code: grpc.StatusCode
    message: str


Policy = Callable[[str, Any], Refusal | None]
"""(method path, invocation metadata) -> None to let the call in, or why it is refused."""


def _refuse(handler: grpc.RpcMethodHandler, refusal: Refusal) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `refusal`."""

    async def abort(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(refusal.code, refusal.message)

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(refusal.code, refusal.message)
        yield None  # pragma: no cover - abort raises; this makes it an async generator

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort_stream)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort_stream)
    return grpc.unary_unary_rpc_method_handler(abort)


class AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # untyped in grpc
    """Lets a call reach its handler only when `policy` admits its caller."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.refused = 0
        self._public_reflection = _public_reflection_handler()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        refusal = self.policy(method, details.invocation_metadata)
        if refusal is None:
            return handler
        if method.startswith(REFLECTION):
            return self._public_reflection
        self.refused += 1
        return _refuse(handler, refusal)


def _public_reflection_handler() -> grpc.RpcMethodHandler:
    """Reflection that lists and describes the health service (and itself) only."""
    from grpc_health.v1 import health
    from grpc_reflection.v1alpha import reflection, reflection_pb2

    from swarmpipe.transport.request_parsing import method_handlers

    servicer = reflection.aio.ReflectionServicer([health.SERVICE_NAME, reflection.SERVICE_NAME])
    service = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
    return method_handlers(servicer, service)["ServerReflectionInfo"]


def unauthenticated(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.UNAUTHENTICATED, message)


def denied(message: str) -> Refusal:
    return Refusal(grpc.StatusCode.PERMISSION_DENIED, message)


def caller_claim(verifier: Verifier | None, metadata: Any) -> Claim | Refusal:
    """The verified claim of a call's credential, or the UNAUTHENTICATED refusal."""
    credential = metadata_value(metadata, CREDENTIAL_KEY)
    if not credential:
        return unauthenticated(f"this call needs a node credential ({CREDENTIAL_KEY} metadata)")
    if verifier is None:
        return unauthenticated("this node has not joined a run yet: it admits no calls")
    try:
        return verifier.verify(credential)
    except (AuthError, ValueError, KeyError, TypeError) as exc:
        return unauthenticated(f"invalid credential: {exc}")
