"""The compute thread hands every result and every error back to the awaiting coroutine,
and runs as slow as the node is told."""

from __future__ import annotations

import time

import pytest

from swarmpipe.control.link_control import encode
from swarmpipe.node.compute import BACKWARD, FORWARD, ComputeWorker
from swarmpipe.node.daemon import NodeDaemon, NodeOptions


async def test_results_and_errors_come_back() -> None:
    worker = ComputeWorker()
    try:
        assert await worker.run(FORWARD, lambda: 6 * 7) == 42
        with pytest.raises(ZeroDivisionError):
            await worker.run(BACKWARD, lambda: 1 / 0)
    finally:
        worker.close()


async def test_a_job_raising_stop_iteration_fails_instead_of_hanging() -> None:
    # asyncio futures refuse StopIteration, so the awaiting coroutine used to wait forever
    # (seen when a node's old stage summed an empty set of contributions after a move).
    worker = ComputeWorker()
    try:
        with pytest.raises(RuntimeError, match="StopIteration"):
            await worker.run(BACKWARD, lambda: next(iter([])))
        assert await worker.run(FORWARD, lambda: "still serving") == "still serving"
    finally:
        worker.close()


async def test_a_slowed_worker_stays_busy_that_many_times_as_long() -> None:
    worker = ComputeWorker(slowdown=3.0)
    try:
        await worker.run(FORWARD, lambda: time.sleep(0.02))
        # At least 20 ms of work and 40 ms more of slowness; sleeps never end early.
        assert worker.busy_seconds >= 0.06
    finally:
        worker.close()


async def test_a_node_takes_the_slowdown_its_control_topic_sets_and_returns_to_its_own() -> None:
    daemon = NodeDaemon(NodeOptions(coordinator="127.0.0.1:1", node_id="n1", compute_slowdown=2.0))
    try:
        assert daemon.compute.slowdown == 2.0
        daemon._on_link_control("n1", encode(None, slowdown=5.0))
        assert daemon.compute.slowdown == 5.0
        daemon._on_link_control("n2", encode(None, slowdown=9.0))  # another node's
        assert daemon.compute.slowdown == 5.0
        daemon._on_link_control("n1", b"")  # withdrawn: its own again
        assert daemon.compute.slowdown == 2.0
    finally:
        daemon.compute.close()
        await daemon._channel.close()
