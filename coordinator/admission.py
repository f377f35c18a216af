"""Who may call the coordinator: join tokens for Join, credentials for the rest.

The rule (docs/design.md, "Admission"):

- A run is **closed** once its state dir has a token file (`swarmpipe token create`, or the
  testnet, which makes its own). Join then needs a valid join token (metadata
  `swarmpipe-join-token`); Status, Drain and Move need the organiser's token, which the
  coordinator writes to `<state-dir>/admin-token` (mode 0600) on first start.
- A coordinator with no token file that listens on loopback only runs **open**: anyone on
  this machine may Join and call Status/Drain/Move, as before admission existed, so the
  README's quick start and hand-started test swarms need nothing in hand.
- A coordinator with no token file that listens beyond loopback makes one token itself,
  writes it to `<state-dir>/join-token` (0600) and says so in its log: it never admits
  strangers by default.

Either way every other call (Lease, Commit, StepDone, checkpoints, ...) needs the credential
the node got at Join, naming the node the request names; a node whose token was revoked is
refused (PERMISSION_DENIED) from the moment the coordinator reads the token file.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from pathlib import Path
from typing import Any

from swarmpipe.coordinator.broker import BrokerAuth
from swarmpipe.coordinator.tokens import TokenError, TokenStore
from swarmpipe.errors import SwarmpipeError
from swarmpipe.transport.auth import (
    ADMIN_TOKEN_KEY,
    JOIN_TOKEN_KEY,
    REFLECTION,
    ROLE_NODE,
    Claim,
    Refusal,
    RunKey,
    caller_claim,
    denied,
    metadata_value,
    unauthenticated,
)

logger = logging.getLogger(__name__)

ADMIN_TOKEN_FILE = "admin-token"
JOIN_TOKEN_FILE = "join-token"
SERVICE = "/swarmpipe.v1.Coordinator/"
JOIN = SERVICE + "Join"
ORGANISER_METHODS = frozenset(SERVICE + m for m in ("Status", "Drain", "Move"))


def _write_secret(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")


def load_or_create_admin_token(state_dir: Path) -> str:
    path = state_dir / ADMIN_TOKEN_FILE
    if not path.exists():
        state_dir.mkdir(parents=True, exist_ok=True)
        _write_secret(path, secrets.token_urlsafe(32))
    return path.read_text().strip()


class Admission:
    """The coordinator's gate: the run key, the join tokens and the organiser's token."""

    def __init__(self, state_dir: str | Path, run_id: str, *, loopback_only: bool) -> None:
        """`loopback_only`: the coordinator's gRPC API and its embedded broker (if any)
        listen on loopback addresses only."""
        self.state_dir = Path(state_dir)
        self.key = RunKey.load_or_create(self.state_dir, run_id)
        self.verifier = self.key.verifier()
        self.tokens = TokenStore(self.state_dir)
        self.admin_token = load_or_create_admin_token(self.state_dir)
        if not self.tokens.exists and not loopback_only:
            _, token = self.tokens.create(expires_s=None, note="made by the coordinator")
            path = self.state_dir / JOIN_TOKEN_FILE
            path.unlink(missing_ok=True)
            _write_secret(path, token)
            logger.warning(
                "no join tokens in %s and listening beyond loopback: made one; nodes join "
                "with --token-file %s (make more with `swarmpipe token create`)",
                self.tokens.path,
                path,
            )
        self.node_tokens: dict[str, str] = {}
        """Node id -> the id of the join token it was admitted with."""
        self.revoked_nodes: set[str] = set()
        """Nodes put out of the run by a revoked token; refused from then on."""

    @property
    def open(self) -> bool:
        """No token file and loopback only: anyone on this machine may join."""
        return not self.tokens.exists

    # -- Join ------------------------------------------------------------

    def broker_auth(self) -> BrokerAuth | None:
        """The embedded broker's logins and ACL; None (anonymous, as before) in an open run."""
        if self.open:
            return None
        return BrokerAuth(
            run_id=self.key.run_id,
            mqtt_key=self.key.mqtt_key,
            organiser_password=self.admin_token,
        )

    def admit(self, node_id: str, metadata: Any) -> str:
        """The id of the token a joining node comes with ("" in an open run); TokenError
        says why it may not join. `credential` then issues its credential."""
        token_id = ""
        if not self.open:
            record = self.tokens.check(metadata_value(metadata, JOIN_TOKEN_KEY))
            token_id = record.id
            earlier = self.node_tokens.get(node_id)
            if earlier is not None and earlier != token_id:
                raise TokenError(
                    f"node id {node_id!r} joined with another token; pick another --node-id"
                )
            if node_id not in record.nodes:
                self.tokens.record_use(token_id, node_id)
        self.node_tokens[node_id] = token_id
        self.revoked_nodes.discard(node_id)
        return token_id

    def credential(self, node_id: str, stage: int) -> str:
        """The signed credential of an admitted node, naming the stage it was given."""
        return self.key.issue(
            node_id, role=ROLE_NODE, token_id=self.node_tokens.get(node_id, ""), stage=stage
        )

    # -- every call --------------------------------------------------------

    def policy(self, method: str, metadata: Any) -> Refusal | None:
        """The AuthInterceptor's rule for the coordinator's methods."""
        if method == JOIN:
            if self.open:
                return None
            try:
                self.tokens.check(metadata_value(metadata, JOIN_TOKEN_KEY))
            except TokenError as exc:
                return unauthenticated(str(exc))
            return None
        if method.startswith(REFLECTION):
            # The whole schema for the run's nodes and the organiser; the health service
            # alone for anyone else (transport/auth.py).
            given = metadata_value(metadata, ADMIN_TOKEN_KEY)
            if self.open or (
                given and hmac.compare_digest(given.strip().encode(), self.admin_token.encode())
            ):
                return None
        if method in ORGANISER_METHODS:
            if self.open:
                return None
            given = metadata_value(metadata, ADMIN_TOKEN_KEY)
            if not given:
                # The file's name, not its path: anyone who can reach the port reads this.
                return unauthenticated(
                    f"{method.rpartition('/')[2]} is the organiser's: give --admin-token-file "
                    f"with the coordinator's <state-dir>/{ADMIN_TOKEN_FILE}"
                )
            if not hmac.compare_digest(given.strip().encode(), self.admin_token.encode()):
                return unauthenticated("the organiser's token is wrong")
            return None
        claim = caller_claim(self.verifier, metadata)
        if isinstance(claim, Refusal):
            return claim
        return self._refusal(claim)

    def _refusal(self, claim: Claim) -> Refusal | None:
        if claim.role != ROLE_NODE:
            return denied(f"a {claim.role} credential cannot call the coordinator's node API")
        if claim.token_id:
            # Nodes that joined an earlier life of this coordinator (--resume) are known
            # by their first call, so revoking their token finds them too.
            self.node_tokens.setdefault(claim.node_id, claim.token_id)
        if claim.node_id in self.revoked_nodes:
            return denied(f"node {claim.node_id!r} was put out of the run: its token was revoked")
        if claim.token_id:
            record = self.tokens.get(claim.token_id)
            if record is None or record.revoked is not None:
                return denied(f"the join token of node {claim.node_id!r} was revoked")
        return None

    def caller(self, metadata: Any) -> str:
        """The node id of a call's (already checked) credential."""
        claim = caller_claim(self.verifier, metadata)
        return claim.node_id if isinstance(claim, Claim) else ""

    def newly_revoked(self) -> list[str]:
        """Read the token file if it changed; the admitted nodes whose token is now revoked."""
        try:
            if not self.tokens.reload_if_changed():
                return []
        except (OSError, SwarmpipeError) as exc:  # a bad edit must not stop the coordinator
            logger.warning("cannot read the join tokens: %s", exc)
            return []
        out = []
        for node_id, token_id in self.node_tokens.items():
            record = self.tokens.get(token_id) if token_id else None
            if token_id and (record is None or record.revoked is not None):
                if node_id not in self.revoked_nodes:
                    out.append(node_id)
        self.revoked_nodes.update(out)
        return out
