"""Logging setup for the entry points; library modules only call logging.getLogger(__name__).

Every line of a daemon carries its identity (`[node n1 stage 0]`, `[coordinator]`)
so the interleaved logs of a testnet can be read apart. With `--log-format json` each
line is one JSON object instead, for log collectors: time, level, logger, message, the
process's role (the subcommand) and, on a node, its `node` id and `stage`; a traceback is
one string field (`exception`), never lines of its own.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import dataclass, field
from typing import Any

LOG_FORMATS = ("text", "json")


@dataclass(slots=True)
class _Identity:
    role: str = "swarmpipe"
    """The subcommand the process runs: node, coordinator, testnet..."""
    who: str = "swarmpipe"
    """The identity in text lines, e.g. 'node n1 stage 0'."""
    fields: dict[str, Any] = field(default_factory=dict)
    """The same identity as JSON fields, e.g. node="n1", stage=0."""


_identity = _Identity()


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.who = _identity.who
        record.identity = {"role": _identity.role, **_identity.fields}
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line: dict[str, Any] = {
            "time": f"{seconds}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, "identity", {}),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str)


def set_log_identity(who: str, **fields: Any) -> None:
    """Name the process in every later log line: `who` in text ('node n1 stage 0'), `fields`
    in JSON (node="n1", stage=0)."""
    _identity.who = who
    _identity.fields = dict(fields)


def configure_logging(level: str = "INFO", who: str = "swarmpipe", fmt: str = "text") -> None:
    """Log to stderr at `level` as text or (`fmt` "json") JSON lines; `who` is the role."""
    _identity.role = who
    set_log_identity(who)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                "%(asctime)s.%(msecs)03d %(levelname)s [%(who)s] %(name)s: %(message)s",
                "%H:%M:%S",
            )
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
