"""The compute thread hands every result and every error back to the awaiting coroutine."""

from __future__ import annotations

import time

import pytest

from swarmpipe.node.compute import BACKWARD, FORWARD, ComputeWorker


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
