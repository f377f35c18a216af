"""`swarmpipe node --coordinator HOST:PORT`: run one node daemon.

Exit codes: 0 when the run finished, the node was drained, or it got
SIGTERM/SIGINT; 2 for bad arguments or config; 3 when the coordinator cannot
be reached; 4 when the run does not admit the node (no valid join token) or the
organiser revoked its token; 1 for anything unexpected (a clean stop that outlasts
`STOP_BUDGET_S` among them); a second SIGTERM/SIGINT exits at once with 128 + the
signal's number (process/shutdown.py).

The join token comes from `--token-file PATH`, else `$SWARMPIPE_TOKEN`, else `--token`
(which any user of the machine can read in `ps`, hence the warning).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from swarmpipe.config import check_device_spec
from swarmpipe.errors import ConfigError, CoordinatorUnavailable, NotAdmitted
from swarmpipe.process.metrics_flags import add_metrics_arguments, metrics_endpoint
from swarmpipe.transport.limits import MBIT, check_latency_ms, check_limit

logger = logging.getLogger(__name__)

STOP_BUDGET_S = 60.0
"""The most a clean stop may take after SIGTERM/SIGINT (process/shutdown.py): up to 30 s
letting the microbatches in flight finish (node/daemon.py, DRAIN_TIMEOUT_S), then the
goodbye over MQTT and closing the servers."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--coordinator", required=True, help="host:port of the coordinator")
    parser.add_argument(
        "--node-id", default="", help="stable name of this node (default: host-pid)"
    )
    parser.add_argument(
        "--listen",
        default="",
        help="host:port of the Stage server (default: port 0 on 127.0.0.1 when the "
        "coordinator is on this machine, else on 0.0.0.0)",
    )
    parser.add_argument("--advertise-host", default="", help="host peers use to reach this node")
    parser.add_argument(
        "--broker", default="", help="mqtt://host:port overriding the coordinator's"
    )
    parser.add_argument("--join-timeout", type=float, default=30.0, help="seconds to wait to join")
    parser.add_argument(
        "--broker-retry",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="first wait before trying the MQTT broker again at start; doubles each of 4 tries",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--compute-slowdown",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="make this node's compute FACTOR times slower, to try a slow machine on a fast "
        "one (the testnet's --node-profile slow:FACTOR)",
    )
    parser.add_argument("--ready-file", default="", help="write the bound port here as JSON")
    parser.add_argument(
        "--link-mbit",
        type=float,
        default=None,
        help="limit what this node sends to each peer to this many Mbit/s (0: unlimited); "
        "overrides the run's pipeline.link_mbit",
    )
    parser.add_argument(
        "--token-file",
        default="",
        metavar="PATH",
        help="file holding the run's join token (`swarmpipe token create`); or set SWARMPIPE_TOKEN",
    )
    parser.add_argument(
        "--token", default="", help="the join token itself (visible in `ps`: prefer --token-file)"
    )
    parser.add_argument(
        "--device",
        default="",
        metavar="auto|cpu|cuda|cuda:N",
        help="where this node's stage trains (auto: the GPU with the least memory in use, "
        "else the CPU); default: the run's train.device",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="delay what this node sends to each peer by this many ms one way (0: none); "
        "overrides the run's pipeline.link_latency_ms",
    )
    parser.add_argument(
        "--ca-file",
        default="",
        metavar="PATH",
        help="the run CA's certificate (the coordinator's <state-dir>/ca.pem): TLS to the "
        "coordinator and mutual TLS with peers",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving without TLS beyond loopback (prints a warning)",
    )
    add_metrics_arguments(parser)


TOKEN_ENV = "SWARMPIPE_TOKEN"


def join_token(args: argparse.Namespace) -> str:
    """The join token from --token-file, $SWARMPIPE_TOKEN or --token, in that order."""
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(f"--token-file {args.token_file}: {exc.strerror}") from None
        if not token:
            raise ConfigError(f"--token-file {args.token_file} is empty")
        return token
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    if args.token:
        logging.getLogger(__name__).warning(
            "--token shows the join token to every user of this machine (ps); "
            "prefer --token-file or %s",
            TOKEN_ENV,
        )
    return str(args.token).strip()


async def serve(args: argparse.Namespace) -> int:
    from swarmpipe.process.shutdown import StopSignals

    # Before torch is imported (seconds): a SIGTERM meanwhile stops the node once it is built.
    signals = StopSignals(budget_s=STOP_BUDGET_S)
    signals.install()
    metrics = metrics_endpoint(args)
    from swarmpipe.control.link_control import ALL

    if args.link_mbit is not None:
        check_limit(args.link_mbit * MBIT, what=f"--link-mbit {args.link_mbit}")
    if args.latency_ms is not None:
        check_latency_ms(args.latency_ms, what=f"--latency-ms {args.latency_ms:g}")
    if not 1.0 <= args.compute_slowdown <= 1000.0:
        raise ConfigError(f"--compute-slowdown {args.compute_slowdown:g}: give 1 to 1000")
    if not 0 < args.broker_retry <= 600:
        raise ConfigError(f"--broker-retry {args.broker_retry:g}: give 0 < seconds <= 600")
    if args.node_id == ALL:
        raise ConfigError(f"--node-id {ALL!r} is reserved: it addresses every node of a run")
    if args.device:  # a misspelt one is refused at once; whether it is here needs torch
        check_device_spec(args.device, what="--device")
    # Imported only now: the daemon imports torch (seconds on a loaded machine), which
    # `swarmpipe node --help` and a bad flag above must not wait for (process/subcommands.py).
    from swarmpipe.node.daemon import NodeDaemon, NodeOptions, default_node_id, set_torch_threads
    from swarmpipe.process.logs import set_log_identity
    from swarmpipe.transport import tls

    if args.device:
        # Before anything is joined: a node that cannot train where it was told to leaves
        # no trace in the swarm.
        from swarmpipe.node.device import resolve_device

        resolve_device(args.device)
    token = join_token(args)
    if not args.listen:
        # A coordinator on loopback means a swarm on this machine: no peer could reach the
        # node beyond it, and plaintext there needs no --insecure.
        local = tls.is_loopback(args.coordinator.rpartition(":")[0])
        args.listen = "127.0.0.1:0" if local else "0.0.0.0:0"
    ca_pem = b""
    if args.ca_file:
        ca_pem = tls.read_ca_file(args.ca_file)
        logger.info("TLS: trusting the run CA %s (%s)", tls.fingerprint(ca_pem), args.ca_file)
    else:
        tls.check_plaintext(
            {"the Stage server": args.listen}, insecure=args.insecure, logger=logger
        )
    set_torch_threads(args.threads)
    options = NodeOptions(
        coordinator=args.coordinator,
        node_id=args.node_id or default_node_id(),
        listen=args.listen,
        advertise_host=args.advertise_host,
        broker=args.broker,
        join_timeout_s=args.join_timeout,
        broker_retry_s=args.broker_retry,
        compute_slowdown=args.compute_slowdown,
        ready_file=args.ready_file,
        link_mbit=args.link_mbit,
        latency_ms=args.latency_ms,
        metrics=metrics,
        token=token,
        device=args.device,
        ca_pem=ca_pem,
    )
    # Until it knows its stage (daemon.py adds it at Join), a node's lines carry its id.
    set_log_identity(f"node {options.node_id}", node=options.node_id)
    daemon = NodeDaemon(options)
    signals.connect(daemon.stop)
    try:
        await daemon.run()
    except CoordinatorUnavailable as exc:
        if args.ca_file:
            raise
        # A TLS coordinator looks, to a plaintext client, like one that never answers.
        raise CoordinatorUnavailable(f"{exc} (with --tls it needs --ca-file)") from None
    if daemon.revoked:
        raise NotAdmitted("the organiser revoked this node's join token; it left the run")
    return 1 if daemon.failed else 0
