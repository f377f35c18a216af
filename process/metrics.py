"""Prometheus metrics of a daemon: an HTTP endpoint that reads the daemon's state when scraped.

Each daemon (node, coordinator) hands `serve_metrics` a function that turns its current
state into metric families. Nothing is counted twice: the families are built from the
counters the daemon keeps anyway, at scrape time. The endpoint uses its own registry, not
prometheus_client's global one, so a scrape shows this daemon's metrics and no
process-wide defaults.

The HTTP server (prometheus_client's WSGI app on the standard library's server) runs in a
thread of its own, but the daemon's state belongs to its asyncio loop (dicts that the loop
changes between awaits), so a scrape does not read it from that thread: it schedules the
family builder on the loop and waits for the result there. The loop is never blocked by a
scrape; a scrape waits for at most `SCRAPE_TIMEOUT_S` when the loop is busy, and then fails
with a 503 (Prometheus records the failed scrape) rather than hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client.core import CollectorRegistry, Metric
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app
from prometheus_client.registry import Collector

from swarmpipe.errors import ConfigError

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 5.0

Families = Callable[[], Iterable[Metric]]
"""Builds the metric families of a daemon's state as it is now; runs on the daemon's loop."""


class LoopCollector(Collector):
    """A collector that builds its families on the asyncio loop that owns the state."""

    def __init__(self, loop: asyncio.AbstractEventLoop, families: Families) -> None:
        self._loop = loop
        self._families = families

    def collect(self) -> Iterator[Metric]:
        future: concurrent.futures.Future[list[Metric]] = concurrent.futures.Future()

        def build() -> None:
            if not future.set_running_or_notify_cancel():
                return  # the scrape gave up waiting
            try:
                future.set_result(list(self._families()))
            except BaseException as exc:  # handed to the scraping thread, which raises it
                future.set_exception(exc)

        self._loop.call_soon_threadsafe(build)
        try:
            families = future.result(timeout=SCRAPE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise
        return iter(families)


class _Direct(Collector):
    """A collector that builds its families in the caller's thread (tests, offline use)."""

    def __init__(self, families: Families) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(list(self._families()))


def registry_of(
    families: Families, loop: asyncio.AbstractEventLoop | None = None
) -> CollectorRegistry:
    """A registry of its own holding `families`, built on `loop` when one is given."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Direct(families) if loop is None else LoopCollector(loop, families))
    return registry


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No line per request: Prometheus scrapes every few seconds."""


@dataclass(slots=True)
class MetricsServer:
    """The running endpoint; `close()` stops it."""

    host: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve_metrics(host: str, port: int, families: Families) -> MetricsServer:
    """Serve `families` on http://host:port/metrics (port 0: any free one) from a thread.

    Call from the loop that owns the state the families read. `host` is an IP address.
    """
    exposition = make_wsgi_app(registry_of(families, asyncio.get_running_loop()))

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        try:
            return exposition(environ, start_response)  # type: ignore[no-any-return]
        except Exception as exc:
            # wsgiref would print a bare traceback to stderr, past the log's format; a
            # failed scrape is one logged line and a 503 that Prometheus records.
            logger.warning("a metrics scrape failed: %r", exc)
            start_response("503 Service Unavailable", [("Content-Type", "text/plain")])
            return [f"metrics unavailable: {exc!r}\n".encode()]

    family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET

    class Server(ThreadingWSGIServer):
        """prometheus_client's thread-per-request server, in the address family of `host`."""

        address_family = family

    try:
        server = make_server(host, port, app, Server, handler_class=_QuietHandler)
    except OSError as exc:
        raise ConfigError(
            f"cannot serve metrics on {host}:{port} ({exc.strerror or exc}); "
            "give another --metrics-port, or 0 for any free one"
        ) from exc
    # A short poll interval: close() waits up to one for the serving loop to notice.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics", daemon=True
    )
    thread.start()
    return MetricsServer(host, int(server.server_port), server, thread)
