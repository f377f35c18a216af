"""`swarmpipe coordinator`: run the coordinator, with an embedded MQTT broker by default.

When the run is done (every stage's final state stored), the coordinator waits for the nodes
to leave (they need its embedded broker to hear that the run is done; at most
`LEAVE_GRACE_S`), prints a one-screen summary on stdout and exits 0; `--stay` keeps it
serving Status instead, until SIGTERM/SIGINT.

Exit codes: 0 when the run is done or after SIGTERM/SIGINT, 2 for a configuration error,
1 otherwise (a clean stop that outlasts `STOP_BUDGET_S` among them); a second SIGTERM/SIGINT
exits at once with 128 + the signal's number (process/shutdown.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from swarmpipe.config import RunConfig, add_config_arguments, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.process.metrics_flags import add_metrics_arguments, metrics_endpoint

if TYPE_CHECKING:
    from swarmpipe.coordinator.service import CoordinatorService
    from swarmpipe.coordinator.state_db import StateDB
    from swarmpipe.transport.run_ca import RunCA

logger = logging.getLogger(__name__)

LEAVE_GRACE_S = 15.0
"""How long a finished coordinator waits for its nodes to leave before it exits."""
STOP_STEP_S = 5.0
"""The most each part of the clean stop (the background tasks, the gRPC server, the
embedded broker) may take; past it the stop goes on without that part."""
STOP_BUDGET_S = 30.0
"""The most the whole clean stop may take after SIGTERM/SIGINT (process/shutdown.py): its
parts take 3 * STOP_STEP_S at most, and docker kills a container 10 s after its SIGTERM."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument(
        "--listen", default="0.0.0.0:7600", help="host:port of the gRPC API (port 0: any free)"
    )
    parser.add_argument(
        "--broker", help="mqtt://host:port of an external broker; default: embed one"
    )
    parser.add_argument(
        "--broker-listen",
        default="127.0.0.1:0",
        help="host:port of the embedded broker (use 0.0.0.0:1883 for remote volunteers)",
    )
    parser.add_argument(
        "--state-dir",
        default="swarmpipe-state",
        help="folder for what outlives the nodes: stage checkpoints (default: ./swarmpipe-state)",
    )
    parser.add_argument("--ready-file", help="write the bound ports here as JSON once serving")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the run recorded in --state-dir from its last complete step "
        "(--set overrides it, e.g. train.steps=N to train further)",
    )
    parser.add_argument(
        "--stay",
        action="store_true",
        help="keep serving Status after the run is done (default: print a summary and exit)",
    )
    tls = parser.add_argument_group("TLS (transport/tls.py)")
    tls.add_argument(
        "--tls",
        action="store_true",
        help="serve gRPC over TLS with the run CA (<state-dir>/ca.pem, made on first start); "
        "nodes need that ca.pem as --ca-file",
    )
    tls.add_argument("--tls-ca-cert", default="", help="PEM CA certificate you bring (with --tls)")
    tls.add_argument("--tls-ca-key", default="", help="its EC private key (PEM, unencrypted)")
    tls.add_argument(
        "--tls-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a DNS name or IP nodes dial, added to the coordinator's certificate (repeatable)",
    )
    tls.add_argument(
        "--insecure",
        action="store_true",
        help="allow serving without TLS beyond loopback (prints a warning)",
    )
    add_metrics_arguments(parser)


def _split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def _check_plaintext(args: argparse.Namespace) -> None:
    """Refuse plaintext beyond loopback unless --insecure (transport/tls.py)."""
    from swarmpipe.control.bus import parse_broker_url
    from swarmpipe.transport.tls import check_plaintext

    listening = {}
    if not args.tls:
        listening["the gRPC API"] = args.listen
        if not args.broker:
            listening["the embedded broker"] = args.broker_listen
    if args.broker:
        external = parse_broker_url(args.broker)
        if not external.tls:
            # Not a listener, but the run's MQTT passwords cross the same open wire.
            listening["the MQTT connection to"] = f"{external.host}:{external.port}"
    check_plaintext(listening, insecure=args.insecure, logger=logger)


async def serve(args: argparse.Namespace) -> int:
    from swarmpipe.process.shutdown import StopSignals

    # First of all, so that a SIGTERM during start-up (slow imports, the first join token,
    # the broker starting) stops the coordinator cleanly once start-up is over.
    stop = asyncio.Event()
    signals = StopSignals(budget_s=STOP_BUDGET_S)
    signals.install()
    signals.connect(lambda _name: stop.set())
    endpoint = metrics_endpoint(args)
    # Imported here, not above: grpc, the broker and the MQTT client take a while to
    # import, which `swarmpipe coordinator --help` must not wait for (process/subcommands.py).
    from swarmpipe.control.bus import BrokerAddress
    from swarmpipe.coordinator.admission import Admission
    from swarmpipe.coordinator.service import CoordinatorService
    from swarmpipe.transport.tls import is_loopback

    if bool(args.tls_ca_cert) != bool(args.tls_ca_key):
        raise ConfigError("--tls-ca-cert and --tls-ca-key go together")
    if args.tls_ca_cert and not args.tls:
        raise ConfigError("--tls-ca-cert needs --tls")
    if not args.resume:
        load_config(args.config, args.set)  # a bad key is named before plaintext is refused
    # Before the state folder is touched: a refused start leaves nothing behind.
    _check_plaintext(args)
    state_dir = Path(args.state_dir)
    config, resume_at, db = open_state(args, state_dir)
    try:
        hosts = [_split_hostport(args.listen)[0]]
        if not args.broker:
            hosts.append(_split_hostport(args.broker_listen)[0])
        admission = Admission(
            state_dir, config.run_id, loopback_only=all(is_loopback(h) for h in hosts)
        )
        # The broker is known once the embedded one listens (_serve).
        service = CoordinatorService(
            config,
            BrokerAddress(host="", port=0),
            state_dir,
            resume_at=resume_at,
            admission=admission,
            state_db=db,
            ca=_run_ca(args, state_dir, config.run_id),
        )
        live = service.restore()
        grpc_port, broker_port = db.ports() if live else (0, 0)
        listen, broker_listen = args.listen, args.broker_listen
        # A coordinator started again listens where its nodes expect it, unless told where.
        if grpc_port and _split_hostport(listen)[1] == 0:
            listen = f"{_split_hostport(listen)[0]}:{grpc_port}"
        if broker_port and _split_hostport(broker_listen)[1] == 0:
            broker_listen = f"{_split_hostport(broker_listen)[0]}:{broker_port}"
        return await _serve(args, service, endpoint, listen, broker_listen, stop=stop)
    finally:
        db.close()


def _run_ca(args: argparse.Namespace, state_dir: Path, run_id: str) -> RunCA | None:
    """The run CA with --tls: the organiser's (--tls-ca-cert/--tls-ca-key), or the one this
    coordinator made in its state folder on first start; None without --tls."""
    if not args.tls:
        return None
    from swarmpipe.transport import tls

    if args.tls_ca_cert:
        return tls.RunCA.load(args.tls_ca_cert, args.tls_ca_key)
    return tls.RunCA.load_or_create(state_dir, run_id)


def _ca_file(args: argparse.Namespace) -> str:
    """The CA certificate nodes need as --ca-file."""
    from swarmpipe.transport import tls

    if args.tls_ca_cert:
        return str(Path(args.tls_ca_cert).resolve())
    return str((Path(args.state_dir) / tls.CA_CERT_FILE).resolve())


def open_state(args: argparse.Namespace, state_dir: Path) -> tuple[RunConfig, int, StateDB]:
    """The run to serve, the step a `--resume` opens at, and its state database.

    The rule: a state database of an unfinished run in `--state-dir` is resumed live (same
    step and phase, leases, counters, members), when the config given is the one it holds;
    `--resume` restarts from the last complete checkpoint set instead (the live state is
    dropped: the nodes are gone too); a finished run, or another run's state, is refused,
    unless that run never opened a step: then it holds nothing to lose and is replaced."""
    from swarmpipe.coordinator import run_state
    from swarmpipe.coordinator.state_db import StateDB, StateDBError, db_path
    from swarmpipe.coordinator.step_protocol import Phase

    path = db_path(state_dir)
    db = StateDB.open(path) if path.exists() else None
    try:
        if args.resume:
            if args.config:
                raise ConfigError(
                    "--resume takes the recorded run's config; use --set to change it"
                )
            run_id = next((s.partition("=")[2] for s in args.set if s.startswith("run_id=")), None)
            if db is not None and run_id is not None and db.run_id != run_id:
                raise StateDBError(_other_run(path, db.run_id))
            recorded = run_id or (db.run_id if db is not None else None)
            config, resume_at = run_state.resume(state_dir, list(args.set), recorded)
            logger.info(
                "resuming run %r from step %d (its last complete step) to %d",
                config.run_id,
                resume_at,
                config.train.steps,
            )
            if db is None:
                db = StateDB.create(path, config)
            else:
                db.reset(config)
            return config, resume_at, db
        config = load_config(args.config, args.set)
        if db is None:
            run_state.start(state_dir, config)
            return config, 0, StateDB.create(path, config)
        if db.run_id != config.run_id or db.config_json != config.to_json():
            if db.started:
                raise StateDBError(_other_run(path, db.run_id, same_id=db.run_id == config.run_id))
            # A coordinator stopped before its run opened step 0 left nothing to lose.
            run_state.start(state_dir, config)
            logger.info("replacing the state of run %r, which never started", db.run_id)
            db.reset(config)
            return config, 0, db
        if db.phase is Phase.DONE:
            raise StateDBError(
                f"run {db.run_id!r} in {state_dir} is finished (step {db.step}): pass --resume "
                f"--set train.steps=N with N > {db.step} to train it further, or give another "
                "--state-dir"
            )
        return config, 0, db
    except BaseException:
        if db is not None:
            db.close()
        raise


def _other_run(path: Path, run_id: str, *, same_id: bool = False) -> str:
    what = f"run {run_id!r} with another config" if same_id else f"run {run_id!r}"
    return (
        f"{path} holds the state of {what}; start that run again with its own config, "
        "or give another --state-dir"
    )


async def _serve(
    args: argparse.Namespace,
    service: CoordinatorService,
    endpoint: tuple[str, int] | None,
    listen: str,
    broker_listen: str,
    *,
    stop: asyncio.Event,
) -> int:
    from swarmpipe.control.bus import BrokerAddress, parse_broker_url
    from swarmpipe.control.mqtt_acl import COORDINATOR_USER
    from swarmpipe.coordinator.broker import EmbeddedBroker
    from swarmpipe.coordinator.metrics import coordinator_families
    from swarmpipe.coordinator.summary import summary_lines
    from swarmpipe.process.metrics import MetricsServer, serve_metrics
    from swarmpipe.process.ready import write_ready_file
    from swarmpipe.process.shutdown import bounded, stop_tasks
    from swarmpipe.protos import coordinator_pb2
    from swarmpipe.transport import tls
    from swarmpipe.transport.auth import AuthInterceptor
    from swarmpipe.transport.peer_limits import PeerLimiter, limits_for
    from swarmpipe.transport.request_parsing import add_servicer
    from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection

    config = service.config
    admission = service.admission
    ca = service.ca
    server_creds = None
    tls_files: tuple[Path, Path] | None = None
    if ca is not None:
        server_key = tls.new_key()
        names = [_split_hostport(listen)[0], *tls.local_names(), *args.tls_host]
        if not args.broker:
            broker_names = [_split_hostport(broker_listen)[0], *names[1:]]
            tls_files = tls.write_broker_files(ca, broker_names, service.state_dir)
        server_creds = tls.server_credentials(
            tls.key_pem(server_key), ca.issue_server(names, server_key)
        )
        logger.info(
            "TLS with the run CA %s: nodes need --ca-file %s", ca.fingerprint, _ca_file(args)
        )
    embedded: EmbeddedBroker | None = None
    if args.broker:
        broker: BrokerAddress = parse_broker_url(args.broker)
    else:
        auth = admission.broker_auth()
        embedded = EmbeddedBroker(
            *_split_hostport(broker_listen),
            auth=auth,
            tls_files=(str(tls_files[0]), str(tls_files[1])) if tls_files else None,
        )
        broker = await embedded.start()
        if auth is not None:
            broker = dataclasses.replace(
                broker,
                username=COORDINATOR_USER,
                password=admission.key.mqtt_password(COORDINATOR_USER),
            )
    if ca is not None:
        broker = dataclasses.replace(broker, ca_pem=ca.cert_pem)
    service.broker = broker
    limiter = PeerLimiter(limits_for(service.config.pipeline), admission.caller)
    server = create_server(AuthInterceptor(admission.policy), limiter=limiter)
    add_servicer(server, service, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"])
    await enable_health_and_reflection(
        server, [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]
    )
    port = bind(server, listen, server_creds)
    assert service.db is not None
    service.db.set_ports(port, 0 if args.broker else broker.port)
    metrics: MetricsServer | None = None
    if endpoint is not None:
        stages = config.pipeline.stages
        metrics = serve_metrics(
            *endpoint,
            lambda: coordinator_families(service.status(), stages=stages),
        )
        logger.info("metrics on %s", metrics.url)
    watch = asyncio.create_task(service.watch_mqtt())
    revocations = asyncio.create_task(service.watch_tokens())
    grace = asyncio.create_task(service.wait_for_members())
    rebalancing = asyncio.create_task(service.rebalance_loop())
    applies = asyncio.create_task(service.watch_applies())
    try:
        await server.start()
        logger.info(
            "coordinator of run %r serving on port %d, broker %s, %d stages, %d steps",
            config.run_id,
            port,
            broker.url,
            config.pipeline.stages,
            config.train.steps,
        )
        if args.ready_file:
            write_ready_file(
                args.ready_file,
                {
                    "grpc_port": port,
                    "broker_url": broker.url,
                    "pid": os.getpid(),
                    "metrics_port": metrics.port if metrics else None,
                    "ca_file": _ca_file(args) if ca is not None else "",
                },
            )
        stopper = asyncio.create_task(stop.wait())
        waiting = {stopper, watch}
        if not args.stay:
            waiting.add(asyncio.create_task(service.finished(LEAVE_GRACE_S)))
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in waiting - done:
            task.cancel()
        if watch.done() and not watch.cancelled():
            watch.result()  # re-raise whatever ended the MQTT watch
        if service.done.is_set():
            print("\n".join(summary_lines(service.status())), flush=True)
        logger.info("stopping")
        costs = service.db.commit_seconds if service.db is not None else []
        if costs:
            logger.info(
                "state database: last %d transactions took %.2f ms on average, %.2f ms at most",
                len(costs),
                1e3 * sum(costs) / len(costs),
                1e3 * max(costs),
            )
    finally:
        # Every part is bounded: a stop that waits on a part that never ends is a
        # coordinator that ignores SIGTERM (process/shutdown.py).
        # The watch's exception, if any, was raised above; the rest must stop all the same.
        await stop_tasks(
            (revocations, grace, rebalancing, applies, watch),
            STOP_STEP_S,
            "the MQTT watch and the background tasks",
        )
        await bounded(server.stop(grace=2.0), STOP_STEP_S, "the gRPC server")
        if metrics is not None:
            metrics.close()
        if embedded is not None:
            await bounded(embedded.stop(), STOP_STEP_S, "the embedded MQTT broker")
    return 0
