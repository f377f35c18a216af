"""`swarmpipe testnet`: a whole swarm on this machine, as separate processes, with a report.

Starts a coordinator (with its embedded broker, or --broker) and N node
daemons on 127.0.0.1 ephemeral ports, shows step, loss, samples/s and bytes/s
while they train, then writes report.json into the output folder and prints
its path. Ctrl-C, the coordinator exiting, or a node exiting with an error of
its own stops every process it started. A node killed by the churn scenario
(--churn, --churn-random, see churn.py) or by a signal from outside the testnet
(someone's `kill -9`) is churn, recorded in the report ("died"): the run goes
on, and stops only when the swarm cannot (no step for --stall-timeout). A
coordinator killed from outside is started again at once with its command line,
as a supervisor would, and takes the run up from its state database.

Exit codes: 0 when the run finished and wrote its report, 1 when a child
crashed or the run stalled, 2 for bad arguments or config, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from swarmpipe.config import RunConfig, add_config_arguments, check_device_spec, load_config
from swarmpipe.control import link_control
from swarmpipe.control.bus import BrokerAddress, parse_broker_url
from swarmpipe.control.status_view import sample_counters
from swarmpipe.coordinator.admission import load_or_create_admin_token
from swarmpipe.coordinator.summary import busy_seconds, summary_lines
from swarmpipe.coordinator.tokens import TokenStore
from swarmpipe.errors import ConfigError, SwarmpipeError
from swarmpipe.node.main import TOKEN_ENV
from swarmpipe.process.ready import wait_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.testnet.churn import ChurnEvent, ChurnPlan, ChurnRecord, parse_schedule
from swarmpipe.testnet.metrics_scrape import MetricsScraper
from swarmpipe.testnet.netns import NetnsLab, check_available
from swarmpipe.testnet.netns_commands import exec_prefix
from swarmpipe.testnet.node_timeline import NodeTimeline
from swarmpipe.testnet.picture import write_picture
from swarmpipe.testnet.processes import COORDINATOR, Child, ProcessGroup
from swarmpipe.testnet.profiles import parse_profiles
from swarmpipe.testnet.progress import ProgressBar
from swarmpipe.testnet.time_breakdown import time_breakdown
from swarmpipe.transport.auth import ADMIN_TOKEN_KEY, CredentialHolder
from swarmpipe.transport.limits import MBIT
from swarmpipe.transport.rpc import open_channel
from swarmpipe.transport.tls import COORDINATOR_NAME, ChannelTLS

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0
POLL_S = 0.25
_AWAY = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
"""Status codes of a coordinator that is not there right now (it may be restarting)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=int, default=3, help="node daemons to start")
    parser.add_argument("--stages", type=int, help="pipeline stages (default: config, 3)")
    parser.add_argument("--steps", type=int, help="optimizer steps (default: config, 50)")
    add_config_arguments(parser)
    parser.add_argument("--out", help="output folder (default: ./testnet-runs/<time>)")
    parser.add_argument("--broker", default="", help="mqtt://host:port of an external broker")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per node")
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=120.0,
        help="fail when no step finishes for this many seconds",
    )
    parser.add_argument("--quiet", action="store_true", help="no live progress lines")
    parser.add_argument(
        "--no-picture",
        action="store_true",
        help="write report.json only, not report.png (drawing it costs about a CPU-second; "
        "python -m swarmpipe.testnet.picture OUT/report.json draws it later)",
    )
    parser.add_argument(
        "--device",
        default="",
        metavar="auto|cpu|cuda|cuda:N",
        help="every node's --device (several nodes may share one GPU); default: train.device",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        help="run over TLS: the coordinator makes the run CA and issues every node's "
        "certificate at Join (mutual TLS between nodes)",
    )
    parser.add_argument(
        "--link-mbit",
        type=float,
        help="limit every link to this many Mbit/s in each direction (pipeline.link_mbit)",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        help="delay everything each node sends to each peer by this many ms one way "
        "(pipeline.link_latency_ms)",
    )
    parser.add_argument(
        "--node-profile",
        action="append",
        default=[],
        metavar="NODE=mbit:X,slow:Y,lat:MS",
        help="give one node its own send limit (Mbit/s on each link), compute slowdown "
        "factor and one-way delay (ms), e.g. 'n0=mbit:50,slow:2,lat:80'; repeat for other nodes",
    )
    parser.add_argument(
        "--churn",
        default="",
        metavar="SCHEDULE",
        help="SIGKILL and start nodes (or the coordinator: 'kill coordinator@30s'), and change "
        "their send limits and profiles, on a schedule, e.g. 'kill n1@8s, start n1@step12, "
        "link n0=2@step8, link n0=off@step20' (seconds since training began, or steps "
        "finished; link NODE=MBIT or =off, NODE may be all; profile NODE=mbit:X,slow:Y "
        "changes a node's --node-profile)",
    )
    parser.add_argument(
        "--churn-random",
        type=float,
        default=0.0,
        metavar="RATE",
        help="also SIGKILL a random replica (whose stage keeps another) RATE times per minute, "
        "restarting it after --churn-downtime",
    )
    parser.add_argument("--churn-seed", type=int, default=0, help="seed of --churn-random")
    parser.add_argument(
        "--churn-downtime", type=float, default=5.0, help="seconds a random victim stays dead"
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="Linux, root: each daemon in a network namespace of its own on a bridge, its "
        "links shaped in the kernel (htb per peer; netem for the delay where the kernel has "
        "it) instead of in the sender; see docs/testnet.md",
    )
    parser.add_argument(
        "--metrics",
        action="store_true",
        help="serve Prometheus metrics from every daemon (--metrics-port 0), scrape them while "
        "the run goes on, and save each one's last scrape in OUT/metrics/ (report.json: metrics)",
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    extra = list(args.set)
    if args.stages is not None:
        extra.append(f"pipeline.stages={args.stages}")
    if args.steps is not None:
        extra.append(f"train.steps={args.steps}")
    if args.link_mbit is not None:
        extra.append(f"pipeline.link_mbit={args.link_mbit}")
    if args.latency_ms is not None:
        extra.append(f"pipeline.link_latency_ms={args.latency_ms}")
    return extra


class StallError(SwarmpipeError):
    """The testnet made no progress for too long."""


async def serve(args: argparse.Namespace) -> int:
    overrides = _overrides(args)
    config = load_config(args.config, overrides)
    if args.nodes < config.pipeline.stages:
        raise ConfigError(
            f"--nodes {args.nodes} cannot cover {config.pipeline.stages} stages; "
            "give at least one node per stage"
        )
    parse_profiles(args.node_profile, args.nodes)  # a bad profile fails before anything starts
    if args.netns:
        check_available()
        if args.broker or args.metrics:
            raise ConfigError("--netns runs the embedded broker and no --metrics; leave those out")
    if args.device:  # as a node would refuse it, but before any process starts
        check_device_spec(args.device, what="--device")  # a misspelt one: before torch
        from swarmpipe.node.device import resolve_device

        resolve_device(args.device)
    churn = ChurnPlan(
        parse_schedule(args.churn),
        random_rate_per_min=args.churn_random,
        seed=args.churn_seed,
        downtime_s=args.churn_downtime,
    )
    out = Path(args.out or Path("testnet-runs") / time.strftime("%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runner = Testnet(config, args, overrides, out, churn)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    loop.add_signal_handler(signal.SIGINT, main_task.cancel)
    loop.add_signal_handler(signal.SIGTERM, main_task.cancel)
    try:
        if args.netns:
            runner.use_netns(config)
        report = await runner.run()
    except asyncio.CancelledError:
        print("\ninterrupted: stopping every process", file=sys.stderr)
        return 130  # the finally below stops them
    finally:
        runner.group.stop_all()
        if runner.netns is not None:
            runner.netns.close()  # after the children: nothing inside holds a namespace
    path = out / "report.json"
    path.write_text(json.dumps(report, indent=2))
    if not args.quiet and runner.final_status is not None:
        print("\n".join(summary_lines(runner.final_status)))
    print(f"report: {path}")
    if not args.no_picture:
        write_picture(report, out / "report.png")
    return 0


class Testnet:
    def __init__(
        self,
        config: RunConfig,
        args: argparse.Namespace,
        overrides: list[str],
        out: Path,
        churn: ChurnPlan | None = None,
    ) -> None:
        self.config = config
        self.args = args
        self.overrides = overrides
        self.out = out
        self.group = ProcessGroup(out)
        self.churn = churn or ChurnPlan([])
        self.churn_records: list[ChurnRecord] = []
        self.final_status: coordinator_pb2.StatusReply | None = None
        self.target = ""
        self.broker_url = ""
        self.link_controls: set[str] = set()
        self.controls: dict[str, tuple[float | None, float | None]] = {}
        """Per control topic (node or all): the send limit (bytes/s; None: withdrawn) and
        compute slowdown (None: the node's own) the testnet's churn set, sent together."""
        """Nodes (or "all") given a retained LinkControl, cleared when the run ends."""
        self.training_since: float | None = None
        self.training_began_wall: float | None = None
        self.step_seen_at: list[float] = []
        self.scraper = MetricsScraper(out, time.monotonic()) if args.metrics else None
        self.daemon_args = ["--metrics-port", "0"] if args.metrics else []
        """Flags every daemon gets after its subcommand."""
        self.log_args = ["--log-level", "INFO", "--log-format", args.log_format]
        self.node_timeline = NodeTimeline()
        self.profiles = parse_profiles(args.node_profile, args.nodes)
        self.coord_args: list[str] = []
        """The coordinator's command line; `start coordinator@T` runs it again, and it takes
        up the run from its state database on the same ports."""
        self.bar: ProgressBar | None = None
        """The live bar, on a terminal without --quiet; otherwise plain progress lines."""
        self.admin_token = ""
        """The organiser's token (the coordinator's admin-token file), for Status and MQTT."""
        self.node_env: dict[str, str] = {}
        """What every node gets in its environment: the join token the testnet made."""
        self.credential = CredentialHolder()
        """What the testnet's own calls to the coordinator carry: the organiser's token."""
        self.ca_file = ""
        """With --tls: the run CA the coordinator made, which nodes get as --ca-file."""
        self.netns: NetnsLab | None = None
        """With --netns: every daemon's namespace and the kernel's shaping of its links."""

    def use_netns(self, config: RunConfig) -> None:
        """Put each child in a namespace of its own (made on its first start)."""
        lab, note = NetnsLab.open(
            COORDINATOR,
            self.args.nodes,
            run_mbit=config.pipeline.link_mbit,
            run_latency_ms=config.pipeline.link_latency_ms,
            profiles=self.profiles,
        )
        self.netns = lab
        if note:
            print(note, file=sys.stderr, flush=True)
        self.group.wrap = lambda name: exec_prefix(lab.ensure(name))

    def _host(self, name: str) -> str:
        return "127.0.0.1" if self.netns is None else self.netns.ensure(name).address

    def _node_args(self, name: str) -> list[str]:
        node_args = [
            *self.log_args,
            "node",
            *self.daemon_args,
            "--coordinator",
            self.target,
            "--node-id",
            name,
            "--listen",
            f"{self._host(name)}:0",
            "--threads",
            str(self.args.threads),
        ]
        if self.args.broker:
            node_args += ["--broker", self.args.broker]
        if self.args.device:
            node_args += ["--device", self.args.device]
        if self.netns is not None and not self.args.tls:
            node_args.append("--insecure")  # a private bridge, as for the coordinator
        profile = self.profiles.get(name)
        if profile is not None:
            node_args += profile.node_args()
        if self.ca_file:
            node_args += ["--ca-file", self.ca_file]
        if self.netns is not None:
            node_args += self.netns.node_flags()
        return node_args

    def _start_children(self) -> str:
        # --stay: the testnet reads the final Status after the nodes leave, then stops it.
        host = self._host(COORDINATOR)
        coord_args = [*self.log_args, "coordinator", *self.daemon_args, "--listen", f"{host}:0"]
        if self.netns is not None:
            coord_args += ["--broker-listen", f"{host}:0"]
            if not self.args.tls:
                # The namespaces' bridge is private to this machine: plaintext there is what
                # the loopback testnet does, not a door to the world.
                coord_args.append("--insecure")
        coord_args.append("--stay")
        state_dir = self.out / "coordinator-state"
        coord_args += ["--state-dir", str(state_dir)]
        # A closed run, like a real one, with nothing in the user's hands: the testnet makes
        # the join token its nodes get (in their environment, out of `ps`).
        _, token = TokenStore(state_dir).create(expires_s=None, note="testnet")
        self.node_env = {TOKEN_ENV: token}
        if self.args.config:
            coord_args += ["--config", str(Path(self.args.config).resolve())]
        for item in [f"coordinator.min_nodes={self.args.nodes}", *self.overrides]:
            coord_args += ["--set", item]
        if self.args.broker:
            coord_args += ["--broker", self.args.broker]
        if self.args.tls:
            coord_args.append("--tls")
        self.coord_args = coord_args
        coordinator = self.group.start(COORDINATOR, coord_args)
        try:
            ready = wait_ready_file(coordinator.ready_file, START_TIMEOUT_S, coordinator.alive)
        except (RuntimeError, TimeoutError) as exc:
            raise SwarmpipeError(
                f"the coordinator did not start ({exc}); the end of {coordinator.log_path}:\n"
                f"{coordinator.log_tail()}"
            ) from exc
        self.ca_file = ready.get("ca_file") or ""
        self.target = f"{host}:{ready['grpc_port']}"
        admin_token = load_or_create_admin_token(state_dir)
        self.credential.set(ADMIN_TOKEN_KEY, admin_token)
        self.admin_token = admin_token
        self.broker_url = self.args.broker or ready["broker_url"]
        for i in range(self.args.nodes):
            self.group.start(f"n{i}", self._node_args(f"n{i}"), env=self.node_env)
        return self.target

    async def run(self) -> dict[str, Any]:
        started = time.time()
        t0 = time.monotonic()
        target = await asyncio.to_thread(self._start_children)
        channel = open_channel(
            target,
            self.credential,
            ChannelTLS(Path(self.ca_file).read_bytes(), COORDINATOR_NAME) if self.ca_file else None,
        )
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        try:
            if sys.stdout.isatty() and not self.args.quiet:
                self.bar = ProgressBar()
            with self.bar or contextlib.nullcontext():
                status = await self._follow(stub)
            # Nodes leave by themselves once the run is done; give them a moment.
            deadline = time.monotonic() + 15
            while any(c.alive() for c in self.group.nodes()) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            status = await stub.Status(coordinator_pb2.StatusRequest(), timeout=10)
            if self.scraper is not None:
                status = await self.scraper.scrape_final(
                    self.group,
                    status,
                    lambda: stub.Status(coordinator_pb2.StatusRequest(), timeout=10),
                )
            self.final_status = status
        finally:
            await channel.close()
            await self._clear_link_controls()
        wall = time.monotonic() - t0
        report = build_report(
            self.config,
            status,
            started=started,
            wall_seconds=wall,
            nodes=self.args.nodes,
            logs=str(self.out / "logs"),
        )
        # When each step was seen finished, in seconds since training began
        # (to the 0.25 s poll), so samples/s can be lined up with churn events.
        for record, seen in zip(report["steps"], self.step_seen_at, strict=False):
            record["seen_at_seconds"] = seen
        report["churn"] = [r.as_dict() for r in self.churn_records]
        if self.netns is not None:
            report["netns"] = self.netns.describe()
        # Steps and churn count from when training began, link_choices from the testnet's
        # start: this offset lines the two up.
        report["training_began_at_seconds"] = (
            None if self.training_began_wall is None else self.training_began_wall - started
        )
        report["churn_not_reached"] = [e.label for e in self.churn.pending]
        report["final_states"] = [
            {"stage": f.stage, "step": f.step, "path": f.path} for f in status.final_states
        ]
        report["joins"], report["departures"] = status.joins, status.departures
        report["moves"] = [
            {
                "node": m.node_id,
                "from_stage": m.from_stage,
                "to_stage": m.to_stage,
                "reason": m.reason,
                "step": m.step,
                "elapsed_s": m.elapsed_s,
            }
            for m in status.moves
        ]
        # Nodes the coordinator took out for poisoned tensors (node/robust_reduce.py).
        report["reports"] = status.reports
        report["benched"] = [
            {
                "node": b.node_id,
                "stage": b.stage,
                "reason": b.reason,
                "step": b.step,
                "reporters": list(b.reporters),
                "elapsed_s": b.elapsed_s,
                "step_begun_again": b.step_begun_again,
            }
            for b in status.benched
        ]
        if self.scraper is not None:
            report["metrics"] = self.scraper.finish()
        # Each node's stage, online and serving flags as they changed, on the churn clock.
        report["node_timeline"] = self.node_timeline.records(
            t0 if self.training_since is None else self.training_since
        )
        return report

    async def _churn(self, status: coordinator_pb2.StatusReply, now: float) -> None:
        """Record nodes killed from outside, perform the churn events due now and record
        them."""
        if self.training_since is None and not (status.phase == "waiting" and not status.steps):
            self.training_since = now
            self.training_began_wall = time.time()
        elapsed = 0.0 if self.training_since is None else now - self.training_since
        steps = len(status.steps)
        stages = {n.node_id: n.stage for n in status.nodes}
        for dead in self.group.killed_from_outside():
            signal_name = _signal_name(-(dead.popen.returncode or 0))
            self._record(
                ChurnRecord(
                    "died",
                    dead.name,
                    "outside",
                    elapsed,
                    steps,
                    stages.get(dead.name, -1),
                    f"killed by {signal_name} from outside the testnet",
                )
            )
            if dead.name == COORDINATOR:
                # As a supervisor (systemd's Restart=on-failure) would: it takes the run
                # up from its state database while the nodes train on and reconnect.
                if status.done:
                    raise SwarmpipeError(
                        f"the coordinator was killed by {signal_name} after the run was done"
                    )
                self.group.start(COORDINATOR, self.coord_args)
                self._record(
                    ChurnRecord("start", COORDINATOR, "restart", elapsed, steps, -1, "started")
                )
        if self.training_since is None:
            return  # the schedules count from the start of training
        for event in self.churn.due(elapsed, steps):
            if status.done and event.node == COORDINATOR:
                # A finished run's coordinator is not started again (it would refuse the
                # finished run): the event is reported as not reached.
                self.churn.pending.append(event)
                continue
            if event.action in ("link", "profile"):
                await self._link(event, steps=steps, stages=stages)
            else:
                self._perform(event.action, event.node, event.when, steps=steps, stages=stages)
        online: dict[int, list[str]] = {}
        for n in status.nodes:
            child = self.group.latest(n.node_id)
            if n.online and child is not None and child.alive():
                online.setdefault(n.stage, []).append(n.node_id)
        eligible = [node for nodes in online.values() if len(nodes) > 1 for node in nodes]
        victim = self.churn.random_victim(elapsed, eligible)
        if victim == "":
            self.churn_records.append(
                ChurnRecord("kill", "", "random", elapsed, steps, -1, "skipped: no stage has 2")
            )
        elif victim is not None:
            self._perform("kill", victim, "random", steps=steps, stages=stages)

    def _perform(
        self,
        action: str,
        node: str,
        planned: str,
        *,
        steps: int,
        stages: dict[str, int],
    ) -> None:
        # Each action's own time: several can fall due in one poll (a fast run
        # finishes steps 3 to 5 between two polls), and a start that follows a
        # kill must not be reported as simultaneous with it.
        assert self.training_since is not None
        elapsed = time.monotonic() - self.training_since
        child: Child | None = self.group.latest(node)
        if action == "kill":
            killed = child is not None and self.group.kill_on_purpose(child)
            outcome = "killed" if killed else "not running"
        elif child is not None and child.alive():
            outcome = "already running"
        else:
            if node == COORDINATOR:
                self.group.start(node, self.coord_args)
            else:
                self.group.start(node, self._node_args(node), env=self.node_env)
            outcome = "started"
        record = ChurnRecord(action, node, planned, elapsed, steps, stages.get(node, -1), outcome)
        self._record(record)

    def _record(self, record: ChurnRecord) -> None:
        self.churn_records.append(record)
        what = f"{record.action} {record.node}"
        logger.info(
            "churn: %s at %.1f s (step %d): %s",
            what,
            record.at_seconds,
            record.step,
            record.outcome,
        )
        if not self.args.quiet:
            print(
                f"churn: {what} at {record.at_seconds:.1f} s, step {record.step}: {record.outcome}",
                flush=True,
            )

    async def _link(self, event: ChurnEvent, *, steps: int, stages: dict[str, int]) -> None:
        """Publish the event's LinkControl, as `swarmpipe link-limit` would: a `link` event
        sets or withdraws the send limit, a `profile` event the keys it names; the node's
        other setting goes along unchanged (one retained message holds both). With --netns
        the kernel shapes the links, so a limit changes the node's classes there instead."""
        assert self.training_since is not None
        limit, slowdown = self.controls.get(event.node, (None, None))
        sets_limit = event.action == "link" or event.mbit is not None
        if sets_limit:
            limit = None if event.mbit is None else event.mbit * MBIT
        if event.slow is not None:
            slowdown = event.slow
        self.controls[event.node] = (limit, slowdown)
        changed: list[str] | None = None
        if self.netns is not None and sets_limit:
            changed = await asyncio.to_thread(self.netns.set_rate, event.node, event.mbit)
        if self.netns is None or slowdown is not None:
            self.link_controls.add(event.node)
            await link_control.publish(
                self._organiser_broker(),
                self.config.run_id,
                event.node,
                limit if self.netns is None else None,
                slowdown=slowdown,
            )
        elapsed = time.monotonic() - self.training_since
        outcome = "withdrawn" if limit is None else f"limited to {link_control.describe(limit)}"
        if event.action == "profile":
            outcome = "set " + ", ".join(
                ([f"send limit {link_control.describe(limit)}"] if event.mbit is not None else [])
                + ([f"compute slowdown {event.slow:g}"] if event.slow is not None else [])
            )
        if changed is not None:
            outcome = f"{outcome} in the kernel" if changed else "not running"
        self._record(
            ChurnRecord(
                event.action,
                event.node,
                event.when,
                elapsed,
                steps,
                stages.get(event.node, -1),
                outcome,
                mbit=event.mbit,
                slow=event.slow,
            )
        )

    def _organiser_broker(self) -> BrokerAddress:
        """The run's broker with the organiser's login: only it may publish link limits."""
        broker = parse_broker_url(self.broker_url)
        if broker.tls and self.ca_file:
            broker = dataclasses.replace(broker, ca_pem=Path(self.ca_file).read_bytes())
        return link_control.organiser_login(broker, self.admin_token)

    async def _clear_link_controls(self) -> None:
        """Clear the retained LinkControl messages of this run: a later run with the same
        run_id on an external broker must not start with them."""
        for node in sorted(self.link_controls):
            try:
                await link_control.publish(self._organiser_broker(), self.config.run_id, node, None)
            except SwarmpipeError as exc:
                logger.warning("could not clear the link control message of %s: %s", node, exc)
        self.link_controls.clear()

    async def _follow(self, stub: coordinator_pb2_grpc.CoordinatorStub) -> Any:
        last_step_count, last_progress = -1, time.monotonic()
        last_bytes, last_time = 0, time.monotonic()
        next_line = 0.0
        status: coordinator_pb2.StatusReply | None = None
        while True:
            crashed = self.group.crashed()
            if crashed:
                c = crashed[0]
                raise SwarmpipeError(
                    f"{c.name} exited with code {c.popen.returncode}; last lines of "
                    f"{c.log_path}:\n{c.log_tail()}"
                )
            try:
                status = await stub.Status(coordinator_pb2.StatusRequest(), timeout=5)
            except grpc.aio.AioRpcError as exc:
                coordinator = self.group.latest(COORDINATOR)
                away = coordinator is not None and coordinator.killed_on_purpose
                if status is None or not (away or exc.code() in _AWAY):
                    raise SwarmpipeError(
                        f"the coordinator stopped answering: {exc.code().name}"
                    ) from exc
                # The coordinator is away (killed by the churn schedule, or restarting): the
                # schedule goes on from the last status, to start it again; the stall
                # timeout still ends a run it never comes back to.
                now = time.monotonic()
                await self._churn(status, now)
                if now - last_progress > self.args.stall_timeout:
                    raise StallError(
                        f"the coordinator has not answered for {self.args.stall_timeout:.0f} s "
                        f"({exc.code().name}); logs are in {self.out / 'logs'}"
                    ) from exc
                await asyncio.sleep(POLL_S)
                continue
            now = time.monotonic()
            if self.scraper is not None:
                await self.scraper.scrape(self.group, done=status.done, force=status.done)
            await self._churn(status, now)
            self.node_timeline.observe(now, len(status.steps), status.nodes)
            if self.training_since is not None:
                while len(self.step_seen_at) < len(status.steps):
                    self.step_seen_at.append(now - self.training_since)
            if len(status.steps) != last_step_count:
                last_step_count, last_progress = len(status.steps), now
            elif now - last_progress > self.args.stall_timeout:
                raise StallError(
                    f"no step finished for {self.args.stall_timeout:.0f} s (phase "
                    f"{status.phase}, step {status.step}); logs are in {self.out / 'logs'}"
                )
            total_bytes = sum(link.bytes for link in status.links)
            if self.bar is not None:
                self.bar.update(status, now)
            elif not self.args.quiet and (now >= next_line or status.done):
                rate = (total_bytes - last_bytes) / max(now - last_time, 1e-9)
                last_bytes, last_time = total_bytes, now
                print(progress_line(status, rate), flush=True)
                next_line = now + 2.0
            if status.done:
                return status
            await asyncio.sleep(POLL_S)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def progress_line(status: coordinator_pb2.StatusReply, bytes_per_second: float) -> str:
    c = status.counters
    online = sum(1 for n in status.nodes if n.online)
    if status.steps:
        last = status.steps[-1]
        recent = status.steps[-5:]
        busy = busy_seconds((s.elapsed_s - s.seconds, s.elapsed_s) for s in recent)
        sps = sum(s.samples for s in recent) / max(busy, 1e-9)
        loss = f"loss {last.loss:.4f}"
    else:
        sps, loss = 0.0, "loss -"
    if status.evals:
        loss += f" eval {status.evals[-1].loss:.4f}"
    return (
        f"step {len(status.steps)}/{status.total_steps} {status.phase:<8} {loss} | "
        f"{sps:6.1f} samples/s | {bytes_per_second / 1e6:6.2f} MB/s | nodes {online}/"
        f"{len(status.nodes)} | leased {c.leased} committed {c.committed} "
        f"replayed {c.replayed} lost {c.lost}"
    )


def link_choices(status: coordinator_pb2.StatusReply, started: float) -> list[dict[str, Any]]:
    """Per link and direction: measured bandwidth, and which codec it used from when on.

    `timeline` entries give `seconds` since the testnet started (senders' clocks are this
    machine's) and the sender's `step` when the codec took over.
    """
    return [
        {
            "src": c.src_node,
            "dst": c.dst_node,
            "direction": c.direction,
            "measured_mbit": c.bytes_per_second * 8 / 1e6,
            "limit_mbit": c.limit_bytes_per_second * 8 / 1e6,
            "latency_ms": c.latency_ms,
            "wire_bytes": c.wire_bytes,
            "codec": c.codec,
            "timeline": [
                {
                    "seconds": change.timestamp - started,
                    "step": change.step,
                    "codec": change.codec,
                    "measured_mbit": change.bytes_per_second * 8 / 1e6,
                    "budget_ms": change.budget_seconds * 1e3,
                }
                for change in c.changes
            ],
        }
        for c in status.link_choices
    ]


def build_report(
    config: RunConfig,
    status: coordinator_pb2.StatusReply,
    *,
    started: float,
    wall_seconds: float,
    nodes: int,
    logs: str,
) -> dict[str, Any]:
    steps = [
        {
            "step": s.step,
            "loss": s.loss,
            "samples": s.samples,
            "seconds": s.seconds,
            "samples_per_second": s.samples_per_second,
            "elapsed_s": s.elapsed_s,
            # The parameters the step trained on, in optimizer steps applied: its own number,
            # or fewer for a step opened early (train.step_overlap).
            "trains_on": s.trains_on,
        }
        for s in status.steps
    ]
    evals = [
        {
            "step": e.step,
            "loss": e.loss,
            "tokens": e.tokens,
            "elapsed_s": e.elapsed_s,
            "trains_on": e.trains_on,
        }
        for e in status.evals
    ]
    train_seconds = busy_seconds((s["elapsed_s"] - s["seconds"], s["elapsed_s"]) for s in steps)
    c = status.counters
    return {
        "format": "swarmpipe.testnet/1",
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_seconds": wall_seconds,
        "nodes": nodes,
        "config": dataclasses.asdict(config),
        "samples_per_second": (
            sum(s["samples"] for s in steps) / train_seconds if train_seconds else 0.0
        ),
        "final_loss": steps[-1]["loss"] if steps else None,
        "final_eval_loss": evals[-1]["loss"] if evals else None,
        "steps": steps,
        "evals": evals,
        "links": [
            {
                "src": link.src_node,
                "dst": link.dst_node,
                "direction": link.direction,
                "codec": link.codec,
                "bytes": link.bytes,
                "tensors": link.tensors,
            }
            for link in status.links
        ],
        "link_choices": link_choices(status, started),
        "compute_ms_per_microbatch": {
            n.node_id: n.compute_seconds_per_microbatch * 1e3 for n in status.nodes
        },
        # Each head's window of microbatches in flight at the end (pipeline.in_flight).
        "in_flight": {n.node_id: n.in_flight_window for n in status.nodes if n.in_flight_window},
        # Where the time went: the coordinator's step boundaries and each node's phases.
        "time_breakdown": time_breakdown(status),
        "counters": sample_counters(c),
        "members": [
            {
                "node_id": n.node_id,
                "stage": n.stage,
                "address": n.address,
                "online": n.online,
                "last_step": n.last_step,
                "param_digest": n.param_digest,
                "samples": n.samples,
                "serving": n.serving,
            }
            for n in status.nodes
        ],
        "logs": logs,
    }
