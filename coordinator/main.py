"""`swarmpipe coordinator`: run the coordinator, with an embedded MQTT broker by default.

When the run is done (every stage's final state stored), the coordinator waits for the nodes
to leave (they need its embedded broker to hear that the run is done; at most
`LEAVE_GRACE_S`), prints a one-screen summary on stdout and exits 0; `--stay` keeps it
serving Status instead, until SIGTERM/SIGINT.

Exit codes: 0 when the run is done or after SIGTERM/SIGINT, 2 for a configuration error,
1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
from pathlib import Path

from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.errors import ConfigError
from swarmpipe.process.metrics_flags import add_metrics_arguments, metrics_endpoint

logger = logging.getLogger(__name__)

LEAVE_GRACE_S = 15.0
"""How long a finished coordinator waits for its nodes to leave before it exits."""


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
    endpoint = metrics_endpoint(args)
    # Imported here, not above: grpc, the broker and the MQTT client take a while to
    # import, which `swarmpipe coordinator --help` must not wait for (process/subcommands.py).
    from swarmpipe.control.bus import BrokerAddress, parse_broker_url
    from swarmpipe.control.mqtt_acl import COORDINATOR_USER
    from swarmpipe.coordinator import run_state
    from swarmpipe.coordinator.admission import Admission, is_loopback
    from swarmpipe.coordinator.broker import EmbeddedBroker
    from swarmpipe.coordinator.metrics import coordinator_families
    from swarmpipe.coordinator.service import CoordinatorService
    from swarmpipe.coordinator.summary import summary_lines
    from swarmpipe.process.metrics import MetricsServer, serve_metrics
    from swarmpipe.process.ready import write_ready_file
    from swarmpipe.protos import coordinator_pb2
    from swarmpipe.transport import tls
    from swarmpipe.transport.auth import AuthInterceptor
    from swarmpipe.transport.request_parsing import add_servicer
    from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection

    if bool(args.tls_ca_cert) != bool(args.tls_ca_key):
        raise ConfigError("--tls-ca-cert and --tls-ca-key go together")
    if args.tls_ca_cert and not args.tls:
        raise ConfigError("--tls-ca-cert needs --tls")
    state_dir = Path(args.state_dir)
    resume_at = 0
    if args.resume:
        if args.config:
            raise ConfigError("--resume takes the recorded run's config; use --set to change it")
        run_id = next((s.partition("=")[2] for s in args.set if s.startswith("run_id=")), None)
        config, resume_at = run_state.resume(state_dir, list(args.set), run_id)
        logger.info(
            "resuming run %r from step %d (its last complete step) to %d",
            config.run_id,
            resume_at,
            config.train.steps,
        )
    else:
        config = load_config(args.config, args.set)
    _check_plaintext(args)
    if not args.resume:
        run_state.start(state_dir, config)
    hosts = [_split_hostport(args.listen)[0]]
    if not args.broker:
        hosts.append(_split_hostport(args.broker_listen)[0])
    admission = Admission(
        state_dir, config.run_id, loopback_only=all(is_loopback(h) for h in hosts)
    )
    ca: tls.RunCA | None = None
    server_creds = None
    ca_file = ""
    tls_files: tuple[Path, Path] | None = None
    if args.tls:
        if args.tls_ca_cert:
            ca = tls.RunCA.load(args.tls_ca_cert, args.tls_ca_key)
            ca_file = str(Path(args.tls_ca_cert).resolve())
        else:
            ca = tls.RunCA.load_or_create(state_dir, config.run_id)
            ca_file = str((state_dir / tls.CA_CERT_FILE).resolve())
        server_key = tls.new_key()
        names = [_split_hostport(args.listen)[0], *tls.local_names(), *args.tls_host]
        if not args.broker:
            broker_names = [_split_hostport(args.broker_listen)[0], *names[1:]]
            tls_files = tls.write_broker_files(ca, broker_names, state_dir)
        server_creds = tls.server_credentials(
            tls.key_pem(server_key), ca.issue_server(names, server_key)
        )
        logger.info("TLS with the run CA %s: nodes need --ca-file %s", ca.fingerprint, ca_file)
    embedded: EmbeddedBroker | None = None
    if args.broker:
        broker: BrokerAddress = parse_broker_url(args.broker)
    else:
        auth = admission.broker_auth()
        embedded = EmbeddedBroker(
            *_split_hostport(args.broker_listen),
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
    service = CoordinatorService(
        config, broker, state_dir, resume_at=resume_at, admission=admission, ca=ca
    )
    server = create_server(AuthInterceptor(admission.policy))
    add_servicer(server, service, coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"])
    await enable_health_and_reflection(
        server, [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]
    )
    port = bind(server, args.listen, server_creds)
    metrics: MetricsServer | None = None
    if endpoint is not None:
        stages = config.pipeline.stages
        metrics = serve_metrics(
            *endpoint,
            lambda: coordinator_families(service.status(), stages=stages),
        )
        logger.info("metrics on %s", metrics.url)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(service.watch_mqtt())
    revocations = asyncio.create_task(service.watch_tokens())
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
                    "ca_file": ca_file,
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
    finally:
        revocations.cancel()
        watch.cancel()
        # Its exception, if any, was raised above; the server must stop all the same.
        await asyncio.gather(watch, return_exceptions=True)
        await server.stop(grace=2.0)
        if metrics is not None:
            metrics.close()
        if embedded is not None:
            await embedded.stop()
    return 0
