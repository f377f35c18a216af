"""Ready files: how a daemon started on port 0 tells its parent which ports it bound."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def write_ready_file(path: str | Path, data: dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)  # atomic: a reader never sees half a file


def read_ready_file(path: str | Path) -> dict[str, Any] | None:
    """The ready file's content, or None if the daemon has not written it yet."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return None
    return data


def wait_ready_file(path: str | Path, timeout: float, alive: Any = None) -> dict[str, Any]:
    """Poll for a ready file until `timeout`; `alive()` returning False aborts early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = read_ready_file(path)
        if data is not None:
            return data
        if alive is not None and not alive():
            raise RuntimeError(f"process exited before writing {path}")
        time.sleep(0.02)
    raise TimeoutError(f"no ready file at {path} after {timeout:.0f} s")


def poll_until(predicate: Any, timeout: float, what: str) -> Any:
    """Poll `predicate` until it returns something truthy; TimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
