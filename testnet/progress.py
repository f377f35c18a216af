"""The testnet's live view on a terminal: a progress bar with an ETA (rich).

`swarmpipe testnet` shows this bar only when stdout is a terminal and --quiet is
not given; piped into a file or a test, it prints the plain lines of
`main.progress_line` every 2 s instead, which scripts parse.

    training ━━━━━━━━━━━━━━━━━━━━━━━━╺━━━━━━━━━━━━━━━  57/150 elapsed 0:00:09 eta 0:00:12
    loss 4.1234 eval 4.2011 | 512.3 samples/s | 1.21 MB/s | nodes 4/4 | replayed 8 lost 0

The figures have a line of their own, so a narrow terminal cuts them short rather than
the bar, the step count and the ETA.

While the bar is live, lines printed to stdout (churn events) and the
testnet's own log lines appear above it instead of tearing through it.
"""

from __future__ import annotations

import logging
import sys
from collections import deque
from collections.abc import Iterable
from types import TracebackType
from typing import TextIO

from rich.console import Console, RenderableType
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from swarmpipe.protos import coordinator_pb2

RATE_WINDOW_S = 2.0
"""Bytes/s is taken over this much time: one 0.25 s poll apart it jumps with every step."""


def recent_samples_per_second(status: coordinator_pb2.StatusReply) -> float:
    """Samples per second of the last 5 steps (0 before the first)."""
    recent = status.steps[-5:]
    return sum(s.samples for s in recent) / max(sum(s.seconds for s in recent), 1e-9)


def stats_text(status: coordinator_pb2.StatusReply, bytes_per_second: float) -> str:
    """The figures beside the bar: loss, throughput, nodes online and lost samples."""
    loss = f"loss {status.steps[-1].loss:.4f}" if status.steps else "loss -"
    if status.evals:
        loss += f" eval {status.evals[-1].loss:.4f}"
    online = sum(1 for n in status.nodes if n.online)
    c = status.counters
    return (
        f"{loss} | {recent_samples_per_second(status):.1f} samples/s | "
        f"{bytes_per_second / 1e6:.2f} MB/s | nodes {online}/{len(status.nodes)} | "
        f"replayed {c.replayed} lost {c.lost}"
    )


class _BarAndFigures(Progress):
    """Rich's progress display with one more line under the bar: the run's figures."""

    figures: Text = Text("")

    def get_renderables(self) -> Iterable[RenderableType]:
        yield self.make_tasks_table(self.tasks)
        yield self.figures


class ProgressBar:
    """A rich progress bar fed with Status replies; use it as a context manager."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = _BarAndFigures(
            TextColumn("{task.description:<8}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            # Rich's estimate: the steps left over the step rate of the last 30 s.
            TimeRemainingColumn(),
            console=console,
            refresh_per_second=4,  # as often as the testnet polls Status
        )
        self._task = self._progress.add_task("starting", total=None)
        self._bytes: deque[tuple[float, int]] = deque()
        self._handlers: list[tuple[logging.StreamHandler[TextIO], TextIO]] = []

    def __enter__(self) -> ProgressBar:
        stderr = sys.stderr
        self._progress.start()
        # Progress.start swapped sys.stdout and sys.stderr for proxies that print above
        # the bar; the root log handler still holds the real stderr, so point it there too.
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream is stderr:
                self._handlers.append((handler, handler.stream))
                handler.setStream(sys.stderr)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for handler, stream in self._handlers:
            handler.setStream(stream)
        self._handlers.clear()
        self._progress.stop()

    def update(self, status: coordinator_pb2.StatusReply, now: float) -> None:
        """Show this Status, polled at monotonic time `now`."""
        total_bytes = sum(link.bytes for link in status.links)
        self._bytes.append((now, total_bytes))
        while len(self._bytes) > 2 and now - self._bytes[1][0] >= RATE_WINDOW_S:
            self._bytes.popleft()
        then, before = self._bytes[0]
        rate = (total_bytes - before) / (now - then) if now > then else 0.0
        self._progress.update(
            self._task,
            description=status.phase,
            total=status.total_steps or None,
            completed=len(status.steps),
        )
        self._progress.figures = Text(
            stats_text(status, rate), no_wrap=True, overflow="ellipsis", end=""
        )
