"""The compute worker: one thread that runs every forward and backward, never the event loop.

gRPC and MQTT I/O stay responsive on the asyncio loop while torch works here.
Jobs are served by priority, backward before forward: a backward frees the
activations a forward saved, so preferring it bounds memory (the 1F1B idea).
One thread keeps the stage's parameters and autograd graphs single-threaded.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

BACKWARD = 0
FORWARD = 1
_STOP = -1


class ComputeWorker:
    """Runs submitted callables on one thread, by priority then arrival order."""

    def __init__(self, name: str = "compute", *, slowdown: float = 1.0) -> None:
        self.slowdown = slowdown
        """Each job takes this many times as long (a testnet's slow node); 1: as it runs."""
        self._queue: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self.busy_seconds = 0.0

    def _run(self) -> None:
        while True:
            priority, _, job = self._queue.get()
            if priority == _STOP:
                return
            fn, future, loop = job
            start = time.perf_counter()
            try:
                result = fn()
            except BaseException as exc:
                self.busy_seconds += time.perf_counter() - start
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                # Counted before the result is handed over: the awaiting coroutine (and a
                # telemetry tick after it) must see the job's time in busy_seconds.
                self.busy_seconds += time.perf_counter() - start
                loop.call_soon_threadsafe(_set_result, future, result)

    def _slowed(self, fn: Callable[[], T]) -> Callable[[], T]:
        """fn, taking `slowdown` times as long: the thread stays busy as long as it would on
        a slower machine, and every measurement of its compute time sees that."""
        if self.slowdown <= 1.0:
            return fn

        def slowed() -> T:
            start = time.perf_counter()
            try:
                return fn()
            finally:
                time.sleep((self.slowdown - 1.0) * (time.perf_counter() - start))

        return slowed

    async def _submit(self, priority: int, fn: Callable[[], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._queue.put((priority, next(self._order), (fn, future, loop)))
        return await future

    async def run(self, priority: int, fn: Callable[[], T]) -> T:
        """Run fn on the compute thread and await its result."""
        return await self._submit(priority, self._slowed(fn))

    async def run_timed(self, priority: int, fn: Callable[[], T]) -> tuple[T, float]:
        """Run fn like `run`; also return the seconds it ran (waiting in the queue excluded)."""
        seconds = 0.0
        job = self._slowed(fn)

        def timed() -> T:
            nonlocal seconds
            start = time.perf_counter()
            try:
                return job()
            finally:
                seconds = time.perf_counter() - start

        result = await self._submit(priority, timed)
        return result, seconds

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def close(self) -> None:
        self._queue.put((_STOP, next(self._order), None))
        self._thread.join(timeout=10)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.cancelled():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: BaseException) -> None:
    if future.cancelled():
        return
    if isinstance(exc, StopIteration):
        # A future cannot hold StopIteration (asyncio refuses it, and the awaiting coroutine
        # would wait forever): hand it over as the RuntimeError a generator would raise.
        wrapped = RuntimeError(f"a compute job raised StopIteration: {exc!r}")
        wrapped.__cause__ = exc
        exc = wrapped
    future.set_exception(exc)
