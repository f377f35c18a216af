"""`swarmpipe testnet --metrics`: scrape every daemon's Prometheus endpoint while the run goes on.

Each child serves metrics on a port of its own choosing (`--metrics-port 0`) and writes it
into its ready file. The testnet scrapes every live daemon twice a second, once more when
it sees the run done, and the coordinator a last time at the end (`scrape_final`). The
last scrape of each daemon is saved as `<out>/metrics/<name>.prom`, and report.json's
`metrics` says where each daemon served and when its saved scrape was taken.

Why the coordinator's saved scrape equals report.json's counters exactly: the last scrape
is taken between two Status replies whose counters are equal, and the report is built
from the second. The counters only grow, so the scrape between them shows the same. (At
DONE they have almost stopped, but not quite: a head's late commit of a lease that was
replayed still counts as a duplicate after DONE.) A node leaves by itself soon after DONE,
so its saved scrape is the last one it answered; `after_done` says whether that was taken
once the run was done.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmpipe.process.ready import read_ready_file
from swarmpipe.protos import coordinator_pb2
from swarmpipe.testnet.processes import Child, ProcessGroup

logger = logging.getLogger(__name__)

SCRAPE_EVERY_S = 0.5
SCRAPE_TIMEOUT_S = 3.0
FINAL_TRIES = 5


@dataclass(slots=True)
class _Daemon:
    name: str
    url: str
    scrapes: int = 0
    failed: int = 0
    text: str = ""
    at_seconds: float | None = None
    after_done: bool = False


class MetricsScraper:
    """Scrapes the testnet's daemons and keeps the latest scrape of each."""

    def __init__(self, out: Path, t0: float) -> None:
        self.folder = out / "metrics"
        self.t0 = t0
        self.daemons: dict[str, _Daemon] = {}
        self._next = 0.0

    async def scrape(self, group: ProcessGroup, *, done: bool, force: bool = False) -> None:
        """Scrape every live daemon serving metrics; at most every SCRAPE_EVERY_S unless `force`."""
        now = time.monotonic()
        if not force and now < self._next:
            return
        self._next = now + SCRAPE_EVERY_S
        latest = {c.name: c for c in group.children}  # a restarted node: its newest process
        targets = [d for c in latest.values() if (d := self._daemon(c)) is not None]
        await asyncio.gather(*(self._scrape_one(d, done) for d in targets))

    async def scrape_final(
        self,
        group: ProcessGroup,
        status: coordinator_pb2.StatusReply,
        fetch_status: Callable[[], Awaitable[coordinator_pb2.StatusReply]],
    ) -> coordinator_pb2.StatusReply:
        """Scrape every daemon between `status` and a later Status with the same counters;
        returns that later Status, which the report is to be built from."""
        for _ in range(FINAL_TRIES):
            await self.scrape(group, done=True, force=True)
            after = await fetch_status()
            if after.counters == status.counters and len(after.steps) == len(status.steps):
                return after
            status = after
        logger.warning("the counters kept moving; the last metrics scrape may not match the report")
        return status

    def _daemon(self, child: Child) -> _Daemon | None:
        if not child.alive():
            return None
        ready = read_ready_file(child.ready_file)
        if not ready or not ready.get("metrics_port"):
            return None  # not joined yet (a node writes its ready file at Join)
        url = f"http://127.0.0.1:{ready['metrics_port']}/metrics"
        daemon = self.daemons.get(child.name)
        if daemon is None:
            daemon = self.daemons[child.name] = _Daemon(child.name, url)
        daemon.url = url  # a restarted node serves on a new port
        return daemon

    async def _scrape_one(self, daemon: _Daemon, done: bool) -> None:
        try:
            text = await asyncio.to_thread(_get, daemon.url)
        except (OSError, urllib.error.URLError) as exc:
            # A node that left between our look and the scrape; not an error of the run.
            daemon.failed += 1
            logger.debug("scraping %s at %s failed: %s", daemon.name, daemon.url, exc)
            return
        daemon.scrapes += 1
        daemon.text = text
        daemon.at_seconds = time.monotonic() - self.t0
        daemon.after_done = done

    def finish(self) -> dict[str, Any]:
        """Save each daemon's last scrape; the report's `metrics` section."""
        self.folder.mkdir(parents=True, exist_ok=True)
        section: dict[str, Any] = {}
        for name, d in sorted(self.daemons.items()):
            path = self.folder / f"{name}.prom"
            if d.text:
                path.write_text(d.text)
            section[name] = {
                "url": d.url,
                "scrapes": d.scrapes,
                "failed_scrapes": d.failed,
                "last_scrape": str(path.relative_to(self.folder.parent)) if d.text else None,
                "last_scrape_at_seconds": d.at_seconds,
                "after_done": d.after_done,
            }
        return section


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as response:
        return str(response.read().decode())
