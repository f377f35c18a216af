"""`swarmpipe status` and `swarmpipe drain`: an organiser's view of a run, and its one lever.

    swarmpipe status --coordinator HOST:PORT                 # the swarm as a table
    swarmpipe status --coordinator HOST:PORT --json          # the same, as one JSON object
    swarmpipe status --coordinator HOST:PORT --watch [SEC]   # redrawn every SEC s (default 2)
    swarmpipe drain NODE --coordinator HOST:PORT             # move NODE's work away; it leaves

Both read or call the coordinator's gRPC API (`Status`, `Drain`) and nothing else: no MQTT,
no torch. The JSON object's keys are listed in `control/status_view.py`.

`--watch` redraws in place on a terminal and, when stdout is a file or a pipe, prints each
table after a blank line (with `--json`, one object a line). It stops by itself once the run
is done, and Ctrl-C stops it with exit 0. A coordinator that stops answering while watched
is reported on one line and asked again, since an organiser restarts it (`--resume`) and
wants the watch to carry on.

A drained node is taken out of the plan at once: the samples it has leased go back to the
queue (counted as replayed) and the node leaves, exiting 0. The run goes on if its stage
has another replica, else it waits for a node to join that stage.

In a closed run (one with join tokens) these are the organiser's calls: give
`--admin-token-file <state-dir>/admin-token`, the file the coordinator writes on first start
(or set SWARMPIPE_ADMIN_TOKEN_FILE). An open loopback run needs none.

Exit codes: 0 done; 1 the coordinator refused (`drain` of a node it does not know); 2 bad
arguments; 3 the coordinator cannot be reached (before a watch drew anything).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Protocol, TextIO

from swarmpipe.errors import ConfigError, CoordinatorUnavailable, SwarmpipeError

if TYPE_CHECKING:
    import grpc

    from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc

DEFAULT_COORDINATOR = "127.0.0.1:7600"
"""The coordinator's default `--listen` port, on this machine: where an organiser is."""

CALL_TIMEOUT_S = 10.0
"""How long one Status or Drain call may take. Status is built from memory in one pass, so a
coordinator that has not answered in this long is stuck or unreachable."""

DEFAULT_WATCH_S = 2.0
ADMIN_TOKEN_ENV = "SWARMPIPE_ADMIN_TOKEN_FILE"
CA_FILE_ENV = "SWARMPIPE_CA_FILE"

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")
_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def check_address(address: str) -> str:
    match = _ADDRESS.match(address)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"--coordinator {address!r} must be HOST:PORT, e.g. 127.0.0.1:7600")
    return address


class CoordinatorConnection:
    """One channel to the coordinator's API, with its failures turned into our errors."""

    def __init__(self, address: str, admin_token: str = "", ca_pem: bytes = b"") -> None:
        import grpc

        from swarmpipe.protos import coordinator_pb2_grpc
        from swarmpipe.transport.auth import ADMIN_TOKEN_KEY
        from swarmpipe.transport.rpc import CHANNEL_OPTIONS
        from swarmpipe.transport.tls import COORDINATOR_NAME, ChannelTLS

        self.address = check_address(address)
        self._metadata = ((ADMIN_TOKEN_KEY, admin_token),) if admin_token else None
        self._tls = bool(ca_pem)
        if ca_pem:
            tls = ChannelTLS(ca_pem, COORDINATOR_NAME)
            self._channel = grpc.secure_channel(
                address, tls.credentials(), options=[*CHANNEL_OPTIONS, *tls.options()]
            )
        else:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub: coordinator_pb2_grpc.CoordinatorStub = coordinator_pb2_grpc.CoordinatorStub(
            self._channel
        )

    def close(self) -> None:
        self._channel.close()

    def _failed(self, call: str, exc: grpc.RpcError) -> SwarmpipeError:
        import grpc

        code = exc.code()
        details = " ".join(str(exc.details() or code.name).split())
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            hint = "" if self._tls else " (a coordinator started with --tls needs --ca-file)"
            return CoordinatorUnavailable(
                f"no coordinator answers at {self.address} ({details}); is it running, and is "
                f"the address right?{hint}"
            )
        return SwarmpipeError(f"the coordinator at {self.address} refused {call}: {details}")

    def status(self) -> coordinator_pb2.StatusReply:
        import grpc

        from swarmpipe.protos import coordinator_pb2

        try:
            reply: coordinator_pb2.StatusReply = self._stub.Status(
                coordinator_pb2.StatusRequest(), timeout=CALL_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._failed("Status", exc) from None
        return reply

    def move(self, node_id: str, stage: int) -> int:
        """Move `node_id` to `stage`; returns the stage it served. The coordinator's refusals
        (unknown node, no such stage, the last replica of a stage) are one-line errors."""
        import grpc

        from swarmpipe.protos import coordinator_pb2

        try:
            reply = self._stub.Move(
                coordinator_pb2.MoveRequest(node_id=node_id, stage=stage),
                timeout=CALL_TIMEOUT_S,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise self._failed("Move", exc) from None
            raise SwarmpipeError(" ".join(str(exc.details() or exc.code().name).split())) from None
        return int(reply.from_stage)

    def drain(self, node_id: str) -> bool:
        """Drain `node_id`; False when the coordinator does not know it."""
        import grpc

        from swarmpipe.protos import coordinator_pb2

        try:
            self._stub.Drain(
                coordinator_pb2.DrainRequest(node_id=node_id),
                timeout=CALL_TIMEOUT_S,
                metadata=self._metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return False
            raise self._failed("Drain", exc) from None
        return True


# -- status -----------------------------------------------------------------


class StatusSource(Protocol):
    """Where `show_status` gets the swarm from: a `CoordinatorConnection`, or a test's."""

    def status(self) -> coordinator_pb2.StatusReply: ...


def _render(status: coordinator_pb2.StatusReply, *, as_json: bool, one_line: bool) -> str:
    from swarmpipe.control.status_view import status_table, status_view

    view = status_view(status)
    if as_json:
        return json.dumps(view, indent=None if one_line else 2)
    return "\n".join(status_table(view))


def show_status(
    connection: StatusSource, *, as_json: bool, watch: float | None, out: TextIO
) -> int:
    """Print the swarm once, or every `watch` seconds until the run is done."""
    if watch is None:
        print(_render(connection.status(), as_json=as_json, one_line=False), file=out)
        return 0
    redraw = out.isatty() and not as_json
    drawn = 0
    while True:
        try:
            status = connection.status()
        except CoordinatorUnavailable as exc:
            if not drawn:
                raise
            print(f"{time.strftime('%H:%M:%S')} {exc}; asking again", file=out, flush=True)
        else:
            text = _render(status, as_json=as_json, one_line=True)
            if redraw:
                then = "the run is done" if status.done else f"every {watch:g} s; Ctrl-C stops"
                footer = f"\n\n{time.strftime('%H:%M:%S')}, {then}"
                out.write(_CLEAR + text + footer + "\n")
            else:
                out.write(("\n" if drawn and not as_json else "") + text + "\n")
            out.flush()
            drawn += 1
            if status.done:
                return 0  # nothing changes any more
        time.sleep(watch)


def _watch_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be above 0 seconds")
    return seconds


def add_admin_token_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-token-file",
        default=os.environ.get(ADMIN_TOKEN_ENV, ""),
        metavar="PATH",
        help="the organiser's token: <state-dir>/admin-token of the coordinator, needed when "
        f"the run has join tokens (default: ${ADMIN_TOKEN_ENV}, else "
        f"{DEFAULT_ADMIN_TOKEN_FILE} when it exists)",
    )


DEFAULT_ADMIN_TOKEN_FILE = "swarmpipe-state/admin-token"
"""Where a coordinator started here with its default --state-dir keeps it."""


def read_admin_token(path: str) -> str:
    """The organiser's token in `path` (no path: the default state dir's, if there is one;
    else ""); ConfigError if unreadable."""
    if not path:
        if not os.path.exists(DEFAULT_ADMIN_TOKEN_FILE):
            return ""
        path = DEFAULT_ADMIN_TOKEN_FILE
    try:
        token = open(path).read().strip()
    except OSError as exc:
        raise ConfigError(f"--admin-token-file {path}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"--admin-token-file {path} is empty")
    return token


def _add_coordinator(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        default=DEFAULT_COORDINATOR,
        metavar="HOST:PORT",
        help=f"the coordinator's gRPC API (default {DEFAULT_COORDINATOR})",
    )
    add_admin_token_argument(parser)
    parser.add_argument(
        "--ca-file",
        default=os.environ.get(CA_FILE_ENV, ""),
        metavar="PATH",
        help="the run CA (<state-dir>/ca.pem) of a coordinator started with --tls "
        f"(default: ${CA_FILE_ENV})",
    )


def _connect(args: argparse.Namespace) -> CoordinatorConnection:
    ca_pem = b""
    if args.ca_file:
        from swarmpipe.transport.tls import read_ca_file

        ca_pem = read_ca_file(args.ca_file)
    return CoordinatorConnection(
        args.coordinator, read_admin_token(args.admin_token_file), ca_pem=ca_pem
    )


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    from swarmpipe.control.status_view import BOTTLENECK_RULE, RECENT_STEPS

    parser.epilog = (
        f"samples/s in the header is over the last {RECENT_STEPS} finished steps. "
        + BOTTLENECK_RULE.replace("%", "%%")
    )
    _add_coordinator(parser)
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (keys in control/status_view.py) instead of the table",
    )
    parser.add_argument(
        "--watch",
        nargs="?",
        type=_watch_seconds,
        const=DEFAULT_WATCH_S,
        metavar="SECONDS",
        help=f"redraw every SECONDS (default {DEFAULT_WATCH_S:g}) until the run is done or "
        "Ctrl-C (exit 0); not a terminal: a new table after a blank line each time (with "
        "--json, one object a line)",
    )


def serve_status(args: argparse.Namespace) -> int:
    connection = _connect(args)
    try:
        return show_status(connection, as_json=args.json, watch=args.watch, out=sys.stdout)
    except KeyboardInterrupt:
        print(file=sys.stderr)  # end the line the terminal echoed ^C on
        return 0
    except BrokenPipeError:
        # `swarmpipe status | head`: the reader has what it wanted. Point stdout at
        # /dev/null so that Python's flush at exit does not fail a second time.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    finally:
        connection.close()


# -- drain ------------------------------------------------------------------


def add_drain_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", metavar="NODE", help="the node's id, as `swarmpipe status` shows")
    _add_coordinator(parser)


def serve_drain(args: argparse.Namespace) -> int:
    connection = _connect(args)
    try:
        before = connection.status()
        if not connection.drain(args.node):
            raise SwarmpipeError(f"no node {args.node!r} in run {before.run_id!r}")
    finally:
        connection.close()
    record = next((n for n in before.nodes if n.node_id == args.node), None)
    where = f"{args.node} (stage {record.stage})" if record else args.node
    if record is not None and not record.online:
        print(f"{where} was already offline; it stays out of the plan of run {before.run_id!r}")
    else:
        print(
            f"drained {where} from run {before.run_id!r}: the samples it held go back to the "
            "queue, and it leaves now"
        )
        if record is not None and not any(
            n.stage == record.stage and n.serving and n.node_id != args.node for n in before.nodes
        ):
            print(f"stage {record.stage} has no other replica: the run waits for a node to join it")
    return 0


def add_move_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node", metavar="NODE", help="the node's id, as `swarmpipe status` shows")
    parser.add_argument("stage", metavar="STAGE", type=int, help="the stage it should serve")
    _add_coordinator(parser)


def serve_move(args: argparse.Namespace) -> int:
    if args.stage < 0:
        raise ConfigError(f"STAGE {args.stage}: stages are numbered from 0")
    connection = _connect(args)
    try:
        before = connection.move(args.node, args.stage)
    finally:
        connection.close()
    print(
        f"moving {args.node} from stage {before} to stage {args.stage}: it fetches the stage's "
        "state, then serves it (`swarmpipe status` shows when)"
    )
    return 0


# -- the subcommands, as cli.py's COMMANDS names them -----------------------


class StatusCommand:
    """`swarmpipe status`: the swarm as a table (header, stages with their replicas and the
    bottleneck, links with the codec each uses now), or as JSON with --json; --watch
    redraws it."""

    add_arguments = staticmethod(add_status_arguments)
    serve = staticmethod(serve_status)


class DrainCommand:
    """`swarmpipe drain NODE`: take a node out of the run. The samples it leased go back to
    the queue and it leaves at once, exiting 0; its stage's other replicas carry on."""

    add_arguments = staticmethod(add_drain_arguments)
    serve = staticmethod(serve_drain)


class MoveCommand:
    """`swarmpipe move NODE STAGE`: an operator's override. The node leaves its stage's plan,
    fetches STAGE's state from a live replica (or its newest checkpoint) and serves it."""

    add_arguments = staticmethod(add_move_arguments)
    serve = staticmethod(serve_move)
