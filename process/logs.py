"""Logging setup for the entry points; library modules only call logging.getLogger(__name__).

Every line of a daemon carries its identity (`[node n1 stage 0]`, `[coordinator]`)
so the interleaved logs of a testnet can be read apart.
"""

from __future__ import annotations

import logging
import sys

_context = {"who": "swarmpipe"}


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.who = _context["who"]
        return True


def set_log_identity(who: str) -> None:
    """Name the process in every later log line, e.g. 'node n1 stage 0'."""
    _context["who"] = who


def configure_logging(level: str = "INFO", who: str = "swarmpipe") -> None:
    set_log_identity(who)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s.%(msecs)03d %(levelname)s [%(who)s] %(name)s: %(message)s", "%H:%M:%S"
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
