"""testnet/processes.py: a child started with `die_with_parent` does not outlive its parent.

The testnet's daemons rely on it: a testnet killed hard runs no cleanup of its own."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from swarmpipe.process.ready import poll_until


def _running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap an orphan)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.slow  # starts processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_goes_when_its_parent_is_killed_hard() -> None:
    parent_code = (
        "import subprocess, sys\n"
        "from swarmpipe.testnet.processes import die_with_parent\n"
        "child = subprocess.Popen(['sleep', '600'], start_new_session=True,\n"
        "                         preexec_fn=die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdout is not None
    pid = 0
    try:
        pid = int(parent.stdout.readline())
        assert _running(pid)
        parent.kill()  # SIGKILL: no cleanup of its own runs
        parent.wait(timeout=30)
        poll_until(lambda: not _running(pid), 10, "the child to go with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if pid and _running(pid):
            os.kill(pid, signal.SIGKILL)
        parent.stdout.close()
        if parent.stdin is not None:
            parent.stdin.close()
