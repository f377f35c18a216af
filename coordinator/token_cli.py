"""`swarmpipe token create|list|revoke --state-dir DIR`: the organiser's join tokens.

The tokens live in the coordinator's state dir (coordinator/tokens.py); a running
coordinator notices a change within a second. `create` prints the token once, on stdout
alone, so `swarmpipe token create > node.token` captures it; the file keeps only its hash.

Exit codes: 0 done, 2 a bad argument (an unknown id, a malformed --expires).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from swarmpipe.coordinator.tokens import TokenRecord, TokenStore, parse_duration


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="token_action", required=True, metavar="ACTION")
    create = sub.add_parser("create", help="make a join token and print it once")
    create.add_argument(
        "--expires",
        default="7d",
        help="how long it admits nodes: 45m, 12h, 7d, 2w or never (default: 7d)",
    )
    create.add_argument("--note", default="", help="what it is for, shown by `token list`")
    listing = sub.add_parser("list", help="show every token: id, dates, note, nodes, revoked")
    listing.add_argument("--json", action="store_true", help="one JSON object per token")
    revoke = sub.add_parser(
        "revoke", help="admit nobody with this token again, and put its nodes out of the run"
    )
    revoke.add_argument("token_id", metavar="ID", help="the token's id, as `token list` shows")
    for child in (create, listing, revoke):
        child.add_argument(
            "--state-dir",
            default="swarmpipe-state",
            help="the coordinator's --state-dir (default: ./swarmpipe-state)",
        )


def _when(t: float | None) -> str:
    if t is None:
        return "never"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def _row(record: TokenRecord, now: float) -> dict[str, object]:
    return {
        "id": record.id,
        "created": _when(record.created),
        "expires": _when(record.expires),
        "note": record.note,
        "nodes": list(record.nodes),
        "revoked": _when(record.revoked) if record.revoked is not None else "",
        "admits": record.refusal(now) is None,
    }


def serve(args: argparse.Namespace) -> int:
    store = TokenStore(args.state_dir)
    now = time.time()
    if args.token_action == "create":
        record, token = store.create(expires_s=parse_duration(args.expires), note=args.note)
        print(token, flush=True)
        print(
            f"token {record.id} admits nodes until {_when(record.expires)}; it is shown only "
            "this once: give it to a node as --token-file or SWARMPIPE_TOKEN",
            file=sys.stderr,
        )
        return 0
    if args.token_action == "revoke":
        record = store.revoke(args.token_id)
        nodes = ", ".join(record.nodes) or "no node"
        print(f"token {record.id} revoked; {nodes} leave(s) the run")
        return 0
    rows = [_row(r, now) for r in store.records]
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    if not rows:
        print(f"no join tokens in {store.path}")
        return 0
    print(f"{'ID':<9} {'CREATED':<21} {'EXPIRES':<21} {'REVOKED':<21} NODES  NOTE")
    for r in store.records:
        revoked = _when(r.revoked) if r.revoked is not None else "-"
        print(
            f"{r.id:<9} {_when(r.created):<21} {_when(r.expires):<21} {revoked:<21} "
            f"{','.join(r.nodes) or '-'}  {r.note}"
        )
    return 0
