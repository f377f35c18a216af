"""A test process killed hard leaves no daemon behind (tests/reaper.py), and the watcher
kills only what that process started."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from swarmpipe.process.ready import poll_until
from tests.conftest import REPO
from tests.reaper import TOKEN_VARIABLE, marked_processes


def _start_time(pid: int) -> str | None:
    """The process's start time (field 22 of /proc/PID/stat), or None once it is gone or a
    zombie: a pid the system hands to a new process has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    fields = stat.rpartition(")")[2].split()
    return None if fields[0] in ("Z", "X") else fields[19]


PARENT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    from pathlib import Path
    from tests.conftest import Procs
    from tests.reaper import TOKEN_VARIABLE, start_reaper

    start_reaper()
    procs = Procs(Path(sys.argv[1]))
    coordinator, _ = procs.start(
        "coordinator", "coordinator", "--listen", "127.0.0.1:0",
        "--state-dir", sys.argv[1] + "/state", "--stay")
    # A launcher in its own session whose child has a session of its own, as the testnet
    # starts its daemons: neither is in the process group of what the test started.
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "c = subprocess.Popen(['sleep', '600'], start_new_session=True); "
         "print(c.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    grandchild = int(launcher.stdout.readline())
    # Not started by this process (no mark): the watcher must leave it alone.
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
    stranger = subprocess.Popen(["sleep", "600"], env=env, start_new_session=True)
    print(json.dumps({"marked": [coordinator.pid, launcher.pid, grandchild],
                      "stranger": stranger.pid}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_a_test_process_killed_hard_leaves_no_daemon(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VARIABLE}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        start_new_session=True,
    )
    stranger = 0
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent exited ({parent.wait()}) before starting its daemons"
        started = json.loads(line)
        stranger = started["stranger"]
        marked = {pid: _start_time(pid) for pid in started["marked"]}
        assert all(marked.values()), marked
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)

        def all_gone() -> bool:
            return all(_start_time(pid) != start for pid, start in marked.items())

        poll_until(all_gone, 30, "the watcher to kill what the dead parent started")
        assert _start_time(stranger) is not None, "the watcher killed an unmarked process"
    finally:
        if parent.poll() is None:
            os.kill(parent.pid, signal.SIGKILL)
            parent.wait(timeout=30)
        if stranger:
            os.kill(stranger, signal.SIGKILL)


def test_marked_processes_finds_this_sessions_mark_only() -> None:
    """This pytest process marked its own environment after it started, so its /proc
    environ does not carry the mark and its watcher would spare it; a child started now
    carries it, and a made-up token matches nothing."""
    token = os.environ[TOKEN_VARIABLE]
    assert token.startswith(f"{os.getpid()}-")
    assert os.getpid() not in marked_processes(token)
    child = subprocess.Popen(["sleep", "60"])
    try:
        # Popen returns once the child's exec has begun, but the kernel fills in the new
        # environment a moment later: until then /proc/PID/environ reads empty (CI saw it).
        poll_until(lambda: child.pid in marked_processes(token), 10, "the child's mark")
        assert marked_processes("no-such-token") == []
    finally:
        child.kill()
        child.wait()
