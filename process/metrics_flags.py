"""The `--metrics-port` and `--metrics-host` flags that both daemons take.

Kept apart from process/metrics.py so that building the command line (and `--help`)
imports no HTTP server or Prometheus client. A bad value is a ConfigError: one line, exit 2.
"""

from __future__ import annotations

import argparse
import ipaddress

from swarmpipe.errors import ConfigError

DEFAULT_METRICS_HOST = "127.0.0.1"


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-port",
        metavar="PORT",
        help="serve Prometheus metrics on http://HOST:PORT/metrics (0: any free port, written "
        "to the ready file as metrics_port); default: no metrics",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        metavar="HOST",
        help="IP address the metrics endpoint binds (default: 127.0.0.1, this machine only; "
        "0.0.0.0 lets a Prometheus elsewhere scrape it)",
    )


def metrics_endpoint(args: argparse.Namespace) -> tuple[str, int] | None:
    """(host, port) of the metrics endpoint the flags ask for, or None when it is off."""
    if args.metrics_port is None:
        return None
    value = str(args.metrics_port)
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"--metrics-port {value!r}: give a TCP port, 1 to 65535, or 0 for any free one"
        )
    host = str(args.metrics_host)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(
            f"--metrics-host {host!r}: give an IP address, e.g. 127.0.0.1 (this machine only) "
            "or 0.0.0.0 (every interface)"
        ) from None
    return host, port
