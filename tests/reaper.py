"""Kills what a pytest process started when that process dies without reaping it.

The fixtures reap their children when a test ends, fails or errors, but a pytest killed
hard (SIGKILL, the OOM killer, a CI job's timeout) runs no teardown, and the daemons it
started in their own sessions train on: once a 100000-step run for 80 minutes.
PR_SET_PDEATHSIG cannot help there: set between fork and exec of a child of the test
process, it killed nodes at start while that process held gRPC channels (gRPC's fork
handlers), so only the testnet's own launcher uses it (testnet/processes.py).

So each pytest process (the main one and every xdist worker) starts one small watcher,
with subprocess (fork and exec at once, which gRPC's fork handlers do not mind), and marks
its own environment with a token unique to it, `SWARMPIPE_TEST_REAPER=<pid>-<random>`.
Every process the tests start inherits the mark, however it was started (`Procs`, a
`swarmpipe testnet` and the daemons it starts, mosquitto), because each child takes the
test process's environment. The watcher runs in a session of its own, so a Ctrl-C or a
signal to pytest's process group leaves it to do its job. It notices pytest's death when
it is handed to another parent (its parent id changes: no pid that the system could have
reused is involved), then finds the marked processes by reading /proc/PID/environ, the
environment each process was started with, and SIGKILLs them, again until none is left.
A process carries the mark only if this pytest process, or one of its descendants, started
it, so a recycled pid cannot make it kill a stranger. pytest's own processes are spared:
the token is set only after they started (the xdist workers carry their parent's token,
and their own watchers' environments the worker's).

Run as a script (`python tests/reaper.py TOKEN`): it imports the standard library only.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

TOKEN_VARIABLE = "SWARMPIPE_TEST_REAPER"
POLL_S = 0.2
"""How often the watcher looks at its parent: at most this late after pytest's death."""
KILL_ROUNDS_S = 5.0
"""How long the watcher keeps killing marked processes that a dying parent started last."""


def marked_processes(token: str) -> list[int]:
    """Pids of the live processes started with `TOKEN_VARIABLE=token` in their environment."""
    entry = f"{TOKEN_VARIABLE}={token}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if entry in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


def kill_marked(token: str) -> int:
    """SIGKILL every marked process but this one, again until none is left (a testnet being
    killed may just have started a node); returns how many were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_ROUNDS_S
    empty_scans = 0
    while time.monotonic() < deadline:
        # A killed process whose parent is gone is a zombie until init reaps it, and a
        # zombie's environ reads empty: it is not found twice. So does a process in the
        # middle of its exec (the kernel sets up the new environment after the exec has
        # begun), so one empty scan is not enough to stop.
        pids = [pid for pid in marked_processes(token) if pid != os.getpid()]
        if not pids:
            empty_scans += 1
            if empty_scans == 2:
                break
            time.sleep(0.05)
            continue
        empty_scans = 0
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        time.sleep(0.05)
    return len(killed)


def watch(token: str, parent: int) -> None:
    """Wait for `parent` to die, then kill what it left behind."""
    while os.getppid() == parent:
        time.sleep(POLL_S)
    count = kill_marked(token)
    if count:
        print(f"reaper: pytest process {parent} died; killed {count} of its processes",
              file=sys.stderr)  # fmt: skip


def start_reaper() -> str:
    """Mark this process's environment with a fresh token and start its watcher; once per
    process (pytester-style in-process runs call pytest_configure again). Returns the token."""
    current = os.environ.get(TOKEN_VARIABLE, "")
    if current.startswith(f"{os.getpid()}-"):
        return current
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    os.environ[TOKEN_VARIABLE] = token
    subprocess.Popen(
        [sys.executable, "-S", str(Path(__file__).resolve()), token, str(os.getpid())],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    return token


if __name__ == "__main__":
    # Ignore a Ctrl-C that reaches the terminal's whole foreground group: pytest's death,
    # not a signal, is what this waits for.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch(sys.argv[1], int(sys.argv[2]))
