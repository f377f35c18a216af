"""Log lines as text (the default, unchanged) and as JSON objects that carry the identity."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest

from swarmpipe.process.logs import configure_logging, set_log_identity


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    set_log_identity("swarmpipe")


def test_json_lines_carry_the_node_id_and_stage(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", who="node", fmt="json")
    log = logging.getLogger("swarmpipe.node.daemon")
    set_log_identity("node n1", node="n1")
    log.info("joining with %d threads", 2)
    set_log_identity("node n1 stage 2", node="n1", stage=2)
    log.warning("applied step %d", 7)
    log.debug("not at INFO")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 2
    first, second = (json.loads(line) for line in lines)
    assert first["message"] == "joining with 2 threads"
    assert first["role"] == "node" and first["node"] == "n1" and "stage" not in first
    assert second == {
        "time": second["time"],
        "level": "WARNING",
        "logger": "swarmpipe.node.daemon",
        "message": "applied step 7",
        "role": "node",
        "node": "n1",
        "stage": 2,
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", second["time"])


def test_a_json_line_holds_its_traceback_in_one_field(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", who="coordinator", fmt="json")
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        logging.getLogger("swarmpipe.coordinator.service").exception("a handler failed")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1  # the traceback's lines are inside the JSON string
    line = json.loads(lines[0])
    assert line["role"] == "coordinator" and "node" not in line
    assert line["message"] == "a handler failed"
    assert (
        line["exception"].startswith("Traceback") and "ValueError: bad\nthing" in line["exception"]
    )


def test_text_lines_stay_as_they_were(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("INFO", who="node")
    set_log_identity("node n1 stage 0", node="n1", stage=0)
    logging.getLogger("swarmpipe.node.head").info("leased %d samples", 4)
    line = capsys.readouterr().err
    assert re.fullmatch(
        r"\d\d:\d\d:\d\d\.\d{3} INFO \[node n1 stage 0\] swarmpipe\.node\.head: leased 4 samples\n",
        line,
    )
