"""A small raw-bytes fuzz of every RPC of a real coordinator and a real node (issue 22).

Bytes that are not a valid message must be INVALID_ARGUMENT, never grpc's UNKNOWN or
INTERNAL, and cost at most one log line per method, never a traceback: before requests
were parsed in our code, 20 inputs a method wrote 158 tracebacks into the coordinator's log
and 46 into the node's. `swarmpipe bench fuzz-rpc` runs the same fuzz at a larger budget.
"""

from __future__ import annotations

import asyncio

import pytest

from swarmpipe.bench.fuzz_rpc import fuzz_credentials, fuzz_process
from tests.conftest import Procs

pytestmark = pytest.mark.timeout(180)

INPUTS = 20
"""Per method: each kind of input (fuzz_inputs.KINDS) three times or more."""


def test_every_rpc_answers_bytes_that_do_not_parse_with_invalid_argument(
    procs: Procs, tiny: list[str]
) -> None:
    # Two stages and one node: the node serves stage 0 and no step ever opens, so what the
    # servers log while they are fuzzed is the fuzz's doing.
    coordinator = procs.coordinator(*tiny, "pipeline.stages=2", "train.steps=1000")
    node, _ = procs.node("n0", coordinator)
    info = procs.wait_serving("n0")
    coordinator_popen = procs.children[0][0]
    servers = {
        "coordinator": (coordinator, coordinator_popen.pid, procs.tmp / "coordinator.log"),
        "node": (f"127.0.0.1:{info['grpc_port']}", node.pid, procs.tmp / "n0.log"),
    }
    # Valid credentials, so the fuzz gets past admission to the parsers.
    metadata = fuzz_credentials(procs.tmp / "coordinator-state")
    for name, (target, pid, log) in servers.items():
        report = asyncio.run(
            fuzz_process(
                target,
                pid=pid,
                log_path=log,
                metadata=metadata[name],
                inputs=INPUTS,
                seed=22,
                deadline_s=1.0,
                in_flight=8,
                max_seconds=60,
            )
        )
        methods = report["methods"]
        assert any(m.startswith("/swarmpipe.v1.") for m in methods), methods
        assert {"/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"} <= set(methods)
        for path, method in methods.items():
            assert method["calls"] == INPUTS, (name, path, method)
            assert sum(method["unparsable_codes"].values()) > 0, (name, path, method)
            escaped = {"UNKNOWN", "INTERNAL"} & set(method["unparsable_codes"])
            assert not escaped, (name, path, method)
            # Its credential took it past admission to the parsers.
            assert "UNAUTHENTICATED" not in method["unparsable_codes"], (name, path, method)
            assert method["healthy_after"], (name, path)
        assert report["hangs"] == 0, report
        assert report["alive"], (name, log.read_text()[-3000:])
        # The fuzz's peak resident memory stays within what the message limit allows.
        assert report["memory"]["within_bound"], (name, report["memory"])
        assert report["log"]["tracebacks"] == 0, log.read_text()[-3000:]
        for path, lines in report["log"]["lines_per_method"].items():
            assert lines <= 1, (name, path, lines)
    assert coordinator_popen.poll() is None and node.poll() is None
