"""Child processes of a testnet: started in their own session, logged to files, always reaped.

Known failure mode this guards against: a testnet killed hard (SIGKILL) would
leave its daemons running. Each child asks the kernel for SIGTERM when its
parent dies (PR_SET_PDEATHSIG, Linux), so even then nothing is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
COORDINATOR = "coordinator"
"""The coordinator child's name (a churn schedule may kill and start it like a node)."""


_prctl: Callable[..., int] | None = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl


def die_with_parent() -> None:
    """`preexec_fn` of a child that must not outlive its parent: the kernel sends it SIGTERM
    when the parent dies (Linux; nothing elsewhere). prctl is looked up at import, so
    between fork and exec the child makes this one call."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ready_file: Path
    started_at: float = field(default_factory=time.monotonic)
    killed_on_purpose: bool = False
    """A churn scenario SIGKILLed it: its exit is planned, not a crash."""
    reported: bool = False
    """Its death from outside the testnet is already recorded as churn."""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


class ProcessGroup:
    """Starts swarmpipe subcommands and guarantees they are all gone at the end."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Child] = []
        self.wrap: Callable[[str], list[str]] | None = None
        """What goes before a child's command, by its name (`ip netns exec NS` with --netns)."""
        (workdir / "logs").mkdir(parents=True, exist_ok=True)

    def coordinator_and_node(
        self, settings: list[str], timeout_s: float
    ) -> tuple[Child, dict[str, Any], Child, dict[str, Any]]:
        """A coordinator on 2 stages (state in `workdir/state`, staying after the run) and
        node n0 serving it: each Child with its ready file's contents (the benches that
        measure one node under attack start this)."""
        from swarmpipe.process.ready import poll_until, read_ready_file, wait_ready_file

        args = ["coordinator", "--listen", "127.0.0.1:0"]
        args += ["--state-dir", str(self.workdir / "state"), "--stay"]
        for item in ["pipeline.stages=2", *settings]:
            args += ["--set", item]
        coordinator = self.start("coordinator", args)
        ready = wait_ready_file(coordinator.ready_file, timeout_s, coordinator.alive)
        node = self.start(
            "n0",
            ["node", "--coordinator", f"127.0.0.1:{ready['grpc_port']}", "--node-id", "n0",
             "--listen", "127.0.0.1:0", "--threads", "1"],
        )  # fmt: skip

        def serving() -> dict[str, Any] | None:
            if not node.alive():
                raise SystemExit(f"n0 exited:\n{node.log_tail()}")
            info = read_ready_file(node.ready_file)
            return info if info and info.get("serving") else None

        info: dict[str, Any] = poll_until(serving, timeout_s, "n0 to serve")
        return coordinator, ready, node, info

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Child:
        log_path = self.workdir / "logs" / f"{name}.log"
        ready = self.workdir / "logs" / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "swarmpipe", *args, "--ready-file", str(ready)]
        if self.wrap is not None:
            cmd = [*self.wrap(name), *cmd]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,  # Ctrl-C reaches the testnet, which stops children in order
                preexec_fn=die_with_parent,  # noqa: PLW1509 - needed for PDEATHSIG
            )
        child = Child(name, popen, log_path, ready)
        self.children.append(child)
        return child

    def crashed(self) -> list[Child]:
        """Children that failed: the coordinator exiting with code 0 before the run was
        done, or any child exiting with an error of its own (code > 0). A child killed by a
        signal it did not send itself is churn (`killed_from_outside`), as a volunteer
        pulling the plug is; the testnet starts a coordinator killed so again."""
        failed = []
        for c in self.children:
            code = c.popen.poll()
            if code is None or c.killed_on_purpose:
                continue
            if code > 0 or (code == 0 and c.name == COORDINATOR):
                failed.append(c)
        return failed

    def nodes(self) -> list[Child]:
        """Every node child started, restarted ones included (not the coordinator)."""
        return [c for c in self.children if c.name != COORDINATOR]

    def killed_from_outside(self) -> list[Child]:
        """Children (nodes or the coordinator) that died of a signal the testnet did not
        send, not reported yet."""
        found = []
        for c in self.children:
            code = c.popen.poll()
            if code is not None and code < 0 and not c.killed_on_purpose and not c.reported:
                c.reported = True
                found.append(c)
        return found

    def latest(self, name: str) -> Child | None:
        """The most recently started child of that name (a restarted node has several)."""
        for child in reversed(self.children):
            if child.name == name:
                return child
        return None

    def kill_on_purpose(self, child: Child) -> bool:
        """SIGKILL a child's whole process group as planned churn; False if it was not running."""
        if not child.alive():
            return False
        child.killed_on_purpose = True
        self.kill(child)
        return True

    def stop(self, child: Child, grace: float = 10.0) -> int | None:
        if child.alive():
            with contextlib.suppress(ProcessLookupError):
                child.popen.send_signal(signal.SIGTERM)
            try:
                child.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGTERM for %.0f s; killing it", child.name, grace)
                self.kill(child)
        return child.popen.returncode

    def kill(self, child: Child) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.popen.pid, signal.SIGKILL)
        child.popen.wait()

    def stop_all(self, grace: float = 10.0) -> None:
        """SIGTERM everyone, wait up to `grace`, SIGKILL the rest (whole process groups)."""
        for child in self.children:
            if child.alive():
                with contextlib.suppress(ProcessLookupError):
                    child.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in self.children:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                child.popen.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                self.kill(child)
        for child in self.children:
            # Grandchildren, if any, share the child's session and group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.popen.pid, signal.SIGKILL)
