"""`swarmpipe coordinator`: run the coordinator, with an embedded MQTT broker by default.

Exit codes: 0 after SIGTERM/SIGINT, 2 for a configuration error, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

from swarmpipe.config import add_config_arguments, load_config
from swarmpipe.process.metrics_flags import add_metrics_arguments, metrics_endpoint

logger = logging.getLogger(__name__)


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
    add_metrics_arguments(parser)


def _split_hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


async def serve(args: argparse.Namespace) -> int:
    endpoint = metrics_endpoint(args)
    # Imported here, not above: grpc, the broker and the MQTT client take a while to
    # import, which `swarmpipe coordinator --help` must not wait for (process/subcommands.py).
    from swarmpipe.control.bus import BrokerAddress, parse_broker_url
    from swarmpipe.coordinator.broker import EmbeddedBroker
    from swarmpipe.coordinator.metrics import coordinator_families
    from swarmpipe.coordinator.service import CoordinatorService
    from swarmpipe.process.metrics import MetricsServer, serve_metrics
    from swarmpipe.process.ready import write_ready_file
    from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
    from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection

    config = load_config(args.config, args.set)
    embedded: EmbeddedBroker | None = None
    if args.broker:
        broker: BrokerAddress = parse_broker_url(args.broker)
    else:
        embedded = EmbeddedBroker(*_split_hostport(args.broker_listen))
        broker = await embedded.start()
    service = CoordinatorService(config, broker, args.state_dir)
    server = create_server()
    coordinator_pb2_grpc.add_CoordinatorServicer_to_server(service, server)
    await enable_health_and_reflection(
        server, [coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name]
    )
    port = bind(server, args.listen)
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
                },
            )
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({stopper, watch}, return_when=asyncio.FIRST_COMPLETED)
        if watch.done():
            watch.result()  # re-raise whatever ended the MQTT watch
        logger.info("stopping")
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
        await server.stop(grace=2.0)
        if metrics is not None:
            metrics.close()
        if embedded is not None:
            await embedded.stop()
    return 0
