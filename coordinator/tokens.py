"""Join tokens: the organiser's invitations to a run, kept in `<state-dir>/tokens.json`.

A token is printed once, as `<id>.<secret>`, when the organiser creates it; the file keeps
only the secret's SHA-256, so a copy of the state dir admits nobody. Each record says when it
was made, when it expires (None: never), a note, the nodes that joined with it and whether it
was revoked. The CLI (`swarmpipe token create/list/revoke`) and the running coordinator both
change the file: every change is a read-modify-write under an exclusive `flock` on
`tokens.lock`, and the new file replaces the old with `os.replace` (mode 0600), so a reader
never sees half a file and neither writer loses the other's change. The coordinator notices
the organiser's changes by polling the file's mtime (`TokenStore.reload_if_changed`), so a
revocation needs no RPC and works while the coordinator is busy or unreachable.

Expiry bounds when a token may be used to join; a node that joined keeps its credential
until its token is revoked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import hmac
import json
import os
import re
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from swarmpipe.errors import ConfigError, SwarmpipeError

TOKENS_FILE = "tokens.json"
_LOCK_FILE = "tokens.lock"
_VERSION = 1
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
MAX_NOTE = 200
MAX_NODES_LISTED = 1000
"""Node ids remembered per token, so a token used by a flood of joins keeps a bounded file."""


def parse_duration(text: str) -> float | None:
    """`7d`, `12h`, `30m`, `45s`, `2w` -> seconds; `never` -> None."""
    if text == "never":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([smhdw])", text.strip())
    if match is None or float(match[1]) <= 0:
        raise ConfigError(
            f"--expires {text!r}: give a positive number and a unit (s, m, h, d, w), "
            "e.g. 7d, or never"
        )
    return float(match[1]) * _UNITS[match[2]]


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenRecord:
    """One join token as the store keeps it (the secret itself is not kept)."""

    id: str
    secret_sha256: str
    created: float
    """Unix seconds."""
    expires: float | None
    """Unix seconds after which the token admits nobody; None: never."""
    note: str = ""
    nodes: tuple[str, ...] = field(default=())
    """Node ids that joined with this token, oldest first."""
    revoked: float | None = None
    """Unix seconds of the revocation; None: not revoked."""

    def refusal(self, now: float) -> str | None:
        """Why this token admits nobody now, or None if it admits."""
        if self.revoked is not None:
            return f"join token {self.id} was revoked"
        if self.expires is not None and now >= self.expires:
            return f"join token {self.id} expired"
        return None

    def to_json(self) -> dict[str, object]:
        return {
            "id": self.id,
            "secret_sha256": self.secret_sha256,
            "created": self.created,
            "expires": self.expires,
            "note": self.note,
            "nodes": list(self.nodes),
            "revoked": self.revoked,
        }

    @staticmethod
    def from_json(raw: dict[str, object]) -> TokenRecord:
        expires, revoked = raw.get("expires"), raw.get("revoked")
        nodes = raw.get("nodes", [])
        return TokenRecord(
            id=str(raw["id"]),
            secret_sha256=str(raw["secret_sha256"]),
            created=float(str(raw["created"])),
            expires=None if expires is None else float(str(expires)),
            note=str(raw.get("note", "")),
            nodes=tuple(str(n) for n in nodes) if isinstance(nodes, list) else (),
            revoked=None if revoked is None else float(str(revoked)),
        )


class TokenError(SwarmpipeError):
    """A join token is missing, malformed, unknown, expired or revoked."""


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    """The run's join tokens in `state_dir/tokens.json`."""

    def __init__(self, state_dir: str | Path) -> None:
        self.state_dir = Path(state_dir)
        self.path = self.state_dir / TOKENS_FILE
        self._records: dict[str, TokenRecord] = {}
        self._mtime_ns: int | None = None
        self.reload_if_changed()

    @property
    def exists(self) -> bool:
        """Whether the organiser has ever created a token for this state dir."""
        return self.path.exists()

    @property
    def records(self) -> list[TokenRecord]:
        return sorted(self._records.values(), key=lambda r: (r.created, r.id))

    def get(self, token_id: str) -> TokenRecord | None:
        return self._records.get(token_id)

    # -- reading ---------------------------------------------------------

    def _read(self) -> dict[str, TokenRecord]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            raise SwarmpipeError(
                f"{self.path} is unreadable ({exc}); restore it or remove it"
            ) from exc
        if not isinstance(raw, dict) or raw.get("version") != _VERSION:
            raise SwarmpipeError(f"{self.path} is not a swarmpipe token file (version {_VERSION})")
        try:
            records = [TokenRecord.from_json(r) for r in raw.get("tokens", [])]
        except (KeyError, TypeError, ValueError) as exc:
            raise SwarmpipeError(f"{self.path} has a malformed token record: {exc}") from exc
        return {r.id: r for r in records}

    def reload_if_changed(self) -> bool:
        """Read the file again if it changed since the last read; returns whether it did."""
        try:
            mtime: int | None = self.path.stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime == self._mtime_ns and (mtime is not None or not self._records):
            return False
        self._records = self._read()
        self._mtime_ns = mtime
        return True

    # -- changing --------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, TokenRecord]]:
        """The records under the file lock; what the block leaves in the dict is written."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            records = self._read()
            yield records
            self._write(records)
            self._records = records
            self._mtime_ns = self.path.stat().st_mtime_ns
        finally:
            os.close(fd)  # releases the lock

    def _write(self, records: dict[str, TokenRecord]) -> None:
        body = {"version": _VERSION, "tokens": [r.to_json() for r in records.values()]}
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(body, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def create(
        self, *, expires_s: float | None, note: str = "", now: float | None = None
    ) -> tuple[TokenRecord, str]:
        """A new token; returns its record and the token text (`<id>.<secret>`), shown once."""
        if len(note) > MAX_NOTE:
            raise ConfigError(f"--note is {len(note)} characters; keep it to {MAX_NOTE}")
        now = time.time() if now is None else now
        secret = secrets.token_urlsafe(32)
        with self._locked() as records:
            token_id = secrets.token_hex(4)
            while token_id in records:
                token_id = secrets.token_hex(4)
            record = TokenRecord(
                id=token_id,
                secret_sha256=_digest(secret),
                created=now,
                expires=None if expires_s is None else now + expires_s,
                note=note,
            )
            records[token_id] = record
        return record, f"{token_id}.{secret}"

    def revoke(self, token_id: str, *, now: float | None = None) -> TokenRecord:
        """Revoke a token: nobody joins with it again, and the nodes that did leave the run."""
        with self._locked() as records:
            record = records.get(token_id)
            if record is None:
                known = ", ".join(sorted(records)) or "none"
                raise ConfigError(f"no join token {token_id!r} in {self.path} (known: {known})")
            if record.revoked is None:
                record = replace(record, revoked=time.time() if now is None else now)
                records[token_id] = record
        return record

    def record_use(self, token_id: str, node_id: str) -> None:
        """Remember that `node_id` joined with `token_id` (for `token list` and revocation)."""
        with self._locked() as records:
            record = records.get(token_id)
            if record is not None and node_id not in record.nodes:
                nodes = (*record.nodes, node_id)[-MAX_NODES_LISTED:]
                records[token_id] = replace(record, nodes=nodes)

    # -- checking --------------------------------------------------------

    def check(self, token: str, *, now: float | None = None) -> TokenRecord:
        """The record of a valid token; TokenError saying what is wrong otherwise."""
        if not token:
            raise TokenError("no join token: give the node --token-file PATH or SWARMPIPE_TOKEN")
        token_id, dot, secret = token.strip().partition(".")
        if not dot or not token_id or not secret:
            raise TokenError("the join token is malformed: it should look like <id>.<secret>")
        record = self._records.get(token_id)
        if record is None or not hmac.compare_digest(record.secret_sha256, _digest(secret)):
            raise TokenError("the join token is not one of this run's tokens")
        reason = record.refusal(time.time() if now is None else now)
        if reason is not None:
            raise TokenError(reason)
        return record
