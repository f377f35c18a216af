"""process/shutdown.py: background tasks stopped even when a cancel is dropped, bounded
awaits, and the signal handlers' second signal and watchdog (in a child process)."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap

import pytest

from swarmpipe.process.shutdown import bounded, stop_tasks


async def _drops_one_cancel(ended: list[str]) -> None:
    """What a task does when Python 3.11's asyncio.wait_for drops its cancel: runs on."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        pass
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append("yes")


def test_a_task_that_drops_a_cancel_is_cancelled_again_until_it_ends() -> None:
    async def main() -> list[str]:
        ended: list[str] = []
        task = asyncio.create_task(_drops_one_cancel(ended))
        await asyncio.sleep(0)
        await stop_tasks([task], 60.0, "the test task")
        assert task.cancelled()
        return ended

    assert asyncio.run(main()) == ["yes"]


def test_a_task_whose_cancel_asyncio_wait_for_dropped_is_stopped() -> None:
    """The coordinator's hang, in miniature: the MQTT watch is connecting (aiomqtt awaits
    the CONNACK through asyncio.wait_for) when it is cancelled, the CONNACK comes in the
    same turn of the loop, and on Python 3.11 wait_for returns it instead of raising: the
    watch goes on to read MQTT. One cancel and a wait would never end."""

    async def main() -> bool:
        connack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reading = asyncio.Event()

        async def watch() -> None:
            await asyncio.wait_for(connack, timeout=10)
            reading.set()
            await asyncio.sleep(3600)  # reading MQTT

        task = asyncio.create_task(watch())
        await asyncio.sleep(0)  # it awaits the CONNACK now
        connack.set_result(None)
        task.cancel()
        await stop_tasks([task], 60.0, "the watch")
        assert task.cancelled()
        return reading.is_set()

    dropped = asyncio.run(main())
    assert dropped == (sys.version_info < (3, 12))  # the premise, where it still holds


def test_a_task_that_never_ends_is_given_up_on(caplog: pytest.LogCaptureFixture) -> None:
    release = asyncio.Event()

    async def deaf() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    async def main() -> None:
        task = asyncio.create_task(deaf())
        await asyncio.sleep(0)
        await stop_tasks([task], 0.2, "the deaf task")
        assert not task.done()
        release.set()
        await task

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "the deaf task did not stop within" in caplog.text


def test_a_bounded_await_goes_on_without_what_does_not_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        await bounded(asyncio.Event().wait(), 0.1, "the never-ending wait")
        await bounded(_fails(), 10.0, "the failing close")

    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert "the never-ending wait did not stop within" in caplog.text
    assert "the failing close failed while stopping: RuntimeError('boom')" in caplog.text


async def _fails() -> None:
    raise RuntimeError("boom")


# A daemon whose clean stop never ends: it prints "ready" once its handlers are in.
_STUCK_DAEMON = textwrap.dedent(
    """
    import asyncio, logging, sys
    from swarmpipe.process.shutdown import StopSignals

    async def main():
        signals = StopSignals(budget_s=float(sys.argv[1]))
        signals.install()
        signals.connect(lambda name: print("stopping on", name, flush=True))
        print("ready", flush=True)
        await asyncio.Event().wait()

    logging.basicConfig(level=logging.INFO)
    asyncio.run(main())
    """
)


def _start_stuck(budget_s: float) -> subprocess.Popen[str]:
    popen = subprocess.Popen(
        [sys.executable, "-c", _STUCK_DAEMON, str(budget_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert popen.stdout is not None and popen.stdout.readline() == "ready\n"
    return popen


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once_when_the_clean_stop_hangs() -> None:
    popen = _start_stuck(budget_s=600.0)
    try:
        popen.send_signal(signal.SIGTERM)
        assert popen.stdout is not None and popen.stdout.readline() == "stopping on SIGTERM\n"
        popen.send_signal(signal.SIGINT)
        _, err = popen.communicate(timeout=60)
    finally:
        popen.kill()
    assert popen.returncode == 128 + signal.SIGINT, err
    assert "SIGINT again: exiting now" in err


@pytest.mark.slow
def test_a_clean_stop_past_its_budget_is_cut_short_with_the_stacks() -> None:
    popen = _start_stuck(budget_s=0.5)
    try:
        popen.send_signal(signal.SIGTERM)
        _, err = popen.communicate(timeout=60)
    finally:
        popen.kill()
    assert popen.returncode == 1, err
    assert "the clean stop after SIGTERM took more than 0.5 s" in err
    assert "most recent call first" in err  # faulthandler's dump of the threads
