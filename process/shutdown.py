"""Stopping a daemon on SIGTERM or SIGINT: heard at any moment, and within a bound.

systemd and docker stop a service with SIGTERM and kill it a while later (docker after
10 s): a daemon that misses the signal, or hangs in its clean stop, loses its goodbye and
makes every stop take the full wait. So:

- the entry point installs `StopSignals` before it starts anything, so a signal that
  comes during start-up (the broker starting, the first join token made, the state
  database opened) is heard, and the daemon stops as soon as start-up ends; the ready
  file a parent waits for is written only after that;
- the first SIGTERM or SIGINT asks for the clean stop (the daemon's callback) and arms a
  watchdog: a clean stop still running `budget_s` later is cut short with exit code 1
  and the threads' stacks on stderr (a stop that hangs is a bug to find, not to wait out);
- a second SIGTERM or SIGINT exits at once, with 128 + the signal's number, as a shell
  reports a process a signal ended;
- `bounded(aw, seconds, what)` is for each await of a clean stop: past `seconds` it logs
  what did not stop and goes on, without waiting for the cancellation to finish (asyncio's
  `wait_for` does wait, unboundedly, for a task that ignores it);
- `stop_tasks(tasks, seconds, what)` cancels background tasks and cancels them again until
  they end. One cancel is not enough on Python 3.11: its `asyncio.wait_for` drops a
  cancellation that comes just as what it waits for completes (fixed in 3.12), and the task
  runs on. aiomqtt connects through it: a coordinator sent SIGTERM as its MQTT watch
  connected never exited (3 hangs in 100 starts beside two busy loops, with
  scripts/sigterm_stress.py; none after, 12 of the 100 stops cancelling a task again).
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

logger = logging.getLogger(__name__)

EXIT_STOP_TIMED_OUT = 1
"""The exit code when the clean stop outlasted its budget."""

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RECANCEL_S = 0.5
"""How long `stop_tasks` lets a cancelled task clean up before it cancels it again."""


class StopSignals:
    """SIGTERM/SIGINT handlers for a daemon's event loop: the first calls the daemon's stop
    (`connect`) and arms the watchdog, the second exits at once."""

    def __init__(self, *, budget_s: float) -> None:
        self.budget_s = budget_s
        self.requested = ""
        """The name of the signal that asked for the stop ("" before one came)."""
        self._on_stop: Callable[[str], None] | None = None
        self._watchdog: threading.Timer | None = None

    def install(self) -> None:
        """Take SIGTERM and SIGINT on the running loop: first thing in a daemon's `serve`,
        before the slow imports and anything else that takes time."""
        loop = asyncio.get_running_loop()
        for sig in _SIGNALS:
            loop.add_signal_handler(sig, self._received, sig)

    def connect(self, on_stop: Callable[[str], None]) -> None:
        """Stop the daemon with `on_stop(signal name)`: at the first signal, or now if it
        came while the daemon was being built."""
        self._on_stop = on_stop
        if self.requested:
            on_stop(self.requested)

    def _received(self, sig: signal.Signals) -> None:
        name = sig.name
        if self.requested:
            logger.warning("%s again: exiting now, without finishing the clean stop", name)
            _exit(128 + int(sig))
        self.requested = name
        logger.info("%s: stopping (send it again to exit at once)", name)
        self._watchdog = threading.Timer(self.budget_s, self._expired)
        self._watchdog.daemon = True
        self._watchdog.start()
        if self._on_stop is not None:
            self._on_stop(name)

    def _expired(self) -> None:
        logger.error(
            "the clean stop after %s took more than %g s: exiting without finishing it "
            "(the threads' stacks follow)",
            self.requested,
            self.budget_s,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        _exit(EXIT_STOP_TIMED_OUT)


def _exit(code: int) -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    os._exit(code)


async def bounded(aw: Awaitable[Any], seconds: float, what: str) -> None:
    """Await `aw` for at most `seconds`; past that, cancel it, log `what` did not stop and
    return at once (whatever it raises is logged, not raised: a clean stop goes on)."""
    task = asyncio.ensure_future(aw)
    done, _ = await asyncio.wait({task}, timeout=seconds)
    if not done:
        task.cancel()
        logger.warning("%s did not stop within %g s; going on without it", what, seconds)
        return
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.warning("%s failed while stopping: %r", what, exc)


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], seconds: float, what: str) -> None:
    """Cancel `tasks`, and again every RECANCEL_S while one runs on (see the module's
    docstring), for at most `seconds`; then log `what` did not stop and return. What the
    tasks raised is theirs to report: it is only logged here at DEBUG."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    pending = set(tasks)
    first = True
    while pending:
        if not first:
            logger.debug("%s ran on after a cancel: cancelling again", what)
        first = False
        for task in pending:
            task.cancel()
        remaining = deadline - loop.time()
        if remaining <= 0:
            logger.warning("%s did not stop within %g s; going on without them", what, seconds)
            return
        done, pending = await asyncio.wait(pending, timeout=min(RECANCEL_S, remaining))
        for task in done:
            if not task.cancelled() and (exc := task.exception()) is not None:
                logger.debug("%s ended with %r", task.get_name(), exc)
