"""Join tokens: create, list, revoke, expiry, and what a check says about each bad token."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.coordinator.tokens import TokenError, TokenStore, parse_duration
from swarmpipe.errors import ConfigError


def test_create_stores_only_a_hash_and_the_token_checks(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    record, token = store.create(expires_s=3600, note="lab")
    token_id, _, secret = token.partition(".")
    assert token_id == record.id and secret
    text = (tmp_path / "tokens.json").read_text()
    assert secret not in text
    assert stat.S_IMODE(os.stat(tmp_path / "tokens.json").st_mode) == 0o600
    assert store.check(token).id == record.id
    # Another store on the same folder (the coordinator beside the CLI) agrees.
    assert TokenStore(tmp_path).check(token).note == "lab"


@pytest.mark.parametrize(
    ("token", "words"),
    [
        ("", "no join token"),
        ("nodot", "malformed"),
        ("abcd1234.wrongsecret", "not one of this run's tokens"),
    ],
)
def test_a_bad_token_is_refused_saying_why(tmp_path: Path, token: str, words: str) -> None:
    store = TokenStore(tmp_path)
    store.create(expires_s=None)
    with pytest.raises(TokenError, match=words):
        store.check(token)


def test_a_token_with_the_right_id_and_a_wrong_secret_is_unknown(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    record, _ = store.create(expires_s=None)
    with pytest.raises(TokenError, match="not one of this run's tokens"):
        store.check(f"{record.id}.guessed")


def test_an_expired_token_admits_nobody(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    record, token = store.create(expires_s=60, now=1000.0)
    assert store.check(token, now=1059.0).id == record.id
    with pytest.raises(TokenError, match=f"join token {record.id} expired"):
        store.check(token, now=1060.0)


def test_revoke_is_seen_by_a_running_reader(tmp_path: Path) -> None:
    coordinator = TokenStore(tmp_path)
    record, token = TokenStore(tmp_path).create(expires_s=None)
    assert coordinator.reload_if_changed()
    coordinator.check(token)
    coordinator.record_use(record.id, "n0")
    TokenStore(tmp_path).revoke(record.id)
    assert coordinator.reload_if_changed()
    assert not coordinator.reload_if_changed()  # nothing new since
    with pytest.raises(TokenError, match="revoked"):
        coordinator.check(token)
    # The node the coordinator recorded survived the CLI's read-modify-write.
    again = coordinator.get(record.id)
    assert again is not None and again.nodes == ("n0",) and again.revoked is not None


def test_revoking_an_unknown_id_names_the_known_ones(tmp_path: Path) -> None:
    store = TokenStore(tmp_path)
    record, _ = store.create(expires_s=None)
    with pytest.raises(ConfigError, match=record.id):
        store.revoke("nope")


@pytest.mark.parametrize(
    ("text", "seconds"), [("45s", 45), ("30m", 1800), ("12h", 43200), ("7d", 604800)]
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["7", "0d", "-1h", "3x", ""])
def test_bad_durations_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError, match="--expires"):
        parse_duration(text)


def test_never_has_no_expiry() -> None:
    assert parse_duration("never") is None


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "swarmpipe", "token", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow
def test_token_cli_create_list_revoke(tmp_path: Path) -> None:
    state = str(tmp_path)
    made = _cli("create", "--expires", "2h", "--note", "alice's box", "--state-dir", state)
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    assert "." in token and "\n" not in token  # stdout is the token alone
    token_id = token.partition(".")[0]
    listed = _cli("list", "--json", "--state-dir", state)
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(r["id"], r["note"], r["admits"], r["revoked"]) for r in rows] == [
        (token_id, "alice's box", True, "")
    ]
    assert token.partition(".")[2] not in listed.stdout
    assert _cli("revoke", token_id, "--state-dir", state).returncode == 0
    rows = [
        json.loads(line)
        for line in _cli("list", "--json", "--state-dir", state).stdout.splitlines()
    ]
    assert rows[0]["admits"] is False and rows[0]["revoked"]
    bad = _cli("revoke", "nope", "--state-dir", state)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
