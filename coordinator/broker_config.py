"""`swarmpipe broker-config --state-dir DIR --out DIR`: mosquitto files enforcing the run's rules.

Writes into --out:

- `passwd`: mosquitto's password file (PBKDF2-SHA512, the `$7$` form `mosquitto_passwd`
  writes) with `coordinator`, `organiser` (its password is the admin token) and one user per
  node: the nodes recorded in `tokens.json` and each `--node ID`. A node's password is the
  one the coordinator derives from the run key and hands it at Join, so a node needs nothing
  besides its join token. mosquitto cannot derive passwords itself: a node id that is not in
  the file yet is refused until the file is written again (`--node`) and mosquitto reloads it
  (SIGHUP).
- `acl`: `control/mqtt_acl.py`'s rule for one run, as mosquitto patterns.
- `mosquitto.conf`: a listener with anonymous clients refused, pointing at both files.
- `coordinator.password` (mode 0600): give it to the coordinator as
  `SWARMPIPE_BROKER_USERNAME=coordinator SWARMPIPE_BROKER_PASSWORD_FILE=...`.
- with `--tls`: `ca.pem`, `broker.pem` and `broker-key.pem` (0600; mosquitto's user must be
  able to read it), a certificate from the run CA (`<state-dir>/ca.pem`, made if the state
  dir has none) named `swarmpipe-broker`, localhost and each `--tls-host`, and TLS lines on
  the listener (default port 8883). Give the coordinator `--broker mqtts://HOST:8883 --tls`.

Exit codes: 0 written, 2 a state dir with no run or a bad argument.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
import secrets
from pathlib import Path

from swarmpipe.errors import ConfigError

PBKDF2_ITERATIONS = 101
"""mosquitto_passwd's default for the `$7$` (PBKDF2-SHA512) form."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir", default="swarmpipe-state", help="the coordinator's --state-dir"
    )
    parser.add_argument("--out", required=True, help="folder to write passwd, acl and conf into")
    parser.add_argument("--run", default="", help="the run id (default: the state dir's run)")
    parser.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ID",
        help="a node id to add a login for (repeatable); nodes that joined are added anyway",
    )
    parser.add_argument(
        "--listen-port", type=int, default=0, help="mosquitto's port (default 1883, TLS 8883)"
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="a TLS listener with a certificate from the run CA (transport/tls.py)",
    )
    parser.add_argument(
        "--tls-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name or IP clients dial, added to the broker's certificate (repeatable)",
    )


def mosquitto_hash(password: str, salt: bytes | None = None) -> str:
    """`password` as mosquitto's password file keeps it (`$7$<iterations>$<salt>$<hash>`)."""
    salt = secrets.token_bytes(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, PBKDF2_ITERATIONS)
    b64 = base64.b64encode
    return f"$7${PBKDF2_ITERATIONS}${b64(salt).decode()}${b64(digest).decode()}"


def acl_text(run_id: str) -> str:
    root = f"swarmpipe/{run_id}"
    return "\n".join(
        [
            f"# swarmpipe run {run_id!r}: written by `swarmpipe broker-config` "
            "(control/mqtt_acl.py's rule).",
            "# Every user (a node is named by its node id) reads the run's topics and writes",
            "# only its own presence and telemetry.",
            f"pattern read {root}/#",
            f"pattern write {root}/presence/%u",
            f"pattern write {root}/telemetry/%u",
            "",
            "# The coordinator publishes the plan and step state (and clears link limits).",
            "user coordinator",
            f"topic readwrite {root}/#",
            "",
            "# The organiser (password: the admin token) publishes link limits.",
            "user organiser",
            f"topic write {root}/control/+",
            "",
        ]
    )


def conf_text(out: Path, port: int, tls: bool = False) -> str:
    folder = out.resolve()
    tls_lines = [
        "# TLS only, with a certificate from the run CA (clients check 'swarmpipe-broker')",
        f"certfile {folder / 'broker.pem'}",
        f"keyfile {folder / 'broker-key.pem'}",
        f"cafile {folder / 'ca.pem'}",
    ]
    return "\n".join(
        [
            "# mosquitto for one swarmpipe run: written by `swarmpipe broker-config`.",
            f"listener {port}",
            *(tls_lines if tls else []),
            "allow_anonymous false",
            f"password_file {out.resolve() / 'passwd'}",
            f"acl_file {out.resolve() / 'acl'}",
            "# the coordinator republishes its retained plan and step state on reconnect",
            "persistence false",
            "",
        ]
    )


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def serve(args: argparse.Namespace) -> int:
    from swarmpipe.control.mqtt_acl import COORDINATOR_USER, ORGANISER_USER, RESERVED_USERS
    from swarmpipe.coordinator.admission import load_or_create_admin_token
    from swarmpipe.coordinator.tokens import TokenStore
    from swarmpipe.transport.auth import RUN_KEY_FILE, RunKey

    state = Path(args.state_dir)
    if not (state / RUN_KEY_FILE).exists():
        raise ConfigError(
            f"{state} has no {RUN_KEY_FILE}: start the coordinator on it once "
            "(or check --state-dir)"
        )
    run_id = args.run
    if not run_id:
        runs = sorted(p.name for p in (state / "checkpoints").glob("*") if p.is_dir())
        if len(runs) != 1:
            raise ConfigError(f"{state} holds runs {runs or 'none'}: name one with --run")
        run_id = runs[0]
    bad = [n for n in args.node if not n or "/" in n or n in RESERVED_USERS or ":" in n]
    if bad:
        raise ConfigError(f"--node {bad[0]!r} cannot be a node id")
    key = RunKey.load_or_create(state, run_id)
    nodes = {n for r in TokenStore(state).records if r.revoked is None for n in r.nodes}
    nodes.update(args.node)
    users = {
        COORDINATOR_USER: key.mqtt_password(COORDINATOR_USER),
        ORGANISER_USER: load_or_create_admin_token(state),
    }
    users.update({n: key.mqtt_password(n) for n in sorted(nodes)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "passwd", "".join(f"{u}:{mosquitto_hash(p)}\n" for u, p in users.items()), 0o600)
    _write(out / "acl", acl_text(run_id))
    if args.tls:
        from swarmpipe.transport.tls import RunCA, write_broker_files

        ca = RunCA.load_or_create(state, run_id)
        write_broker_files(ca, args.tls_host, out)
        _write(out / "ca.pem", ca.cert_pem.decode())
    port = args.listen_port or (8883 if args.tls else 1883)
    _write(out / "mosquitto.conf", conf_text(out, port, tls=args.tls))
    _write(out / "coordinator.password", users[COORDINATOR_USER] + "\n", 0o600)
    print(
        f"wrote {out}/mosquitto.conf, passwd ({len(nodes)} node(s) and the coordinator and "
        f"organiser), acl and coordinator.password for run {run_id!r}"
        + (", and broker.pem/broker-key.pem from the run CA" if args.tls else "")
    )
    return 0
