"""Fixtures shared by the multi-process tests: real daemons on 127.0.0.1, always reaped."""

from __future__ import annotations

import collections
import contextlib
import gc
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from swarmpipe.process.ready import poll_until, read_ready_file, wait_ready_file
from swarmpipe.protos import coordinator_pb2, coordinator_pb2_grpc
from swarmpipe.transport.auth import ADMIN_TOKEN_KEY, CREDENTIAL_KEY, ROLE_COORDINATOR, RunKey
from tests.reaper import start_reaper

REPO = Path(__file__).resolve().parent.parent

# A model small enough that a 3-stage testnet trains 10 steps in seconds on 2 cores.
TINY = [
    "model.n_layers=4",
    "model.d_model=32",
    "model.n_heads=2",
    "model.context=32",
    "train.global_batch=16",
    "train.microbatch=4",
    "train.lr=0.003",
    # Every node on the CPU even where a GPU is free, so equality with the CPU baseline
    # holds on any machine; the GPU tests set train.device=cuda after these.
    "train.device=cpu",
]


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread in the test processes and the children they start, unless the caller
    set OMP_NUM_THREADS: torch's default pool, a thread per core, spins against the other
    worker and the node daemons on a shared 2-core machine. The tiny model's 10-step
    single-process baseline took 50 s so under load, and 7 s on one thread. Before
    collection, so before any test module imports torch (xdist's workers inherit it)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "torch" in sys.modules:  # a plugin got there first: the variable came too late
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Whatever this process starts from here on is killed if it dies unreaped (SIGKILL, a
    # CI timeout): tests/reaper.py. Each xdist worker runs this too, with its own watcher.
    start_reaper()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the modules that hold slow tests first, each in its own order, the rest after.

    scripts/test.sh hands modules to two workers as each finishes one; a minute-long scenario
    handed out last would leave the other worker idle for most of that minute, while short
    tests at the end fill the gaps. The sort is stable: modules keep their order, and tests
    that share a module's processes keep theirs."""
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Collect garbage after a module's last test, its fixtures torn down, so what that
    module left unclosed (an event loop, a socket) warns in its own teardown, under its own
    filters, rather than from whichever test the collector next ran in: a codec test under
    filterwarnings("error") failed on another module's event loop so.

    Before pytest's own teardown hook, which reports those warnings (both run last; among
    those, pluggy calls the later-registered conftest first). One collection per module:
    about 0.02 s each, 120 modules."""
    if nextitem is None or nextitem.path != item.path:
        gc.collect()


@pytest.fixture(autouse=True)
def _no_stale_log_handler() -> Iterator[None]:
    """Take off the root logger, after each test, the handler an in-process entry point
    added (process/logs.py configure_logging: a StreamHandler on the stderr that pytest
    captured for that test, closed once the test ends).

    Left on, any later log line in the process, a garbage-collected event loop's included,
    printed '--- Logging error ---' and a traceback into whichever test ran then: which one
    depends on the order, and on two workers the order changes."""
    level = logging.getLogger().level
    yield
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if type(h) is not logging.StreamHandler]
    root.setLevel(level)


class _Details(
    collections.namedtuple(
        "_Details",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class WithMetadata(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `pairs` to the metadata of every call on a (blocking) channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self.pairs = pairs

    def _details(self, d: Any) -> _Details:
        metadata = (*(d.metadata or ()), *self.pairs)
        return _Details(
            d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression
        )

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
        return continuation(self._details(details), requests)


GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl_protos(folder: Path) -> list[str]:
    """grpcurl flags that read our services from the .proto files, as a stranger with the
    source would (reflection shows a caller without a credential the health service only).
    The files import each other as `swarmpipe/protos/...`: `folder` gets that link."""
    root = folder / "proto-root"
    root.mkdir(parents=True, exist_ok=True)
    link = root / "swarmpipe"
    if not link.exists():
        link.symlink_to(REPO, target_is_directory=True)
    files = ("coordinator.proto", "stage.proto")
    return [
        "-import-path",
        str(root),
        *(a for f in files for a in ("-proto", f"swarmpipe/protos/{f}")),
    ]


def run_to_end(stub: Any, timeout: float = 240) -> coordinator_pb2.StatusReply:
    """The coordinator's Status once its run is done (`stub`: a CoordinatorStub)."""
    final: coordinator_pb2.StatusReply = poll_until(
        lambda: (s := stub.Status(coordinator_pb2.StatusRequest(), timeout=5)).done and s,
        timeout,
        "the run to finish",
    )
    return final


def run_to_end_at(target: str, timeout: float = 240) -> coordinator_pb2.StatusReply:
    """`run_to_end` over a channel of its own to the coordinator at `target`."""
    with grpc.insecure_channel(target) as channel:
        return run_to_end(coordinator_pb2_grpc.CoordinatorStub(channel), timeout)


def organiser_channel(target: str, state_dir: Path) -> grpc.Channel:
    """A channel to the coordinator at `target` whose calls carry the organiser's token
    (`state_dir/admin-token`), as `swarmpipe status --admin-token-file` sends it."""
    token = (state_dir / "admin-token").read_text().strip()
    return grpc.intercept_channel(
        grpc.insecure_channel(target), WithMetadata(((ADMIN_TOKEN_KEY, token),))
    )


class Procs:
    """Starts `python -m swarmpipe ...` children in their own sessions and reaps them."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.children: list[tuple[subprocess.Popen[bytes], Path]] = []

    def start(
        self, name: str, *args: str, ready: bool = True, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        log = self.tmp / f"{name}.log"
        ready_file = self.tmp / f"{name}.ready.json"
        cmd = [sys.executable, "-m", "swarmpipe", *args]
        if ready:
            cmd += ["--ready-file", str(ready_file)]
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        self.children.append((popen, log))
        info: dict[str, Any] = {}
        if ready:
            try:
                info = wait_ready_file(ready_file, 60, lambda: popen.poll() is None)
            except (RuntimeError, TimeoutError) as exc:
                raise AssertionError(f"{name} did not start: {exc}\n{log.read_text()}") from exc
        return popen, info

    def coordinator(self, *settings: str, broker: str | None = None, stay: bool = True) -> str:
        """Start a coordinator; by default it stays after the run is done, so a test can
        still ask its Status (`stay=False`: it prints its summary and exits, as a user's)."""
        args = ["coordinator", "--listen", "127.0.0.1:0"]
        args += ["--state-dir", str(self.tmp / "coordinator-state")]
        if stay:
            args.append("--stay")
        for s in settings:
            args += ["--set", s]
        if broker:
            args += ["--broker", broker]
        _, info = self.start("coordinator", *args)
        return f"127.0.0.1:{info['grpc_port']}"

    def tls_pair(self, *settings: str) -> tuple[str, str, dict[str, Any], str]:
        """A closed --tls coordinator on 2 stages with nodes n0 and n1 serving it (a join
        token in hand, the CA from the ready file); returns the coordinator's address, the
        CA file, n1's ready file and the join token."""
        state = self.tmp / "coordinator-state"
        from swarmpipe.coordinator.tokens import TokenStore

        _, token = TokenStore(state).create(expires_s=None, note="test")
        args = ["coordinator", "--listen", "127.0.0.1:0", "--tls", "--state-dir", str(state),
                "--stay"]  # fmt: skip
        for s in ["pipeline.stages=2", *settings]:
            args += ["--set", s]
        _, ready = self.start("coordinator", *args)
        coordinator = f"127.0.0.1:{ready['grpc_port']}"
        ca_file: str = ready["ca_file"]
        env = {"SWARMPIPE_TOKEN": token}
        self.node("n0", coordinator, "--ca-file", ca_file, env=env)
        _, info = self.node("n1", coordinator, "--ca-file", ca_file, env=env)
        self.wait_serving("n1")
        return coordinator, ca_file, info, token

    @staticmethod
    def _node_args(name: str, coordinator: str) -> list[str]:
        # No --listen: a node of a coordinator on loopback serves on loopback by default.
        return ["node", "--coordinator", coordinator, "--node-id", name, "--threads", "1"]

    def node(
        self, name: str, coordinator: str, *extra: str, env: dict[str, str] | None = None
    ) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
        """Start one node; `env` adds variables (e.g. an armed fault point)."""
        return self.start(name, *self._node_args(name, coordinator), *extra, env=env)

    def nodes(self, count: int, coordinator: str) -> dict[str, subprocess.Popen[bytes]]:
        """Start `count` nodes at once (n0, n1, ...) and wait until each has joined."""
        started = {}
        for i in range(count):
            name = f"n{i}"
            ready = str(self.tmp / f"{name}.ready.json")
            args = [*self._node_args(name, coordinator), "--ready-file", ready]
            started[name] = self.start(name, *args, ready=False)[0]
        for name, popen in started.items():
            try:
                wait_ready_file(
                    self.tmp / f"{name}.ready.json", 60, lambda p=popen: p.poll() is None
                )
            except (RuntimeError, TimeoutError) as exc:
                log = (self.tmp / f"{name}.log").read_text()
                raise AssertionError(f"{name} did not start: {exc}\n{log}") from exc
        return started

    def wait_serving(self, name: str, timeout: float = 120) -> dict[str, Any]:
        """Wait until node `name` holds its stage's current state and takes traffic (a node
        joining a running run downloads it first); returns its ready file, with the join's
        `source`, `step`, `download_bytes` and timestamps."""
        popen = next(p for p, log in self.children if log.name == f"{name}.log")
        path = self.tmp / f"{name}.ready.json"

        def serving() -> dict[str, Any] | None:
            if popen.poll() is not None:
                raise AssertionError(f"{name} exited:\n{(self.tmp / f'{name}.log').read_text()}")
            info = read_ready_file(path)
            return info if info and info.get("serving") else None

        info: dict[str, Any] = poll_until(serving, timeout, f"{name} to serve")
        return info

    def credential(self, node_id: str = "test", role: str = ROLE_COORDINATOR) -> str:
        """A credential the coordinator's run key signed (by default as the coordinator's)."""
        state_dir = self.tmp / "coordinator-state"
        (run_id,) = [p.name for p in (state_dir / "checkpoints").iterdir()]
        return RunKey.load_or_create(state_dir, run_id).issue(node_id, role=role)

    def peer_channel(self, port: int, node_id: str = "test") -> grpc.Channel:
        """A channel to the node on `port` whose calls carry a credential the coordinator's
        run key signed (as the coordinator's own), so a test can talk to a node directly."""
        credential = self.credential(node_id)
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        return grpc.intercept_channel(channel, WithMetadata(((CREDENTIAL_KEY, credential),)))

    def reap(self) -> None:
        for popen, _ in self.children:
            if popen.poll() is None:
                try:
                    os.killpg(popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            popen.wait(timeout=30)


@pytest.fixture
def tiny() -> list[str]:
    """Config overrides for a model small enough to train in seconds."""
    return list(TINY)


@pytest.fixture(scope="session")
def tiny_settings() -> tuple[str, ...]:
    """The same overrides, for fixtures shared by several tests."""
    return tuple(TINY)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.reap()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    """Processes shared by a module's tests that only read them; reaped after the module."""
    p = Procs(tmp_path_factory.mktemp("shared"))
    try:
        yield p
    finally:
        p.reap()


@contextlib.contextmanager
def run_mosquitto(conf: Path, settings: list[str]) -> Iterator[str]:
    """Debian's mosquitto on a free loopback port with `settings` (mosquitto.conf lines
    beside the listener) written to `conf`; yields its mqtt:// URL and stops it after."""
    binary = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
    if not Path(binary).exists():
        pytest.skip("mosquitto is not installed (scripts/test.sh installs it as root)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf.write_text("\n".join([f"listener {port} 127.0.0.1", *settings]) + "\n")
    popen = subprocess.Popen(
        [binary, "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:

        def accepting() -> bool:
            with socket.socket() as c:
                return c.connect_ex(("127.0.0.1", port)) == 0

        poll_until(accepting, 10, "mosquitto to accept connections")
        yield f"mqtt://127.0.0.1:{port}"
    finally:
        popen.terminate()
        popen.wait(timeout=10)


@pytest.fixture(scope="session")
def mosquitto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real mosquitto broker on a free loopback port, anonymous clients welcome."""
    conf = tmp_path_factory.mktemp("mosquitto") / "mosquitto.conf"
    settings = ["allow_anonymous true", "persistence false"]
    if os.geteuid() == 0:
        settings.append("user root")  # else it drops to `mosquitto`, who cannot read tmp dirs
    with run_mosquitto(conf, settings) as url:
        yield url


@pytest.fixture
def mosquitto_with(tmp_path: Path) -> Iterator[Callable[[list[str]], str]]:
    """Start a mosquitto of this test's own: `mosquitto_with(settings)` returns its URL."""
    with contextlib.ExitStack() as stack:

        def start(settings: list[str]) -> str:
            return stack.enter_context(run_mosquitto(tmp_path / "mosquitto.conf", settings))

        yield start
