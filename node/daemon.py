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
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import aiomqtt
import torch
from prometheus_client.core import Metric

from swarmpipe import __version__
from swarmpipe.config import RunConfig
from swarmpipe.control.bus import BrokerAddress, Topics, make_client, parse_broker_url
from swarmpipe.control.link_control import LinkSettings, describe
from swarmpipe.errors import PeerError, SwarmpipeError
from swarmpipe.node.checkpointing import Checkpointer
from swarmpipe.node.compute import BACKWARD, ComputeWorker
from swarmpipe.node.context import CoordinatorClient, NodeStatus, StageContext
from swarmpipe.node.head import Head
from swarmpipe.node.links import Links
from swarmpipe.node.metrics import node_families
from swarmpipe.node.peer_admission import PeerAdmission
from swarmpipe.node.replica_sync import ReplicaSync
from swarmpipe.node.router import Router
from swarmpipe.node.server import StageServicer
from swarmpipe.node.stage_runtime import StageRuntime
from swarmpipe.node.state_transfer import StateTransfer
from swarmpipe.node.transport import EncodeOptions, LinkStats
from swarmpipe.process.logs import set_log_identity
from swarmpipe.process.metrics import MetricsServer, serve_metrics
from swarmpipe.process.ready import write_ready_file
from swarmpipe.protos import control_pb2, coordinator_pb2, stage_pb2
from swarmpipe.transport import tls
from swarmpipe.transport.auth import CREDENTIAL_KEY, AuthInterceptor, CredentialHolder, Verifier
from swarmpipe.transport.limits import MBIT
from swarmpipe.transport.request_parsing import add_servicer
from swarmpipe.transport.rpc import bind, create_server, enable_health_and_reflection, open_channel

logger = logging.getLogger(__name__)

TELEMETRY_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 15.0
# Tries to set up the MQTT session at start, `NodeOptions.broker_retry_s` apart at first,
# then twice as long each time (1, 2 and 4 s by default).
BUS_ATTEMPTS = 4
DRAIN_TIMEOUT_S = 30.0


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
    metrics: tuple[str, int] | None = None
    """(host, port) of the Prometheus endpoint (port 0: any free one); None: no metrics."""
    token: str = field(default="", repr=False)
    """The join token the organiser gave (empty: an open loopback run needs none)."""
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
        """This node's TLS key; the coordinator signs its public half at Join."""
        self._server_tls = tls.NodeServerTLS(self.node_id) if options.ca_pem else None
        coordinator_tls = (
            tls.ChannelTLS(options.ca_pem, tls.COORDINATOR_NAME) if options.ca_pem else None
        )
        self._channel = open_channel(options.coordinator, self.credential, coordinator_tls)
        self.coordinator = CoordinatorClient(self._channel, options.coordinator)
        self.servicer = StageServicer(self.node_id, self.status, self.peer_admission)
        self.joined: _Joined | None = None
        self._topics: Topics | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._applying: set[int] = set()
        self._last_step_state: control_pb2.StepState | None = None
        self._ready_info: dict[str, Any] = {}
        self._client: aiomqtt.Client | None = None
        self._move_order = 0
        self._applies: set[asyncio.Task[Any]] = set()
        """Optimizer steps under way; a move cancels them."""
        self.samples_per_second = 0.0
        """Samples/s, smoothed over the telemetry ticks (the status line's figure)."""

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
        return joined

    # -- lifecycle ------------------------------------------------------

    async def run(self) -> str:
        """Run until done, drained or stopped; returns why it stopped."""
        metrics = self._serve_metrics()
        binding = []
        if self._server_tls is not None:
            binding = [tls.CertificateBinding(lambda: self.peer_admission.verifier)]
        server = create_server(AuthInterceptor(self.peer_admission.policy), *binding)
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
            reply = await self.coordinator.join(
                coordinator_pb2.JoinRequest(
                    node_id=self.node_id,
                    address=f"{host}:{port}",
                    version=__version__,
                    tls_public_key=tls.public_pem(self._tls_key) if self._tls_key else b"",
                ),
                timeout_s=self.options.join_timeout_s,
                token=self.options.token,
            )
            joined_at = time.time()
            self._take_certificate(reply)
            self.credential.set(CREDENTIAL_KEY, reply.credential)
            self.peer_admission.verifier = Verifier(reply.verify_key, reply.run_id)
            self.peer_admission.stage = reply.stage
            config = RunConfig.from_json(reply.run_config_json)
            stage = reply.stage
            self.router.configure(config.pipeline)
            set_log_identity(f"node {self.node_id} stage {stage}", node=self.node_id, stage=stage)
            link_mbit = self.options.link_mbit
            if link_mbit is None:
                link_mbit = config.pipeline.link_mbit
            self.link_settings.start_limit = link_mbit * MBIT
            self.links.configure(
                limit_bytes_per_second=self.link_settings.limit,
                options=EncodeOptions.from_pipeline(config.pipeline),
            )
            runtime = await self.compute.run(BACKWARD, lambda: StageRuntime(config, stage))
            joined = self.joined = self._build(config, stage, runtime)
            n_params = sum(p.numel() for p in runtime.module.parameters())
            logger.info(
                "joined run %r as stage %d of %d (%d parameters), serving on %s:%d",
                reply.run_id,
                stage,
                config.pipeline.stages,
                n_params,
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
            async with self._open_bus(broker, self._topics, will) as client:
                self._client = client
                self._spawn(self._read_mqtt(client))
                self._spawn(self._telemetry_loop(client))
                self._spawn(self._start_serving(joined))
                await self.status.wait_stop()
                await self._drain()
                await self.joined.checkpointer.close()
                useful = max(time.monotonic() - self.status.started_at, 1e-9)
                logger.info("leaving: %s", self.status_line(self.status.samples_processed / useful))
                await self._cancel_tasks()
                try:
                    # A last report, so counters of a short run are not lost between ticks.
                    await client.publish(
                        self._topics.telemetry(self.node_id),
                        self._telemetry(0.0).SerializeToString(),
                        qos=1,
                    )
                    await client.publish(
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

    @contextlib.asynccontextmanager
    async def _open_bus(
        self, broker: BrokerAddress, topics: Topics, will: aiomqtt.Will
    ) -> AsyncIterator[aiomqtt.Client]:
        """Connect to the broker, subscribe to the run's topics and announce ourselves.

        A broker that refuses or drops us while we set up (restarting, overloaded) is
        retried a few times with backoff; one that stays away is a one-line error.
        """
        delay = self.options.broker_retry_s
        for attempt in range(1, BUS_ATTEMPTS + 1):
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
            except aiomqtt.MqttError as exc:
                with contextlib.suppress(aiomqtt.MqttError):
                    await stack.aclose()
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
                continue
            async with stack:
                yield client
            return

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
        runtime = await self.compute.run(BACKWARD, lambda: StageRuntime(config, stage))
        joined = self.joined = self._build(config, stage, runtime)
        self.peer_admission.stage = stage
        self._applying.clear()  # step numbers of the old stage's applies
        await self._add_head(joined)
        set_log_identity(f"node {self.node_id} stage {stage}")
        self._ready_info.update(stage=stage, serving=False)
        if self.options.ready_file:
            write_ready_file(self.options.ready_file, self._ready_info)
        if self._client is not None:
            await self._client.publish(
                self._topics.presence(self.node_id),
                self._presence(online=True).SerializeToString(),
                qos=1,
                retain=True,
            )
        await self._start_serving(joined)

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
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

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
        if isinstance(exc, aiomqtt.MqttError):
            logger.error("lost the MQTT broker: %s", exc)
            self.stop(f"lost the MQTT broker: {exc}", failed=True)
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
            node_id=self.node_id, online=online, stage=max(self.stage, 0), timestamp=time.time()
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
        try:
            if not self.link_settings.on_message(target, payload):
                return  # another node's (amqtt sends retained ones to everyone)
        except PeerError as exc:
            logger.warning("ignoring the link control message on control/%s: %s", target, exc)
            return
        limit = self.link_settings.limit
        if limit != before:
            self.links.set_limit(None, limit)
        logger.info(
            "send limit %s on every link (control/%s; was %s)",
            describe(limit) if limit != before else f"stays {describe(limit)}",
            target,
            describe(before),
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
                if self.joined is not None and move.stage != self.joined.ctx.stage:
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
        elif state.phase == Phase.PHASE_APPLY and state.step == joined.ctx.runtime.step:
            self._applies.add(self._spawn(self._apply(joined, state.step)))
        elif (
            state.phase == Phase.PHASE_SAVE
            and self.node_id in state.save_from
            and state.step == joined.ctx.runtime.step
        ):
            self._spawn(joined.checkpointer.save_final(state.step))

    async def _apply(self, joined: _Joined, step: int) -> None:
        runtime = joined.ctx.runtime
        if step in self._applying:
            return  # MQTT delivers at least once: this APPLY is already being handled
        self._applying.add(step)
        replicas = 1
        if runtime.outer is None:
            reduced, replicas = await joined.replica_sync.reduce(step)
            samples = await self.compute.run(BACKWARD, lambda: runtime.apply_step(step, reduced))
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
        digest = await self.compute.run(BACKWARD, runtime.parameter_digest)
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
        await joined.checkpointer.after_step(step + 1)

    async def _telemetry_loop(self, client: aiomqtt.Client) -> None:
        assert self._topics is not None
        topic = self._topics.telemetry(self.node_id)
        last_samples, last_time = 0, time.monotonic()
        rate = 0.0
        next_status = time.monotonic() + STATUS_INTERVAL_S
        while True:
            await asyncio.sleep(TELEMETRY_INTERVAL_S)
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
            compute_samples_per_second=(
                self.status.samples_processed / self.compute.busy_seconds
                if self.compute.busy_seconds > 0
                else 0.0
            ),
        )


def default_node_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def set_torch_threads(threads: int) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
