"""The node daemon: join, build the stage, serve it, train, and leave cleanly.

Lifecycle: bind the Stage server (port 0 is fine), join the coordinator over
gRPC (which returns the run spec and this node's stage), build the stage,
announce presence on MQTT with a Last Will, bring the stage's state up to
the swarm's step (node/state_transfer.py: from a live replica, a checkpoint,
or the seed before the run starts) and get accepted into the plan, then
serve, lead (stage 0), apply optimizer steps as the coordinator announces
them and checkpoint every few steps, until the run is done, the node is
drained, or it gets SIGTERM/SIGINT (drain in-flight work, then exit 0).
Until it is accepted the node refuses microbatches and takes no part in
the reduce: its parameters are not the stage's yet.

The daemon owns the lifecycle and the MQTT session; the parts it builds after
Join (head, Stage servicer, replica sync, state transfer, checkpointer) each
get only the `StageContext` (node/context.py) and the parts they call, and
the shared mutable state lives in one `NodeStatus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import aiomqtt
import grpc
import torch
from prometheus_client.core import Metric

from swarmpipe import __version__
from swarmpipe.config import RunConfig
from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
from swarmpipe.control.link_control import LinkSettings, describe
from swarmpipe.errors import PeerError, SwarmpipeError
from swarmpipe.node import calibration, fault_points
from swarmpipe.node.checkpointing import Checkpointer
from swarmpipe.node.compute import BACKWARD, ComputeWorker
from swarmpipe.node.context import CoordinatorClient, NodeStatus, StageContext
from swarmpipe.node.device import describe_device, resolve_device
from swarmpipe.node.head import Head
from swarmpipe.node.links import Links
from swarmpipe.node.metrics import node_families
from swarmpipe.node.peer_admission import PeerAdmission
from swarmpipe.node.replica_sync import ReplicaSync
from swarmpipe.node.router import Router
from swarmpipe.node.server import StageServicer
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.state_transfer import StateTransfer
from swarmpipe.node.tensor_guard import PeerReporter, TensorGuard
from swarmpipe.node.transport import EncodeOptions, LinkStats
from swarmpipe.process.logs import set_log_identity
from swarmpipe.process.metrics import MetricsServer, serve_metrics
from swarmpipe.process.ready import write_ready_file
from swarmpipe.process.shutdown import stop_tasks
from swarmpipe.protos import control_pb2, coordinator_pb2, stage_pb2
from swarmpipe.transport import tls
from swarmpipe.transport.auth import CREDENTIAL_KEY, AuthInterceptor, CredentialHolder, Verifier
from swarmpipe.transport.limits import MBIT
from swarmpipe.transport.peer_limits import PeerLimiter, limits_for
from swarmpipe.transport.request_parsing import add_servicer
from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection, open_channel

logger = logging.getLogger(__name__)

TELEMETRY_INTERVAL_S = 1.0
# The compute rate in telemetry is over this many telemetry ticks, so a node that slows down
# (or gets faster) shows it within that long, not diluted by its whole life.
RATE_WINDOW_TICKS = 20
STATUS_INTERVAL_S = 15.0
# Tries to set up the MQTT session at start, `NodeOptions.broker_retry_s` apart at first,
# then twice as long each time (1, 2 and 4 s by default).
BUS_ATTEMPTS = 4
DRAIN_TIMEOUT_S = 30.0
STOP_TASKS_S = 5.0
"""The most the node's background tasks may take to end once cancelled, at its stop."""


def _refused_as_revoked(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a call failed because this node's credential is no longer admitted (a peer
    whose plan lags says PERMISSION_DENIED too, but not "revoked")."""
    if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
        return True
    return exc.code() == grpc.StatusCode.PERMISSION_DENIED and "revoked" in (exc.details() or "")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeOptions:
    """How one node daemon runs (the run itself is defined by the coordinator)."""

    coordinator: str
    """host:port of the coordinator's gRPC API."""
    node_id: str
    listen: str = "0.0.0.0:0"
    """host:port of this node's Stage server; port 0 picks a free one."""
    advertise_host: str = ""
    """Host peers use to reach this node; empty: the address that routes to the coordinator."""
    broker: str = ""
    """mqtt://host:port overriding the broker the coordinator names."""
    join_timeout_s: float = 30.0
    broker_retry_s: float = 1.0
    """First wait before trying the MQTT broker again at start; doubles each try."""
    compute_slowdown: float = 1.0
    """Make every compute job this many times slower (a testnet's slow node)."""
    """Give up (exit code 3) when the coordinator does not answer for this long."""
    ready_file: str = ""
    link_mbit: float | None = None
    """Send limit per peer in Mbit/s overriding the run's pipeline.link_mbit; 0: unlimited."""
    latency_ms: float | None = None
    """One-way delay per peer in ms overriding the run's pipeline.link_latency_ms; 0: none."""
    metrics: tuple[str, int] | None = None
    """(host, port) of the Prometheus endpoint (port 0: any free one); None: no metrics."""
    token: str = field(default="", repr=False)
    """The join token the organiser gave (empty: an open loopback run needs none)."""
    device: str = ""
    """Where the stage trains (node/device.py); empty: the run's train.device."""
    ca_pem: bytes = field(default=b"", repr=False)
    """The run CA's certificate (--ca-file): TLS to the coordinator, mutual TLS with peers.
    Empty: plaintext."""


def _route_host(target_host: str) -> str:
    """The local address this machine uses to reach target_host (no packet is sent)."""
    if target_host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target_host, 9))
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


@dataclass(slots=True)
class _HeldApply:
    """A held APPLY (StepState.hold) on this node, from its arrival until it may step."""

    attempt: int
    task: asyncio.Task[Any]
    go: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when the APPLY of the step comes without hold."""


@dataclass(slots=True)
class _Joined:
    """The parts a node builds once it knows its stage."""

    ctx: StageContext
    replica_sync: ReplicaSync
    state_transfer: StateTransfer
    checkpointer: Checkpointer
    head: Head | None


class NodeDaemon:
    """One node: its lifecycle, its MQTT session, and the parts it builds after Join."""

    def __init__(self, options: NodeOptions) -> None:
        self.options = options
        self.node_id = options.node_id
        self.status = NodeStatus()
        self.compute = ComputeWorker(slowdown=options.compute_slowdown)
        self.stats = LinkStats()
        self.links = Links()
        self.link_settings = LinkSettings(self.node_id)
        """The send limit from the start options and the run's LinkControl messages."""
        self.credential = CredentialHolder()
        """What every call this node makes carries: its credential, once it joined."""
        self.peer_admission = PeerAdmission(self.node_id)
        """Who may call this node: nodes of the current plan (node/peer_admission.py)."""
        self.revoked = False
        """The organiser revoked this node's join token (node/main.py exits 4)."""
        self.router = Router(self.node_id, self.stats, self.links, credential=self.credential)
        self._tls_key = tls.new_key() if options.ca_pem else None
        self._certificate = b""
        self.incarnation = secrets.randbits(63) or 1
        """This process among the node id's (Join and presence carry it): a Last Will of an
        earlier process that arrives late cannot put this one offline."""
        """The node's TLS certificate (PEM) now: from Join, then each renewal."""
        self.certificates_renewed = 0
        """This node's TLS key; the coordinator signs its public half at Join."""
        self._server_tls = tls.NodeServerTLS(self.node_id) if options.ca_pem else None
        coordinator_tls = (
            tls.ChannelTLS(options.ca_pem, tls.COORDINATOR_NAME) if options.ca_pem else None
        )
        self._channel = open_channel(options.coordinator, self.credential, coordinator_tls)
        self.device = torch.device("cpu")
        """The stage's device, resolved at Join and kept across moves."""
        self.coordinator = CoordinatorClient(self._channel, options.coordinator)
        self.servicer = StageServicer(self.node_id, self.status, self.peer_admission)
        self.peer_limiter = PeerLimiter(
            limits_for(RunConfig().pipeline), self.peer_admission.caller
        )
        """Per-peer limits on this node's server: the defaults until Join brings the run's."""
        self.joined: _Joined | None = None
        self._topics: Topics | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._applying: set[int] = set()
        self._held_applies: dict[int, _HeldApply] = {}
        self._last_step_state: control_pb2.StepState | None = None
        self._ready_info: dict[str, Any] = {}
        self._client: aiomqtt.Client | None = None
        self._bus_stack: contextlib.AsyncExitStack | None = None
        self._move_order = 0
        self._applies: set[asyncio.Task[Any]] = set()
        self._step_acked = asyncio.Event()
        """Set when this node has applied a step, so telemetry carries it at once."""
        """Optimizer steps under way; a move cancels them."""
        self.samples_per_second = 0.0
        """Samples/s, smoothed over the telemetry ticks (the status line's figure)."""
        self._rate_window: deque[tuple[float, int]] = deque(maxlen=RATE_WINDOW_TICKS)
        """(compute busy seconds, samples processed) at each telemetry tick."""
        self._compute_rate = 0.0
        self._calibrated = 0.0
        self._stage_flops = 0.0
        self._stage_state_bytes = 0.0

    @property
    def failed(self) -> bool:
        return self.status.failed

    def _build(self, config: RunConfig, stage: int, runtime: StageRuntime) -> _Joined:
        ctx = StageContext(
            node_id=self.node_id,
            stage=stage,
            config=config,
            runtime=runtime,
            compute=self.compute,
            links=self.links,
            stats=self.stats,
            router=self.router,
            coordinator=self.coordinator,
            status=self.status,
        )
        checkpointer = Checkpointer(ctx)
        joined = _Joined(
            ctx=ctx,
            replica_sync=ReplicaSync(ctx),
            state_transfer=StateTransfer(ctx, checkpointer),
            checkpointer=checkpointer,
            head=None,
        )
        self.servicer.attach(ctx, joined.replica_sync, joined.state_transfer)
        # Absurd activations and gradients are refused and their senders reported.
        reporter = PeerReporter(self.node_id, self.coordinator.stub)
        self.router.guard = TensorGuard(config.robust, reporter)
        self.router.decode_device = runtime.device
        return joined

    # -- lifecycle ------------------------------------------------------

    async def run(self) -> str:
        """Run until done, drained or stopped; returns why it stopped."""
        metrics = self._serve_metrics()
        binding = []
        if self._server_tls is not None:
            binding = [tls.CertificateBinding(lambda: self.peer_admission.verifier)]
        server = create_server(
            AuthInterceptor(self.peer_admission.policy), *binding, limiter=self.peer_limiter
        )
        add_servicer(server, self.servicer, stage_pb2.DESCRIPTOR.services_by_name["Stage"])
        await enable_health_and_reflection(
            server, [stage_pb2.DESCRIPTOR.services_by_name["Stage"].full_name]
        )
        server_creds = self._server_tls.credentials() if self._server_tls is not None else None
        port = bind(server, self.options.listen, server_creds)
        await server.start()
        try:
            coord_host = self.options.coordinator.rpartition(":")[0].strip("[]")
            host = self.options.advertise_host or self.options.listen.rpartition(":")[0]
            if host in ("", "0.0.0.0", "::", "[::]"):
                host = _route_host(coord_host)
            joining = asyncio.ensure_future(
                self.coordinator.join(
                    coordinator_pb2.JoinRequest(
                        node_id=self.node_id,
                        address=f"{host}:{port}",
                        version=__version__,
                        incarnation=self.incarnation,
                        tls_public_key=tls.public_pem(self._tls_key) if self._tls_key else b"",
                    ),
                    timeout_s=self.options.join_timeout_s,
                    token=self.options.token,
                )
            )
            # Joining can take join_timeout_s (a coordinator that is down): a SIGTERM
            # meanwhile leaves at once, joined to nothing.
            stopped = asyncio.ensure_future(self.status.wait_stop())
            await asyncio.wait({joining, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not joining.done():
                await stop_tasks([joining], STOP_TASKS_S, "the join")
                return self.status.stop_reason
            reply = joining.result()
            joined_at = time.time()
            self._take_certificate(reply)
            self.credential.set(CREDENTIAL_KEY, reply.credential)
            self.peer_admission.verifier = Verifier(reply.verify_key, reply.run_id)
            self.peer_admission.stage = reply.stage
            config = RunConfig.from_json(reply.run_config_json)
            stage = reply.stage
            self.router.configure(config.pipeline)
            self.peer_limiter.configure(limits_for(config.pipeline))
            set_log_identity(f"node {self.node_id} stage {stage}", node=self.node_id, stage=stage)
            link_mbit = self.options.link_mbit
            if link_mbit is None:
                link_mbit = config.pipeline.link_mbit
            self.link_settings.start_limit = link_mbit * MBIT
            latency_ms = self.options.latency_ms
            if latency_ms is None:
                latency_ms = config.pipeline.link_latency_ms
            self.link_settings.start_latency_ms = latency_ms
            self.links.configure(
                limit_bytes_per_second=self.link_settings.limit,
                latency_s=self.link_settings.latency_ms / 1e3,
                options=EncodeOptions.from_pipeline(config.pipeline),
            )
            # A --device was checked before Join (node/main.py); the run's own setting can
            # only be checked now, and a device missing here is the same one line and exit 2.
            device = self.device = resolve_device(
                self.options.device or config.train.device,
                what="--device" if self.options.device else "train.device",
            )
            runtime = await self.compute.run(BACKWARD, lambda: StageRuntime(config, stage, device))
            await self._calibrate(runtime)
            joined = self.joined = self._build(config, stage, runtime)
            n_params = sum(p.numel() for p in runtime.module.parameters())
            logger.info(
                "joined run %r as stage %d of %d (%d parameters, %s on %s), serving on %s:%d",
                reply.run_id,
                stage,
                config.pipeline.stages,
                n_params,
                config.train.precision,
                describe_device(device),
                host,
                port,
            )
            await self._add_head(joined)
            broker_url = self.options.broker or reply.broker_url
            broker = parse_broker_url(broker_url)
            if broker.host in ("127.0.0.1", "0.0.0.0", "localhost") and coord_host not in (
                "127.0.0.1",
                "localhost",
                "::1",
            ):
                # The coordinator's embedded broker listens beside it; reach it
                # at the coordinator's host rather than our own loopback.
                broker = replace(broker, host=coord_host)
            if broker.tls and self.options.ca_pem:
                broker = replace(broker, ca_pem=self.options.ca_pem)
            if not broker.username and reply.broker_username:
                # The login the coordinator derived for us (its broker's ACL names us).
                broker = replace(
                    broker, username=reply.broker_username, password=reply.broker_password
                )
            self._ready_info = {
                "grpc_port": port,
                "metrics_port": metrics.port if metrics else None,
                "node_id": self.node_id,
                "stage": stage,
                "pid": os.getpid(),
                "joined_at": joined_at,
                "built_at": time.time(),
                "serving": False,
            }
            if self.options.ready_file:
                write_ready_file(self.options.ready_file, self._ready_info)
            self._topics = Topics(reply.run_id)
            will = aiomqtt.Will(
                self._topics.presence(self.node_id),
                self._presence(online=False).SerializeToString(),
                qos=1,
                retain=True,
            )
            self.coordinator.retry_s = config.coordinator.restart_grace_s
            await self._open_bus(broker, self._topics, will)
            self._spawn(self._bus_loop(broker, will, config.coordinator.restart_grace_s))
            self._spawn(self._start_serving(joined))
            if self._server_tls is not None:
                self._spawn(self._renew_certificate())
            await self.status.wait_stop()
            await self._drain()
            await self.joined.checkpointer.close()
            useful = max(time.monotonic() - self.status.started_at, 1e-9)
            logger.info("leaving: %s", self.status_line(self.status.samples_processed / useful))
            await self._cancel_tasks()
            try:
                if self._client is None:
                    raise aiomqtt.MqttError("not connected")
                # A last report, so counters of a short run are not lost between ticks.
                await self._client.publish(
                    self._topics.telemetry(self.node_id),
                    self._telemetry(0.0).SerializeToString(),
                    qos=1,
                )
                await self._client.publish(
                    self._topics.presence(self.node_id),
                    self._presence(online=False).SerializeToString(),
                    qos=1,
                    retain=True,
                )
            except aiomqtt.MqttError as exc:
                # The broker is gone (that may be why we stop): our Last Will says
                # we left, and a traceback here would bury the reason.
                logger.info("no goodbye over MQTT: %s", exc)
        finally:
            await self._cancel_tasks()
            await self._close_bus()
            await server.stop(grace=1.0)
            await self.router.close()
            await self._channel.close()
            self.compute.close()
            if metrics is not None:
                metrics.close()
        return self.status.stop_reason

    def _take_certificate(self, reply: coordinator_pb2.JoinReply) -> None:
        """Serve and call peers with the certificate Join issued (mutual TLS), once checked."""
        if self._tls_key is None or self._server_tls is None:
            return
        ca_pem = self.options.ca_pem
        if not reply.tls_certificate:
            raise tls.TLSError("the coordinator issued no TLS certificate: it runs without --tls")
        # Our CA, not the reply's: the coordinator proved it holds it in the handshake.
        tls.check_node_cert(ca_pem, reply.tls_certificate, self.node_id)
        key = tls.key_pem(self._tls_key)
        self._server_tls.install(key, reply.tls_certificate, ca_pem)
        self.router.tls = tls.ChannelTLS(ca_pem, tls.NODE_NAME, key, reply.tls_certificate)
        self._certificate = reply.tls_certificate

    async def _renew_certificate(self) -> None:
        """Renew this node's TLS certificate (a new key each time) once two thirds of what
        was left of it at issue have passed; a refused or failed renewal is tried again
        until the certificate expires, and only then stops the node."""
        assert self._server_tls is not None
        ca_pem = self.options.ca_pem
        wait = tls.seconds_left(self._certificate) * 2 / 3
        while True:
            await asyncio.sleep(max(1.0, wait))
            key = tls.new_key()
            request = coordinator_pb2.RenewCertificateRequest(
                node_id=self.node_id, tls_public_key=tls.public_pem(key)
            )
            try:
                reply = await self.coordinator.call("RenewCertificate", request)
                tls.check_node_cert(ca_pem, reply.tls_certificate, self.node_id)
            except (grpc.aio.AioRpcError, SwarmpipeError) as exc:
                why = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                left = tls.seconds_left(self._certificate)
                if left <= 0:
                    raise SwarmpipeError(
                        f"this node's TLS certificate expired and could not be renewed: {why}"
                    ) from exc
                wait = min(60.0, left / 10)
                logger.warning(
                    "could not renew the TLS certificate (%s); it expires in %.0f s, trying "
                    "again in %.0f s",
                    why,
                    left,
                    max(1.0, wait),
                )
                continue
            key_bytes = tls.key_pem(key)
            self._server_tls.install(key_bytes, reply.tls_certificate, ca_pem)
            self.router.set_tls(
                tls.ChannelTLS(ca_pem, tls.NODE_NAME, key_bytes, reply.tls_certificate)
            )
            self._certificate = reply.tls_certificate
            self.certificates_renewed += 1
            wait = tls.seconds_left(self._certificate) * 2 / 3
            logger.info("renewed its TLS certificate: valid for %.0f s more", wait * 3 / 2)

    def _serve_metrics(self) -> MetricsServer | None:
        """Start the Prometheus endpoint, if asked for; it reads the parts at each scrape."""
        if self.options.metrics is None:
            return None

        def families() -> list[Metric]:
            return node_families(
                node_id=self.node_id,
                stage=self.stage,
                step=self.joined.ctx.runtime.step if self.joined is not None else 0,
                samples_per_second=self.samples_per_second,
                status=self.status,
                compute=self.compute,
                stats=self.stats,
                router=self.router,
            )

        metrics = serve_metrics(*self.options.metrics, families)
        logger.info("metrics on %s", metrics.url)
        return metrics

    async def _connect_bus(self, broker: BrokerAddress, topics: Topics, will: aiomqtt.Will) -> None:
        """One try to connect, subscribe to the run's topics and announce ourselves."""
        stack = contextlib.AsyncExitStack()
        try:
            client = await stack.enter_async_context(
                make_client(broker, f"node-{self.node_id}", will=will)
            )
            await client.subscribe(topics.plan, qos=1)
            await client.subscribe(topics.step, qos=1)
            await client.subscribe(topics.control(), qos=1)
            await client.publish(
                topics.presence(self.node_id),
                self._presence(online=True).SerializeToString(),
                qos=1,
                retain=True,
            )
        except BaseException:
            with contextlib.suppress(aiomqtt.MqttError):
                await stack.aclose()
            raise
        self._client, self._bus_stack = client, stack

    async def _close_bus(self) -> None:
        stack, self._bus_stack, self._client = self._bus_stack, None, None
        if stack is not None:
            with contextlib.suppress(aiomqtt.MqttError):
                await stack.aclose()

    async def _open_bus(self, broker: BrokerAddress, topics: Topics, will: aiomqtt.Will) -> None:
        """Set up the MQTT session at start.

        A broker that refuses or drops us while we set up (restarting, overloaded) is
        retried a few times with backoff; one that stays away is a one-line error.
        """
        delay = self.options.broker_retry_s
        for attempt in range(1, BUS_ATTEMPTS + 1):
            try:
                await self._connect_bus(broker, topics, will)
                return
            except aiomqtt.MqttError as exc:
                if attempt == BUS_ATTEMPTS or self.status.stopping:
                    raise SwarmpipeError(
                        f"cannot use the MQTT broker at {broker.url} ({attempt} attempt(s)): {exc}"
                    ) from exc
                logger.warning(
                    "MQTT broker %s: %s; retrying in %g s (attempt %d of %d)",
                    broker.url,
                    exc,
                    delay,
                    attempt,
                    BUS_ATTEMPTS,
                )
                await asyncio.sleep(delay)
                delay *= 2

    async def _bus_loop(self, broker: BrokerAddress, will: aiomqtt.Will, grace_s: float) -> None:
        """Read the run's topics and publish telemetry; when the broker goes away (the
        coordinator's embedded broker dies with it), keep training over the peers' gRPC
        links and reconnect with backoff: subscribe again and publish our presence again
        (a restarted broker holds no retained messages; the restarted coordinator publishes
        the plan and step again). Past `grace_s` without a broker the node gives up."""
        assert self._topics is not None
        while True:
            client = self._client
            assert client is not None
            lost: Exception = aiomqtt.MqttError("the broker ended the session")
            try:
                async with asyncio.TaskGroup() as group:
                    group.create_task(self._read_mqtt(client))
                    group.create_task(self._telemetry_loop(client))
            except* aiomqtt.MqttError as errors:
                lost = errors.exceptions[0]
            logger.warning(
                "lost the MQTT broker %s (%s); training goes on, reconnecting for up to %.0f s",
                broker.url,
                lost,
                grace_s,
            )
            await self._close_bus()
            deadline = time.monotonic() + grace_s
            delay = 0.2
            while True:
                await asyncio.sleep(delay)
                try:
                    await self._connect_bus(broker, self._topics, will)
                    break
                except aiomqtt.MqttError as exc:
                    if time.monotonic() + delay > deadline:
                        raise SwarmpipeError(
                            f"the MQTT broker at {broker.url} stayed away for {grace_s:.0f} s "
                            f"(coordinator.restart_grace_s): {exc}"
                        ) from exc
                    logger.debug("MQTT broker %s: %s; trying again", broker.url, exc)
                    delay = min(delay * 2, 2.0)
            logger.info("reconnected to the MQTT broker %s", broker.url)

    async def _add_head(self, joined: _Joined) -> None:
        """A stage-0 node leads: it gets a Head with the run's corpus."""
        if joined.ctx.stage != 0:
            return
        from swarmpipe.data import Corpus

        config = joined.ctx.config
        corpus = await asyncio.to_thread(
            Corpus.load, config.data, config.model.context, config.train.seed
        )
        joined.head = Head(joined.ctx, corpus)

    async def _move(self, stage: int, reason: str) -> None:
        """The coordinator moved this node to `stage`: stop serving the old one, let its
        microbatches finish, build the new stage, fetch its state and serve it."""
        old = self.joined
        assert old is not None and self._topics is not None
        logger.warning("moving from stage %d to stage %d: %s", old.ctx.stage, stage, reason)
        self.status.stop_serving()  # refuse new microbatches; senders reroute
        if old.head is not None:
            old.head.stopping.set()
        for task in list(self._applies):
            task.cancel()  # the old stage's optimizer step is no longer this node's to take
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.status.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        config = old.ctx.config
        device = self.device
        runtime = await self.compute.run(BACKWARD, lambda: StageRuntime(config, stage, device))
        await self._calibrate(runtime)
        joined = self.joined = self._build(config, stage, runtime)
        self.peer_admission.stage = stage
        self._applying.clear()  # step numbers of the old stage's applies
        self._held_applies.clear()
        await self._add_head(joined)
        set_log_identity(f"node {self.node_id} stage {stage}")
        self._ready_info.update(stage=stage, serving=False)
        if self.options.ready_file:
            write_ready_file(self.options.ready_file, self._ready_info)
        if self._client is not None:
            # Without a broker now, the reconnect announces the new stage.
            with contextlib.suppress(aiomqtt.MqttError):
                await self._client.publish(
                    self._topics.presence(self.node_id),
                    self._presence(online=True).SerializeToString(),
                    qos=1,
                    retain=True,
                )
        await self._start_serving(joined)

    async def _calibrate(self, runtime: StageRuntime) -> None:
        """Measure the new stage before it takes traffic (node/calibration.py), and start the
        measured rate afresh: the old window was another stage's."""
        self._stage_flops = calibration.stage_flops_per_sample(runtime)
        self._stage_state_bytes = calibration.stage_state_bytes(runtime)
        self._calibrated = self._compute_rate = 0.0
        made = calibration.calibration_inputs(runtime)
        if made is not None:
            x, tokens = made
            passes = calibration.CALIBRATION_PASSES

            def run_passes() -> None:
                for _ in range(passes):
                    calibration.calibration_pass(runtime, x, tokens)

            try:
                await self.compute.run(
                    BACKWARD, lambda: calibration.calibration_pass(runtime, x, tokens)
                )
                _, seconds = await self.compute.run_timed(BACKWARD, run_passes)
            except (RuntimeError, ValueError) as exc:  # the stage will say so on real input
                logger.warning("calibration of stage %d failed: %s", runtime.stage, exc)
            else:
                if seconds > 0:
                    self._calibrated = passes * x.shape[0] / seconds
                logger.info(
                    "calibrated stage %d: %.1f samples/s (%d passes of a microbatch of %d)",
                    runtime.stage,
                    self._calibrated,
                    passes,
                    x.shape[0],
                )
        self._rate_window.clear()
        self._rate_window.append((self.compute.busy_seconds, self.status.samples_processed))

    def _measured_compute_rate(self) -> float:
        """Samples per busy second of the compute thread over the last RATE_WINDOW_TICKS
        ticks (the last figure while it had no work: idle says nothing about its speed)."""
        busy, samples = self.compute.busy_seconds, self.status.samples_processed
        self._rate_window.append((busy, samples))
        old_busy, old_samples = self._rate_window[0]
        if busy > old_busy and samples > old_samples:
            self._compute_rate = (samples - old_samples) / (busy - old_busy)
        return self._compute_rate

    async def _start_serving(self, joined: _Joined) -> None:
        """Catch up with the swarm, then take traffic (and lead, on stage 0)."""
        if not await joined.state_transfer.join():
            return
        self.status.start_serving()
        if self.options.ready_file:
            self._ready_info.update(serving=True, **joined.state_transfer.report)
            write_ready_file(self.options.ready_file, self._ready_info)
        if self._last_step_state is not None:
            # An APPLY of the step it now serves may have come while it was syncing.
            self._on_step(self._last_step_state)
        if joined.head is not None:
            self._spawn(joined.head.run())

    async def _cancel_tasks(self) -> None:
        tasks = list(self._tasks)
        self._tasks.clear()
        # Cancelled again while they run on: Python 3.11 can drop a cancel (shutdown.py).
        await stop_tasks(tasks, STOP_TASKS_S, "the node's background tasks")

    def stop(self, reason: str, *, failed: bool = False) -> None:
        """Leave the run cleanly (signal handlers call this)."""
        self.status.request_stop(reason, failed=failed)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self._applies.discard(task)
        if task.cancelled() or task.exception() is None or self.status.stopping:
            return
        exc = task.exception()
        if isinstance(exc, SwarmpipeError):
            logger.error("%s", exc)
            self.stop(str(exc), failed=True)
        elif isinstance(exc, aiomqtt.MqttError):
            logger.error("lost the MQTT broker: %s", exc)
            self.stop(f"lost the MQTT broker: {exc}", failed=True)
        elif isinstance(exc, grpc.aio.AioRpcError) and _refused_as_revoked(exc):
            # The coordinator refused our credential (a revoked token) before the plan that
            # says so reached us: the same way out, one line and exit 4.
            logger.error("the coordinator no longer admits this node: %s", exc.details())
            self.revoked = True
            self.stop("the organiser revoked this node's join token", failed=True)
        else:
            logger.error("a node task failed: %r", exc, exc_info=exc)
            self.stop(f"internal error: {exc!r}", failed=True)

    async def _drain(self) -> None:
        """Let in-flight microbatches finish (bounded) before leaving."""
        if self.joined is not None and self.joined.head is not None:
            self.joined.head.stopping.set()
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while self.status.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.status.in_flight:
            logger.warning(
                "left with %d microbatches in flight; they will be replayed",
                self.status.in_flight,
            )

    def _presence(self, *, online: bool) -> control_pb2.Presence:
        return control_pb2.Presence(
            node_id=self.node_id,
            online=online,
            stage=max(self.stage, 0),
            timestamp=time.time(),
            incarnation=self.incarnation,
        )

    @property
    def stage(self) -> int:
        """The stage this node serves; -1 before it has joined."""
        return self.joined.ctx.stage if self.joined is not None else -1

    # -- MQTT -----------------------------------------------------------

    async def _read_mqtt(self, client: aiomqtt.Client) -> None:
        assert self._topics is not None
        async for message in client.messages:
            kind = self._topics.kind_of(str(message.topic))
            payload = message.payload
            if kind is None or not isinstance(payload, bytes | bytearray):
                continue
            if kind[0] == "control":
                self._on_link_control(kind[1], bytes(payload))
                continue
            try:
                if kind[0] == "plan":
                    self._on_plan(control_pb2.Plan.FromString(bytes(payload)))
                elif kind[0] == "step":
                    self._on_step(control_pb2.StepState.FromString(bytes(payload)))
            except Exception as exc:  # a malformed control message must not kill the node
                logger.warning("ignoring malformed %s message: %s", kind[0], exc)

    def _on_link_control(self, target: str, payload: bytes) -> None:
        before = self.link_settings.limit
        latency_before = self.link_settings.latency_ms
        try:
            if not self.link_settings.on_message(target, payload):
                return  # another node's (amqtt sends retained ones to everyone)
        except PeerError as exc:
            logger.warning("ignoring the link control message on control/%s: %s", target, exc)
            return
        slowdown = self.link_settings.slowdown or self.options.compute_slowdown
        if slowdown != self.compute.slowdown:
            logger.info(
                "compute slowdown %g (control/%s; was %g)", slowdown, target, self.compute.slowdown
            )
            self.compute.slowdown = slowdown
        limit = self.link_settings.limit
        if limit != before:
            self.links.set_limit(None, limit)
        latency_ms = self.link_settings.latency_ms
        if latency_ms != latency_before:
            self.links.set_latency(None, latency_ms / 1e3)
        logger.info(
            "send limit %s, delay %s on every link (control/%s; was %s, %g ms)",
            describe(limit) if limit != before else f"stays {describe(limit)}",
            f"{latency_ms:g} ms" if latency_ms != latency_before else f"stays {latency_ms:g} ms",
            target,
            describe(before),
            latency_before,
        )

    def _on_plan(self, plan: control_pb2.Plan) -> None:
        self.router.set_plan(plan)
        self.peer_admission.plan = self.router.plan
        if self.node_id in plan.revoked:
            self.revoked = True
            self.stop("the organiser revoked this node's join token", failed=True)
            return
        if self.node_id in plan.drained:
            self.stop("drained by the coordinator")
            return
        for move in plan.moves:
            if move.node_id == self.node_id and move.order > self._move_order:
                # Plans are retained and redelivered: each order is carried out once.
                self._move_order = move.order
                # An order for its own stage re-syncs a node that serves it (the coordinator
                # took it out of a step it could not finish); one that is syncing already
                # (a restarted node reading its earlier life's order) has nothing to redo.
                joined = self.joined
                if joined is not None and (move.stage != joined.ctx.stage or self.status.serving):
                    self._spawn(self._move(move.stage, move.reason))

    def _on_step(self, state: control_pb2.StepState) -> None:
        Phase = control_pb2.StepState
        joined = self.joined
        if joined is None:
            return
        self._last_step_state = state
        if state.phase == Phase.PHASE_DONE:
            self.stop("the run has finished")
        elif not self.status.serving:
            return  # a syncing node's state is not the stage's: it applies nothing
        elif (
            state.phase == Phase.PHASE_TRAINING
            and state.step == joined.ctx.runtime.step
            and state.step in self._held_applies
        ):
            # A held APPLY goes on (APPLY without hold) or its step trains again: this one.
            self._begin_again(joined, state.step, state.attempt)
        elif state.phase == Phase.PHASE_APPLY and state.step == joined.ctx.runtime.step:
            held = self._held_applies.get(state.step)
            if held is not None and not state.hold:
                held.go.set()  # every verdict is in: the held APPLY goes on
            elif held is not None and state.attempt > held.attempt:
                # The step began again and its TRAINING never reached us (a reconnect gets
                # the retained message only): the held APPLY waiting is of an attempt gone.
                self._begin_again(joined, state.step, state.attempt - 1)
            # The version the step trained on (train.step_overlap); its own otherwise.
            trains_on = state.trains_on if joined.ctx.config.train.step_overlap else state.step
            if state.step not in self._applying:
                task = self._spawn(self._apply(joined, state.step, trains_on))
                self._applies.add(task)
                if state.hold:
                    self._held_applies[state.step] = _HeldApply(state.attempt, task)
        elif (
            state.phase == Phase.PHASE_SAVE
            and self.node_id in state.save_from
            and state.step == joined.ctx.runtime.step
        ):
            self._spawn(joined.checkpointer.save_final(state.step))

    def _begin_again(self, joined: _Joined, step: int, attempt: int) -> None:
        """The coordinator took `step` back from a held APPLY (a replica was benched or lost
        during its reduce) and opens it again: nothing was stepped, so forget this step's
        sums and reduce and train it again on the same parameters."""
        held = self._held_applies.pop(step, None)
        if held is not None:
            held.task.cancel()  # it waits for the APPLY without hold, which will not come
        self._applying.discard(step)
        # The gradient sums start afresh at the step's next microbatch (StageRuntime).
        joined.replica_sync.forget(step)
        logger.warning(
            "step %d begins again (attempt %d): a replica was benched or lost during its reduce",
            step,
            attempt + 1,
        )

    async def _apply(self, joined: _Joined, step: int, trains_on: int) -> None:
        runtime = joined.ctx.runtime
        if step in self._applying:
            return  # MQTT delivers at least once: this APPLY is already being handled
        self._applying.add(step)
        times = self.status.step_times
        times.apply_arrived(step)
        replicas = 1
        if runtime.outer is None:
            reduced, replicas = await joined.replica_sync.reduce(step, trains_on)
            times.reduced(step)
            held = self._held_applies.get(step)
            if held is not None and not held.go.is_set():
                # Every stage's verdict first: a replica benched now takes the step back.
                await self.coordinator.call(
                    "StepDone",
                    coordinator_pb2.StepDoneRequest(node_id=self.node_id, step=step, held=True),
                )
                await held.go.wait()
            self._held_applies.pop(step, None)
            samples = await self.compute.run(
                BACKWARD, lambda: runtime.apply_step(step, reduced, trains_on=trains_on)
            )
            how = f"{replicas} replica{'' if replicas == 1 else 's'}"
        else:
            # DiLoCo: a local inner step, and every few steps the outer average.
            # At a round's end the step number moves only after the outer step,
            # so a joiner's state fetch never sees the parameters in between.
            ends = runtime.outer_round_ends(step)
            samples = await self.compute.run(
                BACKWARD, lambda: runtime.apply_step(step, None, advance=not ends)
            )
            how = "local"
            if ends:
                replicas = await joined.replica_sync.average_parameters(step)
                how = f"local, then averaged over {replicas} replica{'' if replicas == 1 else 's'}"
        joined.state_transfer.step_advanced()
        if fault_points.drift_due(step):
            await self.compute.run(BACKWARD, runtime.nudge_for_test)
        digest = await self.compute.run(BACKWARD, runtime.parameter_digest)
        times.applied(step)
        logger.info("applied step %d (%d samples, %s, params %s)", step, samples, how, digest)
        await self.coordinator.call(
            "StepDone",
            coordinator_pb2.StepDoneRequest(
                node_id=self.node_id,
                step=step,
                samples=samples,
                param_digest=digest,
                replicas=replicas,
            ),
        )
        times.acked(step)
        self._step_acked.set()
        await joined.checkpointer.after_step(step + 1)

    async def _telemetry_loop(self, client: aiomqtt.Client) -> None:
        assert self._topics is not None
        topic = self._topics.telemetry(self.node_id)
        last_samples, last_time = 0, time.monotonic()
        rate = 0.0
        next_status = time.monotonic() + STATUS_INTERVAL_S
        while True:
            with contextlib.suppress(TimeoutError):
                due = last_time + TELEMETRY_INTERVAL_S - time.monotonic()
                await asyncio.wait_for(self._step_acked.wait(), max(0.0, due))
                # A step was applied: its time breakdown goes out now, since a short run
                # may end before the next tick; the rate waits for the tick.
                self._step_acked.clear()
                await client.publish(topic, self._telemetry(rate).SerializeToString(), qos=0)
                continue
            now = time.monotonic()
            samples = self.status.samples_processed
            rate = 0.5 * rate + 0.5 * (samples - last_samples) / (now - last_time)
            self.samples_per_second = rate
            last_samples, last_time = samples, now
            await client.publish(topic, self._telemetry(rate).SerializeToString(), qos=0)
            if now >= next_status:
                next_status = now + STATUS_INTERVAL_S
                logger.info("%s", self.status_line(rate))

    def status_line(self, rate: float) -> str:
        """The volunteer's one-line view: stage, throughput, traffic, time spent useful."""
        useful = time.monotonic() - self.status.started_at
        step = self.joined.ctx.runtime.step if self.joined is not None else 0
        return (
            f"stage {self.stage} | step {step} | {rate:.1f} samples/s | "
            f"up {self.stats.total_bytes() / 1e6:.1f} MB down "
            f"{self.stats.received_bytes / 1e6:.1f} MB | {self.status.samples_processed} samples "
            f"in {useful / 60:.1f} min"
        )

    def _telemetry(self, rate: float) -> control_pb2.Telemetry:
        return control_pb2.Telemetry(
            node_id=self.node_id,
            stage=self.stage,
            samples=self.status.samples_processed,
            samples_per_second=rate,
            in_flight=self.status.in_flight,
            links=self.stats.snapshot(),
            timestamp=time.time(),
            link_estimates=self.links.snapshot(),
            compute_seconds_per_microbatch=self.links.compute.value or 0.0,
            step_times=self.status.step_times.snapshot(),
            in_flight_window=(self.joined.head.window if self.joined and self.joined.head else 0),
            compute_samples_per_second=self._measured_compute_rate(),
            calibrated_samples_per_second=self._calibrated,
            stage_flops_per_sample=self._stage_flops,
            stage_state_bytes=self._stage_state_bytes,
        )


def default_node_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def set_torch_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
